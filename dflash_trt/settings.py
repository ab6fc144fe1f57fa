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
# The proposer wherever no drafter is loaded (`--drafter none`, or a target with no drafter of its own) and none is
# named: suffix runs need no model, and a proposer that uses the drafter cannot draft at all.
DRAFTERLESS_PROPOSER = "suffix"

# The PyTorch drafter's dtype wherever none is named (load_decoder, generate, bench, serve; `--drafter-dtype`):
# None = the target's dtype (float32 on a CPU by default). One default for every entry point, so that a seeded
# request at a fixed block size gives the same text from the library, the CLI, the server and Triton (whose ONNX
# drafter computes in float32), and on a CPU with or without bfloat16 instructions: the drafter's dtype moves the
# draft probabilities that rejection sampling compares against. `auto` (bfloat16 next to a float32 target where
# the CPU multiplies bfloat16 in hardware: faster batched drafter passes) is asked for by name, and then holds for
# whichever entry point is given it (loading.drafter_dtype; docs/api.md, Drafter precision).
DRAFTER_DTYPE: str | None = None


NO_DRAFTER = "none"  # `--drafter none`: load no drafter


def drafter_path(text: str) -> Path | str:
    """`--drafter`'s value: a folder, or `none` (a folder of that name is ./none). Here, below the commands and
    the benchmarks, since both parse it."""
    return NO_DRAFTER if text == NO_DRAFTER else Path(text)
