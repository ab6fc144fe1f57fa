"""DFlash drafter training, following the paper's recipe (the authors did not publish code): the loop.

The parts, each in its own file:
- `blocks`: anchors in the response, blocks [x_a, MASK x (B-1)], the block-sparse mask, position weights;
- `features`: the frozen target's features (and teacher hidden), computed once into a disk-backed fp16 cache;
- `loss`: one block-sparse forward pass per sequence, chunked cross-entropy (+ optional KL to the target);
- `checkpoints`: a new drafter warm-started from the target's layers, and the checkpoints a run writes.
Frozen: the target, its embedding table and lm_head; trained: drafter layers, fc, norms. AdamW, cosine
schedule with warm-up, gradient clipping (the step loop shared with `lm.py`); resumable checkpoints in the
published drafter format.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from ..models.drafter import DFlashDrafter
from .blocks import pad_batch
from .checkpoints import STATE_FILE, new_drafter_for, save_checkpoint
from .common import load_state, make_optimizer, run_steps, save_state
from .drafter_config import DrafterTrainConfig
from .features import open_feature_cache
from .loss import drafter_loss
from .regen import SequenceSet

if TYPE_CHECKING:
    from ..models.target import CausalLM

# The `type: ignore[no-untyped-call]`: transformers leaves a PreTrainedModel's eval unannotated.


def as_sequence_set(sequences: np.ndarray | SequenceSet, seq_len: int) -> SequenceSet:
    """Fixed-length token rows [N, L] (plain text or old-style regenerated data) -> windows of `seq_len`
    without a prompt (anchors from position 1)."""
    if isinstance(sequences, SequenceSet):
        return sequences
    seqs = np.asarray(sequences)
    if seqs.shape[1] < seq_len:
        raise ValueError(f"sequences of {seqs.shape[1]} tokens are shorter than seq_len {seq_len}")
    per_row = seqs.shape[1] // seq_len
    windows = seqs[:, : per_row * seq_len].reshape(-1, seq_len)
    return SequenceSet.from_arrays(
        windows.reshape(-1), [seq_len] * len(windows), [1] * len(windows), [str(i) for i in range(len(windows))]
    )


def train_drafter(
    drafter: DFlashDrafter,
    target: CausalLM,
    sequences: np.ndarray | SequenceSet,
    out: Path,
    cfg: DrafterTrainConfig,
    resume: bool = False,
    feature_cache: Path | None | str = "default",
) -> dict[str, Any]:
    """Train on regenerated sequences (SequenceSet) or fixed-length token rows [N, >= seq_len]; writes
    checkpoints (published format) into `out`. `feature_cache`: folder of the target-feature cache
    (default `out/feature-cache`; None: no cache, the target runs every step). The drafter trains on the
    target's device (move the target to a GPU to train there); batches are assembled on the CPU."""
    out.mkdir(parents=True, exist_ok=True)
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()  # type: ignore[no-untyped-call]
    drafter.to(target.device)
    data = as_sequence_set(sequences, cfg.seq_len)
    opt, sched = make_optimizer(drafter.parameters(), cfg.lr, cfg.steps, cfg.warmup_ratio)
    start_step, history = 0, []
    if resume and (out / STATE_FILE).exists():
        state = load_state(out / STATE_FILE, opt, sched)
        start_step, history = state["step"], state.get("history", [])
        print(f"resuming from step {start_step}", flush=True)
    folder = out / "feature-cache" if feature_cache == "default" else feature_cache
    cache = open_feature_cache(Path(folder) if folder else None, data, drafter, target, teacher=cfg.kd_weight > 0)
    drafter.train()
    gen = torch.Generator().manual_seed(cfg.seed + start_step)
    t_start = time.perf_counter()
    last_acc = [torch.zeros(cfg.block_size - 1)]

    def step_fn(step: int) -> tuple[torch.Tensor, int, dict[str, Any]]:
        rows = torch.randint(0, len(data), (cfg.batch_size,), generator=gen).tolist()
        seqs = [data.sequence(k)[: cfg.seq_len] for k in rows]
        batch = pad_batch(seqs, [int(data.prompt_lens[k]) for k in rows])
        feats = teacher = None
        if cache is not None:
            feats, teacher = cache.batch(rows, [len(x) for x in seqs], batch.tokens.shape[1])
        loss, acc = drafter_loss(
            drafter,
            target,
            batch.tokens,
            cfg,
            gen,
            features=feats,
            lengths=batch.lengths,
            prompt_lens=batch.prompt_lens,
            teacher=teacher,
        )
        last_acc[0] = acc
        predicted = int((batch.lengths - batch.prompt_lens).clamp(min=0).sum())
        return loss, predicted, {"acc1": f"{float(acc[0]):.2f}"}

    def on_every(step: int, running: float, elapsed: float, last: bool) -> None:
        history.append(
            {
                "step": step,
                "loss": round(running, 4),
                "accuracy_by_position": [round(float(a), 3) for a in last_acc[0]],
                "seconds": round(elapsed, 1),
            }
        )
        tqdm.write(json.dumps(history[-1]))
        save_checkpoint(drafter, out)
        save_state(out / STATE_FILE, step, opt, sched, {"history": history})

    step = run_steps(
        drafter.parameters(),
        opt,
        sched,
        step_fn,
        start=start_step,
        total=cfg.steps,
        clip=cfg.clip,
        every=cfg.save_every,
        on_every=on_every,
        time_budget_s=cfg.time_budget_s,
        desc="train-drafter",
    )
    drafter.eval()
    summary = {
        "steps": step,
        "history": history,
        "config": asdict(cfg),
        "seconds": round(time.perf_counter() - t_start),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def train_drafter_on_sequences(
    target: CausalLM, data: SequenceSet, out: Path, feature_dir: Path, cfg: DrafterTrainConfig, train: bool = True
) -> dict[str, Any]:
    """The recipe script's entry: a new drafter (or the checkpoint in `out`, resumed), the feature cache
    in `feature_dir`, then training (or only the cache when `train` is False)."""
    mask = cfg.mask_token_id
    if mask is None:
        raise ValueError("mask_token_id is required")
    if (out / STATE_FILE).exists():
        drafter = DFlashDrafter.from_pretrained(out)
    else:
        drafter = new_drafter_for(target, cfg, mask)
    n = sum(p.numel() for p in drafter.parameters())
    print(
        f"drafter: {n / 1e6:.2f}M parameters, {cfg.num_layers} layers, block {cfg.block_size}, features of "
        f"target layers {list(drafter.spec.target_layer_ids)}; {len(data)} sequences, "
        f"{data.response_tokens} response tokens",
        flush=True,
    )
    if not train:
        open_feature_cache(feature_dir, data, drafter, target, teacher=cfg.kd_weight > 0)
        return {"steps": 0}
    return train_drafter(drafter, target, data, out, cfg, resume=True, feature_cache=feature_dir)


def train_drafter_from_dirs(
    target_dir: Path, data: Path, out: Path, cfg: DrafterTrainConfig, resume: bool = False, device: str = "cpu"
) -> dict[str, Any]:
    from ..models.target import load_target, load_tokenizer
    from .data import load_training_sequences

    target = load_target(target_dir, device=device)
    tok = load_tokenizer(target_dir)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else getattr(tok, "mask_token_id", None)
    if mask is None:
        raise ValueError("no mask token: the tokenizer has none; pass --mask-token-id")
    sequences = load_training_sequences(data, tok, cfg.seq_len)
    if resume and (out / "config.json").exists():
        drafter = DFlashDrafter.from_pretrained(out)
    else:
        drafter = new_drafter_for(target, cfg, mask)
    n = sum(p.numel() for p in drafter.parameters())
    print(
        f"drafter: {n / 1e6:.2f}M parameters, {cfg.num_layers} layers, block {cfg.block_size}, "
        f"features of target layers {list(drafter.spec.target_layer_ids)}; {len(sequences)} sequences"
    )
    return train_drafter(drafter, target, sequences, out, cfg, resume=resume)
