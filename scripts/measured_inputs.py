"""Make a benchmark's run an input of the code: copy the sections of its results.json that the package reads into
data/measured/ (dflash_trt/sim/measured.py says which and why this is a step of its own).

    python scripts/measured_inputs.py host-step results/parts/results.json
    python scripts/measured_inputs.py demo-load results/load/results.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_trt.sim.measured import INPUTS, promote


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "name", choices=sorted(INPUTS), help="the input: " + "; ".join(f"{k}: {v[1]}" for k, v in INPUTS.items())
    )
    ap.add_argument("results", type=Path, help="the benchmark's results.json")
    args = ap.parse_args()
    print(f"wrote {promote(args.name, args.results)}")


if __name__ == "__main__":
    main()
