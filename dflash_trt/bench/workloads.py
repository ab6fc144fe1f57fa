"""Workloads for comparing proposers, cut at run time from text no model here was trained on: the
source of installed Python packages. The demo models were trained on the running interpreter's standard library
alone (models/README.md, `train.corpus.stdlib_files`); site-packages is never part of it.

- `bodies`: a function's head (decorators, signature, docstring) alone; the body is the model's (the control: a
  plain completion, little for a suffix match to copy);
- `in-file`: the same question inside the rest of its file, as code assistants send it: the file's text around
  the function (the function itself removed) and then its head;
- `rewrite`: a function's earlier version, then the later version's head: two versions of the same code that
  ship side by side in a venv (pip's and setuptools' vendored copies against the installed package, or a
  package against its successor fork);
- `long`: the first lines of a package module, continued for `LONG_TOKENS` tokens (long generations revisit
  their own lines);
- `session`: turns of one file (`session_turns`): each turn's prompt is the previous prompt, the previous
  answer and the next function's head, as a multi-turn client resends what it received.

Chat workloads, for an instruct target (rendered with its chat template; `Workload.messages`), where users repeat
text and free prose where they do not:

- `chat-rewrite`: a function whole and a request to rename one of its parameters (the answer is the function
  again, one name changed);
- `revise`: a turn that asks to revise the previous answer: the user asked for a function, the assistant answered
  with a package's function, the user asks for it again with a comment before each `return`;
- `extract`: a passage of a package's documentation and a request to quote the sentences that name a word;
- `prose`: an essay on a topic (the control: nothing in the prompt to copy).

For a target of no chat template, the non-repeating controls: `random` (random printable characters: random
tokens) and `prose-text` (a passage of a package's documentation to continue).

Deterministic: files are taken in sorted order and spread evenly; what a set holds depends only on the installed
versions, which each workload reports (`sources`). Nothing is vendored: a package that is missing is skipped, and
a set with too few prompts says so.
"""

from __future__ import annotations

import ast
import difflib
import importlib.metadata
import re
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from .quality import check_body, real_statements

T = TypeVar("T")
# pure-Python packages the project's venv holds through its own dependencies (pyproject.toml)
SOURCE_PACKAGES = ("httpx", "starlette", "fastapi", "uvicorn", "click", "jinja2", "tqdm", "pydantic")
# (label, earlier copy, later copy), folders under site-packages: the same package at two versions
REWRITE_PAIRS = (
    ("platformdirs", "setuptools/_vendor/platformdirs", "pip/_vendor/platformdirs"),
    ("packaging", "pip/_vendor/packaging", "packaging"),
    ("httpcore", "httpcore", "httpcore2"),
    ("httpx", "httpx", "httpx2"),
)
# a vendored copy imports its siblings through its vendor folder: not a change of the code
VENDOR_PREFIX = re.compile(r"\b(?:pip|setuptools)\._vendor\.")
SHORT_TOKENS = 128
LONG_TOKENS = 512


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[str]
    max_new_tokens: int
    sources: dict[str, str] = field(default_factory=dict)  # folder under site-packages -> its version
    labels: list[str] = field(default_factory=list)  # where each prompt comes from (file:line)
    # a chat workload's conversations (rendered with the target's chat template); `prompts` then holds their text
    messages: list[list[dict[str, str]]] = field(default_factory=list)


@dataclass(frozen=True)
class Function:
    rel: str  # file, relative to its package folder
    qualname: str
    line: int
    head: str  # decorators, signature and docstring (if any), without the final newline
    body: str  # the rest of the function
    start: int  # character offsets of the whole function in its file
    end: int


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def version_of(folder: Path) -> str:
    """An installed package's version from its metadata; a vendored copy's from the `__version__` it states (its
    __init__, version.py, _version.py or __version__.py)."""
    if folder.parent == site_packages():
        try:
            return importlib.metadata.version(folder.name)
        except importlib.metadata.PackageNotFoundError:
            pass
    for name in ("__init__.py", "version.py", "_version.py", "__version__.py"):
        path = folder / name
        if path.exists():
            found = re.search(r"__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", path.read_text())
            if found:
                return found.group(1)
    return "unknown"


