"""The drafter's loss: all blocks of a sequence in one block-sparse forward pass, cross-entropy (optionally
mixed with a KL term to the target) through the frozen lm_head, weighted by block position.

- each block sees its own context prefix (one visibility row per block) and its own block, one softmax over
  both, exactly as a round attends at inference (`DFlashDrafter.forward_packed`; no dense [m*B, S + m*B] mask);
- the lm_head product is chunked (no [rows, vocab] fp32 logits kept), weighted by block position
  w_k = exp(-(k-1)/gamma); the teacher logits are computed only at the positions used (from the target's
  cached final hidden).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .blocks import build_blocks, position_weights, sample_anchors
from .common import autocast
from .drafter_config import DrafterTrainConfig, default_gamma
from .features import target_hidden

if TYPE_CHECKING:
    from ..models.drafter import DFlashDrafter
    from ..models.target import CausalLM

# The `type: ignore[no-untyped-call]`: transformers leaves get_output_embeddings unannotated.


def _rows_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor | None,
    lm_head: torch.Tensor,
    drafter: DFlashDrafter,
    kd_weight: float,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted loss sum and correctness of a chunk of rows; logits exist only inside this chunk."""
    logits = drafter.logits(hidden, lm_head).float()
    loss = F.cross_entropy(logits, labels, reduction="none")
    if teacher is not None and kd_weight > 0:
        t = F.log_softmax(F.linear(teacher, lm_head).float() / temperature, -1)
        s = F.log_softmax(logits / temperature, -1)
        kl = (t.exp() * (t - s)).sum(-1) * temperature**2
        loss = (1 - kd_weight) * loss + kd_weight * kl
    return (loss * weights).sum(), (logits.detach().argmax(-1) == labels)


def chunked_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor | None,
    lm_head: torch.Tensor,
    drafter: DFlashDrafter,
    cfg: DrafterTrainConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of the weighted loss, in chunks of `cfg.loss_chunk_rows` whose logits are recomputed
    in backward (activation checkpointing): memory O(chunk x vocab), not O(rows x vocab)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    correct: list[torch.Tensor] = []
    for i in range(0, hidden.shape[0], cfg.loss_chunk_rows):
        sl = slice(i, i + cfg.loss_chunk_rows)
        t = teacher[sl] if teacher is not None else None
        args = (hidden[sl], labels[sl], weights[sl], t, lm_head, drafter, cfg.kd_weight, cfg.kd_temperature)
        if torch.is_grad_enabled() and hidden.requires_grad:
            part, ok = checkpoint(_rows_loss, *args, use_reentrant=False)
        else:
            part, ok = _rows_loss(*args)
        total = total + part
        correct.append(ok)
    return total, torch.cat(correct) if correct else hidden.new_zeros(0, dtype=torch.bool)


def drafter_loss(
    drafter: DFlashDrafter,
    target: CausalLM,
    tokens: torch.Tensor,
    cfg: DrafterTrainConfig,
    generator: torch.Generator,
    features: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    prompt_lens: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and top-1 accuracy per block position for right-padded sequences [b, S] (`lengths`, default
    all S; anchors from `prompt_lens` on, default 1). `features` / `teacher`: the target's, when cached
    (else the target runs here, as deep as needed).

    The loss is computed on the drafter's device. Anchors and blocks are drawn on the CPU (the generator
    is a CPU one, so a run draws the same blocks on any device) and moved there with the features."""
    b, s = tokens.shape
    B = cfg.block_size
    device = drafter.fc.weight.device
    tokens = tokens.cpu()
    lengths = torch.full((b,), s) if lengths is None else lengths.cpu()
    prompt_lens = torch.ones(b, dtype=torch.long) if prompt_lens is None else prompt_lens.cpu()
    want_teacher = cfg.kd_weight > 0
    if features is None or (want_teacher and teacher is None):
        features, teacher = target_hidden(target, tokens, drafter.spec.target_layer_ids, teacher=want_teacher)
    # cached features arrive in fp16 (half the bytes to move); float32 from here, as the target computed them
    features = features.to(device).float()
    teacher = None if teacher is None else teacher.to(device).float()
    embed = cast(torch.Tensor, target.get_input_embeddings().weight)
    lm_head: torch.Tensor = target.get_output_embeddings().weight  # type: ignore[no-untyped-call]
    per_seq = [
        sample_anchors(int(lengths[i]), B, cfg.anchors_per_seq, generator, start=int(prompt_lens[i])) for i in range(b)
    ]
    m = max(1, max(len(a) for a in per_seq))
    id_rows: list[torch.Tensor] = []
    pos_rows: list[torch.Tensor] = []
    label_rows: list[torch.Tensor] = []
    valid_rows: list[torch.Tensor] = []
    anchor_rows: list[torch.Tensor] = []
    for i, a in enumerate(per_seq):
        n_real = len(a)
        a = torch.cat([a, torch.ones(m - n_real, dtype=torch.long)])  # padding blocks carry no loss
        blk_ids, blk_pos, blk_labels, blk_valid = build_blocks(
            tokens[i], a, B, drafter.spec.mask_token_id, int(lengths[i])
        )
        blk_valid[n_real:] = False
        id_rows.append(blk_ids)
        pos_rows.append(blk_pos)
        label_rows.append(blk_labels)
        valid_rows.append(blk_valid)
        anchor_rows.append(a)
    ids, positions, labels = (torch.stack(x).to(device) for x in (id_rows, pos_rows, label_rows))
    valid, anchors = torch.stack(valid_rows).to(device), torch.stack(anchor_rows).to(device)
    with autocast(cfg.bf16, device):
        hidden = drafter.forward_packed(features, drafter.embed_block(ids, embed), positions, anchors)
    hidden = hidden.view(b, m, B, -1)[:, :, 1:]  # predictions for block positions 1..B-1
    weights = position_weights(B, cfg.gamma or default_gamma(B)).to(device).expand(b, m, B - 1)
    rows_teacher = None
    if want_teacher:
        # the target's distribution for the token at a+k comes from its logits at a+k-1
        assert teacher is not None  # given, or computed above when wanted
        idx = (anchors[:, :, None] + torch.arange(B - 1, device=device)[None, None, :]).clamp(max=s - 1)
        rows_teacher = teacher[torch.arange(b, device=device)[:, None, None], idx][valid]
    with autocast(cfg.bf16, device):
        total, correct = chunked_loss(hidden[valid], labels[valid], weights[valid], rows_teacher, lm_head, drafter, cfg)
    loss = total / weights[valid].sum().clamp(min=1e-6)
    hits = torch.zeros(b, m, B - 1, device=device)
    hits[valid] = correct.float()
    accuracy = hits.sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)
    return loss, accuracy
