"""Tiny random configs for the target families beyond Qwen3 / LLaMA (`tiny.tiny_target_config` sends them here):
each keeps what makes its family differ (linear-attention layers, experts, short sliding windows so a test
prompt crosses them, attention sinks, per-layer inputs and shared K/V), at test size."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

FAMILIES = ("llama3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma4")


def _hybrid_layers(layers: int) -> list[str]:
    """Qwen3.5's pattern: three Gated DeltaNet layers, then one full-attention layer."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]


def _linear_attention(hidden: int) -> dict[str, Any]:
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )


def _experts(hidden: int) -> dict[str, Any]:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden)


def family_config(family: str, common: dict[str, Any]) -> PretrainedConfig:
    """`common`: vocab_size, hidden_size, intermediate_size, num_hidden_layers, heads, max_position_embeddings,
    tie_word_embeddings (and any extra keyword, which wins)."""
    hidden, layers = int(common["hidden_size"]), int(common["num_hidden_layers"])
    head_dim = hidden // 4
    if family == "llama3":
        from transformers import LlamaConfig

        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope.update(high_freq_factor=4.0, original_max_position_embeddings=256)
        return LlamaConfig(**{"rope_parameters": rope, **common})
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**{"head_dim": head_dim, **_experts(hidden), **common})
    if family in ("qwen3_5", "qwen3_5_moe"):
        from transformers.models.qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

        extra = {"head_dim": head_dim, "layer_types": _hybrid_layers(layers), **_linear_attention(hidden)}
        if family == "qwen3_5":
            return Qwen3_5TextConfig(**{**extra, **common})
        moe = {**_experts(hidden), "shared_expert_intermediate_size": hidden}
        return Qwen3_5MoeTextConfig(**{**extra, **moe, **common})
    if family == "gpt_oss":
        from transformers.models.gpt_oss import GptOssConfig

        extra = dict(head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
        extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        extra["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        return GptOssConfig(**{**extra, **common})
    if family == "gemma4":
        from transformers.models.gemma4 import Gemma4TextConfig

        extra = dict(head_dim=head_dim, global_head_dim=head_dim, sliding_window=8, hidden_size_per_layer_input=16)
        extra.update(vocab_size_per_layer_input=common["vocab_size"], num_kv_shared_layers=2)
        extra.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        extra["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]
        return Gemma4TextConfig(**{**extra, **common})
    raise ValueError(f"unknown family {family!r} (tiny families: qwen3, llama, {', '.join(FAMILIES)})")
