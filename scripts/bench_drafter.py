#!/usr/bin/env python3
"""Per-round drafter latency: PyTorch vs ONNX Runtime (fp32 and fp16 graph), at several context lengths.

A round hands the drafter the features of the few tokens committed since the last round plus the
block; the context lives in its KV cache. So a round's cost should barely depend on the context
length: the ratio column compares each context with the first. The cache is reset to the same
state before every timed round, so every round sees exactly the stated context.

Uses the demo models when they exist, else a tiny-but-not-trivial random Qwen3 pair built in memory.
Prints a table and writes JSON under results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def build_models(args, workdir: Path):
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target import load_target
    from dflash_trt.models.tiny import make_tiny_drafter, make_tiny_target

    target_dir, drafter_dir = args.target, args.drafter
    if (
        target_dir
        and drafter_dir
        and (target_dir / "config.json").is_file()
        and (drafter_dir / "config.json").is_file()
    ):
        return load_target(target_dir), DFlashDrafter.from_pretrained(drafter_dir), f"{target_dir} + {drafter_dir}"
    target = make_tiny_target(
        workdir / "target",
        family="qwen3",
        vocab_size=args.vocab,
        layers=args.target_layers,
        hidden=args.hidden,
        max_position_embeddings=4096,
    )
    make_tiny_drafter(target.config, workdir / "drafter", layers=args.drafter_layers, block_size=args.block_size)
    desc = (
        f"random Qwen3 target (hidden {args.hidden}, {args.target_layers} layers, vocab {args.vocab}) + "
        f"DFlash drafter ({args.drafter_layers} layers, block {args.block_size})"
    )
    return target, DFlashDrafter.from_pretrained(workdir / "drafter"), desc


def time_rounds(session, context: int, feature_size: int, new_tokens: int, block: int, rounds: int, warmup: int):
    """Median / p90 ms of one drafter pass for a row whose cache holds exactly `context` tokens before it
    (a fresh row per round, filled untimed: the drafter's cache only grows)."""
    from dflash_trt.runtime.base import DraftRequest

    g = torch.Generator().manual_seed(0)
    context_feats = torch.randn(context, feature_size, generator=g)
    feats = torch.randn(new_tokens, feature_size, generator=g)
    times = []
    for i in range(warmup + rounds):
        row = session.add_row()
        session.draft([DraftRequest(row, context_feats, 1, block)])  # fill the cache
        t0 = time.perf_counter()
        session.draft([DraftRequest(row, feats, 2, block)])
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        session.remove_row(row)
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))], "rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO / "models" / "target", help="target checkpoint (default: demo)")
    p.add_argument(
        "--drafter", type=Path, default=REPO / "models" / "drafter", help="drafter checkpoint (default: demo)"
    )
    p.add_argument("--contexts", default="128,1024", help="context lengths, comma-separated (default 128,1024)")
    p.add_argument(
        "--new-tokens", type=int, default=4, help="committed tokens per round fed to the drafter (default 4)"
    )
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per cell (default 30)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch and onnxruntime (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="random model hidden size (default 512)")
    p.add_argument("--target-layers", type=int, default=8)
    p.add_argument("--drafter-layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench_drafter.json")
    args = p.parse_args()

    from dflash_trt.builders.onnx_drafter import export_drafter
    from dflash_trt.runtime.ort_backend import OrtDrafterEngine
    from dflash_trt.runtime.torch_backend import TorchDrafterEngine

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target, drafter, desc = build_models(args, tmp)
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        export_drafter(drafter, embed, head, tmp / "onnx", fp16=True)
        engines = {
            "pytorch fp32": TorchDrafterEngine(drafter, embed, head),
            "onnxruntime fp32": OrtDrafterEngine(tmp / "onnx", "fp32", threads=args.threads),
            "onnxruntime fp16": OrtDrafterEngine(tmp / "onnx", "fp16", threads=args.threads),
        }
        block = drafter.spec.block_size
        rows = []
        for name, engine in engines.items():
            base = None
            for ctx in contexts:
                r = time_rounds(
                    engine.new_session(), ctx, drafter.feature_size, args.new_tokens, block, args.rounds, args.warmup
                )
                base = base or r["median_ms"]
                rows.append({"backend": name, "context": ctx, **r, "ratio_to_first": r["median_ms"] / base})

    print(f"models: {desc}; block {block}, {args.new_tokens} new tokens per round, {args.threads} threads")
    print(f"{'backend':<18} {'context':>8} {'median ms':>10} {'p90 ms':>8} {'vs first':>9}")
    for r in rows:
        print(
            f"{r['backend']:<18} {r['context']:>8} {r['median_ms']:>10.2f} {r['p90_ms']:>8.2f} {r['ratio_to_first']:>8.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "models": desc,
                "block_size": block,
                "new_tokens": args.new_tokens,
                "threads": args.threads,
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
