"""From checkpoint directories to a ready SpeculativeDecoder (PyTorch engines)."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import validate_against_target
from .models.drafter import DFlashDrafter
from .models.target import load_target, load_tokenizer
from .runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from .spec import SpeculativeDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_decoder(
    target_dir: str | Path, drafter_dir: str | Path | None = None, dtype: str = "float32"
) -> SpeculativeDecoder:
    """Load target (+ tokenizer when present) and, unless drafter_dir is None, the DFlash drafter.

    The drafter is validated against the target before anything runs.
    """
    torch_dtype = DTYPES[dtype]
    model = load_target(target_dir, torch_dtype)
    tokenizer = load_tokenizer(target_dir)
    if drafter_dir is None:
        return SpeculativeDecoder(TorchTargetEngine(model), None, tokenizer)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch_dtype)
    validate_against_target(drafter.config, drafter.spec, model.config)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return SpeculativeDecoder(target, TorchDrafterEngine.for_target(drafter, target), tokenizer)
