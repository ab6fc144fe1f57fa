"""Adaptive block size per step and per row: the block sizes that maximise expected committed tokens per second.

Model of one batched step (verify rows r = 1..R, row r with block size B_r; B_r = 1 means no drafting):

    time   = target(R, sum_r B_r) + [any row drafts] * drafter(D, sum_{r drafts} (B_r + n_r))
    tokens = sum_r E(alpha_r, B_r),  E(alpha, B) = 1 + alpha + ... + alpha^(B-1)

`target` and `drafter` are cost models fitted from timed passes at start-up (`measure_costs`): fixed + per row
+ a token term, which is a line (a CPU's), a line that bends once at a knee, or, on a GPU, a curve measured
over a sweep of token counts (its matrices run in tiles, so 136 tokens cost a third more than 128); the
target's one-token pass, a request alone not drafting, is measured apart (see `LinearCost`). Each is
corrected by the passes the decoder really runs (`CostModel.observe`; or refitted from them, `refit`). E is
the expected committed tokens of a round when each draft position is accepted with probability alpha given
the ones before it (the bonus token included). alpha_r is each row's running estimate (`AcceptanceTracker`):
accepted drafts over accepted + rejections, with decay, so a row whose drafts keep failing drafts less; a
row that does not draft drifts back towards the prior, so it is tried again later. A compute-bound batch
(large per-token cost) gets shorter blocks because the same extra tokens cost more time.

`choose_blocks` maximises tokens / time. Every way a row can grow its block is an increment of expected
tokens and seconds; sorted by tokens per second, the prefixes of that list are the candidate choices, each
rated at the true step time (the drafter's fixed cost paid once if any row drafts), and the best is kept
against "nobody drafts" (every free row at 1). With a line the best choice is such a prefix (Dinkelbach's
optimality condition: the increments that beat the optimal rate), so the choice is exact; with a bent token
term, among at most `POLISH_MAX_ROWS` rows, the sweep runs in two orders and a few single-row moves polish it
(within 2 % of the exhaustive best on small random instances); among more rows it runs in one order, where one
row's overshoot of a tile is a rounding. One step is O(rows x block) numpy work and a sort (scripts/bench_choose_blocks.py
times it). Rows with a fixed size (a request's `block_size`) keep it; a probe row (`RowChoice.probe`) drafts
its whole block (its largest size): the backlog it makes the drafter take in costs the same whatever the
size, and a block of 2 would measure one position (at T=1 a hit half the time, whether drafting pays or not).

Probes exist because the estimates feed on themselves: a row that does not draft measures nothing, so one
unlucky early round (or a pessimistic prior) at a batch size where drafting pays only at the true acceptance
would keep it at block 1 for good, and the prior that new rows start from would learn nothing either. The
decoder probes rows that have not drafted lately, a few per regime on the same step (`ProbeSchedule`), so
the drafter's fixed cost is paid once per probe step, not once per row; where probes keep missing, the next
probe of that sampling regime (greedy or sampled) comes half as often each time (each probed row's backlog
is the cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import numpy as np
import torch

from ..runtime.base import DrafterEngine, DraftRequest, TargetEngine


@dataclass
class LinearCost:
    """seconds = fixed + per_row * rows + per_token * tokens (0 for 0 rows); a pass of one token (one row,
    no drafting: one request alone) costs `one_token` instead when it was measured.

    Why the exception: on a CPU a one-token pass multiplies vectors (GEMV), any larger pass matrices, and
    the step between them is no part of a line; priced by the line, drafting for a lone request looks
    cheaper than it is (docs/benchmarks.md, "Measurements behind design choices").

    `knee` (tokens; 0 = none): tokens up to the knee cost `below_knee` each, tokens beyond it `per_token`
    each (a line that bends once). A GPU's matrices are weight-bandwidth bound until a pass has a few hundred
    tokens (docs/benchmarks.md: Vidur's A100 profile), so one line either prices a small batch's drafted
    tokens as if they were compute bound (fitted through the large passes) or a large batch's as free; and
    pricing the tokens under the knee as free (a flat start) fills every step up to the knee with drafts of
    rows that seldom hit (docs/benchmarks.md, "On a GPU, tokens are priced by a measured curve"). `fit`
    takes a knee only where it cuts the squared error of the line by `KNEE_MIN_GAIN`x, so a cost that is a
    line (a CPU's) keeps none."""

    fixed: float = 0.0
    per_row: float = 0.0
    per_token: float = 0.0
    one_token: float | None = None
    knee: float = 0.0
    below_knee: float = 0.0  # seconds per token up to the knee

    curve: tuple[tuple[float, float], ...] = ()  # measured (tokens, seconds) of the token term; replaces the line

    def __call__(self, rows: int, tokens: int) -> float:
        return float(_price(self, np.asarray(rows), np.asarray(tokens, dtype=np.float64)))

    def token_seconds(self, tokens: np.ndarray) -> np.ndarray:
        """The tokens' part of a pass: the measured curve (interpolated; past its end at its last slope), or
        the line with its knee."""
        if self.curve:
            c = _curve_arrays(self.curve)
            out = np.interp(tokens, c.xs, c.ys)
            beyond = tokens > c.xs[-1]
            if beyond.any():
                out = np.where(beyond, c.ys[-1] + c.last_slope * (tokens - c.xs[-1]), out)
        else:
            under = np.minimum(tokens, self.knee)
            out = self.below_knee * under + self.per_token * (tokens - under)
        return np.asarray(out, dtype=np.float64)

    @property
    def bent(self) -> bool:
        """The token term is not one line (a knee or a measured curve): a GPU's shape."""
        return self.knee > 0 or bool(self.curve)

    def scaled(self, k: float, k_one_token: float | None = None) -> LinearCost:
        """The line times k; the one-token pass times k_one_token (k when None)."""
        k1 = k if k_one_token is None else k_one_token
        return LinearCost(
            self.fixed * k,
            self.per_row * k,
            self.per_token * k,
            None if self.one_token is None else self.one_token * k1,
            self.knee,
            self.below_knee * k,
            tuple((x, y * k) for x, y in self.curve),
        )

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], knee: bool = True) -> LinearCost:
        """Least squares over (rows, tokens, seconds); coefficients clamped at >= 0 (costs never shrink).
        One-token passes, when the other samples span enough shapes (3) for the line, are not on it:
        `one_token` is their mean. With `knee`, a knee (see the class) is tried at each sampled token count
        between the smallest and the largest."""
        single = [s for r, t, s in samples if r == 1 and t == 1]
        rest = [(r, t, s) for r, t, s in samples if not (r == 1 and t == 1)]
        if single and len({(r, t) for r, t, _ in rest}) >= 3:
            return cls._fit_knee(rest, one_token=sum(single) / len(single), knee=knee)
        if len(samples) < 3:
            raise ValueError(f"fitting a cost model needs >= 3 samples, got {len(samples)}")
        return cls._fit_knee(samples, knee=knee)

    @classmethod
    def with_curve(cls, samples: Sequence[tuple[int, int, float]], curve: Sequence[tuple[int, float]]) -> LinearCost:
        """The token term from a measured curve of one-row passes ((tokens, seconds), `measure_costs`), the
        fixed and per-row terms fitted to the grid's samples (rows, tokens, seconds) around it; the one-token
        pass apart, as in `fit`."""
        if len(curve) < 2:
            raise ValueError(f"a token curve needs >= 2 points, got {len(curve)}")
        y0 = curve[0][1]
        shape = cls(curve=tuple((float(x), max(0.0, y - y0)) for x, y in curve))
        single = [s for r, t, s in samples if r == 1 and t == 1]
        rest = [(r, t, s) for r, t, s in samples if not (r == 1 and t == 1)] or list(samples)
        a = torch.tensor([[1.0, r] for r, _, _ in rest], dtype=torch.float64)
        y = torch.tensor([[s - shape(1, t)] for _, t, s in rest], dtype=torch.float64)
        fixed, per_row = torch.linalg.lstsq(a, y).solution.view(-1).clamp_min(0).tolist()
        one = sum(single) / len(single) if single and len(rest) >= 2 else None
        return cls(fixed, per_row, 0.0, one, curve=shape.curve)

    @classmethod
    def _fit_knee(
        cls, samples: Sequence[tuple[int, int, float]], one_token: float | None = None, knee: bool = True
    ) -> LinearCost:
        def fitted(coef: list[float], knee: float) -> LinearCost:
            return cls(coef[0], coef[1], coef[2], one_token, knee, coef[3] if knee else 0.0)

        def sse(cost: LinearCost) -> float:
            return sum((cost(r, t) - s) ** 2 for r, t, s in samples)

        line = fitted(cls._line(samples), 0.0)
        best, best_err = line, sse(line)
        tokens = sorted({t for _, t, _ in samples})
        # a knee is one more parameter: tried only on a grid of >= 5 shapes that the line misses by > 1 % (rms)
        scale = sum(s * s for _, _, s in samples)
        if not knee or len({(r, t) for r, t, _ in samples}) < 5 or best_err <= 1e-4 * scale:
            tokens = []
        for at in tokens[1:-1]:
            cost = fitted(cls._line(samples, at), float(at))
            err = sse(cost)
            if err * KNEE_MIN_GAIN < best_err if best.knee == 0.0 else err < best_err:
                best, best_err = cost, err
        return best

    @staticmethod
    def _line(samples: Sequence[tuple[int, int, float]], knee: float = 0.0) -> list[float]:
        """[fixed, per_row, per_token, below_knee] by least squares (below_knee 0 without a knee), clamped >= 0."""
        if knee:
            rows = [[1.0, r, max(t - knee, 0.0), min(t, knee)] for r, t, _ in samples]
        else:
            rows = [[1.0, r, t] for r, t, _ in samples]
        a = torch.tensor(rows, dtype=torch.float64)
        y = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)
        coef: list[float] = torch.linalg.lstsq(a, y).solution.view(-1).clamp_min(0).tolist()
        return coef + [0.0] * (4 - len(coef))


