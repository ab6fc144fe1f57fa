"""What a gpt-oss MXFP4 checkpoint needs, said before it loads (not after an ImportError or an out-of-memory).

Published gpt-oss checkpoints keep their expert weights in MXFP4 (config.json `quantization_config.quant_method`
"mxfp4": each `*_blocks` tensor packs two 4-bit values a byte, with a `*_scales` byte per 32 values). Loading
follows transformers' `Mxfp4HfQuantizer.validate_environment` (quantizers/quantizer_mxfp4.py, 5.25.0), as written:
- without `accelerate` it raises ImportError, unless the config asks to dequantize;
- MXFP4 stays packed on a GPU of compute capability >= 7.5 with Triton >= 3.4.0 and the `kernels` package
  (XPU / CPU: Triton >= 3.5.0 and `kernels`); missing any of these it dequantizes every expert to the load dtype, with a
  warning: the 20B then takes about 42 GB in bf16, the 120B about 234 GB, beyond one GPU.
`mxfp4_plan` reads the checkpoint's safetensors headers (no weights) to size the dequantized model, and refuses
by name what cannot load: a missing `accelerate`, or a dequantized model beyond the device's free memory.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import torch

PACKED_SUFFIX = "_blocks"  # two MXFP4 values a byte
SCALES_SUFFIX = "_scales"  # one shared exponent a 32-value block: folded into the values when dequantized


def is_mxfp4(config: Any) -> bool:
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(method).lower().endswith("mxfp4")


def _dequantize_requested(config: Any) -> bool:
    quant = getattr(config, "quantization_config", None) or {}
    return bool(quant.get("dequantize") if isinstance(quant, dict) else getattr(quant, "dequantize", False))


def safetensors_values(folder: Path) -> int:
    """Values the checkpoint holds once dequantized, from its safetensors headers (8-byte length, JSON)."""
    total = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with shard.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__" or name.endswith(SCALES_SUFFIX):
                continue
            count = 1
            for d in entry["shape"]:
                count *= int(d)
            total += count * 2 if name.endswith(PACKED_SUFFIX) else count
    return total


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _triton_at_least(wanted: tuple[int, int]) -> bool:
    """transformers' own test (utils.is_triton_available), so that its version rule is the one applied."""
    from transformers.utils.import_utils import is_triton_available

    return bool(is_triton_available(f"{wanted[0]}.{wanted[1]}.0"))


def _kernels_usable() -> bool:
    """transformers' own test (utils.is_kernels_available): it accepts `kernels` only within the version range it
    supports, so an installed `kernels` outside it still means dequantizing; presence alone would say packed."""
    from transformers.utils.import_utils import is_kernels_available

    return bool(is_kernels_available())


def keeps_mxfp4(device: torch.device) -> str | None:
    """Why transformers would dequantize on `device` (None: MXFP4 stays packed): CUDA needs compute capability
    >= 7.5 and Triton >= 3.4.0, CPU and XPU Triton >= 3.5.0; all need the `kernels` package."""
    if device.type not in ("cuda", "cpu", "xpu"):
        return f"MXFP4 runs on cuda, xpu or cpu, not {device.type}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (7, 5):
            return f"the GPU's compute capability {major}.{minor} is below 7.5"
    triton = (3, 4) if device.type == "cuda" else (3, 5)
    missing = [f"triton >= {triton[0]}.{triton[1]}"] if not _triton_at_least(triton) else []
    missing += [] if _kernels_usable() else ["kernels (a version transformers accepts)"]
    return f"{' and '.join(missing)} not installed" if missing else None


def free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (None elsewhere: host memory is not judged here)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def mxfp4_plan(folder: str | Path, config: Any, dtype: torch.dtype, device: str | torch.device) -> str | None:
    """None for a checkpoint that is not MXFP4; else a line saying how it will load (packed, or dequantized to
    `dtype` with its size). Raises ValueError, before any weight is read, for what cannot load."""
    if not is_mxfp4(config):
        return None
    device = torch.device(device)
    size = safetensors_values(Path(folder)) * torch.tensor([], dtype=dtype).element_size()
    gb = f"{size / 1e9:.0f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
    if not _dequantize_requested(config) and not _has("accelerate"):
        raise ValueError(
            f"{folder} is an MXFP4 checkpoint (gpt-oss): transformers loads it only with `accelerate` installed "
            "(pip install accelerate; to keep MXFP4 on a GPU of compute capability >= 7.5 also `kernels` and "
            f"triton >= 3.4), or dequantized (quantization_config.dequantize: true): {gb} in {dtype}"
        )
    why = None if _dequantize_requested(config) else keeps_mxfp4(device)
    if why is None and not _dequantize_requested(config):
        return f"MXFP4 checkpoint: experts stay packed on {device}"
    free = free_bytes(device)
    if free is not None and size > free:
        raise ValueError(
            f"{folder} is an MXFP4 checkpoint that would be dequantized to {dtype} ({why or 'as its config asks'}): "
            f"{gb}, beyond the {free / 1e9:.0f} GB free on {device}; install `kernels` and triton >= 3.4 on a GPU "
            "of compute capability >= 7.5 to keep MXFP4, or use more GPUs (a TensorRT-LLM engine with tp > 1)"
        )
    return f"MXFP4 checkpoint dequantized to {dtype} ({why or 'as its config asks'}): {gb}"
