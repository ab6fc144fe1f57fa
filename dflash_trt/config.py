"""DFlash drafter configuration: reading, defaults and validation against a target.

Published drafters (z-lab/*-DFlash-*) ship a Qwen3 `config.json` with extra keys:
`block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`
(newer ones repeat `block_size` inside `dflash_config`). We read both places and write both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import Qwen3Config

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
DRAFTER2_ARCHITECTURE = "DFlash2DraftModel"
# DFlash 2 (z-lab's `dflash` 0.1.0, DFlash2DraftModel): the fields it adds, read like the others from
# dflash_config first, then the top level
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# the drafter layer kinds implemented here (models/drafter.py); any other is refused by name
DRAFTER_LAYER_TYPES = ("full_attention", "sliding_attention")


class ConfigError(ValueError):
    """A drafter config that is malformed or does not fit its target. The message names the field."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default feature layers: evenly spaced from 1 to L-3; one drafter layer uses L//2."""
    if num_draft_layers < 1:
        raise ConfigError(f"num_hidden_layers: a drafter needs at least one layer, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashSpec:
    """The DFlash-specific part of a drafter config (everything else is a plain Qwen3 config)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    # Optional knobs some newer drafters set; 1.0 / None reproduce the original drafters.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 only (0 for DFlash 1): grouped dynamic causal convolutions around each layer's attention and
    # MLP, and the candidate selector over the top-k tokens of each block position
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def generation(self) -> int:
        """1: the paper's drafter; 2: DFlash 2 (convolutions and candidate selector)."""
        return 2 if self.selector_top_k else 1

    @classmethod
    def from_config(cls, config: Qwen3Config | dict[str, Any]) -> DFlashSpec:
        raw = config if isinstance(config, dict) else config.to_dict()
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError("dflash_config: must be an object")

        def value(name: str, default: Any = None) -> Any:
            return dflash.get(name, raw.get(name, default))

        mask = value("mask_token_id")
        if mask is None:
            raise ConfigError("dflash_config.mask_token_id: missing; the drafter cannot build its mask block")
        block_size = value("block_size", 16)
        if not isinstance(block_size, int) or block_size < 2:
            raise ConfigError(f"block_size: must be an integer >= 2, got {block_size!r}")
        n_draft_layers = int(raw.get("num_hidden_layers", 1))
        num_target_layers = raw.get("num_target_layers")
        layer_ids = value("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise ConfigError("dflash_config.target_layer_ids: missing and num_target_layers is not set either")
            layer_ids = build_target_layer_ids(int(num_target_layers), n_draft_layers)
        if not layer_ids or not all(isinstance(i, int) for i in layer_ids):
            raise ConfigError(
                f"dflash_config.target_layer_ids: must be a non-empty list of integers, got {layer_ids!r}"
            )
        softcap = value("final_logit_softcapping")
        dflash2 = _dflash2_fields(raw, value)
        return cls(
            block_size=block_size,
            mask_token_id=int(mask),
            target_layer_ids=tuple(layer_ids),
            num_target_layers=int(num_target_layers) if num_target_layers is not None else max(layer_ids) + 1,
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            **dflash2,
        )

    def to_config_fields(self) -> dict[str, Any]:
        """The keys a published drafter's config.json carries, in the same places."""
        dflash: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
        }
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.generation == 2:
            dflash.update({name: getattr(self, name) for name in DFLASH2_FIELDS})
        return {
            "architectures": [DRAFTER2_ARCHITECTURE if self.generation == 2 else DRAFTER_ARCHITECTURE],
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
        }


def _dflash2_fields(raw: dict[str, Any], value: Any) -> dict[str, int]:
    """The DFlash 2 fields when the config is a DFlash 2 drafter's (its architecture, or any of the fields),
    each a positive integer; {} for a DFlash 1 drafter."""
    architectures = raw.get("architectures") or []
    present = [name for name in DFLASH2_FIELDS if value(name) is not None]
    if DRAFTER2_ARCHITECTURE not in architectures and not present:
        return {}
    fields: dict[str, int] = {}
    for name in DFLASH2_FIELDS:
        got = value(name)
        if not isinstance(got, int) or isinstance(got, bool) or got < 1:
            raise ConfigError(f"dflash_config.{name}: a DFlash 2 drafter needs a positive integer, got {got!r}")
        fields[name] = got
    hidden = raw.get("hidden_size")
    if isinstance(hidden, int) and hidden % fields["conv_group_size"]:
        raise ConfigError(
            f"dflash_config.conv_group_size: {fields['conv_group_size']} does not divide hidden_size {hidden}"
        )
    return fields


def _check_layer_types(raw: dict[str, Any]) -> None:
    """Refuse drafter layer kinds not implemented here, by name. (A sliding layer's window is Qwen3Config's
    sliding_window, None unless use_sliding_window: then the layer is causal without a window, as the
    reference reads the same config.)"""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or len(layer_types) != raw.get("num_hidden_layers"):
        raise ConfigError(f"layer_types: must list one kind per drafter layer, got {layer_types!r}")
    unknown = sorted({str(t) for t in layer_types} - set(DRAFTER_LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types: {unknown} not supported for drafter layers (supported: {DRAFTER_LAYER_TYPES})")


def load_drafter_config(path: str | Path) -> tuple[Qwen3Config, DFlashSpec]:
    """Read a drafter directory's config.json (or the file itself) without any remote code."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"config.json: not found at {file}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.json: not valid JSON ({e})") from None
    return drafter_config_from_dict(raw)


def drafter_config_from_dict(raw: dict[str, Any]) -> tuple[Qwen3Config, DFlashSpec]:
    spec = DFlashSpec.from_config(raw)
    _check_layer_types(raw)
    # auto_map points at remote code we never run; the architecture is implemented here.
    fields = {k: v for k, v in raw.items() if k not in ("auto_map", "architectures", "model_type")}
    for required in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if required not in fields:
            raise ConfigError(f"{required}: missing from the drafter config")
    return Qwen3Config(**fields), spec


def validate_against_target(config: Qwen3Config, spec: DFlashSpec, target_config: Any) -> None:
    """Refuse a drafter that does not fit the target, naming the offending field."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    n_layers = int(text.num_hidden_layers)
    if config.hidden_size != text.hidden_size:
        raise ConfigError(
            f"hidden_size: drafter has {config.hidden_size}, target has {text.hidden_size}; "
            "the drafter must match its target's hidden size"
        )
    # The last layer is excluded: Hugging Face replaces its output in `hidden_states` by the
    # final-normed state, while other engines expose the raw output, so backends would disagree.
    bad = [i for i in spec.target_layer_ids if not 0 <= i < n_layers - 1]
    if bad:
        raise ConfigError(
            f"dflash_config.target_layer_ids: {bad} out of range for a target with {n_layers} layers "
            f"(valid: 0..{n_layers - 2}; the last layer's output is not a usable feature)"
        )
    if spec.num_target_layers != n_layers:
        raise ConfigError(
            f"num_target_layers: drafter was built for {spec.num_target_layers} target layers, target has {n_layers}"
        )
    if not 0 <= spec.mask_token_id < text.vocab_size:
        raise ConfigError(
            f"dflash_config.mask_token_id: {spec.mask_token_id} is outside the target vocabulary (size {text.vocab_size})"
        )
    if spec.block_size < 2:
        raise ConfigError(f"block_size: must be >= 2, got {spec.block_size}")
    if spec.selector_top_k > text.vocab_size:
        raise ConfigError(
            f"dflash_config.selector_top_k: {spec.selector_top_k} candidates from a vocabulary of {text.vocab_size}"
        )
