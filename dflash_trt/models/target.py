"""Loading a Hugging Face causal LM target and reading its intermediate features."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

SUPPORTED_FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a local HF checkpoint; never downloads, never runs remote code."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target directory has no config.json: {path}")
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"target model_type {config.model_type!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    from transformers.utils import logging as hf_logging

    # a per-tensor "Loading weights" bar on every CLI call is noise for small local checkpoints
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, trust_remote_code=False, dtype=dtype, attn_implementation="sdpa"
        )
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return model.eval()


def load_tokenizer(path: str | Path):
    """The target's tokenizer, or None when the directory has none (then only token ids work)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def extract_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the OUTPUTS of decoder layers `layer_ids`.

    Hugging Face's `hidden_states` tuple starts with the embedding output, so the output of
    decoder layer i is `hidden_states[i + 1]`: the off-by-one that silently ruins acceptance.
    """
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
