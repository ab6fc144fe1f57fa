"""`dflash_target`: the target engine, with each sequence's KV cache kept here under its session_id.

Inputs, one value per session (a call may carry several; see dflash_trt.triton.remote): session_id UINT64 [-1],
cache_length INT64 [-1] (the tokens the caller holds cached, after rollback; 0 starts a session),
rollback_to INT64 [-1] (-1: none; applied before the forward); token_ids INT64 [-1] split among the
sessions by token_lengths INT64 [-1] (absent: one session); last_logits_only / want_features / release
BOOL [1] for the whole call. Outputs: logits FP32 [-1, -1] and features FP32 [-1, -1] (every session's rows
in call order; [0, 0] when not asked for), length INT64 [-1]. The target runs all of a call's sessions
in one batched forward (runtime/base.py's TargetSession).
Backends: the PyTorch target on CPU, served and tested here. `device: cuda` and `backend:
tensorrt_llm` (through dflash_trt.runtime.registry) are written against the real APIs but never run
in this project: no GPU/TensorRT here. One instance only: sessions live in this process.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ...runtime import registry
from ...runtime.base import EngineOptions, TargetEngine
from ..remote import TARGET_INPUTS, TargetSessions, serve_target
from .common import error_response, get, load_config, resolve


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        _, params, folder = load_config(args)
        threads = int(params.get("threads", "0"))
        if threads:
            torch.set_num_threads(threads)
        options = EngineOptions(
            dtype=params.get("dtype", "float32"),
            device=params.get("device"),
            feature_layer_ids=tuple(json.loads(params.get("feature_layer_ids", "[]"))),
        )
        engine: TargetEngine = registry.target_engine(
            params.get("backend", "torch"), resolve(folder, params.get("engine_dir", "target")), options
        )
        self.sessions = TargetSessions(engine, float(params.get("session_ttl_s", "600")))

    def execute(self, requests: list[Any]) -> list[Any]:  # pb_utils requests -> responses
        return [self._one(r) for r in requests]

    def _one(self, request: Any) -> Any:
        try:
            inputs = {name: a for name in TARGET_INPUTS if (a := get(request, name)) is not None}
            out = serve_target(self.sessions, inputs)
            return pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, np.ascontiguousarray(a)) for name, a in out.items()]
            )
        except Exception as e:  # noqa: BLE001 - report to the caller, keep serving
            return error_response(f"dflash_target: {type(e).__name__}: {e}")
