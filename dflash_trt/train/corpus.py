"""The text a corpus is read from: the running interpreter's standard library (split train / held-out by
file), a text file or a folder. Apart from `data` so that the prompt builders can list files without importing
the training data module (the package keeps no import circle)."""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path


def stdlib_files(split: str = "train", held_out_every: int = 10) -> list[Path]:
    """Python files of the running interpreter's standard library, split by a stable hash of the
    relative path: 1 in `held_out_every` files is held out (never trained on)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel:
            continue
        held = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % held_out_every == 0
        if (split == "held-out") == held:
            files.append(path)
    return files


def read_texts(paths: Iterable[Path], min_chars: int = 200) -> Iterator[str]:
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib test files are deliberately not UTF-8
        if len(text) >= min_chars:
            yield text


def text_files(data: str | Path) -> list[Path]:
    """`stdlib` (the training split), a text file, or a folder (its *.py, *.txt, *.md files)."""
    if str(data) == "stdlib":
        return stdlib_files("train")
    path = Path(data)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for ext in ("*.py", "*.txt", "*.md") for p in path.rglob(ext))
    raise FileNotFoundError(f"training data not found: {data} (a file, a folder, or 'stdlib')")
