"""docs/benchmarks.md's table of the simulator's proposers (issue 55): one grid slice run with --proposer dflash,
suffix and hybrid (the suffix runs replayed from data/measured/suffix-trace.json's rewrite, long or bodies
rounds), tokens/s per cell and the ratio to DFlash alone. Run from the repository root after the runs that
results/sim/proposers/README.md lists: python scripts/sim/proposer_table.py"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parents[2] / "results" / "sim" / "proposers"
RUNS = ("dflash", "suffix", "hybrid", "hybrid-long", "hybrid-bodies")
LABELS = ("DFlash tokens/s", "suffix (rewrite)", "hybrid (rewrite)", "hybrid (long)", "hybrid (bodies)")


def key(r: dict) -> tuple:
    return r["gpu"], r["model"], r["workload"], r["concurrency"], r["policy"]


data = {n: {key(r): r for r in json.loads((HERE / f"{n}.json").read_text())["runs"]} for n in RUNS}
print("| cell | policy | " + " | ".join(LABELS) + " | hybrid (rewrite): suffix rounds |")
print("|---|---|" + "---|" * len(LABELS) + "---|")
for k in sorted(data["dflash"]):
    base = data["dflash"][k]["tokens_per_s"]
    cells = [f"{base:,.1f}"] + [
        f"{data[n][k]['tokens_per_s']:,.1f} ({data[n][k]['tokens_per_s'] / base:.2f}x)" for n in RUNS[1:]
    ]
    rounds = data["hybrid"][k]["proposers"]
    share = rounds.get("suffix", {}).get("rounds", 0) / sum(v["rounds"] for v in rounds.values())
    print(f"| {k[0].upper()} {k[1]} `{k[2]}` C={k[3]} | {k[4]} | " + " | ".join(cells) + f" | {share:.0%} |")
