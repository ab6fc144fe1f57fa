"""Training blocks of one sequence: anchors, the block-sparse mask, the block-position weights, padding.

Per sequence, random anchor positions are drawn in the RESPONSE (the prompt is context only, as
SpecForge's loss mask); each anchor a gives a block [x_a, MASK x (B-1)] at positions a..a+B-1 predicting
x_{a+1}..x_{a+B-1} (labels past the sequence end are masked), with context = target features of 0..a-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def sample_anchors(
    seq_len: int, block_size: int, count: int, generator: torch.Generator, start: int = 1
) -> torch.Tensor:
    """Distinct sorted anchors in [start, seq_len - 2]: each has context before it and at least one
    label after it (labels past the end are masked, so the last tokens, EOS included, are trained too)."""
    start = max(1, start)
    candidates = max(0, seq_len - 1 - start)
    count = min(count, candidates)
    return torch.randperm(candidates, generator=generator)[:count].sort().values + start


def block_sparse_mask(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """[m*B, S + m*B] boolean: block j's queries see context keys < a_j and the keys of block j only.
    The dense reference the tests compare `forward_packed` with; training never builds it."""
    m = anchors.shape[0]
    q_block = torch.arange(m).repeat_interleave(block_size)  # block index of each query
    ctx_visible = torch.arange(seq_len)[None, :] < anchors[q_block][:, None]
    blk_visible = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx_visible, blk_visible], dim=1)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 (position 0 is the given token)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def build_blocks(
    tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block ids [m*B], positions [m*B], labels [m, B-1] and label validity [m, B-1] (label inside the
    first `length` tokens) for one sequence."""
    length = tokens.shape[0] if length is None else length
    offsets = torch.arange(block_size)
    positions = (anchors[:, None] + offsets[None, :]).reshape(-1)
    ids = torch.full((anchors.shape[0], block_size), mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    label_pos = anchors[:, None] + offsets[None, 1:]
    valid = label_pos < length
    labels = tokens[label_pos.clamp(max=tokens.shape[0] - 1)]
    return ids.reshape(-1), positions, labels, valid


@dataclass
class Batch:
    """Right-padded sequences; anchors come from [prompt_len, length - 2] of each."""

    tokens: torch.Tensor  # [b, S]
    lengths: torch.Tensor  # [b]
    prompt_lens: torch.Tensor  # [b]
    features: torch.Tensor | None = None  # [b, S, F] the target's features, when cached
    teacher: torch.Tensor | None = None  # [b, S, H] the target's final (normed) hidden, for distillation


def pad_batch(seqs: list[np.ndarray], prompt_lens: list[int]) -> Batch:
    s = max(len(x) for x in seqs)
    tokens = torch.zeros(len(seqs), s, dtype=torch.long)
    for r, x in enumerate(seqs):
        tokens[r, : len(x)] = torch.from_numpy(x.astype(np.int64))
    return Batch(tokens, torch.tensor([len(x) for x in seqs]), torch.tensor(prompt_lens))
