"""How much of the waiting prompts one step takes (chunked prefill): a token budget and a time bound.

A joining row's prompt enters in chunks inside the running rows' verify pass (loop.py). A step's chunks hold:

- at most what the token budget `step_tokens` leaves after the running rows' verify blocks, but at least a
  quarter of it, so a batch of long blocks never starves a prompt. The rows come first, as vLLM's and
  TensorRT-LLM's schedulers put decode tokens (drafts included) before prefill chunks;
- at most what keeps the step within `stall` times the rows' own step: a token budget bounds a chunk's tokens,
  not the seconds it adds, and where the rows' steps are short (little drafted, a small batch, a CPU whose pass
  costs what its tokens cost) a chunk of the budget is many of their steps: rows at block 1 on the CPU server
  waited 8-13x their usual gap while a long prompt entered (docs/benchmarks.md, "Chunked prefill"). The seconds
  come from the steps this decoder ran (`ChunkPacer.line`), so the bound needs no model of the engine;
- at least `MIN_CHUNK` tokens (or the budget, if smaller), so a prompt always progresses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .step import StepProfile

if TYPE_CHECKING:
    from .loop import BatchRow

# The default token budget of one step's target pass on the CPU server: a small one keeps a short prompt from
# making one long step before any time is measured; the time bound does the rest.
STEP_TOKENS = 128
# A step with prompt chunks takes at most about this many times the rows' own step: a streaming row's longest
# wait while a long prompt enters, in units of its usual one (issue 40 asks for at most 3x, on a CPU whose own
# step-to-step noise reaches 2-3x).
STALL = 2.0
MIN_CHUNK = 8
# the moving averages and the line follow about the last 1 / WEIGHT steps of their kind; a gap measured more
# than STALE chunk steps ago is the line's instead (the batch may have changed since)
WEIGHT = 0.1
STALE = 30


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
        if size < c.size and size < least:
            break
        kept.append(c._replace(size=size))
        room -= size
    return kept


class ChunkPacer:
    """The prompt tokens a step takes (`room`), from the budget and the seconds of the steps it observed.

    The bound is (stall - 1) x `gap` / `per_token`: `gap` is the running rows' own step, a moving average of
    the recent steps without prompts; `per_token` what a chunk step took beyond `gap`, per prompt token, a moving
    average over the chunk steps. Measured at the chunk sizes the bound itself picks, so a cost that is not a
    line in the tokens (a GPU's: flat while the pass is bound by reading the weights, steep beyond) is priced
    where it is used; and what a chunk step changes in the rows' own choices (a policy that drafts less beside a
    chunk) is in it too.

    Until both are measured, and where no step without prompts ran lately (at a large batch nearly every step
    carries a chunk), a line fitted to every step (seconds = gap + per_token x prompt tokens, least squares,
    each step weighted by its age) stands in; before that, a pass of prompts alone gives `per_token`."""

    def __init__(self, step_tokens: int = STEP_TOKENS, stall: float = STALL):
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        if stall <= 1.0:
            raise ValueError(f"stall must be > 1 (a chunk step takes longer than a plain one), got {stall}")
        self.step_tokens, self.stall = step_tokens, stall
        self.seed: float | None = None  # seconds per token of the first pass of prompts alone
        self._sums = [0.0] * 5  # aged sums of 1, x, y, x*x, x*y; x: a step's prompt tokens, y: its seconds
        self._gap: float | None = None  # moving average of the steps without prompts
        self._since_plain = 0  # steps since the last one without prompts
        self._per_token: float | None = None  # moving average over chunk steps

    def room(self, reserved: int) -> int:
        """Prompt tokens for the next step beside `reserved` tokens of running rows' verify blocks."""
        tokens = max(self.step_tokens - reserved, self.step_tokens // 4)
        costs = self.costs()
        if reserved and costs is not None and costs[1] > 0:
            tokens = min(tokens, int((self.stall - 1.0) * costs[0] / costs[1]))
        return max(tokens, min(MIN_CHUNK, self.step_tokens))

    def costs(self) -> tuple[float, float] | None:
        """(gap, per_token) as the bound uses them (see the class)."""
        line = self.line()
        gap = self._gap if self._gap is not None and self._since_plain <= STALE else None
        gap = gap if gap is not None else (line[0] if line is not None else None)
        per_token = self._per_token if self._per_token is not None else (line[1] if line is not None else None)
        return None if gap is None or per_token is None else (gap, per_token)

    def line(self) -> tuple[float, float] | None:
        """(gap, per_token) of the line fitted to every step (see the class)."""
        n, sx, sy, sxx, sxy = self._sums
        if n == 0.0:
            return None
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
        if not x:
            self._gap, self._since_plain = _moved(self._gap, y), 0
            return
        self._since_plain += 1
        costs = self.costs()
        if costs is not None:
            self._per_token = _moved(self._per_token, max(0.0, y - costs[0]) / x)


def _moved(average: float | None, sample: float) -> float:
    return sample if average is None else average + WEIGHT * (sample - average)