def functions(path: Path, root: Path, top_level: bool = False) -> Iterator[Function]:
    """The functions of a file (methods too unless `top_level`), in order, as head and body."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
        return
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    rel = path.relative_to(root).as_posix()
    todo: list[tuple[ast.AST, str]] = [(tree, "")]
    while todo:
        node, prefix = todo.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not top_level:
                todo.append((child, f"{prefix}{child.name}."))
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) or child.end_lineno is None:
                continue
            first = (child.decorator_list[0].lineno if child.decorator_list else child.lineno) - 1
            head_end = child.body[0].end_lineno if ast.get_docstring(child) is not None else child.body[0].lineno - 1
            if head_end is None or head_end <= first:
                continue
            whole = "".join(lines[first : child.end_lineno])
            head = "".join(lines[first:head_end]).rstrip("\n")
            yield Function(
                rel,
                prefix + child.name,
                child.lineno,
                head,
                whole[len(head) :],
                offsets[first],
                offsets[child.end_lineno],
            )


def package_files(packages: tuple[str, ...] = SOURCE_PACKAGES) -> tuple[list[tuple[Path, Path]], dict[str, str]]:
    """(file, its package folder) of the installed packages' modules (tests excluded), sorted, and the
    versions of the packages found."""
    sp, files, versions = site_packages(), [], {}
    for name in packages:
        folder = sp / name
        if not (folder / "__init__.py").exists():
            continue
        versions[name] = version_of(folder)
        files += [(p, folder) for p in sorted(folder.rglob("*.py")) if "test" not in p.relative_to(folder).as_posix()]
    return files, versions


def spread(items: list[T], n: int, what: str) -> list[T]:
    """n items spread evenly over the list, in order."""
    if len(items) < n:
        raise ValueError(f"only {len(items)} usable {what} in the installed packages; asked for {n}")
    return [items[int(i * len(items) / n)] for i in range(n)]


def _fair(fn: Function, max_chars: int) -> bool:
    """A head worth asking for a body: a docstring, at most `max_chars`, and the package's own body is code of
    two or more statements (the check `bench.quality` applies to a model's)."""
    head, body = _dedented(fn)
    return len(head) <= max_chars and head.endswith(('"', "'")) and check_body(head, body).is_code


def _indent(text: str) -> int:
    return len(text) - len(text.lstrip(" "))


def _dedented(fn: Function) -> tuple[str, str]:
    whole = textwrap.dedent(fn.head + fn.body)
    head = "\n".join(line[_indent(fn.head) :] for line in fn.head.split("\n"))
    return head, whole[len(head) :]


def body_prompts(n: int = 8, max_chars: int = 700, per_file: int = 2) -> Workload:
    """`bodies`: n function heads (dedented), at most `per_file` a file."""
    files, versions = package_files()
    found: list[tuple[str, str]] = []
    for path, root in files:
        taken = [f for f in functions(path, root) if _fair(f, max_chars)][:per_file]
        found += [(f"{root.name}/{f.rel}:{f.line}", _dedented(f)[0]) for f in taken]
    chosen = spread(found, n, "function heads")
    return Workload("bodies", [p for _, p in chosen], SHORT_TOKENS, versions, [s for s, _ in chosen])


def _lines_window(text: str, chars: int, from_end: bool) -> str:
    """At most `chars` of the text, whole lines, from its end or its start."""
    if len(text) <= chars:
        return text
    if from_end:
        cut = text.find("\n", len(text) - chars)
        return text[cut + 1 :] if cut >= 0 else ""
    cut = text.rfind("\n", 0, chars)
    return text[: cut + 1] if cut >= 0 else ""


def in_file_prompts(n: int = 8, context_chars: int = 3000, max_chars: int = 700) -> Workload:
    """`in-file`: n top-level functions, each as the file around it (the function removed; `context_chars` at
    most, two thirds before it) and then its head, one per file."""
    files, versions = package_files()
    found: list[tuple[str, str]] = []
    for path, root in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for f in functions(path, root, top_level=True):
            if _fair(f, max_chars):
                before = _lines_window(text[: f.start], 2 * context_chars // 3, from_end=True)
                after = _lines_window(text[f.end :].lstrip("\n"), context_chars - len(before), from_end=False)
                if after.strip() and before.strip():
                    found.append((f"{root.name}/{f.rel}:{f.line}", f"{before}{after.rstrip()}\n\n\n{f.head}"))
                    break
    chosen = spread(found, n, "functions with a file around them")
    return Workload("in-file", [p for _, p in chosen], SHORT_TOKENS, versions, [s for s, _ in chosen])


def _changed_pairs(label: str, early: Path, late: Path, max_chars: int) -> list[tuple[str, str]]:
    """(source, prompt) for the functions both copies hold, changed but alike (difflib ratio 0.5-0.99)."""
    old = {(f.rel, f.qualname): f for p in sorted(early.rglob("*.py")) for f in functions(p, early)}
    pairs = []
    for p in sorted(late.rglob("*.py")):
        for f in functions(p, late):
            was = old.get((f.rel, f.qualname))
            if was is None or VENDOR_PREFIX.sub("", was.head + was.body) == f.head + f.body:
                continue
            before, (head, body) = textwrap.dedent(was.head + was.body), _dedented(f)
            alike = difflib.SequenceMatcher(None, before, head + body).ratio()
            if 0.5 < alike < 0.99 and len(before) + len(head) <= max_chars and real_statements_of(body) >= 2:
                prompt = (
                    f"# {label} {version_of(early)}: {f.rel}\n{before.rstrip()}\n\n\n"
                    f"# {label} {version_of(late)}: {f.rel}\n{head}"
                )
                pairs.append((f"{label}/{f.rel}:{f.line}", prompt))
    return pairs


def real_statements_of(body: str) -> int:
    """Real statements (`quality.real_statements`) of a dedented function's body text."""
    try:
        tree = ast.parse("def f():\n" + textwrap.indent(textwrap.dedent(body), "    "))
    except SyntaxError:
        return 0
    fn = tree.body[0]
    return real_statements(fn.body) if isinstance(fn, ast.FunctionDef) else 0


def rewrite_prompts(n: int = 8, max_chars: int = 3000) -> Workload:
    """`rewrite`: n changed functions, the earlier version whole and then the later one's head, taken in turn
    from each pair of copies (`REWRITE_PAIRS`) that is installed."""
    sp, per_pair, versions = site_packages(), [], {}
    for label, early, late in REWRITE_PAIRS:
        if (sp / early / "__init__.py").exists() and (sp / late / "__init__.py").exists():
            versions[early], versions[late] = version_of(sp / early), version_of(sp / late)
            found = _changed_pairs(label, sp / early, sp / late, max_chars)
            per_pair.append(spread(found, min(len(found), n), f"changed {label} functions") if found else [])
    mixed = [item for group in zip(*[g for g in per_pair if g]) for item in group] if per_pair else []
    chosen = spread(mixed[:n], n, "changed functions")  # the pairs in turn
    return Workload("rewrite", [p for _, p in chosen], SHORT_TOKENS, versions, [s for s, _ in chosen])


def long_prompts(n: int = 3, prefix_chars: int = 400) -> Workload:
    """`long`: the first lines (`prefix_chars` at most, whole lines) of n package modules of 4x that or more."""
    files, versions = package_files()
    found = []
    for path, root in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= 4 * prefix_chars:
            found.append((f"{root.name}/{path.relative_to(root).as_posix()}", _lines_window(text, prefix_chars, False)))
    chosen = spread(found, n, "modules")
    return Workload("long", [p for _, p in chosen], LONG_TOKENS, versions, [s for s, _ in chosen])


def session_turns(turns: int = 4, max_chars: int = 700, opening_chars: int = 600) -> tuple[str, list[str], str]:
    """A multi-turn session over one package file: (the opening: the file's first lines, whole lines), the
    heads of `turns` top-level functions of it in order, and the file's name. The client sends, turn by turn,
    everything so far (opening, each earlier head and the answer it got) and the next head."""
    files, _ = package_files()
    for path, root in files:
        heads = [f.head for f in functions(path, root, top_level=True) if _fair(f, max_chars)]
        if len(heads) >= turns:
            text = path.read_text(encoding="utf-8", errors="replace")
            return _lines_window(text, opening_chars, False), heads[:turns], f"{root.name}/{path.relative_to(root)}"
    raise ValueError(f"no installed package file has {turns} top-level functions with docstrings")


CHAT_TOKENS = 160
ESSAY_TOPICS = (
    "the history of lighthouses",
    "why bread rises",
    "how bees find flowers",
    "the first winter in a new city",
    "the life of a river from its source to the sea",
    "a day at a street market",
    "what makes a good teacher",
    "the night sky without light pollution",
)


def _chat(name: str, conversations: list[tuple[str, list[dict[str, str]]]], versions: dict[str, str]) -> Workload:
    prompts = [m[-1]["content"] for _, m in conversations]
    return Workload(name, prompts, CHAT_TOKENS, versions, [s for s, _ in conversations], [m for _, m in conversations])


def _small_functions(n: int, max_chars: int) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """n top-level functions (label, dedented source, a parameter name of 3+ letters that is not `self`) of at
    most `max_chars`, spread over the installed packages."""
    files, versions = package_files()
    found = []
    for path, root in files:
        for f in functions(path, root, top_level=True):
            source = textwrap.dedent(f.head + f.body).strip("\n")
            try:
                args = ast.parse(source).body[0].args  # type: ignore[attr-defined]
            except (SyntaxError, IndexError, AttributeError):
                continue
            names = [a.arg for a in args.args + args.kwonlyargs if len(a.arg) >= 3 and a.arg != "self"]
            if names and len(source) <= max_chars and source.count("\n") >= 5:
                found.append((f"{root.name}/{f.rel}:{f.line}", source, names[0]))
            break  # one a file
    return spread(found, n, "small functions"), versions


def chat_rewrite_prompts(n: int = 4, max_chars: int = 900) -> Workload:
    """`chat-rewrite`: rename a parameter of the function given."""
    chosen, versions = _small_functions(n, max_chars)
    return _chat(
        "chat-rewrite",
        [
            (
                label,
                [
                    {
                        "role": "user",
                        "content": f"Rename the parameter `{name}` to `{name}_value` in this "
                        f"function. Reply with the whole function only.\n\n```python\n{source}\n```",
                    }
                ],
            )
            for label, source, name in chosen
        ],
        versions,
    )


def revise_prompts(n: int = 4, max_chars: int = 900) -> Workload:
    """`revise`: the previous answer again, revised."""
    chosen, versions = _small_functions(n, max_chars)
    conversations = []
    for label, source, name in chosen:
        what = source.split("(", 1)[0].replace("def ", "").replace("async ", "").strip()
        conversations.append(
            (
                label,
                [
                    {"role": "user", "content": f"Write a Python function `{what}` that takes `{name}`."},
                    {"role": "assistant", "content": f"```python\n{source}\n```"},
                    {
                        "role": "user",
                        "content": "Give me the whole function again with a short comment before each "
                        "`return` statement.",
                    },
                ],
            )
        )
    return _chat("revise", conversations, versions)


def _passages(n: int, min_chars: int = 400, max_chars: int = 1200) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """n docstrings of English prose (a module's, class's or function's of 4+ sentences; min_chars..max_chars, cut
    at a sentence; the first of a file), spread over the installed packages."""
    files, versions = package_files()
    found = []
    for path, root in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            if doc is None or len(doc) < min_chars or doc.count(". ") < 4 or ">>>" in doc or "::" in doc:
                continue
            cut = doc[:max_chars]
            found.append((f"{root.name}/{path.relative_to(root).as_posix()}", cut[: cut.rfind(". ") + 1].strip()))
            break
    return spread(found, n, "docstrings of prose"), versions


def extract_prompts(n: int = 4) -> Workload:
    """`extract`: quote the sentences of a passage that name its most frequent long word."""
    chosen, versions = _passages(n)
    conversations = []
    for label, text in chosen:
        words = re.findall(r"[A-Za-z]{5,}", text.lower())
        word = max(sorted(set(words)), key=words.count)
        ask = f'Here is a passage:\n\n{text}\n\nQuote, word for word, every sentence of the passage that contains "{word}".'
        conversations.append((label, [{"role": "user", "content": ask}]))
    return _chat("extract", conversations, versions)


def prose_prompts(n: int = 4) -> Workload:
    """`prose`: an essay (the control)."""
    topics = spread(list(ESSAY_TOPICS), n, "essay topics")
    return _chat("prose", [(t, [{"role": "user", "content": f"Write a short essay about {t}."}]) for t in topics], {})


def random_prompts(n: int = 4, chars: int = 300) -> Workload:
    """`random`: random printable characters (seeded): random tokens, nothing a model can continue from memory."""
    import random

    rng = random.Random(0)
    alphabet = [chr(c) for c in range(33, 127)]
    prompts = ["".join(rng.choice(alphabet) for _ in range(chars)) for _ in range(n)]
    return Workload("random", prompts, SHORT_TOKENS, {}, [f"seed 0, prompt {i}" for i in range(n)])


def prose_text_prompts(n: int = 4) -> Workload:
    """`prose-text`: a passage of a package's documentation, to continue."""
    chosen, versions = _passages(n)
    return Workload("prose-text", [t for _, t in chosen], SHORT_TOKENS, versions, [s for s, _ in chosen])


WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "bodies": body_prompts,
    "in-file": in_file_prompts,
    "rewrite": rewrite_prompts,
    "long": long_prompts,
    "random": random_prompts,
    "prose-text": prose_text_prompts,
}
# for an instruct target: rendered with its chat template
CHAT_WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "chat-rewrite": chat_rewrite_prompts,
    "revise": revise_prompts,
    "extract": extract_prompts,
    "prose": prose_prompts,
}
