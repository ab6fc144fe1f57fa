"""Plain next-token training of a small causal LM (the demo target and the AR draft baseline)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .common import autocast, load_state, make_optimizer, run_steps, save_state
from .data import random_windows

STATE_FILE = "trainer_state.pt"  # weights, optimizer, schedule, RNGs, history: all a resumed run needs
RESUME_KEYS = ("steps", "batch_size", "seq_len", "lr", "warmup_ratio", "seed")  # a resumed run must match them


@dataclass
class LMTrainConfig:
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1.5e-3
    warmup_ratio: float = 0.04
    clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    time_budget_s: float | None = None  # stop early (cleanly) when exceeded
    bf16: bool = True
    seed: int = 0


@dataclass
class LMTrainReport:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)  # step, train_loss, held_out_loss


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, tokens: np.ndarray, cfg: LMTrainConfig) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same windows every time
    device = next(model.parameters()).device
    losses = []
    for _ in range(cfg.eval_batches):
        x = random_windows(tokens, cfg.batch_size, cfg.seq_len, gen).to(device)
        with autocast(cfg.bf16, device):
            losses.append(float(model(input_ids=x, labels=x).loss))
    model.train()
    return sum(losses) / len(losses)


def train_lm(
    model: torch.nn.Module,
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray,
    cfg: LMTrainConfig,
    log_path: Path | None = None,
    checkpoint_dir: Path | None = None,
) -> LMTrainReport:
    """Train `model` in place. With `checkpoint_dir`, weights and trainer state are saved there at every
    evaluation (one file, written aside and then renamed: a run killed mid-save keeps the last whole
    checkpoint), and a run that finds them resumes: same schedule, same data stream, and the time budget
    counts the seconds spent up to that checkpoint."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt, sched = make_optimizer(model.parameters(), cfg.lr, cfg.steps, cfg.warmup_ratio)
    report = LMTrainReport()
    start_step, spent = 0, 0.0
    if checkpoint_dir is not None and (checkpoint_dir / STATE_FILE).exists():
        state = load_state(checkpoint_dir / STATE_FILE, opt, sched)
        saved = {k: state.get("config", {}).get(k) for k in RESUME_KEYS}
        if saved != {k: getattr(cfg, k) for k in RESUME_KEYS}:
            raise ValueError(f"{checkpoint_dir} holds a run with other settings ({saved}): use another folder")
        model.load_state_dict(state["model"])
        gen.set_state(state["data_rng"])
        start_step, spent = state["step"], state["seconds"]
        report.steps, report.tokens, report.history = start_step, state["tokens"], state["history"]
        tqdm.write(f"resuming from step {start_step} ({spent:.0f} s already spent)")
    model.train()
    device = next(model.parameters()).device  # the model trains where it lives; windows are cut on the CPU
    start = time.perf_counter() - spent

    def step_fn(step: int) -> tuple[torch.Tensor, int, dict[str, Any]]:
        x = random_windows(train_tokens, cfg.batch_size, cfg.seq_len, gen).to(device)
        with autocast(cfg.bf16, device):
            loss: torch.Tensor = model(input_ids=x, labels=x).loss
        report.steps, report.tokens = step + 1, report.tokens + x.numel()
        return loss, x.numel(), {}

    def on_every(step: int, running: float, elapsed: float, last: bool) -> None:
        entry = {
            "step": step,
            "tokens": report.tokens,
            "train_loss": round(running, 4),
            "held_out_loss": round(held_out_loss(model, eval_tokens, cfg), 4),
            "seconds": round(spent + elapsed, 1),  # run_steps counts this process's seconds only
        }
        report.history.append(entry)
        tqdm.write(json.dumps(entry))
        if log_path is not None:
            log_path.write_text(json.dumps(report.history, indent=1))
        if checkpoint_dir is not None:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            extra = {
                "model": model.state_dict(),
                "data_rng": gen.get_state(),
                "seconds": spent + elapsed,
                "tokens": report.tokens,
                "history": report.history,
                "config": {k: getattr(cfg, k) for k in RESUME_KEYS},
            }
            save_state(checkpoint_dir / STATE_FILE, step, opt, sched, extra)

    budget_left = None if cfg.time_budget_s is None else cfg.time_budget_s - spent
    if budget_left is not None and budget_left <= 0:
        tqdm.write(f"the time budget ({cfg.time_budget_s:.0f} s) is spent: nothing to resume")
    else:
        run_steps(
            model.parameters(),
            opt,
            sched,
            step_fn,
            start=start_step,
            total=cfg.steps,
            clip=cfg.clip,
            every=cfg.eval_every,
            on_every=on_every,
            time_budget_s=budget_left,
        )
    report.seconds = time.perf_counter() - start  # spent, when nothing ran
    model.eval()
    return report
