"""Engines that call the repository's models: the decoding loop inside Triton's BLS model, and the target's sessions.

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

Batched calls: one dflash_target call may carry several sessions (rows): `session_id`, `cache_length`,
`rollback_to` hold one value per row and `token_lengths` says how many of the flat `token_ids` each row
takes (ragged, in row order; absent = one row taking them all). `logits` / `features` come back as every
row's rows concatenated in the same order (one logits row per session with `last_logits_only`), `length`
one per row. The model side keeps its sessions as the rows of ONE target session (runtime/base.py), so
a call is one forward pass for all of them (`TargetSessions`).
`RemoteTargetEngine` is the BLS's side (a TargetEngine), and `RemoteDrafterEngine` the drafter's: batched
when the repository serves the batched round graph (dflash_drafter_batch, written by `triton-repo` next to
dflash_drafter): ONE call per step for every drafting row, the BLS keeping each row's drafter cache as a slot
of one array. Otherwise (a TensorRT plan drafter: its batched plan is not served yet) one dflash_drafter call
per drafting row.

These engines implement the TargetEngine / DrafterEngine interfaces of dflash_trt.runtime.base, so the
decoding loop (acceptance, sampling, bookkeeping) runs unchanged; this module only moves tensors. `infer(model, inputs, outputs)` is the
transport: `pb_utils.InferenceRequest(...).exec()` inside the BLS model (see models/bls.py).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..formats import BATCH_DRAFTER_OUTPUTS, DRAFTER_OUTPUTS, DrafterGraphMeta
from ..runtime.base import DrafterSession, TargetEngine, TargetOutput
from ..runtime.ort_backend import BatchGraphSession, RoundGraphSequence
from ..runtime.rows import PerRowDrafter

InferFn = Callable[
    [str, dict[str, np.ndarray], list[str]], dict[str, np.ndarray]
]  # (model name, {input: ndarray}, [output names]) -> {output: ndarray}

TARGET_INPUTS = [
    "session_id",
    "token_ids",
    "token_lengths",
    "cache_length",
    "rollback_to",
    "last_logits_only",
    "want_features",
    "release",
]
TARGET_OUTPUTS = ["logits", "features", "length"]


def new_session_id() -> int:
    return secrets.randbits(63) or 1


class RemoteTargetEngine:
    """dflash_target as a TargetEngine: one call per forward, carrying every row's session."""

    name = "triton"

    def __init__(self, infer: InferFn, model: str, vocab_size: int, max_context: int, feature_layer_ids: Sequence[int]):
        self.infer, self.model = infer, model
        self.vocab_size, self.max_context = int(vocab_size), int(max_context)
        self.feature_layer_ids = tuple(int(i) for i in feature_layer_ids)

    def new_session(self) -> RemoteTargetSession:
        return RemoteTargetSession(self)


