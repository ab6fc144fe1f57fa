"""Backends by name: which engine class implements a role, and whether this machine can run it.

    drafter_engine("onnxruntime", "engines/drafter-onnx", EngineOptions(precision="fp16"))
    target_engine("torch", "models/target", EngineOptions(feature_layer_ids=(1, 3)))

The one factory: every engine is built from its artifact (a checkpoint or a built engine folder) by
its class's `from_artifact(path, options)`, so callers never branch on the backend's name.

A backend whose package or device is missing raises EngineUnavailable naming what is missing,
before anything heavy is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import DrafterEngine, EngineOptions, EngineUnavailable, TargetEngine


@dataclass(frozen=True)
class Backend:
    name: str
    role: str  # "drafter" or "target"
    factory: str  # "module:attribute", imported only when used
    packages: tuple[str, ...] = ()  # import names that must be installed
    needs_cuda: bool = False
    hint: str = ""


BACKENDS: dict[tuple[str, str], Backend] = {
    (b.role, b.name): b
    for b in (
        Backend("torch", "drafter", "dflash_trt.runtime.torch_backend:TorchDrafterEngine", ("torch",)),
        Backend("torch", "target", "dflash_trt.runtime.torch_backend:TorchTargetEngine", ("torch",)),
        Backend("onnxruntime", "drafter", "dflash_trt.runtime.ort_backend:OrtDrafterEngine", ("onnxruntime",)),
        Backend(
            "tensorrt",
            "drafter",
            "dflash_trt.runtime.trt_backend:TrtDrafterEngine",
            ("tensorrt",),
            True,
            "install the `gpu` extra (pip install 'dflash-trt[gpu]') on a machine with an NVIDIA GPU, "
            "or use NVIDIA's TensorRT-LLM container",
        ),
        Backend(
            "tensorrt_llm",
            "target",
            "dflash_trt.runtime.trtllm_backend:TrtllmTargetEngine",
            ("tensorrt_llm",),
            True,
            "use NVIDIA's TensorRT-LLM 1.2 container (see the Dockerfile) on a machine with NVIDIA GPUs",
        ),
    )
}


def names(role: str) -> list[str]:
    return sorted(name for r, name in BACKENDS if r == role)


def _backend(role: str, name: str) -> Backend:
    try:
        return BACKENDS[(role, name)]
    except KeyError:
        raise ValueError(f"unknown {role} backend {name!r} (known: {', '.join(names(role))})") from None


def unavailable_reason(role: str, name: str) -> str | None:
    """Why this backend cannot run here, or None when it can. Cheap: imports nothing heavy."""
    b = _backend(role, name)
    missing = [p for p in b.packages if importlib.util.find_spec(p) is None]
    if missing:
        return f"{role} backend {name!r} needs the Python package {', '.join(missing)}, which is not installed" + (
            f"; {b.hint}" if b.hint else ""
        )
    if b.needs_cuda and not cuda_available():
        return f"{role} backend {name!r} needs an NVIDIA GPU, and none is visible" + (f"; {b.hint}" if b.hint else "")
    return None


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def require(role: str, name: str) -> None:
    reason = unavailable_reason(role, name)
    if reason:
        raise EngineUnavailable(reason)


def engine_class(role: str, name: str) -> Any:
    require(role, name)
    module, attr = _backend(role, name).factory.split(":")
    return getattr(importlib.import_module(module), attr)


def drafter_engine(name: str, path: str | Path = "", options: EngineOptions | None = None) -> DrafterEngine:
    """The drafter engine of backend `name` from its artifact (an exported graph or plan folder)."""
    engine: DrafterEngine = engine_class("drafter", name).from_artifact(Path(path), options or EngineOptions())
    return engine


def target_engine(name: str, path: str | Path = "", options: EngineOptions | None = None) -> TargetEngine:
    """The target engine of backend `name` from its artifact (a checkpoint or a built engine folder)."""
    engine: TargetEngine = engine_class("target", name).from_artifact(Path(path), options or EngineOptions())
    return engine
