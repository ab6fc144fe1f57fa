"""Print docs/benchmarks.md's table of the simulator's proposers from `dflash-trt bench sim` runs' results.json:
DFlash's tokens/s per cell and each other run's as a ratio to it.

    python scripts/sim/proposer_table.py results/sim/proposers-oos/dflash LABEL=DIR ...
"""

import json
import sys
from pathlib import Path
from typing import Any


def cells(folder: str) -> dict[tuple[str, str, str, str, int], dict[str, Any]]:
    runs = json.loads((Path(folder) / "results.json").read_text())["runs"]
    return {(r["gpu"], r["model"], r["workload"], r["policy"], r["concurrency"]): r for r in runs}


def main(argv: list[str]) -> None:
    base = cells(argv[0])
    others = [(label, cells(folder)) for label, folder in (a.split("=", 1) for a in argv[1:])]
    print("| cell | DFlash tokens/s | " + " | ".join(label for label, _ in others) + " |")
    print("|---|---|" + "---|" * len(others))
    for key, r in sorted(base.items(), key=lambda kv: (kv[0][0], kv[0][4])):
        gpu, model, workload, policy, c = key
        row = [f"{gpu.upper()} {model} `{workload}` C={c}", f"{r['tokens_per_s']:,.1f}"]
        for _, runs in others:
            o = runs.get(key)
            if o is None:
                row.append("-")
                continue
            suffix = o.get("proposers", {}).get("suffix", {}).get("rounds", 0)
            every = sum(p.get("rounds", 0) for p in o.get("proposers", {}).values()) or 1
            row.append(
                f"{o['tokens_per_s']:,.1f} ({o['tokens_per_s'] / r['tokens_per_s']:.2f}x, {100 * suffix / every:.0f} % suffix)"
            )
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
