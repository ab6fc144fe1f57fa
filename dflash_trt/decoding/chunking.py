"""How much of the waiting prompts one step takes (chunked prefill): a token budget, a time bound and a floor for a
queue.

A joining row's prompt enters in chunks inside the running rows' verify pass (loop.py). A step's chunks hold:

- at most what the token budget `step_tokens` leaves after the running rows' verify blocks, but at least a
  quarter of it (before the time bound below), so a batch of long blocks never starves a prompt; the pass then
  holds the rows' blocks and the chunks, which may together exceed the budget. The rows come first, as vLLM's and
  TensorRT-LLM's schedulers put decode tokens (drafts included) before prefill chunks;
- at most what keeps the step within `stall` times the rows' own step: a token budget bounds a chunk's tokens,
  not the seconds it adds, and where the rows' steps are short (little drafted, a small batch, a CPU whose pass
  costs what its tokens cost) a chunk of the budget is many of their steps. The seconds come from the steps this
  decoder ran (`ChunkPacer.line`), so the bound needs no model of the engine;
- at least the prompt tokens queued behind the one entering, over `backlog_steps` (default `BACKLOG_STEPS`;
  within the budget's room, above), whatever the time bound. The bound is for one prompt entering among
  streaming rows; where prompts arrive faster than it lets them in, the queue behind grows without end and every
  prompt waits many steps to spare each row part of one. With the floor a steady stream of prompts keeps about
  `backlog_steps` steps' worth of arrivals queued, and a prompt waits about that many steps to enter. 0 turns the floor off: the bound then holds
  under any load, and an operator who would rather have prompts wait than the streams slow chooses it;
- at least `MIN_CHUNK` tokens (or the budget, if smaller), so a prompt always progresses.

Where prompts queue and the chunks fill what the budget leaves, a step's drafts would take their tokens from
the queue's (`verify_room`): a block policy may keep its drafts within it (the adaptive policy's rule 8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from .step import StepProfile, StepRows

if TYPE_CHECKING:
    from .row import BatchRow

# The default token budget of one step's target pass on the CPU server: a small one keeps a short prompt from
# making one long step before any time is measured; the time bound does the rest.
STEP_TOKENS = 128
# A step with prompt chunks takes at most about this many times the rows' own step: a streaming row's longest
# wait while a long prompt enters, in units of its usual one. Below the 3x a streaming client should tolerate,
# with room for the machine's own step-to-step noise.
STALL = 2.0
MIN_CHUNK = 8
# prompts queued behind the one entering get at least 1 / BACKLOG_STEPS of their tokens into each step
BACKLOG_STEPS = 16
# the step seconds' line follows about the last 1 / WEIGHT steps
WEIGHT = 0.1


class Chunk(NamedTuple):
    """A joining row's piece of its prompt in this step's target pass: prompt_ids[start:start + size]."""

    row: BatchRow
    start: int
    size: int


def cut(chunks: list[Chunk], room: int) -> list[Chunk]:
    """The chunks, in order, cut to `room` tokens in all. A piece shorter than `MIN_CHUNK` (or than the whole
    room, if smaller) that does not end its prompt waits a step: a pass of a few prompt tokens costs a row's
    slot for nearly nothing, and a prompt's first chunk then always holds its first MIN_CHUNK tokens."""
    kept, least = [], min(MIN_CHUNK, room)
    for c in chunks:
        size = min(c.size, room)
        if size <= 0 or (size < c.size and size < least):
            break
        kept.append(c._replace(size=size))
        room -= size
    return kept


def rest_of_prompts(joining: Sequence[BatchRow]) -> list[Chunk]:
    """Every joining row's prompt from where its prefill stands to its end, in order of arrival."""
    return [Chunk(r, r.prefilled, len(r.prompt_ids) - r.prefilled) for r in joining]


def queued_tokens(joining: Sequence[BatchRow]) -> int:
    """The prompt tokens queued behind the prompt entering (the backlog floor's `waiting`)."""
    return sum(len(r.prompt_ids) - r.prefilled for r in joining[1:])


def plan_chunks(
    pacer: ChunkPacer,
    joining: Sequence[BatchRow],
    reserved: int,
    step: StepRows,
    choose: Callable[[StepRows], int],
) -> list[Chunk]:
    """A step's prompt chunks around its block policy (`choose`: it sets the rows' blocks and returns their
    verify tokens). The chunks are planned first, from what the budget leaves after `reserved` verify tokens
    (the rows' blocks of the step before: a request's own size, 1 for a row that has not verified), so that the
    policy prices the pass they share (`step` gets them, and the verify room a queue leaves); then they are cut
    to what the chosen blocks leave. Reserving every row's largest block instead would starve the prompts
    whenever the policy drafts little (at a large batch, where it matters most); reserving nothing would have
    the policy price chunks the pass cannot hold. `joining`: the rows whose prompts enter in chunks (none with
    separate prefill)."""
    waiting = queued_tokens(joining)
    chunks = cut(rest_of_prompts(joining), pacer.room(reserved, waiting))
    if chunks:
        size = sum(c.size for c in chunks)
        step = replace(step, chunk_rows=len(chunks), chunk_tokens=size, verify_room=pacer.verify_room(size, waiting))
    verify_tokens = choose(step)
    return cut(chunks, pacer.room(verify_tokens, waiting)) if chunks else chunks


