"""Batched engine sessions: many sequences ("rows") advanced by ONE forward pass each.

The single-sequence protocols in `base.py` (one session = one sequence) stay as they are; these two
add a session that holds every active row of a scheduler. Design:

- A row is an integer handle from `add_row()`; `remove_row()` frees it (finished, cancelled). Rows join
  and leave between calls, so a batch is never rebuilt when its membership changes.
- `forward` / `draft` take the rows that take part in this call, each with its OWN number of new tokens
  (ragged): a verify step mixes rows of different context lengths and block sizes. Backends pad to the
  longest row and mask; callers never see padding (outputs are per row, unpadded).
- The target's KV cache rolls each row back on its own (`rollback(row, length)`); the drafter's context
  cache only grows (committed tokens), as in the single-sequence protocol.

Backends: PyTorch (`torch_batch.py`: static preallocated per-row caches in the style of gpt-fast, grown
by doubling), ONNX Runtime (`ort_batch.py`: the exported batched drafter graph). The TensorRT plan's
batch-axis profile is in `builders/trt_drafter_batch.py` (written, not runnable here: no GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

from .base import Draft, DrafterEngine, DrafterSession, TargetEngine, TargetOutput, TargetSession

S = TypeVar("S")  # a single-sequence session type (PerRowSessions)


@runtime_checkable
class BatchTargetSession(Protocol):
    def add_row(self) -> int:
        """A new, empty row; returns its handle."""

    def remove_row(self, row: int) -> None:
        """Free a row's cache slot (the handle may be reused by a later add_row)."""

    def length(self, row: int) -> int:
        """Tokens held in this row's KV cache."""

    def rollback(self, row: int, length: int) -> None:
        """Drop this row's cached tokens beyond `length`; other rows are untouched."""

    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        """Append tokens[i] ([n_i] ids, n_i >= 1) to rows[i] and score them, all rows in one pass.

        Returns one TargetOutput per row: logits [n_i, V] (or [1, V] when last_logits_only) and
        features [n_i, F] (None when not asked for)."""


@runtime_checkable
class BatchTargetEngine(Protocol):
    name: str
    vocab_size: int
    max_context: int
    feature_layer_ids: tuple[int, ...]

    def new_batch(self) -> BatchTargetSession: ...


@dataclass
class DraftRequest:
    """One row's part of a batched drafter call."""

    row: int
    new_features: torch.Tensor  # [n, F] features of the tokens committed since this row's last draft (n >= 1)
    last_token: int  # block position 0; the drafter proposes block_size - 1 tokens after it
    block_size: int  # >= 2


