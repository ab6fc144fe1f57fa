"""Backend registry: selection by name, clear EngineUnavailable for missing packages / devices."""

import pytest

from dflash_trt.runtime import registry
from dflash_trt.runtime.base import EngineUnavailable


def test_names_per_role():
    assert registry.names("drafter") == ["onnxruntime", "tensorrt", "torch"]
    assert registry.names("target") == ["tensorrt_llm", "torch"]


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown drafter backend 'tensorflow'.*onnxruntime"):
        registry.drafter_engine("tensorflow")


def test_cpu_backends_resolve():
    assert registry.unavailable_reason("drafter", "onnxruntime") is None
    assert registry.engine_class("drafter", "onnxruntime").__name__ == "OrtDrafterEngine"
    assert registry.engine_class("target", "torch").__name__ == "TorchTargetEngine"


def test_missing_package_names_it(monkeypatch):
    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda n: None if n == "tensorrt" else real(n))
    with pytest.raises(EngineUnavailable, match="needs the Python package tensorrt.*gpu"):
        registry.drafter_engine("tensorrt", "engines/x")


def test_missing_gpu_is_reported(monkeypatch):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda n: object())  # pretend installed
    monkeypatch.setattr(registry, "cuda_available", lambda: False)
    with pytest.raises(EngineUnavailable, match="needs an NVIDIA GPU"):
        registry.target_engine("tensorrt_llm", "engines/x")
