"""STAND-IN for NVIDIA's `tensorrt_llm` 1.2 package in the gpu image (tests/pods.py; no TensorRT-LLM here): the slice
dflash-trt imports, doing the file I/O of the sources cited beside each piece."""

from __future__ import annotations

__version__ = "1.2.1"


class Mapping:
    """tensorrt_llm/mapping.py (NVIDIA/TensorRT-LLM b35ac1b6): the rank's place in the world; to_dict() is what
    save_checkpoint writes into config.json."""

    def __init__(self, world_size=1, rank=0, gpus_per_node=8, tp_size=1, pp_size=1, **kw):
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.pp_size = tp_size, pp_size

    def to_dict(self):
        return {
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
        }
