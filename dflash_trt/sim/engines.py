"""Simulated target and drafter behind the batched engine protocols (runtime/base.py), on a virtual clock.

A FAKE for hardware this machine lacks (a GPU serving node): no model runs. What is modelled is what the
decoding loop and its policy can observe: the tokens, the acceptance of drafts, the features' shapes, the
KV-cache lengths and rollbacks, and the time every pass takes (`cost.PassCost`, added to the clock).

- Each sequence has a ground truth: the target's argmax at absolute position q is `truth(seed, q + 1)`,
  whatever the tokens (a deterministic hash of the sequence's seed and the position). The seed and the
  acceptance class come from the prompt: its first token is the class (an index into the drafter's
  profiles), the seed is a hash of its first `SEED_TOKENS` tokens (the same whether the prompt enters whole
  or in chunks). So greedy decoding of the target alone yields the
  truth, and so must any lossless draft-and-verify loop on these engines.
- Features are [n, 3] rows (class, seed, position): the drafter learns its row's sequence and where the
  block starts from them, as a real drafter learns its context from the target's hidden states.
- The drafter proposes the truth for the first k positions of its block and a wrong token at position
  k + 1, k drawn from the class's per-position acceptance rates (`acceptance.AcceptanceProfile`) with a
  generator seeded by (seed, block start): a block of any size at the same place draws the same numbers, so
  a shorter block accepts min(k, B - 1), as a drafter whose per-position quality does not depend on the
  block length would.
- Logits are one-hot over a small vocabulary (a few hundred ids), enough for argmax and acceptance.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from ..runtime.base import Draft, DraftRequest, PassArgmax, TargetOutput
from ..runtime.rows import RowSlots
from .acceptance import AcceptanceProfile
from .cost import PassCost

MASK64 = (1 << 64) - 1
# A sequence's identity is its prompt's first tokens: a chunked prefill's first chunk holds them (the loop cuts no
# prompt to a piece under chunking.MIN_CHUNK >= SEED_TOKENS tokens unless its budget is smaller), so the sequence
# is the same however its prompt is cut.
SEED_TOKENS = 8


class VirtualClock:
    """Seconds of simulated time; engines advance it, the decoder reads it (its `clock` argument)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not run backwards")
        self.now += seconds


def truth(seed: int, position: int, vocab: int) -> int:
    """The target's token at `position` of the sequence `seed` (splitmix64 of both, mod vocab)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) % vocab


def truth_many(seed: Sequence[int] | np.ndarray, position: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray:
    """`truth` of many (seed, position) pairs at once (uint64 arithmetic wraps mod 2^64: the same ids)."""
    s, p = np.asarray(seed).astype(np.uint64), np.asarray(position).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = s * np.uint64(0x9E3779B97F4A7C15) + p * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return cast(np.ndarray, ((z ^ (z >> np.uint64(31))) % np.uint64(vocab)).astype(np.int64))


def _runs(first: Sequence[int], lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """The integer runs first[i], first[i] + 1, ... of lengths[i], concatenated."""
    n = np.asarray(lengths, np.int64)
    offsets = np.repeat(np.cumsum(n) - n, n)
    return cast(np.ndarray, np.repeat(np.asarray(first, np.int64), n) + np.arange(int(n.sum())) - offsets)


def prompt_seed(prompt: Sequence[int]) -> int:
    """A sequence's seed from its prompt (< 2^24, exact in the float features)."""
    h = 0
    for t in prompt:
        h = (h * 1000003 + int(t) + 1) & 0xFFFFFF
    return h


def one_hot(ids: Sequence[int] | np.ndarray | torch.Tensor, vocab: int) -> torch.Tensor:
    index = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids, np.int64))
    out = torch.zeros(len(index), vocab)
    out[torch.arange(len(index)), index] = 1.0
    return out


@dataclass
class _TargetRow:
    length: int = 0
    seed: int = -1
    klass: int = 0


