"""Tiny random targets and drafters built from configs, never downloaded: for the tests, smoke runs and
benchmarks of the code path (random weights show the plumbing, not acceptance)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

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


def steer_to_agree(model: CausalLM, prompts: list[list[int]], token: int, share: float = 0.8) -> float:
    """Make a tiny random target predict `token` at about `share` of the positions of `prompts` (and of what it
    generates after them), through the two weights its DFlash drafter shares with it, so that even a random
    drafter drafts that token most of the time: rounds accept several drafts, then reject one, and the verify
    pass's cache is rolled back to a point inside the block (random weights otherwise accept almost nothing).

    How: every token's input embedding gets one large shared component (dimension 0), which the residual stream
    carries to the final norm of the target and of the drafter (whose blocks start from the same embeddings), and
    `token`'s output row reads only that component, scaled so that it beats the best other logit at `share` of
    the calibration positions. The scale lies between two calibration ratios, never on one (no exact tie).
    Returns that scale. The drafter is untouched: it agrees through the shared weights alone."""
    output_layer = cast(torch.nn.Linear, model.get_output_embeddings())  # type: ignore[no-untyped-call]
    embed = cast(torch.Tensor, model.get_input_embeddings().weight)
    head = output_layer.weight
    if embed.data_ptr() == head.data_ptr():
        raise ValueError("steer_to_agree needs a target with untied input and output embeddings")
    if not 0.0 < share < 1.0:
        raise ValueError(f"share must lie in (0, 1), got {share}")
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(_module: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        captured.append((inputs[0].detach().float().flatten(0, -2), output.detach().float().flatten(0, -2)))

    with torch.no_grad():
        embed[:, 0] = 4.0 * float(embed[:, 1:].abs().max())
        head[token] = 0.0
        hook = output_layer.register_forward_hook(keep)
        try:
            device = embed.device
            for ids in prompts:
                model(input_ids=torch.tensor([ids], device=device))
        finally:
            hook.remove()
        hidden = torch.cat([h for h, _ in captured])
        logits = torch.cat([o for _, o in captured])
        others = logits.clone()
        others[:, token] = float("-inf")
        best = others.max(dim=-1).values
        lead = hidden[:, 0]
        ratios = torch.where(lead > 0, best / lead.clamp_min(1e-12), torch.full_like(best, float("inf")))
        ratios = ratios.sort().values
        k = min(max(int(share * len(ratios)), 1), len(ratios) - 1)
        low, high = float(ratios[k - 1]), float(ratios[k])
        scale = (low + high) / 2 if high != float("inf") else low * 1.5 + 1e-3
        head[token, 0] = scale
    return scale