class _Curve(NamedTuple):
    """A measured curve as `LinearCost.token_seconds` reads it."""

    xs: np.ndarray  # [points] tokens
    ys: np.ndarray  # [points] seconds
    last_slope: float  # seconds per token past the last point
    least_slope: float  # the smallest slope anywhere (>= 0)


def _curve_arrays(curve: tuple[tuple[float, float], ...]) -> _Curve:
    """A curve's arrays. Cached by the tuple's identity (the policy prices with the same curve many times a
    step, and hashing a tuple of ~100 points cost more than the pricing); the entry holds the tuple, so its
    id cannot be reused while cached."""
    hit = _CURVES.get(id(curve))
    if hit is not None and hit[0] is curve:
        return hit[1]
    xs, ys = (np.array(v, dtype=np.float64) for v in zip(*curve))
    slopes = np.diff(ys) / np.diff(xs) if len(xs) > 1 else np.zeros(1)
    arrays = _Curve(xs, ys, float(slopes[-1]), max(0.0, float(slopes.min())))
    if len(_CURVES) >= 16:
        _CURVES.clear()
    _CURVES[id(curve)] = (curve, arrays)
    return arrays


_CURVES: dict[int, tuple[tuple[tuple[float, float], ...], _Curve]] = {}


# a knee is fitted only where it cuts the line's squared error at least 4x
KNEE_MIN_GAIN = 4.0


