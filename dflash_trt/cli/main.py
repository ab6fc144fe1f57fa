"""`dflash-trt` command line. Subcommand names and flags are a public interface.

One module per command group, each with `register(subparsers)`; shared option parsers and loaders in
`options.py`. Nothing outside this package imports it. Keep the modules light at import time (import torch
etc. inside the command function) so that `--help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .options import CliError

COMMAND_MODULES: tuple[str, ...] = (
    "generate",
    "serve",
    "engines",
    "train",
    "bench",
    "evaluate",
    "triton",
    "trtllm",
    "plan",
    "models",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-trt",
        description="DFlash block-diffusion speculative decoding: one drafter pass proposes a block, "
        "the target verifies it in one pass; output equals the target's own.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)  # the command's cmd_* function (set_defaults)
        return code
    except CliError as e:
        print(f"dflash-trt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
