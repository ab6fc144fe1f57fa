"""The draft-and-verify loop inside Triton: engine adapters that call the repository's models.

How a sequence's state is addressed across calls (the two caches live in different places):

* Target KV cache: kept INSIDE `dflash_target`, in a session keyed by a 63-bit random
  `session_id` that the BLS draws per sequence. Every call names its session; the first call
  creates it, `release=true` drops it (the BLS always releases in a `finally`), and sessions idle
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
from typing import Callable

import numpy as np
import torch

from ..runtime.base import Draft, TargetOutput

InferFn = Callable[[str, dict, list], dict]  # (model name, {input: ndarray}, [output names]) -> {output: ndarray}

TARGET_OUTPUTS = ["logits", "features", "length"]
DRAFTER_OUTPUTS = ["logits", "draft_tokens", "present_k", "present_v"]


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
            "rollback_to": np.array([self._rollback_to], dtype=np.int64),
            "last_logits_only": np.array([last_logits_only], dtype=bool),
            "want_features": np.array([features], dtype=bool),
            "release": np.array([release], dtype=bool),
        }
        return self.engine.infer(self.engine.model, inputs, TARGET_OUTPUTS)

    def forward(self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True) -> TargetOutput:
        out = self._request(token_ids.detach().cpu().numpy(), last_logits_only, features)
        self._rollback_to = -1
        self._length = int(out["length"].reshape(-1)[0])
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
    name = "triton"

    def __init__(self, infer: InferFn, model: str, meta: dict):
        """meta: the exported graph's drafter.json (export.onnx_drafter.DrafterGraphMeta as a dict;
        not imported here, to keep torch.onnx out of the BLS process)."""
        self.infer, self.model = infer, model
        self.block_size = int(meta["block_size"])
        self.mask_token_id = int(meta["mask_token_id"])
        self.feature_layer_ids = tuple(int(i) for i in meta["feature_layer_ids"])
        self.empty_cache_shape = (int(meta["num_layers"]), 1, int(meta["num_kv_heads"]), 0, int(meta["head_dim"]))

    def new_session(self) -> "RemoteDrafterSession":
        return RemoteDrafterSession(self)


class RemoteDrafterSession:
    """Holds this sequence's drafter context cache and sends it with every round."""

    def __init__(self, engine: RemoteDrafterEngine):
        self.engine = engine
        self.past_k = np.zeros(engine.empty_cache_shape, dtype=np.float32)
        self.past_v = self.past_k.copy()

    @property
    def context_length(self) -> int:
        return self.past_k.shape[3]

    def draft(self, new_features: torch.Tensor, last_token: int, block_size: int) -> Draft:
        e = self.engine
        block = np.full((1, block_size), e.mask_token_id, dtype=np.int64)
        block[0, 0] = last_token
        feats = new_features.detach().to("cpu", torch.float32).numpy()[None]
        out = e.infer(e.model, {"block_ids": block, "features": feats, "past_k": self.past_k, "past_v": self.past_v},
                      DRAFTER_OUTPUTS)
        self.past_k, self.past_v = out["present_k"], out["present_v"]
        return Draft(logits=torch.from_numpy(np.array(out["logits"][0], dtype=np.float32)),
                     tokens=torch.from_numpy(np.array(out["draft_tokens"][0], dtype=np.int64)))


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


def visible_text(tokenizer, ids: list[int], final: bool) -> str:
    """Decoded text that later tokens cannot change: a trailing partial UTF-8 character (U+FFFD) is
    held back until more tokens complete it or the sequence ends."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text if final else text.rstrip("\ufffd")


def text_delta(tokenizer, ids: list[int], new: int, final: bool) -> str:
    """Text added by the last `new` tokens of `ids`: the stream's chunks concatenate to the full text."""
    before = visible_text(tokenizer, ids[: len(ids) - new], final=False)
    now = visible_text(tokenizer, ids, final)
    return now[len(before):] if now.startswith(before) else now  # (prefix always holds for byte-level BPE)
