"""Content hashes of inputs, for manifests and for skipping builds whose inputs did not change."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_sha256(folder: str | Path) -> str:
    """One hash over every file in a folder (relative names and contents), in sorted order."""
    folder = Path(folder)
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(file_sha256(path).encode())
    return h.hexdigest()


def tree_stamp(folder: str | Path) -> str:
    """A cheap fingerprint of a folder: every file's relative name, size and modification time, no contents (a
    second for a 70B checkpoint where hashing takes minutes). An equal stamp lets a rerun reuse the content hash
    recorded with it; a different one (a copy that lost the times, a touched file) only means hashing again."""
    folder = Path(folder)
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = path.stat()
        h.update(f"{path.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def files_sha256(paths: Iterable[str | Path]) -> dict[str, str]:
    return {Path(p).name: file_sha256(p) for p in paths}


def versions(*packages: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def code_sha256(*modules: str) -> str:
    """Hash of the toolkit source files a built artifact depends on: a code change rebuilds it."""
    import importlib.util

    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"no source file for module {name}")
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()
