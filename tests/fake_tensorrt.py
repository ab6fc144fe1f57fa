"""A FAKE `tensorrt` module that records calls (this workplace has no TensorRT and no GPU).

It mimics the slice of the TensorRT 10/11 Python API that dflash_trt uses, so tests can check
the build sequence and the runtime's tensor binding. It computes nothing real; it proves
nothing about TensorRT itself, only that our code drives the API as documented.
"""

from __future__ import annotations

import ctypes
import enum
import types

import numpy as np


def make(version: str, calls: list, io: dict | None = None) -> types.ModuleType:
    """io: for the runtime, {name: (is_input, dtype_name, output_shape_fn)} of the fake engine."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    major = int(version.split(".")[0])
    trt.float32, trt.float16, trt.int32, trt.int64 = "float32", "float16", "int32", "int64"

    class Logger:
        WARNING = "WARNING"

        def __init__(self, level):
            calls.append(("Logger", level))

    class NetworkDefinitionCreationFlag(enum.IntEnum):
        STRONGLY_TYPED = 1  # the real enum value is 1 in 10.x

    trt.BuilderFlag = types.SimpleNamespace(**({"FP16": "FP16"} if major < 11 else {}), TF32="TF32")
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    trt.NetworkDefinitionCreationFlag = NetworkDefinitionCreationFlag

    class Tensor:
        def __init__(self, name):
            self.name = name

    class Network:
        def __init__(self, flags):
            self.flags = flags
            self.inputs = []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

    class OnnxParser:
        def __init__(self, network, logger):
            self.network = network
            self.num_errors = 0

        def parse_from_file(self, path):
            calls.append(("parse_from_file", path))
            names = ("block_ids", "features", "past_k", "past_v")
            if "drafter_batch" in str(path):  # the batched graph (builders/onnx_drafter_batch.py)
                names = ("block_ids", "block_lengths", "features", "new_lengths", "past_k", "past_v", "past_lengths")
            self.network.inputs = [Tensor(n) for n in names]
            return True

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, mn, opt, mx):
            calls.append(("profile.set_shape", name, tuple(mn), tuple(opt), tuple(mx)))
            self.shapes[name] = (mn, opt, mx)

    class Config:
        def set_memory_pool_limit(self, pool, size):
            calls.append(("set_memory_pool_limit", pool, size))

        def set_flag(self, flag):
            calls.append(("set_flag", flag))

        def add_optimization_profile(self, profile):
            calls.append(("add_optimization_profile", sorted(profile.shapes)))
            return 0

    class Builder:
        def __init__(self, logger):
            calls.append(("Builder",))

        def create_network(self, flags=0):
            calls.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("build_serialized_network",))
            return b"FAKE-PLAN"

    # ---- runtime ----
    class Context:
        def __init__(self):
            self.shapes, self.addresses = {}, {}

        def set_input_shape(self, name, shape):
            calls.append(("set_input_shape", name, tuple(shape)))
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            return io[name][2](self.shapes)

        def set_tensor_address(self, name, address):
            calls.append(("set_tensor_address", name, address))
            self.addresses[name] = address
            return True

        def execute_async_v3(self, stream):
            calls.append(("execute_async_v3", stream))
            # write a recognisable pattern into each output buffer at the address bound to its name
            for name, (is_input, dtype, shape_fn) in io.items():
                if is_input:
                    continue
                shape = shape_fn(self.shapes)
                n = int(np.prod(shape))
                if n == 0:
                    continue
                ctype = {"float32": ctypes.c_float, "int64": ctypes.c_int64}[dtype]
                buf = np.ctypeslib.as_array((ctype * n).from_address(self.addresses[name]))
                buf[:] = FILL[name]
            return True

    class Engine:
        num_io_tensors = len(io or {})

        def get_tensor_name(self, i):
            return list(io)[i]

        def get_tensor_mode(self, name):
            return "INPUT" if io[name][0] else "OUTPUT"

        def get_tensor_dtype(self, name):
            return io[name][1]

        def create_execution_context(self):
            calls.append(("create_execution_context",))
            return Context()

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            calls.append(("deserialize_cuda_engine", bytes(data)))
            return Engine()

    trt.Logger, trt.Builder, trt.OnnxParser, trt.Runtime = Logger, Builder, OnnxParser, Runtime
    return trt


FILL = {"logits": 0.5, "draft_tokens": 7, "present_k": 1.0, "present_v": 2.0}