@runtime_checkable
class BatchDrafterSession(Protocol):
    def add_row(self) -> int: ...

    def remove_row(self, row: int) -> None: ...

    def context_length(self, row: int) -> int:
        """Context tokens whose K/V this row's drafter cache holds."""

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One drafter pass for every request (rows of different context, new-token and block lengths)."""


@runtime_checkable
class BatchDrafterEngine(Protocol):
    name: str
    block_size: int
    feature_layer_ids: tuple[int, ...]

    def new_batch(self) -> BatchDrafterSession: ...


class RowSlots:
    """Row handles -> slots of a preallocated cache; freed slots are reused, the slot count only grows."""

    def __init__(self) -> None:
        self.lengths: list[int] = []  # per slot; meaningful only for live slots
        self.live: list[bool] = []

    def add(self) -> int:
        for slot, used in enumerate(self.live):
            if not used:
                self.live[slot], self.lengths[slot] = True, 0
                return slot
        self.live.append(True)
        self.lengths.append(0)
        return len(self.live) - 1

    def remove(self, row: int) -> None:
        self.check(row)
        self.live[row] = False

    def check(self, row: int) -> None:
        if not (0 <= row < len(self.live) and self.live[row]):
            raise KeyError(f"no live row {row}")

    @property
    def capacity(self) -> int:
        return len(self.live)


def grown(current: int, needed: int, limit: int | None = None) -> int:
    """Capacity after doubling until `needed` fits (capped at `limit` when given)."""
    cap = max(current, 16)
    while cap < needed:
        cap *= 2
    if limit is not None:
        cap = min(cap, max(limit, needed))
    return cap


def backlog_groups(counts: Sequence[int], min_long: int = 16, ratio: float = 4.0) -> list[list[int]]:
    """Indices of a draft call's requests split into calls of similar new-context length, for drafters that
    pad every row's new context to the longest (fixed-shape graphs: ONNX Runtime, TensorRT). A row drafting
    for the first time brings its whole prompt (~100+ feature rows), the others a few: in one call, every
    row pays for the prompt. Rows bringing more than `ratio` x the median and at least `min_long` go in a
    second call (one more call's fixed cost, paid only on steps where such rows draft)."""
    order = sorted(range(len(counts)), key=lambda i: counts[i])
    median = counts[order[(len(order) - 1) // 2]] if order else 0
    long = [i for i in range(len(counts)) if counts[i] >= min_long and counts[i] > ratio * median]
    short = [i for i in range(len(counts)) if i not in set(long)]
    return [g for g in (short, long) if g]


class SlotCacheRows:
    """The row bookkeeping of a session whose K/V cache is `[layers, slots, kv_heads, C, head_dim]`, one
    slot per row: add/remove rows, each row's length, growing the cache (slots and C by doubling, a copy).

    Works for numpy and torch arrays alike: a subclass says how to make a zero array (`_zeros`) and may
    cap C (`cache_limit`)."""

    cache_limit: int | None = None

    def __init__(self, k: Any, v: Any) -> None:
        self.slots = RowSlots()
        self.k: Any = k
        self.v: Any = v

    def _zeros(self, shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def add_row(self) -> int:
        return self.slots.add()

    def remove_row(self, row: int) -> None:
        self.slots.remove(row)

    def _row_length(self, row: int) -> int:
        self.slots.check(row)
        return self.slots.lengths[row]

    def _plan_draft(self, requests: Sequence[DraftRequest]) -> tuple[list[int], list[int], list[int], list[int], int]:
        """Check one batched drafter call (live rows, each once, >= 1 new feature row, blocks of >= 2 tokens)
        and make room for it; returns its rows, new-feature counts, block sizes, past lengths and the cache
        length the call uses (max(past) + max(counts))."""
        rows = [q.row for q in requests]
        for r in rows:
            self.slots.check(r)
        if len(set(rows)) != len(rows):
            raise ValueError("a row appears twice in one draft call")
        counts = [int(q.new_features.shape[0]) for q in requests]
        blocks = [q.block_size for q in requests]
        if min(counts) < 1 or min(blocks) < 2:
            raise ValueError("each draft request needs >= 1 new feature row and a block of >= 2 tokens")
        past = [self.slots.lengths[r] for r in rows]
        cap = max(past) + max(counts)
        self._reserve(self.slots.capacity, cap)
        return rows, counts, blocks, past, cap

    def _advance(self, rows: Sequence[int], past: Sequence[int], counts: Sequence[int]) -> None:
        """Each row's length after a call wrote `counts` new positions after `past`."""
        for r, p, c in zip(rows, past, counts):
            self.slots.lengths[r] = p + c

    def _reserve(self, slots: int, length: int) -> None:
        _, s, _, c, _ = self.k.shape
        if slots <= s and length <= c:
            return
        new_s = s if slots <= s else max(slots, 2 * s, 4)
        new_c = c if length <= c else grown(c, length, self.cache_limit)
        shape = (self.k.shape[0], new_s, self.k.shape[2], new_c, self.k.shape[4])
        k, v = self._zeros(shape), self._zeros(shape)
        k[:, :s, :, :c], v[:, :s, :, :c] = self.k, self.v
        self.k, self.v = k, v


class LoopedDrafterEngine:
    """A single-sequence DrafterEngine behind the batched protocol: one session per row, called in turn.

    For backends without a batched graph yet (the TensorRT plan's runtime, a Triton model call) and for
    test doubles: the loop runs unchanged, but the drafter costs one call per drafting row, not one pass."""

    def __init__(self, engine: DrafterEngine):
        self.engine = engine
        self.name = f"looped-{engine.name}"
        self.block_size = engine.block_size
        self.feature_layer_ids = tuple(getattr(engine, "feature_layer_ids", ()))
        self.max_context = getattr(engine, "max_context", None)

    def new_batch(self) -> LoopedDrafterSession:
        return LoopedDrafterSession(self.engine)


class PerRowSessions(Generic[S]):
    """Row bookkeeping of the looped adapters: one single-sequence session per row, made by the engine."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.sessions: dict[int, S] = {}
        self._next = 0

    def add_row(self) -> int:
        row, self._next = self._next, self._next + 1
        self.sessions[row] = self.engine.new_session()
        return row

    def remove_row(self, row: int) -> None:
        session = self.sessions.pop(row, None)
        if session is None:
            raise KeyError(f"no live row {row}")
        close = getattr(session, "close", None)  # target sessions hold runtime resources (TargetSession.close)
        if close is not None:
            close()


class LoopedDrafterSession(PerRowSessions[DrafterSession]):
    def context_length(self, row: int) -> int:
        return self.sessions[row].context_length

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self.sessions[q.row].draft(q.new_features, q.last_token, q.block_size) for q in requests]


class LoopedTargetEngine:
    """A single-sequence TargetEngine behind the batched protocol: one session per row, run in turn (correct,
    not faster: for a Triton target model whose engine has no batched session)."""

    def __init__(self, engine: TargetEngine):
        self.engine = engine
        self.name = f"looped-{engine.name}"
        self.vocab_size, self.max_context = engine.vocab_size, engine.max_context
        self.feature_layer_ids = tuple(getattr(engine, "feature_layer_ids", ()))

    def new_batch(self) -> LoopedTargetSession:
        return LoopedTargetSession(self.engine)


class LoopedTargetSession(PerRowSessions[TargetSession]):
    def length(self, row: int) -> int:
        return self.sessions[row].length

    def rollback(self, row: int, length: int) -> None:
        self.sessions[row].rollback(length)

    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        return [
            self.sessions[r].forward(t, last_logits_only=last_logits_only, features=features)
            for r, t in zip(rows, tokens)
        ]


def batch_engines(
    target: Any, drafter: DrafterEngine | None = None
) -> tuple[BatchTargetEngine, BatchDrafterEngine | None]:
    """The batched engines for loaded single-sequence ones: each engine's own `batched()`; a drafter
    without one runs looped (one call per row), a target without one cannot be batched."""
    make_target = getattr(target, "batched", None)
    if make_target is None:
        raise ValueError(
            f"the {getattr(target, 'name', type(target).__name__)} target has no batched session "
            "(no `batched()`), so it cannot run the batched loop"
        )
    batch_target = make_target()
    if drafter is None:
        return batch_target, None
    make_drafter = getattr(drafter, "batched", None)
    return batch_target, (make_drafter() if make_drafter is not None else LoopedDrafterEngine(drafter))