class SimTargetSession:
    def __init__(self, engine: SimTargetEngine):
        self.engine = engine
        self.slots = RowSlots()
        self.rows: dict[int, _TargetRow] = {}

    def add_row(self) -> int:
        row = self.slots.add()
        self.rows[row] = _TargetRow()
        return row

    def remove_row(self, row: int) -> None:
        self.slots.remove(row)
        del self.rows[row]

    def length(self, row: int) -> int:
        self.slots.check(row)
        return self.rows[row].length

    def rollback(self, row: int, length: int) -> None:
        r = self.rows[row]
        if not 0 <= length <= r.length:
            raise ValueError(f"rollback of row {row} to {length}: it holds {r.length}")
        r.length = length

    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        e = self.engine
        if len(rows) != len(tokens) or len(set(rows)) != len(rows):
            raise ValueError("one token tensor per row, each row once")
        new, past, logits = [], [], 0
        seeds, klasses, first_scored, scored_per_row = [], [], [], []
        for row, toks in zip(rows, tokens):
            self.slots.check(row)
            r = self.rows[row]
            n = len(toks)
            if not n:
                raise ValueError("forward needs >= 1 token per row")
            if r.length + n > e.max_context:
                raise ValueError(f"row {row}: {r.length + n} tokens exceed max_context {e.max_context}")
            if r.length == 0:  # the prompt's first tokens: the sequence's identity, whatever the chunking
                head = toks[:SEED_TOKENS].tolist()
                r.seed, r.klass = prompt_seed(head), head[0] % max(1, e.classes)
            scored = 1 if last_logits_only else n
            seeds.append(r.seed)
            klasses.append(r.klass)
            first_scored.append(r.length + n - scored)
            scored_per_row.append(scored)
            new.append(n)
            past.append(r.length)
            # a prompt chunk (longer than any verify block) needs only its last token's logits on a GPU server
            logits += scored if n <= e.verify_max else 1
            r.length += n
        # one tensor each for the pass, viewed per row (as a real engine's packed pass): the target's token after
        # each scored position q is the truth at q + 1, every row's in turn
        top = truth_many(np.repeat(seeds, scored_per_row), _runs(first_scored, scored_per_row) + 1, e.vocab_size)
        per_row = torch.split(one_hot(torch.from_numpy(top), e.vocab_size), scored_per_row)
        if features:  # rows (class, seed, position) of every new position
            feats = np.empty((sum(new), 3), np.float64)
            feats[:, 0], feats[:, 1], feats[:, 2] = np.repeat(klasses, new), np.repeat(seeds, new), _runs(past, new)
            per_feats: Sequence[torch.Tensor | None] = torch.split(torch.from_numpy(feats), new)
        else:
            per_feats = [None] * len(rows)
        shared = PassArgmax(None, top.tolist())
        starts = itertools.accumulate(scored_per_row, initial=0)
        outs = [TargetOutput(lg, f, shared, s) for lg, f, s in zip(per_row, per_feats, starts)]
        e.passes += 1
        e.clock.advance(e.cost.target(new, past, logits))
        return outs


class SimTargetEngine:
    """A simulated TargetEngine: `classes` acceptance classes (prompt's first token mod classes)."""

    def __init__(
        self,
        cost: PassCost,
        clock: VirtualClock,
        vocab_size: int = 256,
        max_context: int = 1 << 20,
        feature_layer_ids: tuple[int, ...] = (0,),
        classes: int = 1,
    ):
        self.name = "sim-target"
        self.cost, self.clock = cost, clock
        self.vocab_size, self.max_context = vocab_size, max_context
        self.feature_layer_ids = tuple(feature_layer_ids)
        self.classes = classes
        self.verify_max = 16  # the longest verify block: a row's call of more tokens is a prompt chunk
        self.passes = 0

    def new_session(self) -> SimTargetSession:
        return SimTargetSession(self)


@dataclass
class _DrafterRow:
    context: int = 0
    seed: int = -1
    klass: int = 0


