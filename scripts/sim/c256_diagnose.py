"""Why adaptive misses the tuned table at C=256 (`paper`, chunked prefill): one simulated cell under variants
that each change one thing. A diagnostic, not a benchmark: it patches the policies in this process only.

Specs (one per run): "fixed-K" (every row K tokens a block, any K; a one-entry tuned table), "adaptive",
"oracle" (adaptive told each row's true acceptance: the constant rate with its class's tau at block 16, as
`sim.policies.Oracle`), "oracle@B" (the constant rate with its tau at block B instead: the rate that holds over
the first B positions), "adaptive+wN" (adaptive whose row estimates carry N pseudo-observations of the prior
instead of `AcceptanceTracker.prior_weight`: less noise, slower to learn a row).

    PYTHONPATH=. .venv/bin/python scripts/sim/c256_diagnose.py h100:llama-2-7b:1 0,1 fixed-8 adaptive

CONCURRENCY=N and WORKLOAD=name in the environment run another concurrency or workload (the same request count
rule).
`c256_diagnose.py --table results.jsonl` prints README.md's tables: per setup, workload and concurrency, each variant's mean
over its seeds and its ratio to the fixed block the full grid's tuned table picks there (per seed, min-max;
to adaptive where that block was not run).
"""

import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from dflash_trt.decoding.adaptive import AdaptiveBlocks
from dflash_trt.sim import policies
from dflash_trt.sim.cost import ProfileCost
from dflash_trt.sim.serving import simulate, workload

WORKLOAD, CONCURRENCY = os.environ.get("WORKLOAD", "paper"), int(os.environ.get("CONCURRENCY", 256))
REQUESTS = max(512, 16 * CONCURRENCY)  # the full grid's
work = workload(WORKLOAD)
tracker_for, oracle_tracker_for = AdaptiveBlocks.tracker_for, policies.Oracle.tracker_for


def run(cost: ProfileCost, spec: str, seed: int) -> dict:
    policy, table = spec.split("+")[0].split("@")[0], None
    if policy.startswith("fixed-"):
        policy, table = "tuned-table", {CONCURRENCY: int(spec.split("-")[1])}

    def estimate(self, row):  # "+wN": the row's estimate with N pseudo-observations of the prior
        t = tracker_for(self, row)
        t.prior_weight = float(spec.split("+w")[1])
        return t

    def known(self, row):  # "@B": the class's constant rate with its tau at block B
        return policies.KnownAcceptance(known=work.profiles[row.prompt_ids[0]].equivalent_rate(int(spec.split("@")[1])))

    # every run sets both, so a variant patched for one run never leaks into the next
    AdaptiveBlocks.tracker_for = estimate if "+w" in spec else tracker_for
    policies.Oracle.tracker_for = known if "@" in spec else oracle_tracker_for
    t = time.time()
    r = simulate(cost, work, policy, concurrency=CONCURRENCY, requests=REQUESTS, seed=seed, table=table)
    return {
        "spec": spec,
        "seed": seed,
        "tokens_per_s": round(r.tokens_per_s, 1),
        "mean_block": round(r.mean_block, 2),
        "tau": round(r.tau, 3),
        "mean_batch": round(r.mean_batch, 1),
        "ttft_p50_s": round(r.ttft_s["p50"], 3),
        "itl_p99_s": round(r.itl_s["p99"], 4),
        "wall_s": round(time.time() - t, 1),
    }


def _order(item: tuple[str, dict]) -> tuple[int, int, str]:
    """Fixed blocks by size first, then adaptive and its variants, then the oracles."""
    spec = item[0]
    if spec.startswith("fixed-"):
        return (0, int(spec.split("-")[1]), spec)
    return (1 if spec.startswith("adaptive") else 2, 0, spec)


def table(path: str) -> None:
    tuned = json.loads(
        (Path(__file__).resolve().parents[2] / "results" / "sim" / "full-checks" / "results.json").read_text()
    )["tuned_tables"]
    runs: dict[tuple[str, str, int], dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        runs[(r["setup"], r["workload"], r["concurrency"])][r["spec"]][r["seed"]] = r
    for (setup, wl, c), specs in runs.items():
        block = tuned[setup.replace(":", "/") + f"/{wl}/chunked"][str(c)]
        name = f"fixed-{block}" if f"fixed-{block}" in specs else "adaptive"  # a cell without the table's block
        ref, why = specs[name], "the tuned table's block" if name != "adaptive" else f"fixed-{block} not run"
        print(f"\n{setup} `{wl}`, C={c}: ratios per seed against {name} ({why})\n")
        print("| variant | tokens/s | ratio (seeds) | mean block | tau | TTFT p50 s | ITL p99 ms |")
        print("|---|---|---|---|---|---|---|")
        for spec, seeds in sorted(specs.items(), key=_order):
            ratios = [seeds[k]["tokens_per_s"] / ref[k]["tokens_per_s"] for k in seeds]
            mean = {
                k: statistics.mean(x[k] for x in seeds.values())
                for k in ("tokens_per_s", "mean_block", "tau", "ttft_p50_s", "itl_p99_s")
            }
            print(
                f"| {spec} | {mean['tokens_per_s']:,.0f} | {statistics.mean(ratios):.3f}x ({min(ratios):.3f}-"
                f"{max(ratios):.3f}) | {mean['mean_block']:.2f} | {mean['tau']:.2f} | {mean['ttft_p50_s']:.2f} | "
                f"{1e3 * mean['itl_p99_s']:.0f} |"
            )


if __name__ == "__main__" and sys.argv[1] == "--table":
    table(sys.argv[2])
elif __name__ == "__main__":
    gpu, model, tp = sys.argv[1].split(":")
    cost = ProfileCost(gpu, model, int(tp))
    for spec in sys.argv[3:]:
        for seed in map(int, sys.argv[2].split(",")):
            print(
                json.dumps(
                    {"setup": sys.argv[1], "workload": WORKLOAD, "concurrency": CONCURRENCY, **run(cost, spec, seed)}
                ),
                flush=True,
            )
