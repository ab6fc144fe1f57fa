"""The whole recipe for the SmolLM2-135M-Instruct DFlash drafter, resumable phase by phase:

  prompts     chat / explain / code prompts from the standard library, split by source file
  regenerate  the target's own responses (chat template, stops at EOS), one shard per batch
  features    the target's features of every regenerated sequence, once, into a disk-backed fp16 cache
  train       the drafter (dflash_trt.train.drafter, as `dflash-trt train-drafter`) on the regenerated
              sequences and cached features, checkpointed every --save-every steps
  publish     copy the latest checkpoint (published DFlash format) and its training.json to --publish-dir,
              and the prompts + regenerated responses to data/smollm2/ (committed: a fresh work folder
              starts from them)

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

PHASES = ("prompts", "regenerate", "features", "train", "publish")
DEFAULT_PHASES = "prompts,regenerate,features,train"


def parse_args(argv=None):
    from dflash_trt.train.common import add_training_device_arg

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--target",
        type=Path,
        default=None,
        help="converted target (default: .cache/models/smollm2-135m-instruct, made by `make models`)",
    )
    p.add_argument("--work", type=Path, default=REPO / ".cache" / "smollm2-drafter", help="work folder")
    p.add_argument(
        "--phases",
        default=DEFAULT_PHASES,
        help=f"comma-separated subset of {','.join(PHASES)} (default {DEFAULT_PHASES})",
    )
    p.add_argument("--publish-dir", type=Path, default=REPO / "models" / "smollm2-drafter")
    p.add_argument(
        "--committed",
        type=Path,
        default=REPO / "data" / "smollm2",
        help="committed prompts + regenerated responses: a fresh --work starts from them, publish updates them",
    )
    p.add_argument("--prompts-per-file", type=int, default=6)
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N training prompts")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response budget when regenerating")
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped")
    p.add_argument("--regen-batch", type=int, default=16)
    p.add_argument("--regen-minutes", type=float, default=None, help="stop regenerating after this long")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--target-layer-ids", default="1,14,27", help="target layers whose outputs feed the drafter")
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=16,
        help="mask token (SmolLM2 has no mask token: default <empty_output>, id 16, a special token "
        "chat and code never produce)",
    )
    p.add_argument("--steps", type=int, default=4000, help="optimizer steps (the cosine schedule's length)")
    p.add_argument("--warmup-ratio", type=float, default=0.01)
    p.add_argument(
        "--loss-chunk-rows",
        type=int,
        default=128,
        help="rows per lm_head + loss chunk (128 x 49152 fp32 = 25 MB: under glibc's mmap threshold, "
        "so chunks reuse memory instead of faulting fresh pages)",
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--anchors", type=int, default=32, help="anchor blocks per sequence")
    p.add_argument("--seq-len", type=int, default=1280, help="longest prompt + response trained on (cut beyond)")
    p.add_argument("--kd-weight", type=float, default=0.5, help="distillation weight (sampled generation)")
    p.add_argument(
        "--init-norm-scale",
        type=float,
        default=0.1,
        help="drafter final norm = this x the target's (tempers the first steps' logits)",
    )
    p.add_argument("--train-hours", type=float, default=None, help="stop training cleanly after this long")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared, oversubscribed CPU two threads wait on each "
        "other at every op: generation runs several times slower than with one)",
    )
    add_training_device_arg(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from dflash_trt.models.pretrained import SMOLLM2_DIR, ensure_model
    from dflash_trt.models.target import load_target, load_tokenizer
    from dflash_trt.train.common import training_device
    from dflash_trt.train.prompts import build_prompt_set, load_prompts, save_prompts

    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        print(f"unknown phases: {sorted(unknown)}", file=sys.stderr)
        return 2
    try:
        device = training_device(args.device)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    target_dir = args.target or (ensure_model() if not (SMOLLM2_DIR / "config.json").is_file() else SMOLLM2_DIR)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    train_prompts, held_prompts = work / "prompts-train.jsonl", work / "prompts-held-out.jsonl"
    seed_from_committed(work, args.committed)
    if "prompts" in phases and not held_prompts.is_file():
        t = time.perf_counter()
        save_prompts(build_prompt_set("train", per_file=args.prompts_per_file), train_prompts)
        save_prompts(build_prompt_set("held-out", per_file=args.prompts_per_file), held_prompts)
        print(f"prompts: {train_prompts}, {held_prompts} in {time.perf_counter() - t:.0f}s", flush=True)

    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise SystemExit(f"{target_dir}: no tokenizer (the recipe regenerates text with the chat template)")
    target = None
    regen_dir = work / "regen"
    if "regenerate" in phases:
        from dflash_trt.train.regen import regenerate_prompts

        prompts = load_prompts(train_prompts)[: args.max_prompts]
        target = load_target(target_dir, device=device)
        data = regenerate_prompts(
            target,
            tokenizer,
            prompts,
            regen_dir,
            max_new_tokens=args.max_new_tokens,
            batch=args.regen_batch,
            max_prompt_tokens=args.max_prompt_tokens,
            time_budget_s=args.regen_minutes * 60 if args.regen_minutes else None,
        )
        if data is not None:
            print(f"regenerated: {len(data)} sequences, {data.response_tokens} response tokens", flush=True)

    if "features" in phases or "train" in phases:
        from dflash_trt.train.drafter import train_drafter_on_sequences
        from dflash_trt.train.drafter_config import DrafterTrainConfig
        from dflash_trt.train.regen import SequenceSet

        data = SequenceSet.load(regen_dir)
        cfg = DrafterTrainConfig(
            block_size=args.block_size,
            num_layers=args.layers,
            target_layer_ids=tuple(int(x) for x in args.target_layer_ids.split(",")),
            mask_token_id=args.mask_token_id,
            steps=args.steps,
            batch_size=args.batch_size,
            warmup_ratio=args.warmup_ratio,
            loss_chunk_rows=args.loss_chunk_rows,
            init_norm_scale=args.init_norm_scale,
            anchors_per_seq=args.anchors,
            seq_len=args.seq_len,
            kd_weight=args.kd_weight,
            save_every=args.save_every,
            time_budget_s=args.train_hours * 3600 if args.train_hours else None,
        )
        target = target or load_target(target_dir, device=device)
        summary = train_drafter_on_sequences(
            target, data, work / "drafter", work / "features", cfg, train="train" in phases
        )
        summary["data"] = {
            "sequences": len(data),
            "response_tokens": data.response_tokens,
            "prompts": str(train_prompts.relative_to(REPO))
            if train_prompts.is_relative_to(REPO)
            else str(train_prompts),
        }
        (work / "drafter" / "training.json").write_text(json.dumps(summary, indent=1, default=str))
    if "publish" in phases:
        publish(work / "drafter", args.publish_dir, work)
        save_committed(work, args.committed)
    print(f"done in {time.perf_counter() - t_start:.0f}s", flush=True)
    return 0


COMMITTED = REPO / "data" / "smollm2"  # prompts and regenerated responses kept in git (next runs start here)


def seed_from_committed(work: Path, committed: Path = COMMITTED) -> None:
    """A fresh work folder starts from the committed prompt set and regenerated responses, so a new
    machine need not rebuild or regenerate them (regeneration then continues with the prompts not done)."""
    import shutil

    for name in ("prompts-train.jsonl", "prompts-held-out.jsonl"):
        if not (work / name).is_file() and (committed / name).is_file():
            shutil.copy2(committed / name, work / name)
    regen = work / "regen"
    if not any(regen.glob("shard-*.npz")) and (committed / "regenerated.npz").is_file():
        regen.mkdir(parents=True, exist_ok=True)
        shutil.copy2(committed / "regenerated.npz", regen / "shard-00000.npz")
        print(f"regen: starting from {committed / 'regenerated.npz'}", flush=True)


def save_committed(work: Path, committed: Path = COMMITTED) -> None:
    """Prompts + all regenerated shards as one compressed file under data/smollm2/ (for git)."""
    import shutil

    from dflash_trt.train.regen import SequenceSet

    committed.mkdir(parents=True, exist_ok=True)
    for name in ("prompts-train.jsonl", "prompts-held-out.jsonl"):
        shutil.copy2(work / name, committed / name)
    data = SequenceSet.load(work / "regen")
    data.save(committed / "regenerated.npz")
    print(f"saved {len(data)} sequences ({data.response_tokens} response tokens) -> {committed}", flush=True)


def publish(ckpt: Path, dest: Path, work: Path) -> None:
    """The checkpoint's config + weights (what a drafter directory holds) and a training.json that says
    how far training got. A checkpoint is written at a step boundary, so it is always complete."""
    import shutil

    state_file = ckpt / "trainer_state.pt"
    if not state_file.is_file():
        raise SystemExit(f"no checkpoint in {ckpt}")
    import torch

    state = torch.load(state_file, weights_only=False, map_location="cpu")
    history = state.get("history", [])
    dest.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load_file, save_file

    shutil.copy2(ckpt / "config.json", dest / "config.json")
    # fp16 on disk (half the size; the loaders cast to the dtype they run in)
    weights = {k: v.half().contiguous() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    from dflash_trt.train.regen import SequenceSet

    data = SequenceSet.load(work / "regen")
    info = {
        "finished": False,
        "note": "training NOT finished: a snapshot of the background CPU run (see models/README.md)",
        "steps": state["step"],
        "history": history[-5:],
        "train_seconds": history[-1]["seconds"] if history else 0,
        "data": {
            "sequences": len(data),
            "response_tokens": data.response_tokens,
            "source": "SmolLM2-135M-Instruct's own greedy responses to standard-library prompts "
            "(chat / explain / code), training split by source file",
        },
        "recipe": "scripts/train_smollm2_drafter.py",
        "published": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (dest / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"published step {state['step']} -> {dest}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
