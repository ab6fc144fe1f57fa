#!/usr/bin/env python3
"""Write a tiny random Qwen3 target and a matching DFlash drafter (published format) for smoke runs.

Random weights: useful to check the plumbing end to end, not to see acceptance. The demo
models under models/ are the trained ones.
"""

import argparse
from pathlib import Path

from dflash_trt.models.tiny import make_tiny_drafter, make_tiny_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".cache/tiny"), help="output folder (default .cache/tiny)")
    p.add_argument("--family", choices=["qwen3", "llama"], default="qwen3")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--block-size", type=int, default=8)
    args = p.parse_args()
    target = make_tiny_target(args.out / "target", family=args.family, vocab_size=args.vocab_size, layers=args.layers)
    make_tiny_drafter(target.config, args.out / "drafter", block_size=args.block_size)
    print(f"wrote {args.out / 'target'} and {args.out / 'drafter'}")


if __name__ == "__main__":
    main()