class RemoteTargetSession:
    def __init__(self, engine: RemoteTargetEngine):
        self.engine = engine
        self.rows: dict[int, list[int]] = {}  # handle -> [session_id, length, rollback_to (-1: none)]
        self._next = 0

    def _row(self, row: int) -> list[int]:
        if row not in self.rows:
            raise KeyError(f"no live row {row}")
        return self.rows[row]

    def add_row(self) -> int:
        row, self._next = self._next, self._next + 1
        self.rows[row] = [new_session_id(), 0, -1]
        return row

    def remove_row(self, row: int) -> None:
        """Forget the row and drop its model-side cache (best effort: the model also evicts idle sessions)."""
        sid = self._row(row)[0]
        del self.rows[row]
        try:
            self.engine.infer(
                self.engine.model,
                {
                    "session_id": np.array([sid], np.uint64),
                    "token_ids": np.zeros(0, np.int64),
                    "release": np.array([True]),
                },
                TARGET_OUTPUTS,
            )
        except Exception:  # noqa: BLE001 - releasing must never mask the request's own outcome
            pass

    def length(self, row: int) -> int:
        return self._row(row)[1]

    def rollback(self, row: int, length: int) -> None:
        state = self._row(row)
        if not 0 <= length <= state[1]:
            raise ValueError(f"cannot roll back to {length}: only {state[1]} tokens cached")
        if length < state[1]:
            state[1], state[2] = length, length

    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        states = [self._row(r) for r in rows]
        counts = [int(t.numel()) for t in tokens]
        flat = torch.cat([t.reshape(-1) for t in tokens]) if tokens else torch.zeros(0, dtype=torch.long)
        out = self.engine.infer(
            self.engine.model,
            {
                "session_id": np.array([s[0] for s in states], np.uint64),
                "token_ids": flat.detach().cpu().numpy().astype(np.int64, copy=False),
                "token_lengths": np.array(counts, np.int64),
                "cache_length": np.array([s[1] for s in states], np.int64),  # after the pending rollbacks
                "rollback_to": np.array([s[2] for s in states], np.int64),
                "last_logits_only": np.array([last_logits_only]),
                "want_features": np.array([features]),
            },
            TARGET_OUTPUTS,
        )
        for s in states:
            s[2] = -1
        lengths = out["length"].reshape(-1).tolist()
        for r, s, n, got in zip(rows, states, counts, lengths):
            if int(got) != s[1] + n:
                raise RuntimeError(
                    f"{self.engine.model}: row {r} (session {s[0]}) holds {got} tokens, expected {s[1] + n}"
                )
        logits = torch.from_numpy(np.array(out["logits"], dtype=np.float32))
        feats = np.array(out["features"], dtype=np.float32)
        has_features = features and bool(self.engine.feature_layer_ids) and feats.size > 0
        feats_t = torch.from_numpy(feats) if has_features else None
        results, lo, fo = [], 0, 0
        for s, n in zip(states, counts):
            s[1] += n
            k = 1 if last_logits_only else n
            results.append(
                TargetOutput(logits=logits[lo : lo + k], features=None if feats_t is None else feats_t[fo : fo + n])
            )
            lo, fo = lo + k, fo + n
        return results


class RemoteDrafterEngine:
    """A drafter round graph served as a Triton model, its graph calls made through `infer`.

    batched: the batched round graph (dflash_drafter_batch): ONNX Runtime's batched session logic
    (runtime.ort_backend.BatchGraphSession, every row's cache a slot kept here in the BLS), ONE call per step.
    Otherwise the single-sequence graph (dflash_drafter): ONNX Runtime's sequence logic
    (runtime.ort_backend.RoundGraphSequence), one call per drafting row."""

    name = "triton"

    def __init__(self, infer: InferFn, model: str, meta: dict[str, Any], batched: bool = False, dtype: str = "float32"):
        """meta: the exported graph's drafter.json (dflash_trt.formats.DrafterGraphMeta as a dict); dtype: what the
        drafter model computes in (the BLS model's `drafter_dtype` parameter: the fp32 ONNX graph's, or the
        TensorRT plan's precision)."""
        self.infer, self.model, self.batched, self.dtype = infer, model, batched, dtype
        self.meta = DrafterGraphMeta.from_dict(meta)
        self.block_size, self.mask_token_id = self.meta.block_size, self.meta.mask_token_id
        self.feature_layer_ids = tuple(self.meta.feature_layer_ids)
        self.max_context: int | None = None  # the ONNX graph takes any cache length
        self.outputs = list(BATCH_DRAFTER_OUTPUTS if batched else DRAFTER_OUTPUTS)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.infer(self.model, feeds, self.outputs)
        return [np.array(out[name]) for name in self.outputs]  # writable copies (torch.from_numpy)

    def new_session(self) -> DrafterSession:
        if self.batched:
            return BatchGraphSession(self.meta, self.run)
        return PerRowDrafter(lambda: RoundGraphSequence(self.meta, self.run))


# ---- the target model's side: sessions by id -------------------------------------------------


class SessionExpired(LookupError):
    pass


