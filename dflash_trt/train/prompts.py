"""An offline prompt set for regenerating a chat/code target's own responses: built from the Python
standard library, split (train / held-out) by source file like `corpus.stdlib_files`.

- chat: a function's docstring becomes a request, "Write a Python function `name(args)` that ...";
- explain: "Explain what this Python function does" over a short function's source;
- code: a raw completion prompt, a file's text cut after a function's signature and docstring
  (short: the function alone; long: up to `long_chars` of the file before it, for long contexts).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..decoding.prompting import chat_prompt_ids
from .corpus import stdlib_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Prompt:
    id: str
    source: str  # file the prompt was made from (the held-out split is by file)
    kind: str  # "chat" | "explain" | "code"
    text: str  # the user message (chat, explain) or the raw completion prefix (code)

    @property
    def is_chat(self) -> bool:
        return self.kind != "code"


def _first_sentence(doc: str) -> str | None:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if not 20 <= len(para) <= 300 or para.startswith((">>>", "..")):
        return None
    sentence = para.split(". ")[0].rstrip(".")
    return sentence[0].lower() + sentence[1:] if sentence[:2].isalpha() and not sentence[:2].isupper() else sentence


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
            yield node


def prompts_from_file(path: Path, rel: str, rng: random.Random, long_chars: int = 3000) -> list[Prompt]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
        return []
    lines = text.splitlines(keepends=True)
    out: list[Prompt] = []
    for fn in _functions(tree):
        doc = ast.get_docstring(fn)
        src = ast.get_source_segment(text, fn) or ""
        pid = hashlib.sha1(f"{rel}:{fn.lineno}".encode()).hexdigest()[:12]
        if doc and (sentence := _first_sentence(doc)):
            args = ", ".join(a.arg for a in fn.args.args if a.arg not in ("self", "cls"))
            verb = rng.choice(["Write a Python function", "Implement a Python function", "Write a function"])
            out.append(Prompt(pid + "c", rel, "chat", f"{verb} `{fn.name}({args})` that {sentence}."))
        if 3 <= src.count("\n") <= 40 and len(src) < 1500 and rng.random() < 0.3:
            out.append(
                Prompt(pid + "e", rel, "explain", f"Explain what this Python function does:\n\n```python\n{src}\n```")
            )
        if doc and fn.body and fn.end_lineno and fn.end_lineno - fn.lineno >= 4:
            # prefix: everything up to the end of the docstring (the body is the model's to write)
            body_start = fn.body[1].lineno - 1 if len(fn.body) > 1 else fn.body[0].end_lineno
            head = "".join(lines[fn.lineno - 1 - len(fn.decorator_list) : body_start])
            before = "".join(lines[: fn.lineno - 1 - len(fn.decorator_list)])
            if rng.random() < 0.35 and len(before) > long_chars // 2:
                out.append(Prompt(pid + "L", rel, "code", before[-long_chars:] + head))
            else:
                out.append(Prompt(pid + "s", rel, "code", head))
    return out


def build_prompt_set(split: str, seed: int = 0, per_file: int = 6, long_chars: int = 3000) -> list[Prompt]:
    """At most `per_file` prompts from each file of `split` ('train' or 'held-out'), shuffled."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for path in stdlib_files(split):
        rel = path.relative_to(root).as_posix()
        if "/test" in rel or rel.startswith("test") or "idlelib/idle_test" in rel:
            continue  # test suites: few docstrings, odd code
        found = prompts_from_file(path, rel, rng, long_chars)
        rng.shuffle(found)
        prompts.extend(found[:per_file])
    rng.shuffle(prompts)
    return prompts


def save_prompts(prompts: list[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))


def load_prompts(path: Path) -> list[Prompt]:
    return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids the target sees: the chat template (with the generation prompt) for chat kinds,
    the raw text for code completions."""
    if prompt.is_chat:  # the same ids the server builds for /v1/chat/completions
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt.text}])
    ids: list[int] = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    return ids
