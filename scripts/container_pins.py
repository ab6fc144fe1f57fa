"""Pin what a GPU container already ships, so installing this project cannot replace it.

    python3 scripts/container_pins.py > /tmp/keep.txt          # torch, transformers, tensorrt, ... as installed
    pip install -c /tmp/keep.txt -e .                            # the resolver may only keep those versions
    python3 scripts/container_pins.py --check /tmp/keep.txt      # exit 1 if any of them changed anyway

NVIDIA's containers carry pre-release CUDA builds (torch 2.10.0a0+...nv25.12), which a plain
`pip install` could otherwise "upgrade" to a PyPI wheel. Used by the Dockerfile's gpu image.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

KEEP = (
    "torch",
    "transformers",
    "tokenizers",
    "tensorrt",
    "tensorrt_llm",
    "tensorrt-cu13",
    "tensorrt-cu12",
    "nvidia-modelopt",
    "numpy",
    "triton",
)


def installed(names=KEEP) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", metavar="FILE", help="compare the installed versions with FILE (written earlier)")
    args = p.parse_args(argv)
    now = installed()
    if args.check is None:
        for name, version in now.items():
            print(f"{name}=={version}")
        return 0
    changed = []
    for line in open(args.check).read().split():
        name, _, version = line.partition("==")
        if now.get(name) != version:
            changed.append(f"{name}: {version} -> {now.get(name, 'removed')}")
    if changed:
        print("installing dflash-trt changed the container's packages: " + "; ".join(changed), file=sys.stderr)
        return 1
    print(f"container packages unchanged: {', '.join(f'{k} {v}' for k, v in now.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
