"""Row bookkeeping shared by the backends, and the one adapter for engines that run one sequence per call.

- `RowSlots` / `SlotCacheRows`: row handles -> slots of a preallocated cache `[layers, slots, kv_heads,
  C, head_dim]` (numpy or torch), grown by doubling; what the PyTorch and ONNX Runtime sessions share.
- `PerRowTarget` / `PerRowDrafter`: a `SequenceTarget` / `SequenceDrafter` (one sequence per object:
  a TensorRT plan's execution context, a TensorRT-LLM request, a Triton model call) behind the batched
  protocols of `base.py`, one sequence object per row, called in turn. Correct, not faster: the pass
  costs one call per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from .base import Draft, DraftRequest, TargetOutput


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

    def reserve(self, rows: int, positions: int) -> None:
        """Size the cache now for `rows` rows of `positions` positions each (C at most `cache_limit`), so that no
        later call within those bounds grows it. A growth is a copy of the whole cache made inside the call that
        needs it: a server's streams wait for it as for a long step (a prompt crossing 512 or 1,024 positions,
        a row's first draft), so a server reserves its bounds at start-up (`server.context.reserve_caches`)."""
        if rows < 1 or positions < 1:
            raise ValueError(f"reserve needs >= 1 row and >= 1 position, got {rows} and {positions}")
        if self.cache_limit is not None:
            positions = min(positions, self.cache_limit)
        self._reserve(rows, positions)

    def position_bytes(self) -> int:
        """Bytes of K and V one row's position takes in this cache (all layers)."""
        layers, _, heads, _, dim = self.k.shape
        return int(2 * layers * heads * dim * self.k.dtype.itemsize)

    def _reserve(self, slots: int, length: int) -> None:
        """Grow the cache to hold `slots` rows of `length` positions (slots and C by doubling), K then V: each old
        buffer is released before the next new one is allocated, so the peak is the new cache and one old half
        (2.5x the old cache when C doubles, not old + new = 3x). A cache on a GPU goes through host memory: its
        old half leaves the device before the new one is allocated, so the device never holds old and new
        together (the peak there is the new cache), at the price of a copy each way, once per doubling."""
        _, s, _, c, _ = self.k.shape
        if slots <= s and length <= c:
            return
        new_s = s if slots <= s else max(slots, 2 * s, 4)
        new_c = c if length <= c else grown(c, length, self.cache_limit)
        shape = (self.k.shape[0], new_s, self.k.shape[2], new_c, self.k.shape[4])
        for name in ("k", "v"):
            old = getattr(self, name)
            # a placeholder keeps the dtype and device _zeros reads (torch), holding no memory
            setattr(self, name, old.new_empty((0,)) if isinstance(old, torch.Tensor) else None)
            device = old.device if isinstance(old, torch.Tensor) and old.device.type != "cpu" else None
            if device is not None:
                old = old.cpu()  # the device buffer's last reference goes with this rebinding
            try:
                new = self._zeros(shape)
            except BaseException:  # out of memory: the cache stays as it was, the session usable
                setattr(self, name, old if device is None else old.to(device))
                raise
            new[:, :s, :, :c] = old
            setattr(self, name, new)
            del old  # released before the next buffer is allocated


class SequenceTarget(Protocol):
    """One sequence's target cache, for a backend that cannot batch rows."""

    @property
    def length(self) -> int: ...

    def forward(
        self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True
    ) -> TargetOutput:
        """Append token_ids [n] at positions length..length+n-1 and score them."""

    def rollback(self, length: int) -> None: ...

    def close(self) -> None:
        """Free the sequence's cache now (its row is removed)."""


class SequenceDrafter(Protocol):
    """One sequence's drafter context cache, for a backend that cannot batch rows."""

    @property
    def context_length(self) -> int: ...

    def draft(self, new_features: torch.Tensor, last_token: int, block_size: int) -> Draft:
        """Add the features [n, F] of tokens committed since the last call, draft block_size-1 tokens after last_token."""


S = TypeVar("S", SequenceTarget, SequenceDrafter)


class _PerRow(Generic[S]):
    """Row handles -> one sequence object each, made by `make()`."""

    def __init__(self, make: Callable[[], S]):
        self.make: Callable[[], S] = make
        self.sequences: dict[int, S] = {}
        self._next = 0

    def add_row(self) -> int:
        row, self._next = self._next, self._next + 1
        self.sequences[row] = self.make()
        return row

    def remove_row(self, row: int) -> None:
        sequence = self.sequences.pop(row, None)
        if sequence is None:
            raise KeyError(f"no live row {row}")
        close = getattr(sequence, "close", None)  # target sequences hold runtime resources
        if close is not None:
            close()


class PerRowTarget(_PerRow[SequenceTarget]):
    """A TargetSession over one SequenceTarget per row."""

    def length(self, row: int) -> int:
        return self.sequences[row].length

    def rollback(self, row: int, length: int) -> None:
        self.sequences[row].rollback(length)

    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        return [
            self.sequences[r].forward(t, last_logits_only=last_logits_only, features=features)
            for r, t in zip(rows, tokens)
        ]


class PerRowDrafter(_PerRow[SequenceDrafter]):
    """A DrafterSession over one SequenceDrafter per row."""

    def context_length(self, row: int) -> int:
        return self.sequences[row].context_length

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self.sequences[q.row].draft(q.new_features, q.last_token, q.block_size) for q in requests]
