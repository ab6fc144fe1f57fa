"""How low ITL p99 at C=32 can go whatever the prefill: adaptive on each setup x workload with separate prefill,
with chunked prefill, and with chunked prefill on a setup whose prompt tokens cost nothing (`FreePrompts`: a
pass's rows longer than a verify block are left out of its time). No way of admitting the prompts makes a step
shorter than in that last run, so separate prefill's p99 over its p99 is the most any prefill scheme can lower
ITL p99 by with adaptive's blocks. A diagnostic: it prints JSON lines, one per group and seed. Usage (from the
repository root):
    PYTHONPATH=. .venv/bin/python scripts/sim/itl_free_prompts.py GPU:MODEL:TP:WORKLOAD... > OUT.jsonl
    python scripts/sim/itl_free_prompts.py --table OUT.jsonl..."""

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

VERIFY_MAX = 16  # `SimTargetEngine.verify_max`: a row with more new tokens in a pass is a prompt (chunk)
REQUESTS, CONCURRENCY, SEEDS = 512, 32, (0, 1, 2)  # the full grid's at C=32


class FreePrompts:
    """A setup's pass costs with every prompt token free: rows longer than a verify block cost nothing."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __repr__(self) -> str:  # the policies' start-up grid is cached per cost repr
        return f"FreePrompts({self.inner!r})"

    def target(self, new: Sequence[int], past: Sequence[int], logits: int) -> float:
        kept = [(n, p) for n, p in zip(new, past) if n <= VERIFY_MAX]
        if not kept:
            return 0.0
        prompts = len(new) - len(kept)  # each scored one logit
        return self.inner.target([n for n, _ in kept], [p for _, p in kept], max(1, logits - prompts))


def run(groups: list[str]) -> None:
    from dflash_trt.sim.cost import ProfileCost
    from dflash_trt.sim.serving import simulate, workload

    for group in groups:
        gpu, model, tp, name = group.split(":")
        for seed in SEEDS:
            cost, work = ProfileCost(gpu, model, int(tp)), workload(name)
            out = {"group": group, "seed": seed}
            for label, c, prefill in (
                ("separate", cost, "separate"),
                ("chunked", cost, "chunked"),
                ("free", FreePrompts(cost), "chunked"),
            ):
                r = simulate(
                    c, work, "adaptive", concurrency=CONCURRENCY, requests=REQUESTS, seed=seed, prefill=prefill
                )
                out[label] = {"tokens_per_s": round(r.tokens_per_s, 1), "itl_p99_ms": round(1e3 * r.itl_s["p99"], 2)}
            print(json.dumps(out), flush=True)


def table(paths: list[str]) -> None:
    by: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            by[r["group"]].append(r)
    print(
        "| setup, workload | ITL p99 ms: separate / chunked / prompts free | separate / chunked | separate / prompts free (seeds) |"
    )
    print("|---|---|---|---|")
    for group, runs in sorted(by.items()):
        gpu, model, tp, name = group.split(":")
        p99 = {k: statistics.mean(r[k]["itl_p99_ms"] for r in runs) for k in ("separate", "chunked", "free")}
        ceiling = [r["separate"]["itl_p99_ms"] / r["free"]["itl_p99_ms"] for r in runs]
        print(
            f"| {gpu.upper()} {model} tp={tp} `{name}` | {p99['separate']:.1f} / {p99['chunked']:.1f} / {p99['free']:.1f} | "
            f"{p99['separate'] / p99['chunked']:.2f}x | {statistics.mean(ceiling):.2f}x ({min(ceiling):.2f}-{max(ceiling):.2f}) |"
        )


if __name__ == "__main__":
    table(sys.argv[2:]) if sys.argv[1] == "--table" else run(sys.argv[1:])
