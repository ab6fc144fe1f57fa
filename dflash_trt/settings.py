"""Defaults every layer may read: where the demo models live. Nothing here imports the rest of the package."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# DFLASH_TRT_MODELS moves the demo models (e.g. a container mounting them elsewhere).
DEMO_DIR = Path(os.environ.get("DFLASH_TRT_MODELS", REPO_ROOT / "models"))
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFTER = DEMO_DIR / "drafter"
DEMO_MODELS_HINT = ".venv/bin/python scripts/make_demo_models.py"  # what builds DEMO_DIR's models

# The server's proposer for requests that name none: the hybrid, which measured at least DFlash alone's tokens/s on
# every workload and concurrency it was benchmarked on and far more where text repeats
# (docs/benchmarks.md#make-bench-proposers-proposers-side-by-side); the library's `GenerationConfig` keeps DFlash,
# the method a caller asked for by loading a drafter.
SERVER_PROPOSER = "hybrid"
