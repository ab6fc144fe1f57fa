"""From checkpoint directories to a ready SpeculativeDecoder (PyTorch engines)."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import validate_against_target
from .models.drafter import DFlashDrafter
from .models.target import load_target, load_tokenizer
from .runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from .decoding import SpeculativeDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "cpu") -> torch.device:
    """A torch device this machine has: `cpu`, `cuda` or `cuda:N` (ValueError with the reason otherwise)."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU visible to torch {torch.__version__} "
                             "(a CPU build, or no GPU / driver); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: only cpu and cuda are supported")
    return dev


def load_decoder(
    target_dir: str | Path, drafter_dir: str | Path | None = None, dtype: str = "float32", device: str = "cpu"
) -> SpeculativeDecoder:
    """Load target (+ tokenizer when present) and, unless drafter_dir is None, the DFlash drafter, on `device`.

    The drafter is validated against the target before anything runs.
    """
    torch_dtype = DTYPES[dtype]
    dev = resolve_device(device)
    model = load_target(target_dir, torch_dtype).to(dev)
    tokenizer = load_tokenizer(target_dir)
    if drafter_dir is None:
        return SpeculativeDecoder(TorchTargetEngine(model), None, tokenizer)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch_dtype)
    validate_against_target(drafter.config, drafter.spec, model.config)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return SpeculativeDecoder(target, TorchDrafterEngine.for_target(drafter, target), tokenizer)


def load_decoder_from_engines(engines_dir: str | Path, dtype: str = "float32", draft: bool = True,
                              device: str = "cpu") -> SpeculativeDecoder:
    """Load what `make engines` built: the backends named in engines/manifest.json's `serve` section.

    draft=False loads the target alone (the drafter engine is not touched).
    """
    from .builders.engines import serving_sources
    from .runtime import registry

    engines_dir = Path(engines_dir)
    src = serving_sources(engines_dir)
    tokenizer = load_tokenizer(src.tokenizer_dir)
    drafter = None
    if draft:
        backend = src.drafter["backend"]
        if backend == "onnxruntime":
            drafter = registry.drafter_engine(backend, src.drafter_dir, src.drafter.get("serve_precision", "fp32"))
        else:
            drafter = registry.drafter_engine(backend, src.drafter_dir)
    if src.target["backend"] == "torch":
        model = load_target(src.target_dir, DTYPES[dtype]).to(resolve_device(device))
        target = TorchTargetEngine(model, drafter.feature_layer_ids if drafter is not None else ())
    else:
        target = registry.target_engine(src.target["backend"], src.target_dir)
    return SpeculativeDecoder(target, drafter, tokenizer)
