"""From checkpoint directories (or built engines) to a ready decoder: the loop on its two engines."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import validate_against_target
from .decoding import BatchDecoder
from .models.drafter import DFlashDrafter
from .models.target import DTYPES, load_target, load_tokenizer
from .runtime.base import EngineOptions
from .runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from .settings import DRAFTER_DTYPE

__all__ = ["DTYPES", "drafter_dtype", "load_decoder", "load_decoder_from_engines", "resolve_device"]


def resolve_device(device: str | torch.device = "cpu") -> torch.device:
    """A torch device this machine has: `cpu`, `cuda` or `cuda:N` (ValueError with the reason otherwise)."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: no CUDA GPU visible to torch {torch.__version__} "
                "(a CPU build, or no GPU / driver); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: only cpu and cuda are supported")
    return dev


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware: AMX tiles (Intel Sapphire Rapids and later)
    or AVX512-BF16 dot products (AMD Zen 4 and later, Intel Cooper Lake). Without either, torch emulates
    bfloat16 matmuls and they run slower than float32."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def drafter_dtype(name: str | None, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The PyTorch drafter's dtype, the one rule every entry point resolves `--drafter-dtype` with (its default:
    settings.DRAFTER_DTYPE): None = the target's; "auto" = bfloat16 next to a float32 target on a CPU with
    bfloat16 matrix instructions (`cpu_has_fast_bf16`), else the target's; or a name of DTYPES.

    Lossless whatever it is: the target verifies every drafted token in its own dtype, so the drafter's
    precision only moves which tokens it proposes (and acceptance barely moves). But seeded sampled text moves
    with it: rejection sampling compares the target's probabilities with the drafter's, so the same seed keeps
    other drafts in bfloat16 than in float32. Hence one default everywhere, and "auto" only where asked for. On
    such a CPU bfloat16 makes batched drafter passes of many rows faster (the measurements: docs/design.md#drafter-precision)."""
    if name is None:
        return target_dtype
    if name == "auto":
        fast = device.type == "cpu" and cpu_has_fast_bf16()
        return torch.bfloat16 if fast and target_dtype == torch.float32 else target_dtype
    if name not in DTYPES:
        raise ValueError(f"drafter dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_decoder(
    target_dir: str | Path,
    drafter_dir: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    drafter_dtype_name: str | None = DRAFTER_DTYPE,
) -> BatchDecoder:
    """Load target (+ tokenizer when present) and, unless drafter_dir is None, the DFlash drafter, on `device`.

    The drafter is validated against the target before anything runs. `drafter_dtype_name`: see
    `drafter_dtype` (default settings.DRAFTER_DTYPE, as every command's: the target's dtype); the loaded drafter
    engine says what it resolved to (`decoder.drafter.dtype`).
    """
    torch_dtype = DTYPES[dtype]
    dev = resolve_device(device)
    model = load_target(target_dir, torch_dtype, dev)
    tokenizer = load_tokenizer(target_dir)
    if drafter_dir is None:
        return BatchDecoder(TorchTargetEngine(model), None, tokenizer)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, drafter_dtype(drafter_dtype_name, torch_dtype, dev))
    validate_against_target(drafter.config, drafter.spec, model.config)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    return BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), tokenizer)


def load_decoder_from_engines(
    engines_dir: str | Path, dtype: str = "float32", draft: bool = True, device: str = "cpu"
) -> BatchDecoder:
    """Load what `make engines` built: the backends named in engines/manifest.json's `serve` section.

    draft=False loads the target alone (the drafter engine is not touched). `device` places a PyTorch target.
    """
    from .formats import serving_sources
    from .runtime import registry

    src = serving_sources(engines_dir)
    tokenizer = load_tokenizer(src.tokenizer_dir)
    if src.target["backend"] == "tensorrt_llm":
        # Its feature layers were fixed at build time, so the target loads first: on a tensor-parallel rank
        # other than the leader it is all this process runs (serve_worker), and no drafter is loaded there.
        target = registry.target_engine(src.target["backend"], src.target_dir, EngineOptions(dtype=dtype))
        drafter = None
        if draft and getattr(target, "is_leader", True):
            options = EngineOptions(precision=src.drafter.get("serve_precision", "fp32"))
            drafter = registry.drafter_engine(src.drafter["backend"], src.drafter_dir, options)
        return BatchDecoder(target, drafter, tokenizer)
    drafter = None
    if draft:
        options = EngineOptions(precision=src.drafter.get("serve_precision", "fp32"))
        drafter = registry.drafter_engine(src.drafter["backend"], src.drafter_dir, options)
    features = drafter.feature_layer_ids if drafter is not None else ()
    target_device = str(resolve_device(device)) if src.target["backend"] == "torch" else None
    target = registry.target_engine(
        src.target["backend"],
        src.target_dir,
        EngineOptions(dtype=dtype, device=target_device, feature_layer_ids=tuple(features)),
    )
    return BatchDecoder(target, drafter, tokenizer)
