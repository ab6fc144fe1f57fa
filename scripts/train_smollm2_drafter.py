"""The whole recipe for the SmolLM2-135M-Instruct DFlash drafter, resumable phase by phase:

  prompts     chat / explain / code prompts from the standard library, split by source file
  regenerate  the target's own responses (chat template, stops at EOS), one shard per batch
  features    the target's features of every regenerated sequence, once, into a disk-backed fp16 cache
  train       `dflash-trt train-drafter` on the regenerated sequences and cached features, checkpointed

Every phase skips what is already done, so re-running the same command continues; --phases picks some.
Work files live in --work (default .cache/smollm2-drafter). Run it in the background on a shared machine:

  setsid nohup nice -n 19 .venv/bin/python scripts/train_smollm2_drafter.py > .cache/smollm2-drafter.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("prompts", "regenerate", "features", "train")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=None,
                   help="converted target (default: .cache/models/smollm2-135m-instruct, made by `make models`)")
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "smollm2-drafter", help="work folder")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--prompts-per-file", type=int, default=6)
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response budget when regenerating")
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped")
    p.add_argument("--regen-batch", type=int, default=16)
    p.add_argument("--regen-minutes", type=float, default=None, help="stop regenerating after this long")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--target-layer-ids", default="1,14,27", help="target layers whose outputs feed the drafter")
    p.add_argument("--mask-token-id", type=int, default=16,
                   help="mask token (SmolLM2 has no mask token: default <empty_output>, id 16, a special token "
                   "chat and code never produce)")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--anchors", type=int, default=64, help="anchor blocks per sequence")
    p.add_argument("--kd-weight", type=float, default=0.5, help="distillation weight (sampled generation)")
    p.add_argument("--train-hours", type=float, default=None, help="stop training cleanly after this long")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from dflash_trt.models.pretrained import SMOLLM2_DIR, ensure_model
    from dflash_trt.models.target import load_target, load_tokenizer
    from dflash_trt.train.prompts import build_prompt_set, load_prompts, save_prompts

    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        print(f"unknown phases: {sorted(unknown)}", file=sys.stderr)
        return 2
    target_dir = args.target or (ensure_model() if not (SMOLLM2_DIR / "config.json").is_file() else SMOLLM2_DIR)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    train_prompts, held_prompts = work / "prompts-train.jsonl", work / "prompts-held-out.jsonl"
    if "prompts" in phases and not held_prompts.is_file():
        t = time.perf_counter()
        save_prompts(build_prompt_set("train", per_file=args.prompts_per_file), train_prompts)
        save_prompts(build_prompt_set("held-out", per_file=args.prompts_per_file), held_prompts)
        print(f"prompts: {train_prompts}, {held_prompts} in {time.perf_counter() - t:.0f}s", flush=True)

    tokenizer = load_tokenizer(target_dir)
    target = None
    regen_dir = work / "regen"
    if "regenerate" in phases:
        from dflash_trt.train.regen import regenerate_prompts

        prompts = load_prompts(train_prompts)[: args.max_prompts]
        target = load_target(target_dir)
        data = regenerate_prompts(target, tokenizer, prompts, regen_dir, max_new_tokens=args.max_new_tokens,
                                  batch=args.regen_batch, max_prompt_tokens=args.max_prompt_tokens,
                                  time_budget_s=args.regen_minutes * 60 if args.regen_minutes else None)
        if data is not None:
            print(f"regenerated: {len(data)} sequences, {data.response_tokens} response tokens", flush=True)

    if "features" in phases or "train" in phases:
        from dflash_trt.train.drafter import DrafterTrainConfig, train_drafter_on_sequences
        from dflash_trt.train.regen import SequenceSet

        data = SequenceSet.load(regen_dir)
        cfg = DrafterTrainConfig(
            block_size=args.block_size, num_layers=args.layers,
            target_layer_ids=tuple(int(x) for x in args.target_layer_ids.split(",")),
            mask_token_id=args.mask_token_id, steps=args.steps, batch_size=args.batch_size,
            anchors_per_seq=args.anchors, kd_weight=args.kd_weight, save_every=args.save_every,
            time_budget_s=args.train_hours * 3600 if args.train_hours else None,
        )
        target = target or load_target(target_dir)
        summary = train_drafter_on_sequences(target, data, work / "drafter", work / "features", cfg,
                                             train="train" in phases)
        summary["data"] = {"sequences": len(data), "response_tokens": data.response_tokens,
                           "prompts": str(train_prompts.relative_to(REPO)) if train_prompts.is_relative_to(REPO)
                           else str(train_prompts)}
        (work / "drafter" / "training.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"done in {time.perf_counter() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
