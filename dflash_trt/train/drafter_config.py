"""The drafter trainer's settings, and the paper's loss-weight decay per block size."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's choices per block size


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size / 2))


@dataclass
class DrafterTrainConfig:
    block_size: int = 8
    num_layers: int = 2
    target_layer_ids: tuple[int, ...] | None = None  # default: the reference rule
    mask_token_id: int | None = None  # default: the tokenizer's mask token
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256  # longest sequence trained on (longer ones are cut); fixed-length data: window length
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    clip: float = 1.0
    gamma: float | None = None  # default: DEFAULT_GAMMA
    kd_weight: float = 0.0  # 0 = plain cross-entropy; 1 = distillation only
    kd_temperature: float = 1.0
    init_from_target: bool = True  # start drafter layers from target layers (same shapes)
    # drafter final norm = this x the target's final norm (with init_from_target): a small scale tempers the
    # first steps' overconfident logits (docs/design.md#training).
    init_norm_scale: float = 0.1
    loss_chunk_rows: int = 1024  # rows per chunk of the lm_head + loss (memory: chunk x vocab fp32)
    save_every: int = 200
    time_budget_s: float | None = None
    bf16: bool = True
    seed: int = 0
