#!/usr/bin/env python3
"""Batched draft-and-verify on the demo models: tokens/s at concurrency 1, 4, 16 (held-out code prompts,
greedy), for

    hf-generate        Hugging Face generate() on a left-padded batch (no speculation): the external reference
    batch-target       the batched step with block size 1 (target alone, same code path)
    batch-dflash-b8    the batched step, DFlash at a fixed block of 8
    batch-adaptive     the batched step, DFlash with adaptive block sizes (cost model timed at start-up)

At concurrency C the prompts (at concurrency 1 optionally only the first --c1-prompts) run as consecutive batches of C rows, each row exactly --max-new-tokens
tokens (no stop token), so every method produces the same number of tokens; the batched methods' tokens
are checked against the target alone. Also prints the profile of the batched steps at the highest
concurrency (draft / verify / acceptance / policy / Python overhead per step). JSON under results/.

    .venv/bin/python scripts/bench_batch.py --prompts 16 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dflash_trt.bench.methods import hf_generate_batch
from dflash_trt.bench.prompts import held_out_code_prompts
from dflash_trt.config import validate_against_target
from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder, FixedBlocks, GenerationConfig, StepProfile
from dflash_trt.decoding.cost import measure_costs
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.target import load_target, load_tokenizer
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_TARGET), help="target checkpoint directory (default: demo)")
    ap.add_argument("--drafter", default=str(DEMO_DRAFTER), help="DFlash drafter directory (default: demo)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out code prompts (a multiple of every concurrency)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated batch sizes")
    ap.add_argument(
        "--c1-prompts",
        type=int,
        default=None,
        help="prompts at concurrency 1 (default: all; fewer keeps a slow machine's run short)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_batch.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]

    model = load_target(args.target, torch.float32)
    tok = load_tokenizer(args.target)
    drafter = DFlashDrafter.from_pretrained(args.drafter, torch.float32)
    validate_against_target(drafter.config, drafter.spec, model.config)
    layers = drafter.spec.target_layer_ids
    btarget = TorchTargetEngine(model, layers)
    bdrafter = TorchDrafterEngine.for_target(drafter, btarget)
    prompts = [tok.encode(t, add_special_tokens=False) for t in held_out_code_prompts(args.prompts)]
    n = args.max_new_tokens
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    t0 = time.perf_counter()
    cost = measure_costs(btarget, bdrafter, rows=(1, 4, 16), blocks=(1, 4, 8), context=150, repeats=2)
    cost_s = time.perf_counter() - t0
    print(f"cost model (measured in {cost_s:.1f}s): target {cost.target}, drafter {cost.drafter}", flush=True)

    def batched(block: int | None, adaptive: bool):
        def run(batch):
            dec = BatchDecoder(btarget, bdrafter, policy=AdaptiveBlocks(cost) if adaptive else FixedBlocks())
            rows = [dec.add(p, GenerationConfig(max_new_tokens=n, block_size=block)) for p in batch]
            profiles: list[StepProfile] = []
            while dec.active:
                profiles.append(dec.step().profile)
            return [r.result().token_ids for r in rows], profiles

        return run

    methods = {
        "hf-generate": lambda batch: (hf_generate_batch(model, batch, n, pad), []),
        "batch-target": batched(1, False),
        "batch-dflash-b8": batched(8, False),
        "batch-adaptive": batched(None, True),
    }
    for name, fn in methods.items():  # warm-up (allocations, first-call costs)
        fn(prompts[:2])

    reference: dict[int, list[int]] = {}
    results, profiles_out = [], {}
    for c in levels:
        for name, fn in methods.items():
            tokens, steps, outputs = 0, [], []
            t0 = time.perf_counter()
            subset = prompts[: args.c1_prompts] if c == 1 and args.c1_prompts else prompts
            for start in range(0, len(subset), c):
                out, prof = fn(subset[start : start + c])
                outputs += out
                steps += prof
            secs = time.perf_counter() - t0
            tokens = sum(len(o) for o in outputs)
            if name == "batch-target":
                reference.update(enumerate(outputs))
            exact = (
                None
                if name == "hf-generate" or not reference
                else all(o == reference[i] for i, o in enumerate(outputs))
            )
            verify = [p for p in steps if p.verify_rows]
            row = {
                "concurrency": c,
                "method": name,
                "tokens": tokens,
                "seconds": round(secs, 3),
                "tokens_per_s": round(tokens / secs, 1),
                "equal_to_target_alone": exact,
            }
            if verify:
                row["mean_block"] = round(statistics.mean(b for p in verify for b in p.blocks), 2)
                row["tokens_per_verify_row"] = round(
                    sum(p.committed_tokens for p in verify) / sum(p.verify_rows for p in verify), 2
                )
            results.append(row)
            print(json.dumps(row), flush=True)
            if c == max(levels) and verify:
                keys = ("prefill_s", "policy_s", "draft_s", "verify_s", "accept_s", "overhead_s", "total_s")
                profiles_out[name] = {
                    "steps": len(verify),
                    "rows": round(statistics.mean(p.verify_rows for p in verify), 2),
                    "verify_tokens": round(statistics.mean(p.verify_tokens for p in verify), 1),
                    **{
                        k.removesuffix("_s") + "_ms": round(1e3 * statistics.mean(getattr(p, k) for p in verify), 3)
                        for k in keys
                    },
                }

    print("\n| concurrency | method | tokens/s | vs hf-generate | vs batch-target | mean block | equal to target |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        base = {m["method"]: m["tokens_per_s"] for m in results if m["concurrency"] == r["concurrency"]}
        print(
            f"| {r['concurrency']} | {r['method']} | {r['tokens_per_s']} | {r['tokens_per_s'] / base['hf-generate']:.2f}x"
            f" | {r['tokens_per_s'] / base['batch-target']:.2f}x | {r.get('mean_block', '')} |"
            f" {r['equal_to_target_alone']} |"
        )
    print(f"\nmean batched step at concurrency {max(levels)} (ms):")
    for name, p in profiles_out.items():
        print(f"  {name}: {p}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "results": results,
                "step_profile": profiles_out,
                "cost_model": {
                    "target": vars(cost.target),
                    "drafter": vars(cost.drafter),
                    "measured_s": round(cost_s, 2),
                },
                "settings": {
                    "prompts": len(prompts),
                    "max_new_tokens": n,
                    "threads": args.threads,
                    "target": args.target,
                    "drafter": args.drafter,
                    "prompt_set": "held-out code",
                },
                "machine": {"platform": platform.platform(), "torch": torch.__version__},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