@dataclass
class CostModel:
    """The two engines' costs: the fitted shapes (`target`, `drafter`) times a running correction each (`scale`).

    The shapes come from a start-up grid at one context length, on a machine whose speed moves; what the
    policy uses (`current`) is each shape times the recent ratio of observed to predicted seconds of that
    engine's passes (`observe`). One number per engine stays identifiable from whatever shapes the policy
    picks (a full online refit does not: the policy's own choices make its samples collinear), and it
    follows what the grid cannot see: longer contexts (the drafter attends over all of it), other load on the
    machine, or a start-up grid timed during a burst.

    The target's one-token pass (`LinearCost.one_token`) has a correction of its own (`target_one_token`):
    the two drift apart with the context (a one-token pass attends over it with one query, a drafted block
    with several under a mask).

    A shape with a knee (a GPU's: `LinearCost.knee`) is corrected by adding seconds per row instead
    (`row_offset`, the same moving average of observed - predicted, per row): there the passes a grid at a
    short context cannot see cost more because each row reads a longer KV cache, once whatever its block,
    and a factor on the whole shape would make every drafted token dearer by as much (in the A100
    simulation it kept every row from drafting where drafting paid; results/sim/README.md)."""

    target: LinearCost
    drafter: LinearCost
    window: int = 256  # observations kept for refits
    scale_weight: float = 0.1  # per observed pass: the correction follows the last ~10 passes
    scale: dict[str, float] = field(default_factory=lambda: {"target": 1.0, "target_one_token": 1.0, "drafter": 1.0})
    # per engine whose shape has a knee: seconds per row the passes took beyond the shape (see the class)
    row_offset: dict[str, float] = field(default_factory=lambda: {"target": 0.0, "drafter": 0.0})
    _seen: dict[str, list[tuple[int, int, float]]] = field(default_factory=lambda: {"target": [], "drafter": []})

    def current(self) -> tuple[LinearCost, LinearCost]:
        """The target's and the drafter's costs as the policy should price them now (shape x correction; a
        shape with a knee: shape + a per-row correction, see `observe`)."""
        return self._corrected("target", self.scale["target_one_token"]), self._corrected("drafter", None)

    def _corrected(self, kind: str, k_one_token: float | None) -> LinearCost:
        shape: LinearCost = getattr(self, kind)
        if not shape.bent:
            return shape.scaled(self.scale[kind], k_one_token)
        one = None if shape.one_token is None else shape.one_token * (k_one_token or 1.0)
        per_row = max(0.0, shape.per_row + self.row_offset[kind])
        return LinearCost(shape.fixed, per_row, shape.per_token, one, shape.knee, shape.below_knee, shape.curve)

    def step_time(self, blocks: Sequence[int], new_context: Sequence[int]) -> float:
        target, drafter = self.current()
        drafting = [(b, n) for b, n in zip(blocks, new_context) if b > 1]
        return target(len(blocks), sum(blocks)) + drafter(len(drafting), sum(b + n for b, n in drafting))

    def observe(self, kind: str, rows: int, tokens: int, seconds: float, correct: bool = True) -> None:
        """Record a pass that ran; with `correct`, move the engine's correction towards observed / predicted
        (each ratio clamped to [1/4, 4], so one pass stalled by another process moves it a little only)."""
        seen = self._seen[kind]
        seen.append((rows, tokens, seconds))
        del seen[: -self.window]
        shape = getattr(self, kind)
        predicted = shape(rows, tokens)
        key = (
            "target_one_token"
            if kind == "target" and (rows, tokens) == (1, 1) and shape.one_token is not None
            else kind
        )
        if correct and predicted > 0 and seconds > 0:
            ratio = min(4.0, max(0.25, seconds / predicted))
            if shape.bent and key == kind:  # what the grid missed is per row (see the class), not x all
                residual = (ratio - 1.0) * predicted / rows
                self.row_offset[kind] += self.scale_weight * (residual - self.row_offset[kind])
            else:
                self.scale[key] += self.scale_weight * (ratio - self.scale[key])

    def refit(self, min_samples: int = 16) -> None:
        """Refit the shapes from observed passes when they span enough distinct shapes (online adaptation);
        a refitted shape starts with no correction."""
        for kind in ("target", "drafter"):
            seen = self._seen[kind]
            if len(seen) >= min_samples and len({(r, t) for r, t, _ in seen}) >= 3:
                setattr(self, kind, LinearCost.fit(seen))
                self.scale[kind] = 1.0
                self.row_offset[kind] = 0.0
                if kind == "target":
                    self.scale["target_one_token"] = 1.0


