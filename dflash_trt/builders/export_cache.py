"""The drafter's ONNX graphs kept by what they are made from, so an export runs once per drafter.

The same drafter and target checkpoints, precision set, exporter code and tool versions make the same graphs
(builders/onnx_drafter.py, onnx_drafter_batch.py). `make engines` into another folder, each engines identity that
build-engines.sh makes on a shared volume (another max_batch_size is another folder, the same drafter graphs), and
every Triton repository of the same pair would otherwise export them again; with the cache the second copies the
first's files.

Where: $DFLASH_TRT_CACHE, else $XDG_CACHE_HOME/dflash-trt, else ~/.cache/dflash-trt; DFLASH_TRT_CACHE=off turns it
off. An entry is written under a temporary name and renamed into place once whole, so a reader never takes half of
one; the KEEP most recently used stay. A cache that cannot be read or written (a read-only home in a container)
is passed over with a message, never an error: the export itself is what the caller asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from . import hashing

KEEP = 8  # entries kept: a few drafters, each at both precision sets
COMPLETE = ".complete"  # written last into an entry: its files are all there
# the modules the graphs are traced from: a change to any of them is another export
EXPORT_CODE = (
    "dflash_trt.models.drafter",
    "dflash_trt.builders.onnx_drafter",
    "dflash_trt.models.drafter_batch",
    "dflash_trt.builders.onnx_drafter_batch",
)
EXPORT_TOOLS = ("torch", "onnx", "onnxruntime", "onnxscript", "dflash-trt")


def cache_root() -> Path | None:
    """The cache folder, or None when DFLASH_TRT_CACHE=off."""
    set_to = os.environ.get("DFLASH_TRT_CACHE")
    if set_to == "off":
        return None
    if set_to:
        return Path(set_to)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-trt"


def export_key(target_sha256: str, drafter_sha256: str, fp16: bool) -> str:
    """What the graphs depend on, hashed: both checkpoints' contents, the precision set, the exporter's code and
    the tools' versions."""
    parts = [
        "drafter-onnx",
        target_sha256,
        drafter_sha256,
        fp16,
        hashing.versions(*EXPORT_TOOLS),
        hashing.code_sha256(*EXPORT_CODE),
    ]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cached_export(key: str, out: Path, export: Callable[[Path], None], log: Callable[[str], None] = print) -> bool:
    """Fill `out` with the graphs of `key`: copied from the cache when it holds them (True), else made by
    `export(out)` and then stored (False)."""
    root = cache_root()
    entry = None if root is None else root / "onnx" / key
    if entry is not None and (entry / COMPLETE).is_file():
        try:
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(entry, out, ignore=shutil.ignore_patterns(COMPLETE))
            os.utime(entry)  # recently used: kept longest
            log(f"drafter graphs {key} from the export cache {root}")
            return True
        except OSError as e:
            log(f"export cache {root} not read ({e}); exporting")
    export(out)
    if entry is not None:
        _store(entry, out, log)
    return False


def _store(entry: Path, out: Path, log: Callable[[str], None]) -> None:
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(out, tmp)
        (tmp / COMPLETE).write_text("")
        try:
            tmp.rename(entry)
        except OSError:  # another process stored the same graphs first: theirs stays
            shutil.rmtree(tmp, ignore_errors=True)
        _prune(entry.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"export cache {entry.parent} not written ({e}): the next export of these graphs runs again")


def _prune(folder: Path) -> None:
    """All but the KEEP most recently used entries go (temporary folders of live writers are left alone)."""
    entries = sorted(
        (p for p in folder.iterdir() if not p.name.startswith(".") and (p / COMPLETE).is_file()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in entries[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