class SimDrafterSession:
    def __init__(self, engine: SimDrafterEngine):
        self.engine = engine
        self.slots = RowSlots()
        self.rows: dict[int, _DrafterRow] = {}
        self.rng = random.Random()  # reseeded per row and block (draft)

    def add_row(self) -> int:
        row = self.slots.add()
        self.rows[row] = _DrafterRow()
        return row

    def remove_row(self, row: int) -> None:
        self.slots.remove(row)
        del self.rows[row]

    def context_length(self, row: int) -> int:
        self.slots.check(row)
        return self.rows[row].context

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        e = self.engine
        if len({q.row for q in requests}) != len(requests):
            raise ValueError("a row appears twice in one draft call")
        blocks, new, past, seeds, starts, accepted = [], [], [], [], [], []
        rng = self.rng
        for q in requests:
            self.slots.check(q.row)
            r = self.rows[q.row]
            f = q.new_features
            if f.shape[0] < 1 or q.block_size < 2 or q.block_size > e.block_size:
                raise ValueError(f"draft needs >= 1 feature row and a block of 2..{e.block_size}")
            if r.context == 0:
                r.klass, r.seed = int(f[0, 0]), int(f[0, 1])
            start = int(f[-1, 2]) + 1  # position of the block's first token (the last committed one)
            rng.seed(r.seed * 1_000_003 + start)  # as a fresh random.Random of that seed
            # drawn lazily: a draw per position up to the first rejection (the ones after it decide nothing)
            accepted.append(e.profiles[r.klass].accepted(rng.random() for _ in range(q.block_size - 1)))
            seeds.append(r.seed)
            starts.append(start + 1)
            blocks.append(q.block_size)
            new.append(int(f.shape[0]))
            past.append(r.context)
            r.context += int(f.shape[0])
        # one tensor each for the call, viewed per row: the truth at the block's positions 1..B-1, the first
        # rejected one (if any) replaced by another token
        sizes, acc = np.asarray(blocks, np.int64) - 1, np.asarray(accepted, np.int64)
        ids = truth_many(np.repeat(seeds, sizes), _runs(starts, sizes), e.vocab_size)
        wrong = (np.cumsum(sizes) - sizes + acc)[acc < sizes]
        ids[wrong] = (ids[wrong] + 1) % e.vocab_size
        tokens, split = torch.from_numpy(ids), sizes.tolist()
        drafts = [
            Draft(lg, t) for lg, t in zip(torch.split(one_hot(tokens, e.vocab_size), split), torch.split(tokens, split))
        ]
        e.passes += 1
        e.clock.advance(e.cost.drafter(blocks, new, past))
        return drafts


class SimDrafterEngine:
    """A simulated DrafterEngine: `profiles[c]` is acceptance class c's profile."""

    def __init__(
        self,
        cost: PassCost,
        clock: VirtualClock,
        profiles: Sequence[AcceptanceProfile],
        vocab_size: int = 256,
        block_size: int = 16,
        feature_layer_ids: tuple[int, ...] = (0,),
    ):
        if any(len(p.rates) < block_size - 1 for p in profiles):
            raise ValueError(f"every acceptance profile needs rates for {block_size - 1} positions")
        self.name = "sim-drafter"
        self.cost, self.clock = cost, clock
        self.profiles = list(profiles)
        self.vocab_size, self.block_size = vocab_size, block_size
        self.feature_layer_ids = tuple(feature_layer_ids)
        self.max_context: int | None = None  # the drafter has no context bound of its own (the protocol allows None)
        self.dtype = "float32"  # nothing is computed: its drafts come from the acceptance profiles
        self.passes = 0

    def new_session(self) -> SimDrafterSession:
        return SimDrafterSession(self)


def sim_engines(
    cost: PassCost,
    profiles: Sequence[AcceptanceProfile],
    clock: VirtualClock | None = None,
    vocab_size: int = 256,
    block_size: int = 16,
) -> tuple[SimTargetEngine, SimDrafterEngine, VirtualClock]:
    """A target and drafter pair sharing one clock; prompts whose first token is c use profiles[c]."""
    clock = clock or VirtualClock()
    target = SimTargetEngine(cost, clock, vocab_size, classes=len(profiles))
    drafter = SimDrafterEngine(cost, clock, profiles, vocab_size, block_size)
    return target, drafter, clock
