"""The adaptive block-size policy: per step and per row, the block sizes of the best expected tokens per second.

Model of one batched step (verify rows r = 1..R, row r with block size B_r; B_r = 1 means no drafting):

    time   = target(R, sum_r B_r) + [any row drafts] * drafter(D, sum_{r drafts} (B_r + n_r))
    tokens = sum_r E(alpha_r, B_r),  E(alpha, B) = 1 + alpha + ... + alpha^(B-1)

`target` and `drafter` are the engines' cost model (`cost.CostModel`), alpha_r each row's acceptance estimate
(`estimates.AcceptanceTracker`), n_r the feature rows the drafter takes in for row r. The rules, in the order
`choose_blocks` applies them:

 1. A request's own block size is kept; a probed row drafts its whole block, so that its estimate is measured
    again at every position it can reach (`_forced_sizes`; when to probe: `estimates.ProbeSchedule`).
 2. A cost model that prices the step at 0 s (unfitted) gives every row its largest block: maximise tokens.
 3. A request alone is rated at every size, exact under any cost shape (`_best_alone`).
 4. Otherwise every way a free row can grow its block is an increment of expected tokens and seconds: the jump
    from block 1 to the size b* that gains most per second (it pays the row's drafter share), then one token
    at a time. Sorted by gain per second, every prefix is a choice, each rated at the true step time, and the
    best is kept (`_increments`, `_envelope_sweep`, `_best_prefix`). With costs linear in tokens the best
    choice is such a prefix (Dinkelbach's condition), so the choice is exact.
 5. Among more than `POLISH_MAX_ROWS` rows, increments that no best choice can hold are left out first
    (`_worth_keeping`): there the policy's own time matters.
 6. Under a bent token cost (a GPU's tiles) among at most `POLISH_MAX_ROWS` rows, a second sweep in
    single-token order and a few single-row moves stop a step at the end of a tile instead of just past it
    (`_token_order_sweep`, `_polish`); among hundreds of rows one row's overshoot is a rounding.
 7. When no row has to draft, drafting must beat not drafting by `min_gain`: a margin for what the costs leave
    out (per-row acceptance work, the drafter's backlog) (`_with_margin`).
 8. Where prompts queue behind the one entering and their chunks fill what the token budget leaves, the step
    holds at most the verify tokens the chunks leave room for (`StepRows.verify_room`): each draft token beyond
    would take a queued prompt's token, and while prompts queue the requests' throughput is set by how fast they
    get in, not by how fast the rows already in finish; the step's rate prices neither. Forced sizes are kept, probes included (a probe's measurement is what
    keeps the estimates from feeding on themselves; a few rows a step). The bound is met at the sweeps'
    granularity (a row's first increment is its whole jump to b*), and a polish that ends past it is not taken.

A row's drafter backlog is priced as one new context row (n_r = 1): the backlog is a sunk cost, paid whenever
the row next drafts whatever the size; charging it would keep a row that skipped drafting from ever drafting
again (its backlog grows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from ..runtime.base import DrafterEngine, TargetEngine, cuda_devices
from .cost import CostModel, EngineCost, curve_arrays, measure_costs, price, token_sweep
from .estimates import GPU_PROBE_ROWS, AcceptancePrior, AcceptanceTracker, ProbeSchedule
from .policy import own_or_max
from .proposers import drafter_drafted
from .step import StepResult, StepRows

if TYPE_CHECKING:
    from .row import BatchRow


@dataclass
class _RowState:
    tracker: AcceptanceTracker
    last_draft_step: int  # the policy's verify step at which the row last drafted (or joined)


class AdaptiveBlocks:
    """The block-size policy that maximises expected committed tokens per second (the module's rules).

    It owns the cost model (corrected by every step's passes), each row's acceptance estimate, the prior new
    rows start from (per sampling regime) and the probe schedule.

    min_gain: rule 7's margin. refit_every: refit the cost model from the observed passes every N verify steps
    (0 = never; the policy picks the shapes it then observes, so such a fit can be collinear).
    probe_every / max_probe_backoff / probe_rows: `estimates.ProbeSchedule` (probe_every 0 = never probe).

    One policy per decoder: its per-row state is keyed by the decoder's row ids."""

    def __init__(
        self,
        cost: CostModel | None,
        *,
        min_gain: float = 0.1,
        refit_every: int = 0,
        probe_every: int = 32,
        max_probe_backoff: int = 4,
        probe_rows: int = 0,
    ):
        if cost is None:
            raise ValueError("adaptive block sizes need a cost model (cost.measure_costs)")
        self.cost, self.min_gain, self.refit_every = cost, min_gain, refit_every
        self.probe_rows = probe_rows
        self.probes = ProbeSchedule(probe_every, max_probe_backoff, probe_rows)
        self.prior = AcceptancePrior()  # new rows start from what recent requests of their regime measured
        self.rows: dict[int, _RowState] = {}
        self.steps = 0  # verify steps observed
        self._probing: set[int] = set()  # ids of the rows probed on the step being chosen

    @classmethod
    def measured(
        cls,
        target: TargetEngine,
        drafter: DrafterEngine,
        max_active: int,
        clock: Callable[[], float] = time.perf_counter,
        gpu: bool | None = None,
        **options: Any,
    ) -> AdaptiveBlocks:
        """The policy of a server holding up to `max_active` rows, its cost model measured now on the engines
        (`cost.measure_costs`: rows 1, max_active / 2 and max_active; blocks 1 / 4 / 8; 5 repeats, each cell
        keeping its fastest pass, so a burst of load during start-up spoils one pass, not the fit).

        On a CUDA target the grid also times one-row passes over a sweep of token counts (`token_sweep` up to
        max_active x the drafter's block: GEMM tiles make a pass's time a staircase in its tokens), the fits may
        bend at a knee, and probes take `GPU_PROBE_ROWS` rows at a time (its batches are hundreds of rows with
        long backlogs). A CPU's cost is a line: no sweep, no knee, every stale row probes. `clock` times the
        passes; `gpu`: measure as on a GPU (None: a CUDA target; a simulated GPU says True); `options`: the
        constructor's other arguments."""
        if gpu is None:
            gpu = bool(cuda_devices(target))
        context = min(128, target.max_context // 2)
        sweep = token_sweep(min(max_active * drafter.block_size, target.max_context - context))
        cost = measure_costs(
            target,
            drafter,
            rows=sorted({1, max(1, max_active // 2), max_active}),
            context=context,
            repeats=5,
            clock=clock,
            token_curve=sweep if gpu and len(sweep) > 1 else (),
            knees=gpu,
        )
        return cls(cost, probe_rows=GPU_PROBE_ROWS if gpu else 0, **options)

    def tracker_for(self, row: BatchRow) -> AcceptanceTracker:
        """A joining row's acceptance estimate: the prior of its sampling regime."""
        return self.prior.tracker(row.sampled)

    def choose(self, step: StepRows) -> list[int]:
        if bool(((step.fixed > 0) | (step.max_block < 2)).all()):  # nothing to choose: no probe either
            self._probing = set()
            return own_or_max(step)
        states = [self._state(r) for r in step.rows]
        alpha = np.fromiter((s.tracker.alpha for s in states), np.float64, len(states))
        last = np.fromiter((s.last_draft_step for s in states), np.int64, len(states))
        due = self.probes.due(self.steps, step.sampled, last, step.backlog)
        self._probing = {step.rows[i].id for i in np.flatnonzero(due).tolist()}
        ones = np.ones(len(step))
        choices = RowChoices(alpha=alpha, max_block=step.max_block, new_context=ones, fixed=step.fixed, probe=due)
        chunk = (step.chunk_rows, step.chunk_tokens)
        return choose_blocks(choices, self.cost, self.min_gain, riding=chunk, most_tokens=step.verify_room)

    def _state(self, row: BatchRow) -> _RowState:
        """A row's state; a row the policy has not seen join starts from the prior now."""
        state = self.rows.get(row.id)
        if state is None:
            state = self.rows[row.id] = self._new_state(row)
        return state

    def _new_state(self, row: BatchRow) -> _RowState:
        """A row's state from its regime's prior; the row's proposers read that same estimate of its DFlash
        acceptance (`proposers.RowDrafts.follow_policy`), so a hybrid weighs the block on what sized it."""
        tracker = self.tracker_for(row)
        row.drafts.follow_policy(tracker)
        return _RowState(tracker, self.steps)

    def observe(self, result: StepResult) -> None:
        """Joining rows get their estimate; verified rows update theirs; probes' outcomes per regime; the passes'
        costs correct the cost model. Counts a step only when rows were verified."""
        for row, rnd in result.rounds:
            if rnd.prefill:
                self.rows[row.id] = self._new_state(row)
        verified = result.verified
        if not verified:
            return
        probed: dict[bool, tuple[int, int]] = {}  # per regime: this step's probes' accepted and drafted tokens
        for row, rnd in verified:
            state = self._state(row)
            if not drafter_drafted(
                rnd.proposer
            ):  # another proposer's draft or none: the drafter's estimate learns nothing
                state.tracker.update(0, 0)
                continue
            state.tracker.update(rnd.drafted, rnd.accepted)
            if rnd.drafted:
                state.last_draft_step = self.steps
                if row.id in self._probing:
                    acc, total = probed.get(row.sampled, (0, 0))
                    probed[row.sampled] = (acc + rnd.accepted, total + rnd.drafted)
        for sampled, (acc, total) in probed.items():
            self.probes.observe(self.steps, sampled, acc, total)
        self.steps += 1
        self._observe_costs(result)

    def _observe_costs(self, result: StepResult) -> None:
        prof = result.profile
        # A pass holding prompt chunks is not observed: a chunk attends over its whole prompt so far, which the
        # linear model (timed at a short context) does not price, and the correction would carry that cost into
        # the plain verify steps that follow.
        if not prof.chunk_rows:
            self.cost.observe_target(prof.verify_rows, prof.verify_tokens, prof.verify_s)
        if prof.draft_rows:
            self.cost.observe_drafter(prof.draft_rows, prof.draft_tokens, prof.draft_s)
        if self.refit_every and self.steps % self.refit_every == 0:
            self.cost.refit()  # online: the passes this worker really ran, at its real contexts
        result.cost_correction = self.cost.corrections()

    def forget(self, row: BatchRow) -> None:
        """A finished row's measured acceptance feeds its regime's prior."""
        state = self.rows.pop(row.id, None)
        self._probing.discard(row.id)
        if state is not None and row.done:
            self.prior.observe(row.sampled, state.tracker)


@dataclass(frozen=True)
class RowChoice:
    """What the policy knows about one verify row."""

    alpha: float
    max_block: int  # the drafter's block size, or fewer when the row has fewer tokens left; 1 = cannot draft
    new_context: int = 1  # feature rows the drafter would take in for this row
    fixed: int | None = None  # the request's own block_size: not chosen by the policy
    probe: bool = False  # must draft its whole block this step, so that its acceptance estimate is measured again


@dataclass(frozen=True)
class RowChoices:
    """A step's `RowChoice`s as arrays, one index per verify row: what `choose_blocks` reads. The decoder
    builds it from arrays each step (at hundreds of rows an object per row would cost more than the choice);
    `of` converts a list."""

    alpha: np.ndarray  # [rows] float64
    max_block: np.ndarray  # [rows] int64
    new_context: np.ndarray  # [rows] float64
    fixed: np.ndarray  # [rows] int64; 0 = not fixed (chosen by the policy)
    probe: np.ndarray  # [rows] bool

    @classmethod
    def of(cls, rows: Sequence[RowChoice]) -> RowChoices:
        return cls(
            np.array([r.alpha for r in rows], dtype=np.float64),
            np.array([r.max_block for r in rows], dtype=np.int64),
            np.array([r.new_context for r in rows], dtype=np.float64),
            np.array([r.fixed or 0 for r in rows], dtype=np.int64),
            np.array([r.probe for r in rows], dtype=bool),
        )

    def __len__(self) -> int:
        return len(self.alpha)


def choose_blocks(
    rows: Sequence[RowChoice] | RowChoices,
    cost: CostModel,
    min_gain: float = 0.0,
    riding: tuple[int, int] = (0, 0),
    most_tokens: int = 0,
) -> list[int]:
    """Per-row block sizes maximising expected tokens per second of the step: the module's rules in order.
    riding: (rows, tokens) the target pass holds besides the verify rows (prompt chunks): every choice is
    priced on top of them (`cost.EngineCost`: their own seconds are not the rows'). most_tokens: rule 8's bound
    on the step's verify tokens (0 = none). O(rows x sizes) numpy work plus a sort or two."""
    table = rows if isinstance(rows, RowChoices) else RowChoices.of(rows)
    n = len(table)
    if not n:
        return []
    target, drafter = cost.current()
    if riding != (0, 0):
        target = replace(target, riding_rows=riding[0], riding_tokens=riding[1])
    forced, max_blocks = _forced_sizes(table)  # rule 1
    top = int(max_blocks.max())
    base = np.where(forced > 0, forced, 1)
    # the target's passes this needs, priced in one call: n tokens (no row drafts), every row at its largest
    # size, and the base choice
    t_none, t_all, t_base = price(target, n, np.array([n, n * top, int(base.sum())], dtype=np.float64))
    if t_none <= 0:  # rule 2
        return _within(max_blocks, forced, most_tokens)
    free = np.flatnonzero((forced == 0) & (max_blocks >= 2))  # the rows whose size is chosen here
    if not len(free):
        return cast(list[int], base.tolist())
    if n == 1:  # rule 3
        max_block = (
            min(int(max_blocks[0]), most_tokens) if most_tokens else int(max_blocks[0])
        )  # rule 8: rate only sizes that fit
        return [
            _best_alone(float(table.alpha[0]), max_block, float(table.new_context[0]), target, drafter, min_gain)
            if max_block > 1
            else 1
        ]
    step = _Step(n, target, drafter, table.alpha, table.new_context, forced, max_blocks, base, free, top, most_tokens)
    start = _base_of(step, float(t_base))
    grid = _increments(step, float(t_none), float(t_all))
    best, best_rate = _sweep(step, start, grid)  # rules 4-6
    return _with_margin(best, best_rate, step, start, min_gain)  # rule 7


def _forced_sizes(table: RowChoices) -> tuple[np.ndarray, np.ndarray]:
    """Rule 1: per row the size it must use (its own, or its whole block when probed; 0 = free) and its largest
    size (the forced one, else its max_block)."""
    forced = np.where(table.fixed > 0, table.fixed, np.where(table.probe & (table.max_block >= 2), table.max_block, 0))
    max_blocks = np.where(forced > 0, forced, np.maximum(table.max_block, 1))
    return forced, max_blocks


class _Step(NamedTuple):
    """One choice's inputs: the rows' arrays ([rows]) and the engines' current costs."""

    n: int
    target: EngineCost
    drafter: EngineCost
    alpha: np.ndarray  # [rows] acceptance estimates
    new_context: np.ndarray  # [rows] feature rows the drafter takes in for a row that drafts
    forced: np.ndarray  # [rows] a size the row must use (0: free)
    max_blocks: np.ndarray  # [rows] its largest size
    base: np.ndarray  # the choice in which no free row drafts
    free: np.ndarray  # indices of the rows whose size is chosen
    top: int
    most: int = 0  # rule 8: the most verify tokens (0 = any)


class _Totals(NamedTuple):
    """What a choice holds in all, or what increments add ([k] arrays, one per increment)."""

    gain: Any  # expected tokens
    verify_tokens: Any
    drafting_rows: Any
    drafter_tokens: Any


class _Base(NamedTuple):
    """The base choice (no free row drafts): its totals and its expected tokens per second."""

    totals: _Totals
    rate: float


def _base_of(s: _Step, t_base: float) -> _Base:
    drafting = s.base > 1
    d_rows = int(drafting.sum())
    # E(1) = 1: only the rows that must draft need the sum
    gain = float(s.n - d_rows) + float(_expected(s.alpha[drafting], s.base[drafting]).sum())
    d_tokens = float((s.base + s.new_context)[drafting].sum())
    rate = gain / (t_base + s.drafter(d_rows, int(d_tokens)))
    return _Base(_Totals(gain, float(int(s.base.sum())), float(d_rows), d_tokens), rate)


class _Grid(NamedTuple):
    """The free rows' increments on a grid [free row, size b = 1..top]."""

    sizes: np.ndarray  # [1, top]
    gain: np.ndarray  # E(b) - E(1)
    one_more: np.ndarray  # E(b) - E(b - 1): what the b-th token adds
    valid: np.ndarray  # the sizes the row may take (2..max_block)
    ratio: np.ndarray  # gain per second of the jump from block 1 to b
    jump: np.ndarray  # [free] b*: the size whose jump gains most per second
    token_price: float  # a drafted token's seconds at the mean price
    new_context: np.ndarray  # [free] new context rows


def _increments(s: _Step, t_none: float, t_all: float) -> _Grid:
    """Rule 4's increments: the jump to b* (the upper concave envelope's first point), then one token at a time;
    a drafted token priced at the target's mean slope from n tokens to n x top, plus the drafter's slope."""
    sizes = np.arange(1, s.top + 1, dtype=np.float64)[None, :]
    gain = _expected_grid(s.alpha[s.free], s.top) - 1.0
    one_more = np.zeros_like(gain)
    one_more[:, 1:] = gain[:, 1:] - gain[:, :-1]
    token_price = max(0.0, (t_all - t_none) / (s.n * s.top - s.n)) + s.drafter.per_token
    context = s.new_context[s.free]
    start = s.drafter.per_row + s.drafter.per_token * (1.0 + context[:, None])  # the drafter's share of a row
    seconds = token_price * (sizes - 1.0) + start  # [free, top]: from block 1 to block b
    valid = (sizes >= 2) & (sizes <= s.max_blocks[s.free, None])
    ratio = np.where(valid, gain / np.maximum(seconds, 1e-30), -np.inf)
    return _Grid(sizes, gain, one_more, valid, ratio, ratio.argmax(axis=1) + 1, token_price, context)


def _sweep(s: _Step, base: _Base, g: _Grid) -> tuple[np.ndarray, float]:
    """Rules 4-6: the best choice in which some free row drafts, and its expected tokens per second (-inf when
    no increment is left)."""
    many = s.n > POLISH_MAX_ROWS
    bent = s.target.bent or s.drafter.bent
    keep, beyond = g.valid, g.sizes > g.jump[:, None]
    if many:  # rule 5
        drafts, one_pays = _worth_keeping(g, base.rate, s.target, s.drafter)
        keep, beyond = g.valid & drafts[:, None], beyond & one_pays
    sweeps = [_envelope_sweep(g, keep, beyond, s.top)]
    if bent and not many:  # rule 6
        sweeps.append(_token_order_sweep(g, keep, s.top))
    best, best_rate = _best_prefix(s, base, sweeps)
    if best_rate > -np.inf and bent and not many:  # rule 6
        polished = _polish(best, s, POLISH_MOVES)
        if not s.most or polished.sum() <= s.most:  # rule 8: a move may not take the step past its bound
            best, best_rate = polished, _rate_of(polished, s)
    return best, best_rate


class _Sweep(NamedTuple):
    """Increments in the order a sweep takes them: the free row each grows ([k]) and what each adds."""

    rows: np.ndarray
    adds: _Totals


def _envelope_sweep(g: _Grid, keep: np.ndarray, beyond: np.ndarray, top: int) -> _Sweep:
    """Rule 4: the jump to b*, then one token at a time beyond it; best first (stable, so a row's own
    increments, never rising in gain per second, stay in size order)."""
    at_jump = g.sizes == g.jump[:, None]
    cells = np.flatnonzero(keep & (at_jump | beyond))
    # a token priced at 0 s (a cost model fitted flat) ranks by its gain, as the ratios above do (no 0 / 0)
    per_second = g.one_more / max(g.token_price, 1e-30)
    cells = cells[np.argsort(-np.where(at_jump, g.ratio, per_second).ravel()[cells], kind="stable")]
    jumps = at_jump.ravel()[cells]
    b = cells % top + 1
    rows = cells // top
    adds = _Totals(
        gain=np.where(jumps, g.gain.ravel()[cells], g.one_more.ravel()[cells]).astype(np.float64),
        verify_tokens=np.where(jumps, b - 1, 1).astype(np.float64),
        drafting_rows=jumps.astype(np.float64),
        drafter_tokens=np.where(jumps, b + g.new_context[rows], 1).astype(np.float64),
    )
    return _Sweep(rows, adds)


def _token_order_sweep(g: _Grid, keep: np.ndarray, top: int) -> _Sweep:
    """Rule 6: single-token increments in order of gain (for each token budget the most expected tokens); ties
    go to the row of least backlog and keep one row's increments together, so the drafter's share of a row is
    paid by as few rows as possible."""
    by_context = np.argsort(g.new_context, kind="stable")
    cells = (by_context[:, None] * top + np.arange(top)).ravel()[keep[by_context].ravel()]
    cells = cells[np.argsort(-g.one_more.ravel()[cells], kind="stable")]
    rows, first = cells // top, cells % top == 1  # first: the row's block 2, where it starts drafting
    adds = _Totals(
        gain=g.one_more.ravel()[cells].astype(np.float64),
        verify_tokens=np.ones(len(cells)),
        drafting_rows=first.astype(np.float64),
        drafter_tokens=np.where(first, 2 + g.new_context[rows], 1).astype(np.float64),
    )
    return _Sweep(rows, adds)


def _best_prefix(s: _Step, base: _Base, sweeps: list[_Sweep]) -> tuple[np.ndarray, float]:
    """Every prefix of every sweep rated at the true step time (one pricing call per engine); the best."""

    def running(field: int) -> np.ndarray:  # the totals after each prefix, every sweep's in turn
        return np.concatenate([base.totals[field] + np.cumsum(sweep.adds[field]) for sweep in sweeps])

    gain, tokens, drafting_rows, drafter_tokens = (running(i) for i in range(len(_Totals._fields)))
    rates = gain / (price(s.target, s.n, tokens) + price(s.drafter, drafting_rows, drafter_tokens))
    if s.most:  # rule 8
        rates = np.where(tokens > s.most, -np.inf, rates)
    best, best_rate = s.base, -np.inf
    start_at = 0
    for rows, adds in sweeps:
        if len(rows):
            k = int(rates[start_at : start_at + len(rows)].argmax())
            if rates[start_at + k] > best_rate:
                best = s.base.copy()  # a free row's size: 1 + the tokens its taken increments add
                grow = np.bincount(rows[: k + 1], weights=adds.verify_tokens[: k + 1], minlength=len(s.free))
                best[s.free] += grow.astype(np.int64)
                best_rate = float(rates[start_at + k])
        start_at += len(rows)
    return best, best_rate


def _with_margin(best: np.ndarray, best_rate: float, s: _Step, base: _Base, min_gain: float) -> list[int]:
    """Rule 7: when no row has to draft, the drafting choice must beat not drafting by `min_gain`."""
    bar = base.rate * (1.0 + min_gain) if base.totals.drafting_rows == 0 else base.rate
    return cast(list[int], (best if best_rate > bar else s.base).tolist())


def _worth_keeping(
    g: _Grid, base_rate: float, target: EngineCost, drafter: EngineCost
) -> tuple[np.ndarray, np.ndarray]:
    """Which increments a best choice may hold: per free row whether it may draft at all ([free] bool), and
    per size b whether its b-th token may be taken after the row's start ([free, top] bool).

    Every choice that can win beats the step's rate without the free rows drafting (`base_rate`); taking out
    of it a row's last tokens, or a row's whole draft, whose expected tokens per second at the least they can
    cost fall below that rate raises its rate. So no best choice holds them, and a sweep without them loses
    no prefix that could win (such a prefix, less them, is a prefix of the shorter sweep and rates higher).
    Least costs: a token at the smallest slope of each engine's token term (0 on a flat stretch of a curve;
    a measured curve is taken never to fall), a row that drafts at least the drafter's per-row share:
      - a row drafts only if some size b pays at least cost: E(b) - E(1) >= base_rate x (drafter's per row
        + (b + ctx) drafter tokens + (b - 1) target tokens, at the least prices);
      - its b-th token only if alpha^(b-1) >= base_rate x the least price of one token (falling with b, so
        what is kept of a row is a run of sizes from its start).
    At hundreds of rows most increments fall out (a verify pass of many tokens is dear), and the sorts and
    prefix sums run on the rest."""
    target_slope, drafter_slope = _least_slope(target), _least_slope(drafter)
    sizes = np.arange(1, g.gain.shape[1] + 1, dtype=np.float64)[None, :]
    # [free, top]: the least seconds of a row drafting b tokens
    least = drafter.per_row + drafter_slope * (sizes + g.new_context[:, None]) + target_slope * (sizes - 1.0)
    drafts = (g.valid & (g.gain >= base_rate * least)).any(axis=1)
    return drafts, g.one_more >= base_rate * (target_slope + drafter_slope)


def _least_slope(cost: EngineCost) -> float:
    """The smallest seconds per token of `cost`'s token term anywhere (>= 0)."""
    if cost.curve:
        return curve_arrays(cost.curve).least_slope
    return max(0.0, min(cost.per_token, cost.below_knee) if cost.knee > 0 else cost.per_token)


def _within(sizes: np.ndarray, forced: np.ndarray, most: int) -> list[int]:
    """Rule 8 where nothing was rated (rule 2): the free rows' blocks capped at the largest size that keeps
    the step within `most` verify tokens (forced sizes kept; at block 1 a row drafts nothing)."""
    if most and sizes.sum() > most:
        free = forced == 0
        for cap in range(int(sizes.max()) - 1, 0, -1):
            capped = np.where(free, np.minimum(sizes, cap), sizes)
            if int(capped.sum()) <= most or cap == 1:
                sizes = capped
                break
    return cast(list[int], sizes.tolist())


def _best_alone(
    alpha: float, max_block: int, new_context: float, target: EngineCost, drafter: EngineCost, min_gain: float
) -> int:
    """`choose_blocks` for one free row alone in its step: the size of the best expected tokens per second,
    drafting only when it beats block 1 by `min_gain`."""
    sizes = np.arange(1, max_block + 1, dtype=np.float64)
    ones = np.ones_like(sizes)
    step_s = price(target, ones, sizes) + np.where(sizes > 1, price(drafter, ones, sizes + new_context), 0.0)
    rate = _expected(np.float64(alpha), sizes) / step_s
    b = int(rate[1:].argmax()) + 2
    return b if rate[b - 1] > rate[0] * (1.0 + min_gain) else 1


def _expected(alpha: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`expected_tokens` elementwise (arrays of the same shape, or broadcast)."""
    a = np.minimum(alpha, 1.0)
    return np.where(a >= 1.0, sizes, (1.0 - a**sizes) / np.where(a < 1.0, 1.0 - a, 1.0))


def _expected_grid(alpha: np.ndarray, top: int) -> np.ndarray:
    """[rows, top]: `expected_tokens(alpha_r, b)` for b = 1..top, as 1 + alpha + ... + alpha^(b-1) by running
    products (at hundreds of rows the closed form's powers were the dearest step of the choice)."""
    powers = np.empty((top, len(alpha)))  # sizes first: each running product steps over every row at once
    powers[0] = 1.0
    powers[1:] = np.minimum(alpha, 1.0)
    np.multiply.accumulate(powers, axis=0, out=powers)
    np.add.accumulate(powers, axis=0, out=powers)
    return np.ascontiguousarray(powers.T)


def _rate_of(sizes: np.ndarray, s: _Step) -> float:
    """Expected tokens per second of a step with these block sizes."""
    drafting = sizes > 1
    tokens = float(_expected(s.alpha, sizes).sum())
    drafter_s = s.drafter(int(drafting.sum()), int((sizes + s.new_context)[drafting].sum()))
    return tokens / (s.target(len(sizes), int(sizes.sum())) + drafter_s)


POLISH_MOVES = 3  # single-row changes after the sweep, under a bent token cost (see `_polish`)
# ... for steps of at most this many rows: each move is O(rows x sizes) work, and the sweep's overshoot is one
# row's jump, which matters among a few rows and is a rounding among dozens, where the moves and the second
# sweep would be a large share of the host's time per step (`make bench-parts` measures the host's work)
POLISH_MAX_ROWS = 32


def _polish(out: np.ndarray, s: _Step, moves: int) -> np.ndarray:
    """Up to `moves` single-row changes of a drafting choice, each the one that raises the step's rate (at
    the true cost) the most, while one does and some row still drafts. Under a bent cost the sweep's order
    (at the mean token price) can overshoot the end of a tile: a row accepting nearly everything jumps
    straight to its largest block; the moves close that gap."""
    forced, max_blocks, context, target, drafter = s.forced, s.max_blocks, s.new_context, s.target, s.drafter
    n, top = len(out), int(max_blocks.max())
    sizes = np.arange(1, top + 1)[None, :]
    gain = _expected_grid(s.alpha, top)  # [rows, top]: E per cell
    allowed = np.where(forced[:, None] > 0, sizes == forced[:, None], sizes <= max_blocks[:, None])
    index = np.arange(n)
    out = out.copy()
    for _ in range(moves):
        drafting = out > 1
        tokens, n_draft = int(out.sum()), int(drafting.sum())
        d_tokens = float((out + context)[drafting].sum())
        total = float(gain[index, out - 1].sum())
        current = total / (target(n, tokens) + drafter(n_draft, int(d_tokens)))
        new_tokens = tokens - out[:, None] + sizes  # every cell as a change of its row alone
        new_draft = n_draft - drafting[:, None] + (sizes > 1)
        new_d_tokens = (
            d_tokens - np.where(drafting, out + context, 0)[:, None] + np.where(sizes > 1, sizes + context[:, None], 0)
        )
        new_gain = total - gain[index, out - 1][:, None] + gain
        step_s = price(target, np.full_like(new_tokens, n), new_tokens) + price(drafter, new_draft, new_d_tokens)
        rate = np.where(allowed & (new_draft > 0), new_gain / step_s, -np.inf)
        row, size = np.unravel_index(int(rate.argmax()), rate.shape)
        if rate[row, size] <= current * (1 + 1e-12):
            break
        out[row] = size + 1
    return out
