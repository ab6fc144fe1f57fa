"""The draft-and-verify loop inside Triton: engine adapters that call the repository's models.

How a sequence's state is addressed across calls (the two caches live in different places):

* Target KV cache: kept INSIDE `dflash_target`, in a session keyed by a 63-bit random
  `session_id` that the BLS draws per sequence (`TargetSessions` below). Every call names its
  session and says how many tokens it believes are cached (`cache_length`, after `rollback_to`):
  only `cache_length=0` creates a session; an unknown id with a longer cache is an error
  ("session expired"), never a silent restart at position 0, and so is any other disagreement.
  `release=true` drops a session (the BLS always releases in a `finally`), and sessions idle
  longer than `session_ttl_s` are evicted, so a crashed caller cannot leak memory forever.
  A rollback (rejected drafts) is not a call of its own: it rides on the next forward as
  `rollback_to`, so one verified round costs one target call. Because the state is in-process,
  `dflash_target` runs exactly one instance (more instances would split sessions between them).
* Drafter context cache: passed EXPLICITLY as tensors. The exported ONNX/TensorRT drafter graph
  already takes `past_k`/`past_v` and returns `present_k`/`present_v`, so `dflash_drafter` is
  stateless (any number of instances, TensorRT plan or ONNX Runtime alike) and the BLS keeps each
  sequence's cache between rounds, as the ONNX Runtime engine does in-process.

`RemoteTargetEngine` / `RemoteDrafterEngine` implement the TargetEngine / DrafterEngine interfaces
of dflash_trt.runtime.base, so `SpeculativeDecoder` / `Generation` (acceptance, sampling,
bookkeeping) run unchanged; this module only moves tensors. `infer(model, inputs, outputs)` is the
transport: `pb_utils.InferenceRequest(...).exec()` inside the BLS model (see models/bls.py).
"""

from __future__ import annotations

import secrets
import time
from typing import Callable

import numpy as np
import torch

from ..formats import DRAFTER_OUTPUTS, DrafterGraphMeta
from ..runtime.base import TargetOutput
from ..runtime.ort_backend import OrtDrafterSession

InferFn = Callable[[str, dict, list], dict]  # (model name, {input: ndarray}, [output names]) -> {output: ndarray}

TARGET_INPUTS = ["session_id", "token_ids", "cache_length", "rollback_to", "last_logits_only", "want_features",
                 "release"]
TARGET_OUTPUTS = ["logits", "features", "length"]


def new_session_id() -> int:
    return secrets.randbits(63) or 1


class RemoteTargetEngine:
    name = "triton"

    def __init__(self, infer: InferFn, model: str, vocab_size: int, max_context: int, feature_layer_ids):
        self.infer, self.model = infer, model
        self.vocab_size, self.max_context = int(vocab_size), int(max_context)
        self.feature_layer_ids = tuple(int(i) for i in feature_layer_ids)

    def new_session(self) -> "RemoteTargetSession":
        return RemoteTargetSession(self, new_session_id())


class RemoteTargetSession:
    def __init__(self, engine: RemoteTargetEngine, session_id: int):
        self.engine, self.session_id = engine, session_id
        self._length = 0
        self._rollback_to = -1  # applied by the model before the next forward

    @property
    def length(self) -> int:
        return self._length

    def _request(self, token_ids: np.ndarray, last_logits_only=False, features=True, release=False) -> dict:
        inputs = {
            "session_id": np.array([self.session_id], dtype=np.uint64),
            "token_ids": token_ids.astype(np.int64, copy=False),
            "cache_length": np.array([self._length], dtype=np.int64),  # after the pending rollback
            "rollback_to": np.array([self._rollback_to], dtype=np.int64),
            "last_logits_only": np.array([last_logits_only], dtype=bool),
            "want_features": np.array([features], dtype=bool),
            "release": np.array([release], dtype=bool),
        }
        return self.engine.infer(self.engine.model, inputs, TARGET_OUTPUTS)

    def forward(self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True) -> TargetOutput:
        out = self._request(token_ids.detach().cpu().numpy(), last_logits_only, features)
        self._rollback_to = -1
        length, expected = int(out["length"].reshape(-1)[0]), self._length + int(token_ids.numel())
        if length != expected:
            raise RuntimeError(f"{self.engine.model}: session {self.session_id} holds {length} tokens, expected {expected}")
        self._length = length
        feats = out["features"]
        has_features = features and bool(self.engine.feature_layer_ids) and feats.size > 0
        return TargetOutput(logits=torch.from_numpy(np.array(out["logits"], dtype=np.float32)),
                            features=torch.from_numpy(np.array(feats, dtype=np.float32)) if has_features else None)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: only {self._length} tokens cached")
        if length < self._length:
            self._length, self._rollback_to = length, length

    def close(self) -> None:
        """Drop the model-side cache (best effort: the model also evicts idle sessions)."""
        try:
            self._request(np.zeros(0, dtype=np.int64), release=True)
        except Exception:  # noqa: BLE001 - releasing must never mask the request's own outcome
            pass


