"""Loading a Hugging Face causal LM target and reading its intermediate features."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:
    # what transformers annotates AutoModelForCausalLM.from_pretrained to return: PreTrainedModel + GenerationMixin
    from typing import TypeAlias

    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate

    CausalLM: TypeAlias = _BaseModelWithGenerate

# config.json's model_type. The first five run batched in the layered engine, the others per row
# (runtime/hybrid.py says why). Qwen3.5's published (multimodal) checkpoints, qwen3_5 / qwen3_5_moe, load as
# their text model (AutoModelForCausalLM maps them to Qwen3_5(Moe)ForCausalLM); Gemma 4 as gemma4_text only.
SUPPORTED_FAMILIES = (
    "qwen3",
    "qwen2",
    "llama",
    "mistral",
    "qwen3_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_5",
    "qwen3_5_moe",
    "gpt_oss",
    "gemma4_text",
)
# "sdpa" unless the family has no SDPA path in transformers: gpt-oss's attention sinks are in its eager and
# flex kernels only (GptOssPreTrainedModel._supports_sdpa = False)
ATTENTION_IMPLEMENTATION = {"gpt_oss": "eager"}
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}  # short names: --dtype bf16


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """Load a local HF checkpoint onto `device`, in eval mode; never downloads, never runs remote code."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target directory has no config.json: {path}")
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"target model_type {config.model_type!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    from transformers.utils import logging as hf_logging

    from .mxfp4 import mxfp4_plan

    plan = mxfp4_plan(path, config, dtype, device)  # what an MXFP4 checkpoint needs, before loading it
    if plan is not None:
        import logging

        logging.getLogger(__name__).warning("%s: %s", path, plan)
    # a per-tensor "Loading weights" bar on every CLI call is noise for small local checkpoints
    bar_was_on = hf_logging.is_progress_bar_enabled()
    # (the `type: ignore`s here and below: transformers leaves these functions unannotated)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        # "sdpa": transformers' own forward (training, references) passes enable_gqa only without a mask on CUDA
        # and repeats K/V otherwise (integrations/sdpa_attention.py, use_gqa_in_sdpa), the rule models/attention.py
        # follows for the engines' own attention
        model = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            trust_remote_code=False,
            dtype=dtype,
            attn_implementation=ATTENTION_IMPLEMENTATION.get(config.model_type, "sdpa"),
        )
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    loaded: CausalLM = model.eval()  # type: ignore[no-untyped-call]
    # PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to), whose stub loses the bound self
    loaded.to(device)  # type: ignore[arg-type]
    return loaded


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The target's tokenizer, or None when the directory has none (then only token ids work)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


# transformers 5 writes `TokenizersBackend`, a class 4.57 does not have; both load `PreTrainedTokenizerFast`
# (an alias of TokenizersBackend in 5.x). TensorRT-LLM 1.2 pins transformers 4.57.1.
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def make_portable(folder: str | Path) -> None:
    """Rewrite a saved checkpoint / tokenizer folder so transformers 4.57.x and 5.x both load it.

    tokenizer_config.json: `TokenizersBackend` -> `PreTrainedTokenizerFast`. config.json: 5.x keeps RoPE in
    `rope_parameters`; 4.57 reads `rope_theta` (and `rope_scaling`), so those are written too when missing.
    """
    import json

    folder = Path(folder)
    tok_cfg = folder / "tokenizer_config.json"
    if tok_cfg.is_file():
        data = json.loads(tok_cfg.read_text())
        if data.get("tokenizer_class") in (None, "TokenizersBackend") and (folder / "tokenizer.json").is_file():
            data["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
            tok_cfg.write_text(json.dumps(data, indent=2) + "\n")
    cfg = folder / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        rope = data.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in data:
            data["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default" and "rope_scaling" not in data:
                data["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
            cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


class SavesPretrained(Protocol):
    """A Hugging Face model or tokenizer."""

    def save_pretrained(self, save_directory: Any, /) -> Any: ...


def save_portable(obj: SavesPretrained, folder: str | Path) -> None:
    """`obj.save_pretrained(folder)` (model or tokenizer), then make_portable."""
    obj.save_pretrained(folder)
    make_portable(folder)


def extract_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the OUTPUTS of decoder layers `layer_ids`.

    Hugging Face's `hidden_states` tuple starts with the embedding output, so the output of
    decoder layer i is `hidden_states[i + 1]`: the off-by-one that silently ruins acceptance.
    """
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
