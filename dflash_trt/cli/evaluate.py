"""`dflash-trt eval`: DFlash on held-out prompts against the target alone (dflash_trt/bench/evaluate.py)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..bench import evaluate
    from .options import add_model_args

    p = sub.add_parser(
        "eval",
        help="acceptance (tau), speedup and code quality on held-out prompts, outputs checked against the target "
        "alone (make eval)",
        description=evaluate.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p, dtype=False)
    evaluate.add_arguments(p)
    p.set_defaults(func=evaluate.run)
