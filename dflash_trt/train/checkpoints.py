"""A new drafter for a target (warm-started from its layers) and the checkpoints a run writes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import build_target_layer_ids
from ..models.drafter import DFlashDrafter
from .drafter_config import DrafterTrainConfig

if TYPE_CHECKING:
    from ..models.target import CausalLM

STATE_FILE = "trainer_state.pt"
# The `type: ignore[no-untyped-call]`: transformers leaves get_decoder unannotated.


def new_drafter_for(target: CausalLM, cfg: DrafterTrainConfig, mask_token_id: int) -> DFlashDrafter:
    tc = target.config.get_text_config()
    n_target = tc.num_hidden_layers
    layer_ids = list(cfg.target_layer_ids or build_target_layer_ids(n_target, cfg.num_layers))
    raw = {
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        "rms_norm_eps": tc.rms_norm_eps,
        "vocab_size": tc.vocab_size,
        "max_position_embeddings": tc.max_position_embeddings,
        "rope_parameters": getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": getattr(tc, "hidden_act", "silu"),
        "block_size": cfg.block_size,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids, "block_size": cfg.block_size},
    }
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter.from_config(raw)
    for name, p in drafter.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    if cfg.init_from_target:
        _init_layers_from_target(drafter, target, layer_ids, cfg.init_norm_scale)
    return drafter


def _init_layers_from_target(
    drafter: DFlashDrafter, target: CausalLM, layer_ids: list[int], norm_scale: float = 1.0
) -> None:
    """Copy the target layers just after the feature taps into the drafter: a warm start with
    the same shapes (a heuristic of ours; the paper does not say how drafters are initialised)."""
    layers = target.model.layers
    picks = [min(len(layers) - 1, i + 1) for i in build_target_layer_ids(len(layers), len(drafter.layers))]
    for d_layer, t_idx in zip(drafter.layers, picks):
        src = layers[t_idx].state_dict()
        dst = d_layer.state_dict()
        shared = {k: v for k, v in src.items() if k in dst and dst[k].shape == v.shape}
        d_layer.load_state_dict(shared, strict=False)
    # the drafter's last hidden goes through the target's lm_head as the target's final hidden does:
    # start from the target's final norm, scaled by `norm_scale` (< 1 tempers the first steps' logits)
    final_norm = getattr(target.get_decoder(), "norm", None)  # type: ignore[no-untyped-call]
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.data.copy_(final_norm.weight.data * norm_scale)


def save_checkpoint(drafter: DFlashDrafter, out: Path) -> None:
    """Weights + config written aside, then renamed into place: a run killed mid-save (a background run
    on a shared machine) leaves the previous checkpoint whole."""
    tmp = out / ".saving"
    drafter.save_pretrained(tmp)
    for f in tmp.iterdir():
        f.replace(out / f.name)
    tmp.rmdir()