class ChunkPacer:
    """The prompt tokens a step takes (`room`), from the budget and the seconds of the steps it observed.

    The seconds: a line, step seconds = `gap` + `per_token` x prompt tokens in the step, fitted by least squares
    over the steps of running rows, each weighted by its age (about the last 1 / WEIGHT count), so it follows the
    batch as rows come and go; at a large batch nearly every step carries a chunk, and the line still separates
    the two from chunks of different sizes. Until the steps span two sizes, a pass of prompts alone gives
    `per_token` (its seconds per token) and the steps' mean less that gives `gap`.

    Once the pacer has seen steps of the running rows alone, `gap` is the mean of the last few of them (about
    1 / WEIGHT, however many chunk steps came between) and `per_token` the slope through it. Left to the line, a
    long prompt entering in chunks of about one size (every step carrying one, so that the steps stop spanning
    sizes) whose cost grows with the context it has entered (attention over it; on the CPU engine the verify
    rows' queries padded to a chunk of SHORT_QUERIES or fewer tokens) would read as a growing `gap`, and the
    bound would stay where it was while the steps it should cut grow to several times the rows' own. A stale `gap` (the batch grew while every step carried chunks) errs low:
    smaller chunks, the streams kept safe, the backlog floor still moving a queue.

    Where the cost bends (a GPU's: flat while a pass is bound by reading the weights, steep beyond) the line
    through small and large chunks is shallow at the large ones, and a chunk step runs somewhat over `stall`; an
    average over the chunk steps alone would follow the bend but is noisy where the cost is a line (a CPU's): it
    stalls the rows more and lets prompts in slower."""

    def __init__(self, step_tokens: int = STEP_TOKENS, stall: float = STALL, backlog_steps: int = BACKLOG_STEPS):
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        if stall <= 1.0:
            raise ValueError(f"stall must be > 1 (a chunk step takes longer than a plain one), got {stall}")
        if backlog_steps < 0:
            raise ValueError(f"backlog_steps must be >= 0 (0: no floor for a queue), got {backlog_steps}")
        self.step_tokens, self.stall, self.backlog_steps = step_tokens, stall, backlog_steps
        self.seed: float | None = None  # seconds per token of the first pass of prompts alone
        self._sums = [0.0] * 5  # aged sums of 1, x, y, x*x, x*y; x: a step's prompt tokens, y: its seconds
        self._plain = [0.0, 0.0]  # aged sums of 1 and y over the steps without chunks (aged among themselves)

    def room(self, reserved: int, waiting: int = 0) -> int:
        """Prompt tokens for the next step beside `reserved` tokens of running rows' verify blocks, with
        `waiting` prompt tokens queued behind the prompt entering."""
        budget = max(self.step_tokens - reserved, self.step_tokens // 4)
        tokens, line = budget, self.line()
        if reserved and line is not None and line[1] > 0:
            bound = int((self.stall - 1.0) * line[0] / line[1])
            floor = -(-waiting // self.backlog_steps) if self.backlog_steps else 0
            tokens = min(budget, max(bound, floor))
        return max(tokens, min(MIN_CHUNK, self.step_tokens))

    def verify_room(self, chunk_tokens: int, waiting: int) -> int:
        """The verify tokens a step may hold beside `chunk_tokens` of prompt chunks before the budget cuts them
        (`room`), where that cut delays a queue: prompts `waiting` behind the one entering and chunks above the
        quarter of the budget that no verify blocks take. 0 where no bound applies; at least 1 where one does
        (a bound under the rows' count lets no row draft)."""
        if not waiting or chunk_tokens <= self.step_tokens // 4:
            return 0
        return max(1, self.step_tokens - chunk_tokens)

    def line(self) -> tuple[float, float] | None:
        """(gap, per_token): the seconds of a step of the running rows alone, and what a prompt token adds."""
        n, sx, sy, sxx, sxy = self._sums
        if n == 0.0:
            return None
        plain_n, plain_y = self._plain
        if plain_n > 0.0:  # the rows' own step has been seen: the line goes through it
            gap = plain_y / plain_n
            if sxx > 0.0:
                return gap, max(0.0, (sxy - gap * sx) / sxx)
            return (gap, self.seed) if self.seed is not None else None
        spread = n * sxx - sx * sx
        if spread > 1e-9 * max(1.0, n * sxx):
            slope = max(0.0, (n * sxy - sx * sy) / spread)
        elif self.seed is not None:
            slope = self.seed
        else:
            return None
        return max(0.0, (sy - slope * sx) / n), slope

    def observe(self, prof: StepProfile) -> None:
        """Learn from a step the loop ran (a pass of prompts alone seeds `per_token`; a step that separate
        prefill stalled is neither kind and is left out)."""
        if not prof.verify_rows:
            if prof.prefill_tokens and self.seed is None:
                self.seed = prof.prefill_s / prof.prefill_tokens
            return
        if prof.prefill_tokens:
            return
        x, y = float(prof.chunk_tokens), prof.total_s
        self._sums = [(1.0 - WEIGHT) * s + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y))]
        if x == 0.0:
            self._plain = [(1.0 - WEIGHT) * self._plain[0] + 1.0, (1.0 - WEIGHT) * self._plain[1] + y]
