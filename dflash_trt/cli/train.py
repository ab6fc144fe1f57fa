"""`dflash-trt train-drafter`: train a DFlash drafter for your own target."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..train.common import add_training_device_arg
    from .options import finite_float, positive_int, token_ids

    p = sub.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a target (the paper's recipe)",
        description="Train a DFlash drafter against a frozen target: random anchor blocks [token, MASK x (B-1)] "
        "packed with a block-sparse mask, position-decayed cross-entropy (w_k = exp(-(k-1)/gamma)), "
        "optional distillation, AdamW + cosine schedule. Writes the published drafter format; resumable.",
    )
    p.add_argument("--target", type=Path, required=True, help="Hugging Face target directory (frozen)")
    p.add_argument(
        "--data",
        required=True,
        help="'stdlib' (this Python's standard library), a text file, a folder of *.py/*.txt/*.md, "
        "a .npy array of token sequences [N, L], or the target's regenerated responses (a .npz or a "
        "folder of shard-*.npz written by scripts/train_smollm2_drafter.py: prompt + response, "
        "trained on the responses only)",
    )
    p.add_argument("--out", type=Path, required=True, help="output drafter directory (checkpoints go here)")
    p.add_argument(
        "--regenerate",
        type=positive_int,
        default=None,
        metavar="N",
        help="cut N prompts from the text and train on the target's own continuations (the paper's "
        "recipe); default: train on the text itself",
    )
    p.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens when regenerating")
    p.add_argument(
        "--gen-temperature", type=finite_float, default=0.0, help="temperature when regenerating (0 = greedy)"
    )
    p.add_argument("--block-size", type=positive_int, default=8, help="drafter block size B (>= 2; default 8)")
    p.add_argument("--layers", type=positive_int, default=2, help="drafter layers (default 2)")
    p.add_argument(
        "--target-layer-ids",
        type=token_ids,
        default=None,
        help="target layers whose outputs feed the drafter, e.g. 1,9,17 (default: the reference rule)",
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token id (default: the tokenizer's)")
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--anchors", type=positive_int, default=32, help="anchor blocks per sequence (default 32)")
    p.add_argument("--lr", type=finite_float, default=6e-4, help="peak learning rate (default 6e-4, the paper's)")
    p.add_argument(
        "--gamma",
        type=finite_float,
        default=None,
        help="loss decay gamma (default: 7, 5, 4 for block sizes 16, 10, 8; else B/2)",
    )
    p.add_argument(
        "--kd-weight",
        type=finite_float,
        default=0.0,
        help="weight of the distillation loss to the target's soft distribution, in [0, 1] (default 0)",
    )
    p.add_argument("--kd-temperature", type=finite_float, default=1.0)
    p.add_argument(
        "--no-init-from-target",
        action="store_true",
        help="random drafter layers instead of a warm start from the target's layers",
    )
    p.add_argument("--time-budget-min", type=finite_float, default=None, help="stop cleanly after this many minutes")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    add_training_device_arg(p)
    p.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from ..models.target import load_target, load_tokenizer
    from ..train.common import training_device
    from ..train.data import load_training_sequences
    from ..train.drafter import train_drafter_from_dirs
    from ..train.drafter_config import DrafterTrainConfig
    from .options import CliError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = training_device(args.device)
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"training on {device}")
    if not args.target.is_dir():
        raise CliError(f"target directory not found: {args.target}")
    if args.block_size < 2:
        raise CliError("--block-size must be >= 2")
    if not 0 <= args.kd_weight <= 1:
        raise CliError("--kd-weight must be in [0, 1]")
    cfg = DrafterTrainConfig(
        block_size=args.block_size,
        num_layers=args.layers,
        target_layer_ids=tuple(args.target_layer_ids) if args.target_layer_ids else None,
        mask_token_id=args.mask_token_id,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        anchors_per_seq=args.anchors,
        lr=args.lr,
        gamma=args.gamma,
        kd_weight=args.kd_weight,
        kd_temperature=args.kd_temperature,
        init_from_target=not args.no_init_from_target,
        time_budget_s=args.time_budget_min * 60 if args.time_budget_min else None,
    )
    data = args.data
    try:
        if args.regenerate:
            target, tok = load_target(args.target, device=device), load_tokenizer(args.target)
            seqs = load_training_sequences(
                data,
                tok,
                args.seq_len,
                regenerate_with=target,
                n_sequences=args.regenerate,
                prompt_len=args.prompt_len,
                temperature=args.gen_temperature,
            )
            if not isinstance(seqs, np.ndarray):
                raise CliError(f"--regenerate continues prompts cut from text; {data} holds regenerated sequences")
            args.out.mkdir(parents=True, exist_ok=True)
            data = args.out / "regenerated.npy"
            np.save(data, seqs)
            del target  # training loads the target again: never two copies on one GPU
            print(f"regenerated {seqs.shape[0]} sequences of {seqs.shape[1]} tokens -> {data}")
        summary = train_drafter_from_dirs(args.target, Path(data), args.out, cfg, resume=args.resume, device=device)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None
    print(f"drafter written to {args.out} after {summary['steps']} steps ({summary['seconds']}s)")
    return 0