class TargetSessions:
    """session_id -> a row of ONE batched target session, with idle eviction. Pure Python: dflash_target wraps it.

    engine: the served TargetEngine (PyTorch, TensorRT-LLM)."""

    def __init__(self, engine: TargetEngine, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.batch = self.engine.new_session()
        self.ttl_s, self.clock = ttl_s, clock
        self.sessions: dict[int, tuple[int, float]] = {}  # session_id -> (row, last used)

    def get(self, session_id: int, cache_length: int) -> int:
        """The session's row, created only when the caller starts a sequence (cache_length 0)."""
        now = self.clock()
        for sid in [s for s, (_, used) in self.sessions.items() if now - used > self.ttl_s]:
            self.release(sid)
        if session_id in self.sessions:
            row = self.sessions[session_id][0]
        elif cache_length == 0:
            row = self.batch.add_row()
        else:
            raise SessionExpired(
                f"session expired: {session_id} was idle longer than session_ttl_s={self.ttl_s:g} s, or released, "
                f"while its caller still holds {cache_length} tokens: start the sequence again"
            )
        self.sessions[session_id] = (row, now)
        return row

    def release(self, session_id: int) -> None:
        entry = self.sessions.pop(session_id, None)
        if entry is not None:
            self.batch.remove_row(entry[0])

    def __len__(self) -> int:
        return len(self.sessions)


def _per_row(inputs: dict[str, np.ndarray], name: str, rows: int, default: Any) -> list[Any]:
    """An input with one value per row, or one value for all rows; `default` when absent."""
    a = inputs.get(name)
    if a is None:
        return [default] * rows
    values: list[Any] = np.asarray(a).reshape(-1).tolist()
    if len(values) == 1:
        return values * rows
    if len(values) != rows:
        raise ValueError(f"{name} has {len(values)} values for {rows} sessions")
    return values


def serve_target(sessions: TargetSessions, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One dflash_target call: {TARGET_INPUTS name: ndarray} -> {TARGET_OUTPUTS name: ndarray}.
    Optional inputs may be missing. Raises on any error (the model turns it into an error response)."""
    sids = [int(s) for s in np.asarray(inputs.get("session_id", np.zeros(1, np.uint64))).reshape(-1).tolist()]
    n = len(sids)
    if len(set(sids)) != n:
        raise ValueError("a session_id appears twice in one call")
    if _per_row(inputs, "release", 1, False)[0]:
        for sid in sids:
            sessions.release(sid)
        return {
            "logits": np.zeros((0, 0), np.float32),
            "features": np.zeros((0, 0), np.float32),
            "length": np.zeros(n, dtype=np.int64),
        }
    ids = np.array(inputs["token_ids"], dtype=np.int64).reshape(-1)
    counts = [int(c) for c in _per_row(inputs, "token_lengths", n, -1)] if "token_lengths" in inputs else [ids.size]
    if len(counts) != n or min(counts) < 0 or sum(counts) != ids.size:
        raise ValueError(f"token_lengths {counts} do not split {ids.size} token_ids into {n} sessions")
    cache_lengths = [int(c) for c in _per_row(inputs, "cache_length", n, -1)]
    if min(cache_lengths) < 0:
        raise ValueError("cache_length is required: the tokens the caller holds cached (0 starts a session)")
    rollbacks = [int(r) for r in _per_row(inputs, "rollback_to", n, -1)]
    rows = [sessions.get(sid, c) for sid, c in zip(sids, cache_lengths)]
    batch = sessions.batch
    for sid, row, cache_length, rollback_to in zip(sids, rows, cache_lengths, rollbacks):
        if rollback_to >= 0:
            batch.rollback(row, rollback_to)
        if batch.length(row) != cache_length:
            raise ValueError(
                f"session {sid} holds {batch.length(row)} cached tokens but its caller expects {cache_length}"
            )
    pieces = np.split(ids, np.cumsum(counts)[:-1]) if n else []
    outs = batch.forward(
        rows,
        [torch.from_numpy(p.copy()) for p in pieces],
        last_logits_only=bool(_per_row(inputs, "last_logits_only", 1, False)[0]),
        features=bool(_per_row(inputs, "want_features", 1, False)[0]),
    )

    def cat(ts: list[torch.Tensor | None]) -> np.ndarray:
        if any(t is None for t in ts) or not ts:
            return np.zeros((0, 0), np.float32)
        return np.ascontiguousarray(torch.cat([t.detach().float().cpu() for t in ts if t is not None]).numpy())

    return {
        "logits": cat([o.logits for o in outs]),
        "features": cat([o.features for o in outs]),
        "length": np.array([batch.length(r) for r in rows], np.int64),
    }


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
