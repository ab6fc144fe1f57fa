"""Tiny random targets and drafters built from configs, never downloaded: for the tests, smoke runs and
benchmarks of the code path (random weights show the plumbing, not acceptance)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from ..config import build_target_layer_ids
from .drafter import DFlashDrafter

if TYPE_CHECKING:
    from .target import CausalLM


def tiny_target_config(
    family: str = "qwen3", vocab_size: int = 128, layers: int = 6, hidden: int = 64, **kw: Any
) -> PretrainedConfig:
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=kw.pop("max_position_embeddings", 2048),
        tie_word_embeddings=kw.pop("tie_word_embeddings", False),
    )
    common.update(kw)
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden // 4, **common)
    if family == "llama":
        return LlamaConfig(**common)
    from .tiny_families import family_config

    return family_config(family, common)


def make_tiny_target(out: str | Path | None = None, family: str = "qwen3", seed: int = 0, **kw: Any) -> CausalLM:
    torch.manual_seed(seed)
    # transformers leaves from_config and a PreTrainedModel's eval unannotated
    model: CausalLM = AutoModelForCausalLM.from_config(tiny_target_config(family, **kw)).eval()  # type: ignore[no-untyped-call]
    if out is not None:
        from .target import save_portable

        save_portable(model, out)
    return model


def tiny_drafter_config(
    target_config: PretrainedConfig, layers: int = 2, block_size: int = 8, mask_token_id: int | None = None
) -> dict[str, Any]:
    """A published-format drafter config.json (as a dict) sized for `target_config`."""
    n_target = target_config.num_hidden_layers
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_config.hidden_size,
        "intermediate_size": target_config.hidden_size * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": target_config.hidden_size // 4,
        "vocab_size": target_config.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": target_config.max_position_embeddings,
        "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {
            "mask_token_id": target_config.vocab_size - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": build_target_layer_ids(n_target, layers),
        },
    }


def make_tiny_drafter(
    target_config: PretrainedConfig, out: str | Path | None = None, seed: int = 0, **kw: Any
) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_config(tiny_drafter_config(target_config, **kw))
    # Random init as HF does it (normal 0.02) so outputs are not degenerate.
    for name, p in drafter.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    drafter.eval()
    if out is not None:
        drafter.save_pretrained(out)
    return drafter
