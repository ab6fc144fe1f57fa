"""README.md's table: adaptive at C=32 per setup and workload, separate prefill against chunked prefill at each
time bound (`--prefill-stall` 2, 1.5 and 1.25; the folders of those names), means over the seeds and
the ratios per seed. Run from the repository root: python scripts/sim/stall_table.py"""

import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[2] / "results" / "sim" / "prefill-stall"
RUNS = {"2 (default)": HERE / "2" / "results.json", "1.5": HERE / "1.5" / "results.json"}
RUNS["1.25"] = HERE / "1.25" / "results.json"

cells: dict[tuple, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
for stall, path in RUNS.items():
    for r in json.loads(path.read_text())["runs"]:
        if r["policy"] == "adaptive" and r["concurrency"] == 32:
            mode = "separate" if r["prefill"] == "separate" else stall
            cells[(r["gpu"], r["model"], r["tp"], r["workload"])][mode][r["seed"]] = r


def mean(runs: dict[int, dict], field: str) -> float:
    return statistics.mean(r[field]["p50"] if field == "ttft_ms" else r[field] for r in runs.values())


print(
    "| setup, workload | prefill | tokens/s | TTFT p50 ms | ITL p99 ms | ITL p99 vs separate | tokens/s vs separate |"
)
print("|---|---|---|---|---|---|---|")
for (gpu, model, tp, wl), modes in sorted(cells.items()):
    sep = modes["separate"]
    print(
        f"| {gpu.upper()} {model} tp={tp} `{wl}` | separate | {mean(sep, 'tokens_per_s'):,.0f} | "
        f"{mean(sep, 'ttft_ms'):,.0f} | {1e3 * mean(sep, 'itl_p99_s'):.1f} | | |"
    )
    for stall in RUNS:
        runs = modes[stall]
        itl = [sep[s]["itl_p99_s"] / r["itl_p99_s"] for s, r in runs.items()]
        tps = [r["tokens_per_s"] / sep[s]["tokens_per_s"] for s, r in runs.items()]
        print(
            f"| | chunked, stall {stall} | {mean(runs, 'tokens_per_s'):,.0f} | {mean(runs, 'ttft_ms'):,.0f} | "
            f"{1e3 * mean(runs, 'itl_p99_s'):.1f} | {statistics.mean(itl):.2f}x ({min(itl):.2f}-{max(itl):.2f}) | "
            f"{statistics.mean(tps):.3f}x ({min(tps):.3f}-{max(tps):.3f}) |"
        )