def expected_tokens(alpha: float, block: int) -> float:
    """Committed tokens of a round of `block` tokens (block - 1 drafts), per-position acceptance alpha."""
    if block <= 1:
        return 1.0
    if alpha >= 1.0:
        return float(block)
    return (1.0 - alpha**block) / (1.0 - alpha)


@dataclass
class AcceptanceTracker:
    """A row's running per-position acceptance estimate: (accepted + prior) / (accepted + rejections + prior)."""

    prior_alpha: float = 0.6
    # pseudo-observations of the prior: few enough to learn fast, enough that one failed first round after
    # the prompt (often the hardest position) does not push a row below the drafting threshold for good
    prior_weight: float = 4.0
    decay: float = 0.9  # per round: older rounds count less
    idle_decay: float = 0.97  # per step without drafting: drift back to the prior, so the row is tried again
    accepted: float = 0.0
    rejected: float = 0.0
    total_accepted: int = 0  # over the row's life, undecayed: what the shared prior learns from
    total_rejected: int = 0
    drafted_rounds: int = 0

    @property
    def alpha(self) -> float:
        a = self.accepted + self.prior_alpha * self.prior_weight
        return a / (self.accepted + self.rejected + self.prior_weight)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.accepted *= self.idle_decay
            self.rejected *= self.idle_decay
            return
        rejected = 1 if accepted < drafted else 0
        self.drafted_rounds += 1
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + rejected
        self.total_accepted += accepted
        self.total_rejected += rejected


