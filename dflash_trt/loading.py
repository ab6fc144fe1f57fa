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


def load_decoder_from_engines(engines_dir: str | Path, dtype: str = "float32") -> SpeculativeDecoder:
    """Load what `make engines` built: the backends named in engines/manifest.json's `serve` section."""
    import json

    from .runtime import registry

    engines_dir = Path(engines_dir)
    path = engines_dir / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"no manifest.json in {engines_dir}: build the engines with `make engines`")
    manifest = json.loads(path.read_text())
    engines, serve = manifest["engines"], manifest["serve"]
    drafter_entry, target_entry = engines[serve["drafter"]], engines[serve["target"]]
    checkpoint = manifest["sources"]["target"]["path"]
    tokenizer = load_tokenizer(checkpoint)

    drafter_dir = engines_dir / drafter_entry["dir"]
    if drafter_entry["backend"] == "onnxruntime":
        drafter = registry.drafter_engine("onnxruntime", drafter_dir, drafter_entry.get("serve_precision", "fp32"))
    else:
        drafter = registry.drafter_engine(drafter_entry["backend"], drafter_dir)
    if target_entry["backend"] == "torch":
        model = load_target(target_entry["checkpoint"], DTYPES[dtype])
        target = TorchTargetEngine(model, drafter.feature_layer_ids)
    else:
        target = registry.target_engine(target_entry["backend"], engines_dir / target_entry["dir"])
    return SpeculativeDecoder(target, drafter, tokenizer)
