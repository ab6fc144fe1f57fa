"""Prompt sets for evaluation. The code set is cut from HELD-OUT standard-library files (never
trained on by the demo models); bodies, in-file and rewrite from installed packages (`workloads`: never trained
on either); the others are generic."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..train.data import read_texts, stdlib_files
from .quality import check_body, real_statements
from .workloads import WORKLOADS


def held_out_code_prompts(n: int = 20, prefix_chars: int = 400) -> list[str]:
    """The first `prefix_chars` characters (cut at a line end) of n held-out stdlib files,
    spread evenly over the sorted held-out list."""
    texts = [t for t in read_texts(stdlib_files("held-out"), min_chars=4 * prefix_chars)]
    if len(texts) < n:
        raise ValueError(f"only {len(texts)} held-out files are long enough; asked for {n}")
    step = len(texts) / n
    prompts = []
    for i in range(n):
        text = texts[int(i * step)]
        cut = text.rfind("\n", 0, prefix_chars)
        prompts.append(text[: cut + 1 if cut > 0 else prefix_chars])
    return prompts


def repetitive_prompts(n: int = 5) -> list[str]:
    """Text whose continuation is largely a copy: where drafting shines (and prompt lookup too)."""
    base = [
        "ERROR_CODES = {\n    'E001': 'not found',\n    'E002': 'denied',\n    'E003': 'timeout',\n",
        "def test_add_1():\n    assert add(1, 1) == 2\n\ndef test_add_2():\n    assert add(2, 2) == 4\n\n",
        "import os\nimport sys\nimport re\nimport json\nimport time\nimport math\n",
        "class A:\n    pass\n\nclass B:\n    pass\n\nclass C:\n    pass\n\n",
        "x0 = 0\nx1 = 1\nx2 = 2\nx3 = 3\nx4 = 4\n",
        "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n",
    ]
    return (base * (n // len(base) + 1))[:n]


def free_text_prompts(n: int = 5) -> list[str]:
    """Prose-like prompts (comments and docstrings): harder for a code model to continue predictably."""
    base = [
        '"""This module provides a simple interface for reading configuration files.\n\n',
        "# The scheduler keeps a queue of pending jobs and runs them in order of priority.\n",
        '"""Utilities for working with dates and times.\n\nThe functions here ',
        "# Note: this is a workaround for a bug in older versions of the library, where\n",
        '"""Return the number of items in the collection.\n\n    ',
        "# TODO: handle the case where the file does not exist\n",
    ]
    return (base * (n // len(base) + 1))[:n]


def workload_prompts(name: str) -> Callable[[int], list[str]]:
    """A `workloads` set's prompt texts as a prompt set (its own length aside: the benchmark sets the lengths)."""

    def texts(n: int) -> list[str]:
        return WORKLOADS[name](n).prompts

    return texts


PROMPT_SETS: dict[str, Callable[[int], list[str]]] = {
    "code": held_out_code_prompts,
    "repetitive": repetitive_prompts,
    "free": free_text_prompts,
    **{name: workload_prompts(name) for name in ("bodies", "in-file", "rewrite")},
}


@dataclass(frozen=True)
class FunctionPrompt:
    """A held-out function cut after its docstring: the body is the model's to write."""

    source: str  # file (relative to the standard library) and line
    name: str
    text: str  # decorators, signature and docstring, dedented to column 0, without the final newline
    body: str  # the library's own body after it (the reference a check must accept)


def held_out_function_prompts(n: int = 40, max_chars: int = 700, per_file: int = 2) -> list[FunctionPrompt]:
    """n functions from HELD-OUT standard-library files (test suites excluded), at most `per_file` per file,
    spread evenly over the sorted files: each has a docstring, at most `max_chars` of head, and a real
    body of two or more statements after it (so a body is a fair thing to ask for). The prompt ends
    at the docstring's closing quotes: the model writes the newline and indentation itself, as in
    the text it was trained on."""
    import ast
    import sysconfig
    import textwrap

    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[FunctionPrompt] = []
    for path in stdlib_files("held-out"):
        rel = path.relative_to(root).as_posix()
        if "test" in rel.split("/")[0] or "/test" in rel or "idle_test" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
            continue
        lines = text.splitlines(keepends=True)
        taken = 0
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(fn) is None:
                continue
            if real_statements(fn.body) < 2 or fn.body[0].end_lineno is None:
                continue
            first = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
            full = textwrap.dedent("".join(lines[first : fn.end_lineno]))
            head = "".join(full.splitlines(keepends=True)[: fn.body[0].end_lineno - first]).rstrip("\n")
            prompt = FunctionPrompt(f"{rel}:{fn.lineno}", fn.name, head, full[len(head) :])
            if len(head) <= max_chars and head.startswith(("def ", "async def ", "@")) and head.endswith(('"', "'")):
                if check_body(head, prompt.body).is_code:  # the library's own body passes (a fair question)
                    found.append(prompt)
                taken += 1
                if taken == per_file:
                    break  # the set spans the library rather than a few long files
    if len(found) < n:
        raise ValueError(f"only {len(found)} usable held-out functions; asked for {n}")
    step = len(found) / n
    return [found[int(i * step)] for i in range(n)]
