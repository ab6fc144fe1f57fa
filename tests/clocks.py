"""Clocks for tests whose decoder prices or times its choices, so that no test's outcome depends on the machine's load.

The decoding loop reads one clock (`BatchDecoder(clock=)`) for every timing it takes; the chunk pacer's time
bound (decoding/chunking.py), the proposers' prices (`BatchDecoder._prices`), the adaptive policy's cost
corrections and its start-up grid (`AdaptiveBlocks.measured`, `measure_costs`) all read those timings. On the
wall clock they follow whatever else the machine runs, so a test of any of them either passes the decoder a
clock of its own or does not depend on them:

- `StoppedClock`: time stands still. The pacer then has no seconds to bound a step by (its token budget alone
  cuts prompts), the proposers are unpriced, and the adaptive policy's cost model takes no correction: the
  choices a test of the budget or of a fixed cost model reasons about, whatever the machine.
- `priced_engines`: the real engines, each pass advancing a virtual clock by what a simulated CPU charges
  for it (the simulator's `VirtualClock` and `LinearPassCost`, sim/): timings with the shape of real ones
  (a pass costs its rows and tokens) that no other process can stretch.
- `TickingClock`: each read a fixed step later: a deadline passes after a known number of reads (the server's
  request timeout, `running_server(clock=)`), not after however long the machine takes.
- `AdversarialClock`: seconds that pass at a seeded random rate, changing every few reads, over six orders of
  magnitude.
  tests/conftest.py makes it the default clock of every decoder and cost grid a test builds without one
  (`DFLASH_TEST_CLOCK`), so that a test which silently depends on timings fails on every machine, loaded or
  not, instead of on a busy one only.
"""

from __future__ import annotations

import random
import threading
import zlib
from collections.abc import Sequence
from typing import Any

from dflash_trt.runtime.base import Draft, DraftRequest, TargetOutput
from dflash_trt.sim.cost import LinearPassCost
from dflash_trt.sim.engines import VirtualClock

# A pass on a simulated CPU costs what its rows and tokens cost (the demo pair's shape, rounded: the same figures
# as tests/decoding/test_chunk_pacing.py's CPU): target 5 ms + 0.2 ms a row + 0.25 ms a token, drafter 3 ms +
# 0.1 ms a row + 0.1 ms a token.
CPU_PASSES = LinearPassCost(5e-3, 2e-4, 2.5e-4, 3e-3, 1e-4, 1e-4)

# The adversarial clock: time runs at a rate drawn log-uniform over RATES (six orders of magnitude) that holds for
# about 1 / SWITCH reads (about a step's) before another is drawn, each read's advance jittered over JITTER x. A busy
# machine stretches whole stretches of work, not single reads: so does this clock, so that a prefill may look a
# thousand times slower per token than the steps after it, or a step a thousand times faster than the one before.
RATES = 1e6
SWITCH = 0.1
JITTER = 10.0


class StoppedClock:
    """A clock at which no time passes: every timing is 0 s."""

    def __call__(self) -> float:
        return 0.0


class TickingClock:
    """A clock that advances `tick` seconds at every read, whoever reads it: a deadline of `n` ticks passes after
    `n` reads, however fast or slow the machine runs the work between them."""

    def __init__(self, tick: float):
        self.tick, self.now, self._lock = tick, 0.0, threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += self.tick
            return self.now


class AdversarialClock:
    """Monotonic seconds whose rate changes at random (`RATES`, `SWITCH`, `JITTER`): every timing the decoder
    takes (a pass, a step, a prefill) is noise over several orders of magnitude, and so is every ratio of two
    timings that a choice is made from. `seed` fixes the sequence: a test under it is reproducible."""

    def __init__(self, seed: int = 0, smallest: float = 1e-9):
        self.seed, self.smallest = seed, smallest
        self._rng = random.Random(seed)
        self._rate = RATES ** self._rng.random()
        self.now = 0.0

    @classmethod
    def for_test(cls, nodeid: str, base_seed: int = 0) -> AdversarialClock:
        """One test's clock: seeded by its id (and `base_seed`), so each test draws its own sequence, the same
        on every run."""
        return cls(zlib.crc32(nodeid.encode()) ^ base_seed)

    def __call__(self) -> float:
        rng = self._rng
        if rng.random() < SWITCH:
            self._rate = RATES ** rng.random()
        self.now += self.smallest * self._rate * JITTER ** rng.random()
        return self.now

    def __repr__(self) -> str:
        return f"AdversarialClock(seed={self.seed})"


class _Priced:
    """Shared by the wrappers: the engine or session wrapped, the clock, the cost. Whatever the wrapper does not
    define is the wrapped object's (slots, reserve, position_bytes, ...)."""

    def __init__(self, inner: Any, clock: VirtualClock, cost: LinearPassCost):
        self.inner, self.clock, self.cost = inner, clock, cost

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class PricedTargetSession(_Priced):
    def forward(self, rows: Sequence[int], tokens: Sequence[Any], **kw: Any) -> list[TargetOutput]:
        past = [self.inner.length(r) for r in rows]
        out = self.inner.forward(rows, tokens, **kw)
        new = [len(t) for t in tokens]
        self.clock.advance(self.cost.target(new, past, len(rows) if kw.get("last_logits_only") else sum(new)))
        return out


class PricedDrafterSession(_Priced):
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        past = [self.inner.context_length(q.row) for q in requests]
        out = self.inner.draft(requests)
        new = [int(q.new_features.shape[0]) for q in requests]
        self.clock.advance(self.cost.drafter([q.block_size for q in requests], new, past))
        return out


class PricedTarget(_Priced):
    def new_session(self) -> PricedTargetSession:
        return PricedTargetSession(self.inner.new_session(), self.clock, self.cost)


class PricedDrafter(_Priced):
    def new_session(self) -> PricedDrafterSession:
        return PricedDrafterSession(self.inner.new_session(), self.clock, self.cost)


def priced_engines(
    target: Any, drafter: Any = None, cost: LinearPassCost = CPU_PASSES, clock: VirtualClock | None = None
) -> tuple[PricedTarget, PricedDrafter | None, VirtualClock]:
    """`target` and `drafter` (None: none) as they are, but every pass of their sessions advances `clock` (a new
    `VirtualClock` when None) by what `cost` charges for it; pass the clock to the decoder (`clock=`)."""
    clock = clock or VirtualClock()
    return (
        PricedTarget(target, clock, cost),
        None if drafter is None else PricedDrafter(drafter, clock, cost),
        clock,
    )


def priced_decoder(loaded: Any, cost: LinearPassCost = CPU_PASSES) -> Any:
    """A decoder on `loaded`'s engines priced on a virtual clock (`priced_engines`), reading it, with `loaded`'s
    tokenizer. A server built on it (`server.context.batch_decoder` takes the loaded decoder's engines, tokenizer
    and clock) measures its start-up cost grid and times its steps on that clock: its policy's and proposers'
    prices are what `cost` charges, on any machine."""
    from dflash_trt.decoding import BatchDecoder

    target, drafter, clock = priced_engines(loaded.target, loaded.drafter, cost)
    return BatchDecoder(target, drafter, loaded.tokenizer, clock=clock)
