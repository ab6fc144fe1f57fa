"""STAND-IN for the GPU of the gpu image (tests/pods.py): `dflash_trt.runtime.registry.cuda_available` answers True, so
that the engine build and the server take the TensorRT-LLM path they take on a GPU node. torch itself stays on the CPU
(trtllm_backend.rank_device then puts the output layer on the CPU, as it does wherever no GPU is visible).

Patched when the registry is first imported (an import hook), so a Python process that never loads it pays nothing."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "dflash_trt.runtime.registry"


class _GpuStandIn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.cuda_available = lambda: True

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _GpuStandIn())
