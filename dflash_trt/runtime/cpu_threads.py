"""CPU threading: hand the engines' OpenMP workers over to the one thread that steps them, and keep
onnxruntime's workers from spinning next to PyTorch's (`ort_session_options`).

PyTorch's CPU builds run their parallel kernels on OpenMP, and OpenMP gives every thread that enters a
parallel region its own team of worker threads, kept for the life of that thread. The server loads the
engines and times them (adaptive block sizes) on the main thread, then steps them on its orchestrator
thread: two teams. With more OpenMP workers in the process than CPUs, libgomp stops letting idle workers
spin between parallel regions ("throttled" spinning), so every region of every later pass first wakes its
workers from sleep; a pass of one row is dozens of short regions. So the main thread's team is released
before the orchestrator starts (the measurements: docs/design.md#the-cpu-runtime).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # OpenMP 5.0 omp_pause_resource_t: release threads, keep what is cheap to keep


def _loaded_libgomp() -> list[str]:
    """Paths of GNU OpenMP runtimes mapped into this process (PyTorch's pip wheels bundle one). Only libgomp:
    its pause frees the calling thread's own team and touches no other thread's (Intel's libiomp5 pauses the
    whole process, and sleeps idle workers after a block time rather than by this rule)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():  # not Linux: nothing to find this way
        return []
    found: list[str] = []
    for line in maps.read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        name = Path(path).name
        if name.startswith("libgomp") and ".so" in name and path not in found:
            found.append(path)
    return found


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (`omp_pause_resource_all`), so that the next thread
    to run parallel kernels gets a team of its own with no other team beside it. Call it on a thread that
    is done with the engines, before another one starts stepping them. True when a runtime released them;
    False (and nothing changed) where no libgomp is loaded or it refuses (the caller is inside a parallel
    region)."""
    released = False
    for path in _loaded_libgomp():
        try:
            fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all")
        except (OSError, AttributeError):  # an OpenMP older than 5.0
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        if fn(_OMP_PAUSE_SOFT) == 0:
            released = True
        else:
            log.debug("%s refused to release its OpenMP workers", path)
    return released


def ort_session_options(ort: Any, threads: int | None = None) -> Any:
    """onnxruntime SessionOptions for a graph that runs next to other engines on the same CPUs.

    onnxruntime's intra-op workers spin after each run (waiting for the next one) by default; next to the
    PyTorch target, on as many cores as there are threads, they take the cores its pass needs (the target's
    verify passes slow down several-fold; docs/design.md#the-cpu-runtime). So spinning stays off. `threads`: intra-op
    threads (onnxruntime's default when None or 0)."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    return options