@dataclass
class AcceptancePrior:
    """Where a new request's estimate starts: per sampling regime (greedy or sampled), the acceptance that
    recently finished requests of that regime measured (a moving average over requests). A drafter hits far
    more often at T=0 than at T=1; from one shared guess every request would spend its first rounds learning
    its regime again, and at T=1 that is several failed blocks per request."""

    start: float = 0.6
    weight: float = 0.2  # per finished request
    min_rounds: int = 2  # requests that drafted fewer rounds say too little
    alpha: dict[bool, float] = field(default_factory=dict)

    def tracker(self, sampled: bool) -> AcceptanceTracker:
        return AcceptanceTracker(prior_alpha=self.alpha.get(sampled, self.start))

    def observe(self, sampled: bool, row: AcceptanceTracker) -> None:
        trials = row.total_accepted + row.total_rejected
        if row.drafted_rounds < self.min_rounds or trials == 0:  # (a perfect drafter's rounds reject nothing)
            return
        measured = row.total_accepted / trials
        old = self.alpha.get(sampled, self.start)
        self.alpha[sampled] = (1 - self.weight) * old + self.weight * measured


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
    builds it straight from its rows each step (at hundreds of rows, building an object per row was a large
    share of the policy's time: docs/benchmarks.md); `of` converts a list."""

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


def choose_blocks(rows: Sequence[RowChoice] | RowChoices, cost: CostModel, min_gain: float = 0.0) -> list[int]:
    """Per-row block sizes maximising expected tokens per second of the step (see module docstring).

    min_gain: when nobody has to draft, drafting is chosen only if its expected rate beats not drafting by
    this fraction (a margin for what the costs leave out: per-row acceptance work, the drafter's backlog of
    context rows). Probe and fixed rows draft regardless.

    How: each free row's ways to grow its block are increments in expected tokens and seconds: the first
    one from block 1 to the size b* that gains the most per second (it pays the row's drafter share), then
    one token at a time (each gaining alpha^(b-1), less than the one before). Sorted by gain per second,
    every prefix of that list is a valid choice, and with costs linear in tokens the best choice is such a
    prefix (the rows whose increments beat the optimal rate: Dinkelbach's condition), so rating every prefix
    at the true step time and keeping the best is exact. With a bent token cost (`LinearCost.knee`, a
    measured `curve`: a GPU's tiles make 136 tokens cost a third more than 128) the increments are ordered
    at the average token price and each prefix is still rated at the true cost, so the step can stop at the
    end of a tile instead of just past it. O(rows x sizes) numpy work plus one sort."""
    table = rows if isinstance(rows, RowChoices) else RowChoices.of(rows)
    n = len(table)
    if not n:
        return []
    t, d = cost.current()
    alpha, ctx, max_block, fixed = table.alpha, table.new_context, table.max_block, table.fixed
    # a size the row must use (its own, or its whole block when probed), 0 = free
    forced = np.where(fixed > 0, fixed, np.where(table.probe & (max_block >= 2), max_block, 0))
    caps = np.where(forced > 0, forced, np.maximum(max_block, 1))
    top = int(caps.max())
    base = np.where(forced > 0, forced, 1)
    base_tokens = int(base.sum())
    # the target's passes this needs, priced in one call: n tokens (no row drafts), every row at its largest
    # size, and the base choice
    t_none, t_all, t_base = _price(t, n, np.array([n, n * top, base_tokens], dtype=np.float64))
    if t_none <= 0:  # an unfitted (all-zero) model prices the step at 0 s: maximise tokens
        return cast(list[int], caps.tolist())
    free = np.flatnonzero((forced == 0) & (caps >= 2))  # the rows whose size is chosen here
    if not len(free):
        return cast(list[int], base.tolist())
    if n == 1:  # a request alone: every size rated at the true cost (exact for any cost shape, and cheap)
        return [_best_alone(float(alpha[0]), int(caps[0]), float(ctx[0]), t, d, min_gain)]
    base_drafting = base > 1
    base_d_rows = int(base_drafting.sum())
    # E(1) = 1: only the rows that must draft need the sum
    base_gain = float(n - base_d_rows) + float(_expected(alpha[base_drafting], base[base_drafting]).sum())
    base_d_tokens = float((base + ctx)[base_drafting].sum())

    # The increments of the free rows that may draft, on a grid [free row, size b = 1..top] (a sweep takes its
    # cells by flat index: one gather per quantity instead of a 2-d index each).
    sizes = np.arange(1, top + 1, dtype=np.float64)[None, :]  # [1, top]
    gain = _expected_grid(alpha[free], top) - 1.0  # [free, top]: E(b) - E(1)
    one_more = np.zeros_like(gain)  # [free, top]: E(b) - E(b - 1), what the b-th token adds
    one_more[:, 1:] = gain[:, 1:] - gain[:, :-1]
    # a drafted token's price: the target's mean slope from n tokens to n x top, plus the drafter's slope
    token_price = max(0.0, float(t_all - t_none) / (n * top - n)) + d.per_token
    ctx_free = ctx[free]
    start = d.per_row + d.per_token * (1.0 + ctx_free[:, None])  # the drafter's share of a row that drafts
    seconds = token_price * (sizes - 1.0) + start  # [free, top]: from block 1 to block b
    valid = (sizes >= 2) & (sizes <= caps[free, None])
    ratio = np.where(valid, gain / np.maximum(seconds, 1e-30), -np.inf)
    jump = ratio.argmax(axis=1) + 1  # b* per free row (the upper concave envelope's first point)
    at_jump = sizes == jump[:, None]
    base_rate = base_gain / (float(t_base) + d(base_d_rows, int(base_d_tokens)))
    many = n > POLISH_MAX_ROWS
    keep, beyond = valid, sizes > jump[:, None]
    if many:
        # Increments that no best choice holds (`_worth_keeping`) are left out of the sweep: where the
        # policy's time matters. Among fewer rows the polish below starts from the sweep's best, and a
        # start that differs (not worse) can end its few moves lower.
        drafts, one_pays = _worth_keeping(gain, one_more, valid, ctx_free, base_rate, t, d)
        keep, beyond = valid & drafts[:, None], beyond & one_pays
    # Sweep 1, the envelope's increments: the jump to b*, then one token at a time beyond it; best first
    # (stable, so a row's own increments, never rising in gain per second, stay in size order).
    cells = np.flatnonzero(keep & (at_jump | beyond))
    cells = cells[np.argsort(-np.where(at_jump, ratio, one_more / token_price).ravel()[cells], kind="stable")]
    # A sweep: per increment in its order, the free row it grows ([k]) and what it adds ([4, k]: expected
    # tokens, verify tokens, drafting rows, drafter tokens).
    jumps = at_jump.ravel()[cells]
    b = cells % top + 1
    rows_i = cells // top
    adds = np.empty((4, len(cells)))
    adds[0] = np.where(jumps, gain.ravel()[cells], one_more.ravel()[cells])
    adds[1] = np.where(jumps, b - 1, 1)
    adds[2] = jumps
    adds[3] = np.where(jumps, b + ctx_free[rows_i], 1)
    sweeps = [(rows_i, adds)]
    if (t.bent or d.bent) and not many:
        # A bent cost rewards filling a tile exactly, which a jump to a row's largest block (a row that
        # accepts nearly everything) overshoots: also sweep single-token increments in order of gain (for
        # each token budget the most expected tokens; ties go to the row of least backlog and keep one row's
        # increments together, so the drafter's share of a row is paid by as few rows as possible). Like
        # the polish, only among a few rows: among hundreds one row's overshoot is a rounding, and this
        # sweep's sort and prices would be paid every step where the policy's time matters.
        by_ctx = np.argsort(ctx_free, kind="stable")
        cells = (by_ctx[:, None] * top + np.arange(top)).ravel()[keep[by_ctx].ravel()]
        cells = cells[np.argsort(-one_more.ravel()[cells], kind="stable")]
        rows_j, first = cells // top, cells % top == 1  # first: the row's block 2, where it starts drafting
        adds = np.empty((4, len(cells)))
        adds[0], adds[1], adds[2], adds[3] = one_more.ravel()[cells], 1, first, np.where(first, 2 + ctx_free[rows_j], 1)
        sweeps.append((rows_j, adds))
    # every prefix of every sweep, priced in one call per engine
    base_sums = np.array([[base_gain], [base_tokens], [base_d_rows], [base_d_tokens]])
    cum = [base_sums + np.cumsum(a, axis=1) for _, a in sweeps]
    cum_gain, cum_tokens, cum_d_rows, cum_d_tokens = cum[0] if len(cum) == 1 else np.concatenate(cum, axis=1)
    rates = cum_gain / (_price(t, n, cum_tokens) + _price(d, cum_d_rows, cum_d_tokens))
    best, best_rate = base, -np.inf  # the best choice in which some free row drafts
    start_at = 0
    for r_i, a in sweeps:
        if len(r_i):
            k = int(rates[start_at : start_at + len(r_i)].argmax())
            if rates[start_at + k] > best_rate:
                best = base.copy()  # a free row's size: 1 + the tokens its taken increments add
                best[free] += np.bincount(r_i[: k + 1], weights=a[1, : k + 1], minlength=len(free)).astype(np.int64)
                best_rate = float(rates[start_at + k])
        start_at += len(r_i)
    if best_rate > -np.inf and (t.bent or d.bent) and n <= POLISH_MAX_ROWS:
        best = _polish(best, forced, caps, alpha, ctx, t, d, POLISH_MOVES)
        best_rate = _rate_of(best, alpha, ctx, t, d)
    # nobody must draft: drafting has to beat not drafting by the margin
    bar = base_rate * (1.0 + min_gain) if base_d_rows == 0 else base_rate
    return cast(list[int], (best if best_rate > bar else base).tolist())


def _worth_keeping(
    gain: np.ndarray,
    one_more: np.ndarray,
    valid: np.ndarray,
    ctx: np.ndarray,
    base_rate: float,
    t: LinearCost,
    d: LinearCost,
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
    pt, pd = _least_slope(t), _least_slope(d)
    sizes = np.arange(1, gain.shape[1] + 1, dtype=np.float64)[None, :]
    least = d.per_row + pd * (sizes + ctx[:, None]) + pt * (sizes - 1.0)  # [free, top]: a row drafting b tokens
    drafts = (valid & (gain >= base_rate * least)).any(axis=1)
    return drafts, one_more >= base_rate * (pt + pd)


def _least_slope(cost: LinearCost) -> float:
    """The smallest seconds per token of `cost`'s token term anywhere (>= 0)."""
    if cost.curve:
        return _curve_arrays(cost.curve).least_slope
    return max(0.0, min(cost.per_token, cost.below_knee) if cost.knee > 0 else cost.per_token)


def _best_alone(alpha: float, cap: int, ctx: float, t: LinearCost, d: LinearCost, min_gain: float) -> int:
    """`choose_blocks` for one free row alone in its step: the size of the best expected tokens per second,
    drafting only when it beats block 1 by `min_gain`."""
    sizes = np.arange(1, cap + 1, dtype=np.float64)
    ones = np.ones_like(sizes)
    step_s = _price(t, ones, sizes) + np.where(sizes > 1, _price(d, ones, sizes + ctx), 0.0)
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


def _rate_of(sizes: np.ndarray, alpha: np.ndarray, ctx: np.ndarray, t: LinearCost, d: LinearCost) -> float:
    """Expected tokens per second of a step with these block sizes."""
    drafting = sizes > 1
    tokens = float(_expected(alpha, sizes).sum())
    return tokens / (t(len(sizes), int(sizes.sum())) + d(int(drafting.sum()), int((sizes + ctx)[drafting].sum())))


POLISH_MOVES = 3  # single-row changes after the sweep, under a bent token cost (see `_polish`)
# ... for steps of at most this many rows: each move is O(rows x sizes) work, and the sweep's overshoot is one
# row's jump, which matters among a few rows and is a rounding among hundreds, where the moves would be a
# large share of the policy's time per step (docs/benchmarks.md, "The policy solve is cheap")
POLISH_MAX_ROWS = 64


def _polish(
    out: np.ndarray,
    forced: np.ndarray,
    caps: np.ndarray,
    alpha: np.ndarray,
    ctx: np.ndarray,
    t: LinearCost,
    d: LinearCost,
    moves: int,
) -> np.ndarray:
    """Up to `moves` single-row changes of a drafting choice, each the one that raises the step's rate (at
    the true cost) the most, while one does and some row still drafts. Under a bent cost the sweep's order
    (at the mean token price) can overshoot the end of a tile: a row accepting nearly everything jumps
    straight to its largest block (small random instances: 5 % below the best); the moves close that gap."""
    n, top = len(out), int(caps.max())
    sizes = np.arange(1, top + 1)[None, :]
    gain = _expected_grid(alpha, top)  # [rows, top]: E per cell
    allowed = np.where(forced[:, None] > 0, sizes == forced[:, None], sizes <= caps[:, None])
    index = np.arange(n)
    out = out.copy()
    for _ in range(moves):
        drafting = out > 1
        tokens, n_draft = int(out.sum()), int(drafting.sum())
        d_tokens = float((out + ctx)[drafting].sum())
        g = float(gain[index, out - 1].sum())
        current = g / (t(n, tokens) + d(n_draft, int(d_tokens)))
        new_tokens = tokens - out[:, None] + sizes  # every cell as a change of its row alone
        new_draft = n_draft - drafting[:, None] + (sizes > 1)
        new_d_tokens = (
            d_tokens - np.where(drafting, out + ctx, 0)[:, None] + np.where(sizes > 1, sizes + ctx[:, None], 0)
        )
        new_gain = g - gain[index, out - 1][:, None] + gain
        step_s = _price(t, np.full_like(new_tokens, n), new_tokens) + _price(d, new_draft, new_d_tokens)
        rate = np.where(allowed & (new_draft > 0), new_gain / step_s, -np.inf)
        i, s = np.unravel_index(int(rate.argmax()), rate.shape)
        if rate[i, s] <= current * (1 + 1e-12):
            break
        out[i] = s + 1
    return out


def token_sweep(max_tokens: int) -> list[int]:
    """Token counts for `measure_costs(token_curve=)`: every 8 up to 512 (where GPU tiles step), every 32 up
    to 2048, every 128 beyond, up to max_tokens."""
    out = [1] + list(range(8, min(512, max_tokens) + 1, 8))
    out += list(range(544, min(2048, max_tokens) + 1, 32)) + list(range(2176, max_tokens + 1, 128))
    return out


def _price(cost: LinearCost, rows: np.ndarray | int, tokens: np.ndarray) -> np.ndarray:
    """`cost(rows, tokens)` over arrays (0 for 0 rows; the one-token pass at its own price). `rows` may be
    one count for every pass (a verify pass always holds the whole batch), which skips both exceptions'
    array work where they cannot apply."""
    out = cost.fixed + cost.per_row * rows + cost.token_seconds(tokens)
    one_count = np.ndim(rows) == 0
    if cost.one_token is not None and not (one_count and rows != 1):
        out = np.where((rows == 1) & (tokens == 1), cost.one_token, out)
    if one_count:
        return out if rows != 0 else np.zeros_like(out)
    return np.where(rows == 0, 0.0, out)


GPU_PROBE_ROWS = 4  # `ProbeSchedule.max_rows` for a GPU server's batches (the trade: its `due`)


class ProbeSchedule:
    """When rows that have not drafted lately must draft one whole block again (see the module docstring).

    Per sampling regime (greedy: False, sampled: True), not per row: requests are short next to a backoff,
    so a row's own misses would never grow its wait, and every request of a regime where drafting does not
    pay would be probed about once. One probe step serves every stale row of its regime (the drafter's fixed
    cost paid once). A probe step that misses (its rows accepted fewer than half of their drafts) doubles
    that regime's wait, up to 2^max_backoff x `every` steps, so a regime whose traffic changes is still
    tried now and then; a hit resets it (the estimate, and the prior new rows start from, must catch up)."""

    def __init__(self, every: int = 32, max_backoff: int = 4, max_rows: int = 0):
        self.every, self.max_backoff, self.max_rows = every, max_backoff, max_rows
        self.misses: dict[bool, int] = {}  # per regime: probe steps in a row that missed
        self.next_step: dict[bool, int] = {}  # per regime: the first step at which it may probe again

    def due(self, step: int, sampled: np.ndarray, last_draft: np.ndarray, backlog: np.ndarray) -> np.ndarray:
        """Per row ([rows] arrays: its sampling regime, the step it last drafted at, its backlog of context
        rows): whether it must probe now ([rows] bool). With `max_rows` > 0, at most that many rows per regime
        probe on one step, those of least backlog (0: every stale row, right for a CPU's batches of 8-32 short
        rows, where a cap cost throughput in `bench_load` A/B runs; docs/benchmarks.md). On a GPU:
        at hundreds of stale rows, probing them all made the drafter take in every row's backlog and the
        target verify a whole block per row in one step, the cost by which adaptive trailed the target alone
        where drafting did not pay (results/sim/README.md). A few rows measure whether the regime hits; a hit
        row drafts on, and the prior new rows start from learns from it. How many is a trade measured in the
        A100 simulation (docs/benchmarks.md): more rows cost mixed traffic where drafting barely pays, fewer
        find too few of the rows worth drafting (`GPU_PROBE_ROWS`)."""
        sampled = np.asarray(sampled, dtype=bool)
        due = np.zeros(len(sampled), dtype=bool)
        if self.every <= 0:
            return due
        stale = np.asarray(last_draft) <= step - self.every
        for regime in (False, True):
            if step < self.next_step.get(regime, 0):
                continue
            mine = np.flatnonzero(stale & (sampled == regime))
            if self.max_rows > 0 and len(mine) > self.max_rows:  # the least backlog first (stable: row order)
                mine = mine[np.argsort(np.asarray(backlog)[mine], kind="stable")[: self.max_rows]]
            due[mine] = True
        return due

    def observe(self, step: int, sampled: bool, accepted: int, drafted: int) -> None:
        """A probe step's outcome for one regime: its probed rows' accepted and drafted tokens."""
        k = 0 if 2 * accepted >= drafted else min(self.misses.get(sampled, 0) + 1, self.max_backoff)
        self.misses[sampled] = k
        self.next_step[sampled] = step + self.every * (1 << k)


def measure_costs(
    target: TargetEngine,
    drafter: DrafterEngine | None = None,
    rows: Sequence[int] = (1, 4, 16),
    blocks: Sequence[int] = (1, 4, 8),
    context: int = 128,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    token_curve: Sequence[int] = (),
    knees: bool = False,
) -> CostModel:
    """Time the target (and drafter) on a grid of (rows, block) at a fixed context; fit both costs.

    token_curve: also time one-row passes of these token counts and price the target's tokens by that
    measured curve (`LinearCost.with_curve`) instead of a line: on a GPU a pass's matrices run in tiles, so
    its time is a staircase in its tokens (`token_sweep`; docs/benchmarks.md), which no line or knee follows.

    knees: let the fits bend once (`LinearCost.fit`), for GPU-shaped costs. Off for a CPU, whose costs are
    lines: a knee fitted to a CPU grid follows its noise (docs/benchmarks.md), and a bent shape is corrected
    per row instead of by a factor.

    drafter None: drafting costs nothing extra. The whole grid is timed `repeats` times over and each cell
    keeps its fastest pass, so a burst of load from other processes spoils one pass of a cell, not the
    cell. `clock` reads seconds (a simulation passes its virtual clock)."""
    vocab = int(target.vocab_size)
    g = torch.Generator().manual_seed(0)
    setups = []
    for r in rows:
        sess = target.new_session()
        handles = [sess.add_row() for _ in range(r)]
        outs = sess.forward(
            handles, [torch.randint(0, vocab, (context,), generator=g) for _ in handles], last_logits_only=True
        )
        dsess, dh = None, []
        if drafter is not None and outs[0].features is not None:
            dsess = drafter.new_session()
            dh = [dsess.add_row() for _ in range(r)]
            # fill the context cache
            dsess.draft([DraftRequest(h, o.features, 1, 2) for h, o in zip(dh, outs) if o.features is not None])
        setups.append((r, sess, handles, dsess, dh, outs[0].features))
    best: dict[tuple[str, int, int], float] = {}

    def keep(key: tuple[str, int, int], seconds: float) -> None:
        best[key] = min(best.get(key, float("inf")), seconds)

    for rep in range(repeats + 1):  # pass 0 warms up and is not kept
        for r, sess, handles, dsess, dh, feats in setups:
            for b in blocks:
                ids = [torch.randint(0, vocab, (b,), generator=g) for _ in handles]
                t0 = clock()
                sess.forward(handles, ids)
                seconds = clock() - t0
                for h in handles:
                    sess.rollback(h, context)
                if rep:
                    keep(("target", r, r * b), seconds)
                if dsess is None or b < 2 or feats is None:
                    continue
                t0 = clock()
                dsess.draft([DraftRequest(h, feats[:1], 1, b) for h in dh])
                seconds = clock() - t0
                if rep:
                    keep(("drafter", r, r * (b + 1)), seconds)
    curve: dict[int, float] = {}
    if token_curve:
        sess = target.new_session()
        h = sess.add_row()
        sess.forward([h], [torch.randint(0, vocab, (context,), generator=g)], last_logits_only=True)
        for rep in range(repeats + 1):
            for n in token_curve:
                tokens = torch.randint(0, vocab, (n,), generator=g)
                t0 = clock()
                sess.forward([h], [tokens])
                seconds = clock() - t0
                sess.rollback(h, context)
                if rep:
                    curve[n] = min(curve.get(n, float("inf")), seconds)
        sess.remove_row(h)
    t_samples = [(r, t, s) for (kind, r, t), s in best.items() if kind == "target"]
    d_samples = [(r, t, s) for (kind, r, t), s in best.items() if kind == "drafter"]
    if curve:
        target_cost = LinearCost.with_curve(t_samples, sorted(curve.items()))
    else:
        target_cost = LinearCost.fit(t_samples, knee=knees)
    drafter_cost = LinearCost.fit(d_samples, knee=knees) if len(d_samples) >= 3 else LinearCost()
    model = CostModel(target_cost, drafter_cost)
    for kind, samples in (("target", t_samples), ("drafter", d_samples)):
        for r, t, sec in samples:  # online refits start from the start-up grid
            model.observe(kind, r, t, sec, correct=False)
    return model
