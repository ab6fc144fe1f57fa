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
