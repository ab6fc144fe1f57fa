"""Is a completion code? The check of `dflash-trt eval --prompt-set functions`: given a
function's head (signature and docstring), the generated body must parse and hold two or more real
statements.

Rules, so the figure means one thing:
- the body is the completion up to the first line of code at column 0 (the function ended; the
  head is dedented, so its `def` is at column 0; blank lines and comments do not end it); text after
  the function is not judged;
- when the function did not end within the tokens allowed, its last statement may be incomplete:
  if the body does not parse whole, that statement (from the last line at the body's own
  indentation on) is dropped, and only it. A function that ended must parse whole;
- "parses" is what Python accepts: `compile()`, so a duplicate argument name or a `return` outside
  a function fails too, not only the grammar;
- real statements are the body's statements, those nested in `if` / `for` / `with` / `try` included,
  except the docstring, `pass`, and bare constants (`...`, strings); a nested `def` or `class` is
  one statement, its own body not counted (a model that drifts into writing methods has not
  written this function).
"""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class BodyCheck:
    parses: bool
    statements: int  # real statements of the body (0 when it does not parse)
    ended: bool  # the function ended within the completion (else cut back to what parses)

    @property
    def is_code(self) -> bool:
        return self.parses and self.statements >= 2


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def real_statements(body: list[ast.stmt]) -> int:
    """Real statements of a function body (the rules above)."""
    count = 0
    for node in body:
        if isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            continue  # the docstring, `...`, a stray string
        count += 1
        if not isinstance(node, DEFINITIONS):
            for field in ("body", "orelse", "finalbody"):
                count += real_statements(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):  # try / except
                count += real_statements(handler.body)
            for case in getattr(node, "cases", []):  # match
                count += real_statements(case.body)
    return count


def check_body(head: str, completion: str) -> BodyCheck:
    """`head`: the prompt (a function's decorators, signature and docstring at column 0);
    `completion`: the model's text after it."""
    lines = completion.split("\n")
    code = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    end = next((i for i in code if i > 0 and not lines[i][0].isspace()), None)
    body = lines if end is None else lines[:end]
    keep = [len(body)]
    if end is None and code:  # cut by the token limit: the last statement may be cut too
        base = _indent(lines[code[0]])
        keep += [max(i for i in code if _indent(lines[i]) == base)]
    for k in keep:
        fn = _parse_function(head + "\n".join(body[:k]))
        if fn is not None:
            return BodyCheck(True, real_statements(fn.body), end is not None)
    return BodyCheck(False, 0, end is not None)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parse_function(source: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        with warnings.catch_warnings():  # a generated "\d" is a SyntaxWarning, not this check's business
            warnings.simplefilter("ignore")
            compile(source, "<completion>", "exec", dont_inherit=True)  # what the grammar misses, the compiler sees
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    fn = tree.body[0] if tree.body else None
    return fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
