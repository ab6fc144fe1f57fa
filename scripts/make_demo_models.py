#!/usr/bin/env python3
"""Reproduce the demo models under models/ from data every machine has: the source code of the
running interpreter's standard library (a code-completion corpus; 1 file in 10 held out).

Stages (run in order; each reads what the previous wrote):
  tokenizer  byte-level BPE, 4096 tokens, with <|endoftext|> and <|mask|>
  target     Qwen3-architecture causal LM (8 layers, ~12M parameters)
  drafter    DFlash drafter trained with `dflash_trt.train` on target-regenerated code
  ar-draft   2-layer autoregressive draft model (classic speculative-decoding baseline)

Two more stages run only when named: `corpus` tokenizes the two splits into --cache (train.npy,
held-out.npy) with the target's tokenizer; `regen-prompts` draws from that training split the prompts the
drafter stage would have the target continue (--regen-sequences, --regen-seed) into --prompts-out, so that
another machine (a GPU host, `make gpu-train-demo`) continues exactly these prompts, carrying 1 MiB instead
of the whole tokenized corpus.

`--smoke` shrinks everything to a CI-sized run into a scratch folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash_trt.models.target import make_portable, save_portable
from dflash_trt.train.common import add_training_device_arg, training_device
from dflash_trt.train.data import read_texts, stdlib_files, tokenize_corpus, train_tokenizer
from dflash_trt.train.lm import LMTrainConfig, train_lm

STAGES = ("tokenizer", "target", "drafter", "ar-draft")  # the default run, in order
EXTRA_STAGES = ("corpus", "regen-prompts")


def target_config(vocab: int, smoke: bool):
    from transformers import Qwen3Config

    if smoke:
        return Qwen3Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=2048,
        )
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=320,
        intermediate_size=960,
        num_hidden_layers=8,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=10000.0,  # type: ignore[call-arg]  # transformers 5 takes it into rope_parameters, 4.57 by name
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
    )


def ar_draft_config(target_cfg, smoke: bool):
    from transformers import Qwen3Config

    d = target_cfg.to_dict()
    d.update(num_hidden_layers=2 if not smoke else 1, tie_word_embeddings=True)
    for k in ("layer_types", "transformers_version", "architectures", "dtype", "torch_dtype"):
        d.pop(k, None)
    return Qwen3Config(**d)


def corpus_tokens(out: Path, tokenizer, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    cache.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split in ("train", "held-out"):
        f = cache / f"{split}.npy"
        if not f.exists():
            t = time.perf_counter()
            np.save(f, tokenize_corpus(tokenizer, read_texts(corpus_files(split))))
            print(f"tokenized {split}: {len(np.load(f)):,} tokens in {time.perf_counter() - t:.0f}s")
        arrays[split] = np.load(f)
    return arrays["train"], arrays["held-out"]


MAX_FILES: int | None = None  # --smoke reads only a few files


def corpus_files(split: str) -> list[Path]:
    return stdlib_files(split)[:MAX_FILES]


def save_fp16(model, out: Path) -> None:
    """Weights stored in fp16 (half the size; the models fit the repository's 50 MB)."""
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    make_portable(out)


def stage_tokenizer(args) -> None:
    files = corpus_files("train")
    texts = list(read_texts(files))
    t = time.perf_counter()
    train_tokenizer(texts, args.vocab_size, args.out / "target")
    print(f"tokenizer: {args.vocab_size} tokens from {len(texts)} files in {time.perf_counter() - t:.0f}s")


def stage_corpus(args) -> None:
    from transformers import AutoTokenizer

    train, held = corpus_tokens(args.out, AutoTokenizer.from_pretrained(args.out / "target"), args.cache)
    print(f"corpus: {len(train):,} training and {len(held):,} held-out tokens in {args.cache}")


def stage_regen_prompts(args) -> None:
    from transformers import AutoTokenizer

    from dflash_trt.train.data import write_regen_prompts

    train, _ = corpus_tokens(args.out, AutoTokenizer.from_pretrained(args.out / "target"), args.cache)
    path = write_regen_prompts(
        train, args.prompts_out or args.cache, args.regen_sequences, regen_prompt_len(args), args.regen_seed
    )
    print(f"regen-prompts: {args.regen_sequences} x {regen_prompt_len(args)} tokens in {path}")


def regen_prompt_len(args) -> int:
    return 32 if args.smoke else 64


def stage_lm(args, name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.out / "target")
    train, held = corpus_tokens(args.out, tok, args.cache)
    if name == "target":
        cfg = target_config(len(tok), args.smoke)
        steps, budget = args.target_steps, args.target_minutes * 60
    else:
        from transformers import AutoConfig

        cfg = ar_draft_config(AutoConfig.from_pretrained(args.out / "target"), args.smoke)
        steps, budget = args.ar_steps, args.ar_minutes * 60
    torch.manual_seed(0)
    init = args.target_init if name == "target" else None
    init_record = None
    if init is not None:  # continue from saved weights with a fresh schedule (the tokenizer must be the same)
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        if (init / "training.json").is_file():
            init_record = json.loads((init / "training.json").read_text())
        if model.config.vocab_size != len(tok):
            raise SystemExit(
                f"--target-init {init}: vocabulary {model.config.vocab_size}, the tokenizer has {len(tok)}"
            )
    else:
        model = AutoModelForCausalLM.from_config(cfg).float()  # a config read from the fp16 target says fp16
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n_params / 1e6:.2f}M parameters, {model.config.num_hidden_layers} layers, on {args.device}")
    model.to(args.device)
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    train_cfg = LMTrainConfig(
        steps=steps,
        time_budget_s=budget,
        eval_every=max(10, steps // 20),
        batch_size=4 if args.smoke else 16,
        seq_len=64 if args.smoke else 256,
        lr=args.target_lr if name == "target" else LMTrainConfig.lr,
    )
    # checkpoints at every evaluation; a run that finds them (same --cache) resumes where it stopped. A
    # continuation has its own folder, so that it never resumes the run it continues
    run = args.cache / (f"{name}-run" if init is None else f"{name}-run-continued")
    report = train_lm(model, train, held, train_cfg, log_path=args.cache / f"{name}-history.json", checkpoint_dir=run)
    save_fp16(model, out)
    save_portable(tok, out)
    (out / "training.json").write_text(
        json.dumps(
            {
                "data": "CPython stdlib *.py (training split: files whose sha1(relative path) % 10 != 0)",
                "parameters": n_params,
                # a continuation keeps the record of the run it continued (its steps, tokens and loss curve)
                "init": None if init is None else {"path": str(init), "training": init_record},
                "train_tokens_seen": report.tokens,
                "steps": report.steps,
                "seconds": round(report.seconds),
                "config": vars(train_cfg),
                "history": report.history,
                "corpus_tokens": {"train": int(len(train)), "held_out": int(len(held))},
            },
            indent=1,
            default=str,
        )
    )


def stage_drafter(args) -> None:
    import shutil

    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.train.data import regenerate_dataset
    from dflash_trt.train.drafter import train_drafter_from_dirs
    from dflash_trt.train.drafter_config import DrafterTrainConfig

    cfg = DrafterTrainConfig(
        block_size=args.block_size,
        num_layers=args.drafter_layers,
        steps=args.drafter_steps,
        time_budget_s=args.drafter_minutes * 60,
        batch_size=args.drafter_batch,
        seq_len=64 if args.smoke else 256,
        anchors_per_seq=8 if args.smoke else 32,
        lr=args.drafter_lr,
        kd_weight=args.drafter_kd_weight,
    )
    # prompt seed 1 is the first run's data; a continuation (--drafter-init) trains on prompts of another seed
    seed = args.regen_seed
    data = args.cache / ("regenerated.npy" if seed == 1 else f"regenerated-seed{seed}.npy")
    if not data.exists():
        prompt_len = regen_prompt_len(args)
        regenerate_dataset(
            args.out / "target",
            data,
            n_sequences=args.regen_sequences,
            prompt_len=prompt_len,
            new_tokens=cfg.seq_len - prompt_len,
            seed=seed,
            device=args.device,
            batch=args.regen_batch,
        )
    run = args.cache / ("drafter-run" if args.drafter_init is None else "drafter-run-continued")
    if args.drafter_init is not None and not (run / "config.json").exists():
        # warm start: the given drafter's weights, a fresh optimizer and schedule (no trainer state)
        run.mkdir(parents=True, exist_ok=True)
        DFlashDrafter.from_pretrained(args.drafter_init).float().save_pretrained(run)
        (run / "init.json").write_text(json.dumps({"drafter_init": str(args.drafter_init)}))
    resume = (run / "trainer_state.pt").exists() or args.drafter_init is not None
    train_drafter_from_dirs(args.out / "target", data, run, cfg, resume=resume, device=args.device)
    out = args.out / "drafter"
    DFlashDrafter.from_pretrained(run).half().save_pretrained(out)  # fp16 on disk, fp32 when loaded
    shutil.copy(run / "training.json", out / "training.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models"), help="where the models go (default models/)")
    p.add_argument("--cache", type=Path, default=Path(".cache/demo"), help="tokenized corpus and logs")
    p.add_argument("--stages", nargs="+", choices=STAGES + EXTRA_STAGES, default=list(STAGES))
    p.add_argument("--smoke", action="store_true", help="tiny CI-sized run (use with a scratch --out)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--target-steps", type=int, default=700)
    p.add_argument("--target-minutes", type=float, default=30, help="time budget for the target")
    p.add_argument(
        "--target-init",
        type=Path,
        default=None,
        help="continue the target from these weights (e.g. models/target) with a fresh schedule",
    )
    p.add_argument("--target-lr", type=float, default=LMTrainConfig.lr)
    p.add_argument("--ar-steps", type=int, default=600)
    p.add_argument("--ar-minutes", type=float, default=8)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--drafter-steps", type=int, default=2400)
    p.add_argument("--drafter-minutes", type=float, default=30)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: all cores; use 1 on a busy machine, where OpenMP spinning hurts)",
    )
    add_training_device_arg(p)
    p.add_argument("--drafter-batch", type=int, default=8, help="drafter training sequences per step (default 8)")
    p.add_argument("--regen-batch", type=int, default=32, help="prompts the target continues per batch (default 32)")
    p.add_argument("--regen-sequences", type=int, default=1024, help="target-regenerated training sequences")
    p.add_argument(
        "--regen-seed",
        type=int,
        default=1,
        help="seed of the corpus prompts the target continues (1: the first run's data)",
    )
    p.add_argument(
        "--prompts-out",
        type=Path,
        default=None,
        help="where the regen-prompts stage writes regen-prompts-seed<seed>.npy (default --cache)",
    )
    p.add_argument(
        "--drafter-init",
        type=Path,
        default=None,
        help="continue from this drafter (e.g. models/drafter) with a fresh schedule, in "
        "<cache>/drafter-run-continued, instead of a new drafter warm-started from target layers",
    )
    p.add_argument("--drafter-lr", type=float, default=6e-4)
    p.add_argument(
        "--drafter-kd-weight",
        type=float,
        default=0.0,
        help="weight of distillation from the target's distribution (KL) against cross-entropy "
        "on its greedy tokens; > 0 caches the target's final hidden states with the features",
    )
    args = p.parse_args(argv)
    if args.smoke:
        global MAX_FILES
        MAX_FILES = 40
        args.vocab_size = min(args.vocab_size, 300)
        args.target_steps = args.ar_steps = args.drafter_steps = min(args.target_steps, 6)
        args.regen_sequences = min(args.regen_sequences, 8)
        args.drafter_batch = min(args.drafter_batch, 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        args.device = training_device(args.device)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for stage in args.stages:
        t = time.perf_counter()
        {
            "tokenizer": stage_tokenizer,
            "target": lambda a: stage_lm(a, "target"),
            "drafter": stage_drafter,
            "corpus": stage_corpus,
            "regen-prompts": stage_regen_prompts,
            "ar-draft": lambda a: stage_lm(a, "ar-draft"),
        }[stage](args)
        print(f"== {stage} done in {time.perf_counter() - t:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
