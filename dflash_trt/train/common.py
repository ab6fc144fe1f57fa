"""Pieces both trainers share: AdamW with a cosine schedule and warm-up, checkpointed state."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

# `step_fn(step)` returns (loss tensor, tokens in the step, progress-bar postfix)
StepFn = Callable[[int], tuple[torch.Tensor, int, dict[str, Any]]]
# `on_every(step, running_loss, seconds, last)`
OnEvery = Callable[[int, float, float, bool], None]


def cosine_with_warmup(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up, then cosine decay to `floor` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(
    params: Iterable[torch.nn.Parameter], lr: float, total_steps: int, warmup_ratio: float, weight_decay: float = 0.01
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    trainable = [p for p in params if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]  # norms are not decayed
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, int(total_steps * warmup_ratio))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, total_steps, warmup))
    return opt, sched


def save_state(
    path: Path,
    step: int,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    extra: dict[str, Any] | None = None,
) -> None:
    state = {
        "step": step,
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        **(extra or {}),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # never leave a half-written state behind


def load_state(path: Path, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    # onto the CPU first: a run saved on a GPU resumes on another device (the optimizer's load_state_dict
    # moves its state to its parameters' device), and torch's RNG state is a CPU tensor
    state: dict[str, Any] = torch.load(path, weights_only=False, map_location="cpu")
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state


def add_training_device_arg(parser: argparse.ArgumentParser) -> None:
    """The `--device` option of every trainer's command line (resolved by `training_device`)."""
    parser.add_argument(
        "--device",
        default="auto",
        metavar="{auto,cpu,cuda,cuda:N}",
        help="where the target regenerates and computes its features and the model trains (default auto: the "
        "first CUDA GPU torch sees, else cpu)",
    )


def training_device(name: str) -> str:
    """Where a trainer runs: `auto` -> cuda when torch sees a GPU, else cpu; otherwise cpu, cuda or cuda:N
    (ValueError, with the reason, for a device this machine lacks)."""
    from ..loading import resolve_device

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # what a library allocates on "the current GPU" goes there too, not to GPU 0
    return str(device)


def autocast(enabled: bool, device: torch.device | str = "cpu") -> AbstractContextManager[Any]:
    """bf16 autocast on the training device: on a GPU the usual mixed precision; on a CPU much faster
    training where it has bfloat16 matrix instructions (AMX / AVX512-BF16; docs/design.md#training)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


def run_steps(
    params: Iterable[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    step_fn: StepFn,
    *,
    start: int,
    total: int,
    clip: float,
    every: int,
    on_every: OnEvery,
    time_budget_s: float | None = None,
    desc: str = "train",
) -> int:
    """The one step loop both trainers use: `step_fn(step)` returns (loss tensor, tokens, postfix dict);
    backward, clip, AdamW + schedule step; running loss and tokens/s on a progress bar; every `every`
    steps and at the end `on_every(step, running_loss, seconds, last)`. Stops after `total` steps or
    when `time_budget_s` has passed (cleanly, at a step boundary). Returns the last step done."""
    from tqdm import tqdm

    trainable = [p for p in params if p.requires_grad]
    t0, tokens_done, step = time.perf_counter(), 0, start
    running: float | None = None
    bar = tqdm(range(start, total), desc=desc, unit="step", initial=start, total=total)
    for step in bar:  # tqdm is untyped: its items are the ints of the range
        step = int(step)
        loss, tokens, postfix = step_fn(step)
        torch.autograd.backward(loss)  # = loss.backward(), which torch leaves unannotated
        torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens_done += tokens
        running = float(loss.detach()) if running is None else 0.95 * running + 0.05 * float(loss.detach())
        elapsed = time.perf_counter() - t0
        bar.set_postfix(loss=f"{running:.3f}", tok_s=f"{tokens_done / elapsed:.0f}", **postfix)
        last = step + 1 == total or (time_budget_s is not None and elapsed > time_budget_s)
        if (step + 1) % every == 0 or last:
            on_every(step + 1, running, elapsed, last)
        if last:
            return step + 1
    return step
