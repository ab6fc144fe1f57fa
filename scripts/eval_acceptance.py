#!/usr/bin/env python3
"""Acceptance and speedup of DFlash on held-out code prompts, against the target alone.

For each prompt (a prefix of a standard-library file the demo models never saw) it runs the
target alone and DFlash greedily, in alternating order, checks the outputs are identical, and
records tau (mean tokens per round, bonus included) and the time ratio. Prints a Markdown table
and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_trt.bench.prompts import held_out_code_prompts
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET
from dflash_trt.loading import load_decoder
from dflash_trt.decoding import GenerationConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEMO_TARGET)
    p.add_argument("--drafter", type=Path, default=DEMO_DRAFTER)
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's trained size")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=Path("results/acceptance.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    decoder = load_decoder(args.target, args.drafter)
    prompts = held_out_code_prompts(args.prompts)
    cfg_spec = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size)
    cfg_base = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=1)
    decoder.generate(decoder.encode(prompts[0]), cfg_spec)  # warm-up (allocations, kernels)

    rows, mismatches = [], 0
    for i, text in enumerate(prompts):
        ids = decoder.encode(text)
        order = [("base", cfg_base), ("dflash", cfg_spec)]
        if i % 2:
            order.reverse()  # interleave so drift on a shared machine hits both alike
        runs = {}
        for name, cfg in order:
            t = time.perf_counter()
            runs[name] = decoder.generate(ids, cfg)
            runs[name].stats.total_time_s = time.perf_counter() - t
        same = runs["base"].token_ids == runs["dflash"].token_ids
        mismatches += not same
        s = runs["dflash"].stats
        rows.append({
            "prompt": i, "prompt_tokens": len(ids), "new_tokens": s.new_tokens, "identical": same,
            "tau": round(s.mean_acceptance_length, 3), "rounds": s.rounds,
            "base_s": round(runs["base"].stats.total_time_s, 4), "dflash_s": round(s.total_time_s, 4),
            "speedup": round(runs["base"].stats.total_time_s / s.total_time_s, 3),
            "draft_s": round(s.draft_time_s, 4), "verify_s": round(s.verify_time_s, 4),
        })
        print(f"prompt {i:2d}: tau {rows[-1]['tau']:.2f}  speedup {rows[-1]['speedup']:.2f}x  identical {same}",
              file=sys.stderr)

    taus = [r["tau"] for r in rows]
    speedups = [r["speedup"] for r in rows]
    summary = {
        "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
        "block_size": args.block_size or decoder.drafter.block_size,
        "mean_tau": round(statistics.mean(taus), 3), "min_tau": min(taus), "max_tau": max(taus),
        "median_speedup": round(statistics.median(speedups), 3),
        "speedup_p10_p90": [round(sorted(speedups)[len(speedups) // 10], 3),
                            round(sorted(speedups)[(9 * len(speedups)) // 10], 3)],
        "total_time_speedup": round(sum(r["base_s"] for r in rows) / sum(r["dflash_s"] for r in rows), 3),
        "all_identical": mismatches == 0, "threads": torch.get_num_threads(),
    }
    print("| prompt | prompt tokens | tau | speedup | identical |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['prompt_tokens']} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['identical']} |")
    print(f"\nmean tau {summary['mean_tau']:.2f}, median speedup {summary['median_speedup']:.2f}x "
          f"(total-time ratio {summary['total_time_speedup']:.2f}x), identical outputs: {summary['all_identical']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "per_prompt": rows}, indent=1))
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
