#!/usr/bin/env python3
"""Cost of the adaptive block-size policy per step: `choose_blocks` (the sorted-increment sweep) against the previous
coordinate ascent (kept here as the baseline), at several batch sizes, on random acceptance rates and a
CPU-like and a GPU-like cost model. Prints a table (median milliseconds per call) and the rate each reaches.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from dflash_trt.decoding.adaptive import RowChoice, choose_blocks
from dflash_trt.decoding.cost import CostModel, EngineCost
from dflash_trt.decoding.estimates import expected_tokens

COSTS = {
    "memory-bound": CostModel(EngineCost(10e-3, 0.1e-3, 0.01e-3), EngineCost(2e-3, 0.05e-3, 0.005e-3)),
    "compute-bound": CostModel(EngineCost(2e-3, 0.2e-3, 1.0e-3), EngineCost(1e-3, 0.1e-3, 0.1e-3)),
}


def rate(rows, cost, blocks):
    return sum(expected_tokens(r.alpha, b) for r, b in zip(rows, blocks)) / cost.step_time(
        blocks, [r.new_context for r in rows]
    )


def previous_ascent(rows, cost, sweeps=3):
    """The policy before: coordinate ascent calling a scoring closure per candidate, from two starts."""

    def ascend(blocks):
        best = rate(rows, cost, blocks)
        for _ in range(sweeps):
            changed = False
            for i, r in enumerate(rows):
                if r.fixed is not None:
                    continue
                for b in range(1, r.max_block + 1):
                    if b == blocks[i]:
                        continue
                    trial = blocks[:i] + [b] + blocks[i + 1 :]
                    s = rate(rows, cost, trial)
                    if s > best * (1 + 1e-9):
                        best, blocks, changed = s, trial, True
            if not changed:
                break
        return best, blocks

    low = ascend([r.fixed if r.fixed is not None else 1 for r in rows])
    high = ascend([r.fixed if r.fixed is not None else r.max_block for r in rows])
    return high[1] if high[0] > low[0] else low[1]


def time_ms(fn, repeats):
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--block", type=int, default=8, help="the drafter's block size (each row's largest choice)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = random.Random(0)
    print("| cost model | rows | previous ascent ms | exact ms | speed-up | rate previous | rate exact |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, cost in COSTS.items():
        for n in args.rows:
            rows = [RowChoice(alpha=rng.random(), max_block=args.block) for _ in range(n)]
            old_ms = time_ms(lambda: previous_ascent(rows, cost), max(3, args.repeats // 5))
            new_ms = time_ms(lambda: choose_blocks(rows, cost), args.repeats)
            old_rate, new_rate = (
                rate(rows, cost, previous_ascent(rows, cost)),
                rate(rows, cost, choose_blocks(rows, cost)),
            )
            print(
                f"| {name} | {n} | {old_ms:.3f} | {new_ms:.3f} | {old_ms / new_ms:.0f}x | {old_rate:.1f} | {new_rate:.1f} |"
            )


if __name__ == "__main__":
    main()
