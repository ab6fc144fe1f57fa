"""Bound the CPU kernel caches that grow with every new tensor shape, so a server's memory stays flat.

PyTorch's CPU path for bfloat16 (the drafter's dtype with `--drafter-dtype auto` on a CPU with AVX512-BF16 or AMX)
runs matmuls through oneDNN, and caches a compiled primitive per distinct shape twice: in ideep's computation cache
(capacity from the LRU_CACHE_CAPACITY environment variable, default 1024; PyTorch's CPU performance notes name it)
and in oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, default 1024; oneDNN's "Primitive Cache" docs). A
serving batch has ragged shapes (prompt chunks, rows joining and leaving, new-context lengths), so both caches fill
with entries of a few hundred KiB each: hundreds of MiB of RSS that grew over the first thousands of requests and
looked like a leak (docs/design.md#the-cpu-runtime). A small capacity keeps the entries a steady batch reuses.

Both variables are read once, when each cache is first used: set them before any oneDNN kernel runs (the serve
command does, before loading the engines). A value the operator set is kept.
"""

from __future__ import annotations

import os

KERNEL_CACHE_CAPACITY = 64  # entries per cache: a steady batch's shapes, not every shape ever seen
CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Set both cache capacities to `capacity` unless already set; returns the values in force."""
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in CACHE_VARIABLES}
