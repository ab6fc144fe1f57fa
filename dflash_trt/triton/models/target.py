"""`dflash_target`: the target engine, with each sequence's KV cache kept here under its session_id.

Inputs: session_id UINT64 [1], token_ids INT64 [-1], rollback_to INT64 [1] (-1: none; applied
before the forward), last_logits_only / want_features / release BOOL [1].
Outputs: logits FP32 [-1, -1], features FP32 [-1, -1] ([0, 0] when not asked for), length INT64 [1].
Backends: the PyTorch target (CPU, or CUDA with `device: cuda`) or TensorRT-LLM (`backend:
tensorrt_llm`, GPU). One instance only: sessions live in this process (see dflash_trt.triton.bls).
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from .common import error_response, get, load_config, resolve


class TargetSessions:
    """session_id -> TargetSession, with idle eviction."""

    def __init__(self, engine, ttl_s: float):
        self.engine, self.ttl_s = engine, ttl_s
        self.sessions: dict[int, tuple[object, float]] = {}

    def get(self, session_id: int):
        now = time.monotonic()
        for sid in [s for s, (_, used) in self.sessions.items() if now - used > self.ttl_s]:
            del self.sessions[sid]
        session = self.sessions[session_id][0] if session_id in self.sessions else self.engine.new_session()
        self.sessions[session_id] = (session, now)
        return session

    def release(self, session_id: int) -> None:
        self.sessions.pop(session_id, None)


class TritonPythonModel:
    def initialize(self, args):
        _, params, folder = load_config(args)
        threads = int(params.get("threads", "0"))
        if threads:
            torch.set_num_threads(threads)
        backend = params.get("backend", "torch")
        path = resolve(folder, params.get("engine_dir", "target"))
        if backend == "torch":
            from ...loading import DTYPES
            from ...models.target import load_target
            from ...runtime.torch_backend import TorchTargetEngine

            model = load_target(path, DTYPES[params.get("dtype", "float32")]).to(params.get("device", "cpu"))
            engine = TorchTargetEngine(model, tuple(json.loads(params.get("feature_layer_ids", "[]"))))
        else:
            from ...runtime import registry

            engine = registry.target_engine(backend, path)
        self.sessions = TargetSessions(engine, float(params.get("session_ttl_s", "600")))

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            sid = int(get(request, "session_id").reshape(-1)[0])
            flag = lambda name: bool(get(request, name, np.array([False])).reshape(-1)[0])  # noqa: E731
            if flag("release"):
                self.sessions.release(sid)
                return self._response(np.zeros((0, 0), np.float32), None, 0)
            session = self.sessions.get(sid)
            rollback_to = int(get(request, "rollback_to", np.array([-1])).reshape(-1)[0])
            if rollback_to >= 0:
                session.rollback(rollback_to)
            ids = torch.from_numpy(np.array(get(request, "token_ids"), dtype=np.int64).reshape(-1))
            out = session.forward(ids, last_logits_only=flag("last_logits_only"), features=flag("want_features"))
            return self._response(out.logits, out.features, session.length)
        except Exception as e:  # noqa: BLE001 - report to the caller, keep serving
            return error_response(f"dflash_target: {type(e).__name__}: {e}")

    @staticmethod
    def _response(logits, features, length: int):
        def arr(t):
            if t is None:
                return np.zeros((0, 0), np.float32)
            return t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor) else t

        return pb_utils.InferenceResponse([
            pb_utils.Tensor("logits", np.ascontiguousarray(arr(logits), dtype=np.float32)),
            pb_utils.Tensor("features", np.ascontiguousarray(arr(features), dtype=np.float32)),
            pb_utils.Tensor("length", np.array([length], dtype=np.int64)),
        ])
