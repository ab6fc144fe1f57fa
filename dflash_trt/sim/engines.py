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

import torch

from ..runtime.base import Draft, DraftRequest, PassArgmax, TargetOutput
from ..runtime.rows import RowSlots
from .acceptance import AcceptanceProfile
from .cost import PassCost

MASK64 = (1 << 64) - 1
# A sequence's identity is its prompt's first tokens: a chunked prefill's first chunk holds them (the loop gives a
# chunk at least a quarter of its budget), so the sequence is the same however its prompt is cut.
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


def prompt_seed(prompt: Sequence[int]) -> int:
    """A sequence's seed from its prompt (< 2^24, exact in the float features)."""
    h = 0
    for t in prompt:
        h = (h * 1000003 + int(t) + 1) & 0xFFFFFF
    return h


def one_hot(ids: Sequence[int], vocab: int) -> torch.Tensor:
    out = torch.zeros(len(ids), vocab)
    out[torch.arange(len(ids)), torch.tensor(list(ids), dtype=torch.long)] = 1.0
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
        top: list[int] = []  # the target's token after each scored position, every row's in turn
        scored_per_row, feats = [], []
        for row, toks in zip(rows, tokens):
            self.slots.check(row)
            r = self.rows[row]
            ids = [int(t) for t in toks.tolist()]
            if not ids:
                raise ValueError("forward needs >= 1 token per row")
            if r.length + len(ids) > e.max_context:
                raise ValueError(f"row {row}: {r.length + len(ids)} tokens exceed max_context {e.max_context}")
            if r.length == 0:  # the prompt's first tokens: the sequence's identity, whatever the chunking
                r.seed, r.klass = prompt_seed(ids[:SEED_TOKENS]), ids[0] % max(1, e.classes)
            positions = range(r.length, r.length + len(ids))
            scored = positions[-1:] if last_logits_only else positions
            top += [truth(r.seed, q + 1, e.vocab_size) for q in scored]
            scored_per_row.append(len(scored))
            if features:
                feats += [(r.klass, r.seed, q) for q in positions]
            new.append(len(ids))
            past.append(r.length)
            # a prompt chunk (longer than any verify block) needs only its last token's logits on a GPU server
            logits += len(scored) if len(ids) <= e.verify_max else 1
            r.length += len(ids)
        # one tensor each for the pass, viewed per row (as a real engine's packed pass)
        per_row = torch.split(one_hot(top, e.vocab_size), scored_per_row)
        per_feats = torch.split(torch.tensor(feats, dtype=torch.float64), new) if features else [None] * len(rows)
        shared = PassArgmax(None, top)
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
        drafts, blocks, new, past = [], [], [], []
        for q in requests:
            self.slots.check(q.row)
            r = self.rows[q.row]
            f = q.new_features
            if f.shape[0] < 1 or q.block_size < 2 or q.block_size > e.block_size:
                raise ValueError(f"draft needs >= 1 feature row and a block of 2..{e.block_size}")
            if r.context == 0:
                r.klass, r.seed = int(f[0, 0]), int(f[0, 1])
            start = int(f[-1, 2]) + 1  # position of the block's first token (the last committed one)
            profile = e.profiles[r.klass]
            rng = random.Random(r.seed * 1_000_003 + start)
            draws = [rng.random() for _ in range(e.block_size - 1)]
            k = profile.accepted(draws[: q.block_size - 1])
            ids = [truth(r.seed, start + i, e.vocab_size) for i in range(1, q.block_size)]
            if k < len(ids):
                ids[k] = (ids[k] + 1) % e.vocab_size  # the first rejected position: any other token
            drafts.append(Draft(one_hot(ids, e.vocab_size), torch.tensor(ids, dtype=torch.long)))
            blocks.append(q.block_size)
            new.append(int(f.shape[0]))
            past.append(r.context)
            r.context += int(f.shape[0])
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
        self.max_context = None
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
