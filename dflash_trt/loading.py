"""From checkpoint directories to a ready SpeculativeDecoder (PyTorch engines)."""

from __future__ import annotations

from pathlib import Path

from .config import validate_against_target
from .models.drafter import DFlashDrafter
from .decoding import SpeculativeDecoder
from .models.target import DTYPES, load_target, load_tokenizer
from .runtime.base import EngineOptions
from .runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


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


def load_decoder_from_engines(engines_dir: str | Path, dtype: str = "float32", draft: bool = True) -> SpeculativeDecoder:
    """Load what `make engines` built: the backends named in engines/manifest.json's `serve` section.

    draft=False loads the target alone (the drafter engine is not touched).
    """
    from .formats import serving_sources
    from .runtime import registry

    src = serving_sources(engines_dir)
    tokenizer = load_tokenizer(src.tokenizer_dir)
    drafter = None
    if draft:
        options = EngineOptions(precision=src.drafter.get("serve_precision", "fp32"))
        drafter = registry.drafter_engine(src.drafter["backend"], src.drafter_dir, options)
    features = drafter.feature_layer_ids if drafter is not None else ()
    target = registry.target_engine(src.target["backend"], src.target_dir,
                                    EngineOptions(dtype=dtype, feature_layer_ids=tuple(features)))
    return SpeculativeDecoder(target, drafter, tokenizer)