class RemoteDrafterEngine:
    """The drafter round graph served as a Triton model: the same session logic as ONNX Runtime's
    (runtime.ort_backend.OrtDrafterSession), with the graph call made through `infer`."""

    name = "triton"

    def __init__(self, infer: InferFn, model: str, meta: dict):
        """meta: the exported graph's drafter.json (dflash_trt.formats.DrafterGraphMeta as a dict)."""
        self.infer, self.model = infer, model
        self.meta = DrafterGraphMeta.from_dict(meta)
        self.block_size, self.mask_token_id = self.meta.block_size, self.meta.mask_token_id
        self.feature_layer_ids = self.meta.feature_layer_ids
        self.max_context: int | None = None  # the ONNX graph takes any cache length

    def run(self, feeds: dict) -> list[np.ndarray]:
        out = self.infer(self.model, feeds, list(DRAFTER_OUTPUTS))
        return [np.array(out[name]) for name in DRAFTER_OUTPUTS]  # writable copies (torch.from_numpy)

    def new_session(self) -> OrtDrafterSession:
        return OrtDrafterSession(self)


# ---- the target model's side: sessions by id -------------------------------------------------

class SessionExpired(LookupError):
    pass


class TargetSessions:
    """session_id -> TargetSession, with idle eviction. Pure Python: dflash_target wraps it."""

    def __init__(self, engine, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.engine, self.ttl_s, self.clock = engine, ttl_s, clock
        self.sessions: dict[int, tuple[object, float]] = {}

    def get(self, session_id: int, cache_length: int):
        """The session, created only when the caller starts a sequence (cache_length 0)."""
        now = self.clock()
        for sid in [s for s, (_, used) in self.sessions.items() if now - used > self.ttl_s]:
            del self.sessions[sid]
        if session_id in self.sessions:
            session = self.sessions[session_id][0]
        elif cache_length == 0:
            session = self.engine.new_session()
        else:
            raise SessionExpired(
                f"session expired: {session_id} was idle longer than session_ttl_s={self.ttl_s:g} s, or released, "
                f"while its caller still holds {cache_length} tokens: start the sequence again")
        self.sessions[session_id] = (session, now)
        return session

    def release(self, session_id: int) -> None:
        self.sessions.pop(session_id, None)

    def __len__(self) -> int:
        return len(self.sessions)


def serve_target(sessions: TargetSessions, inputs: dict) -> dict:
    """One dflash_target call: {TARGET_INPUTS name: ndarray} -> {TARGET_OUTPUTS name: ndarray}.
    Optional inputs may be missing. Raises on any error (the model turns it into an error response)."""
    def one(name, default):
        a = inputs.get(name)
        return default if a is None else np.asarray(a).reshape(-1)[0].item()

    sid = int(one("session_id", 0))
    if one("release", False):
        sessions.release(sid)
        return {"logits": np.zeros((0, 0), np.float32), "features": np.zeros((0, 0), np.float32),
                "length": np.array([0], dtype=np.int64)}
    cache_length = int(one("cache_length", -1))
    if cache_length < 0:
        raise ValueError("cache_length is required: the tokens the caller holds cached (0 starts a session)")
    session = sessions.get(sid, cache_length)
    rollback_to = int(one("rollback_to", -1))
    if rollback_to >= 0:
        session.rollback(rollback_to)
    if session.length != cache_length:
        raise ValueError(f"session {sid} holds {session.length} cached tokens but its caller expects {cache_length}")
    ids = torch.from_numpy(np.array(inputs["token_ids"], dtype=np.int64).reshape(-1))
    out = session.forward(ids, last_logits_only=bool(one("last_logits_only", False)),
                          features=bool(one("want_features", False)))

    def arr(t):
        return np.zeros((0, 0), np.float32) if t is None else np.ascontiguousarray(t.detach().float().cpu().numpy())

    return {"logits": arr(out.logits), "features": arr(out.features), "length": np.array([session.length], np.int64)}


# ---- batch bookkeeping shared by the BLS model and its tests ---------------------------------

def pad_rows(rows: list[list[int]], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows -> ([N, max_len] int64 padded, [N, 1] int32 lengths)."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, np.array([[len(r)] for r in rows], dtype=np.int32)


def unpad_rows(ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ids = ids.reshape(len(lengths), -1)
    return [ids[i, : int(n)].tolist() for i, n in enumerate(lengths.reshape(-1))]
