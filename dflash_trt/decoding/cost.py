"""The engines' cost model: seconds of a target or drafter pass from its shape, fitted from timed passes.

A pass over `rows` rows holding `tokens` tokens in all costs `fixed + per_row x rows + token term(tokens)`
(`EngineCost`). The token term is a line (a CPU's), a line that bends once at a knee, or, on a GPU, a curve
measured over a sweep of token counts: its matrices run in tiles, so a pass's time is a staircase in its
tokens. The target's one-token pass, a request alone not drafting, is priced apart (see `EngineCost`).
`measure_costs` times a grid of shapes at start-up and fits both engines; `CostModel` then corrects each fit
by the passes the decoder really runs (`observe_target`, `observe_drafter`), or refits from them (`refit`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..runtime.base import DrafterEngine, DraftRequest, TargetEngine


@dataclass
class EngineCost:
    """One engine's seconds for a pass of `rows` rows holding `tokens` tokens: fixed + per_row * rows + a token
    term (0 for 0 rows), the token term a line (`per_token`), a line that bends once (`knee`) or a measured
    curve (`curve`); a pass of one token (one row, no drafting: one request alone) costs `one_token` instead
    when it was measured.

    Why the exception: on a CPU a one-token pass multiplies vectors (GEMV), any larger pass matrices, and
    the step between them is no part of a line; priced by the line, drafting for a lone request looks
    cheaper than it is.

    `knee` (tokens; 0 = none): tokens up to the knee cost `below_knee` each, tokens beyond it `per_token`
    each (a line that bends once). A GPU's matrices are weight-bandwidth bound until a pass has a few hundred
    tokens, so one line either prices a small batch's drafted
    tokens as if they were compute bound (fitted through the large passes) or a large batch's as free; and
    pricing the tokens under the knee as free (a flat start) fills every step up to the knee with drafts of
    rows that seldom hit: on a GPU tokens are priced by a measured curve (`curve`). `fit`
    takes a knee only where it cuts the squared error of the line by `KNEE_MIN_GAIN`x, so a cost that is a
    line (a CPU's) keeps none."""

    fixed: float = 0.0
    per_row: float = 0.0
    per_token: float = 0.0
    one_token: float | None = None
    knee: float = 0.0
    below_knee: float = 0.0  # seconds per token up to the knee

    curve: tuple[tuple[float, float], ...] = ()  # measured (tokens, seconds) of the token term; replaces the line
    # rows and tokens every priced pass holds besides those priced: a step's prompt chunks, which ride in its
    # verify pass whatever blocks are chosen (chunked prefill). A choice is priced on top of them (the tokens'
    # part of the pass from the chunks' tokens on, so a bent cost's slope beyond them counts), never as a
    # one-token pass, and without the chunks' own seconds: those are spent whatever the rows draft, and in a
    # step's rate they would lower the bar a draft must clear, so a step with a chunk would draft what plain
    # steps find not worth it.
    riding_rows: int = 0
    riding_tokens: int = 0

    def __call__(self, rows: int, tokens: int) -> float:
        return float(price(self, np.asarray(rows), np.asarray(tokens, dtype=np.float64)))

    def token_seconds(self, tokens: np.ndarray) -> np.ndarray:
        """The tokens' part of a pass: the measured curve (interpolated; past its end along the line through its
        upper half, `beyond_slope`), or the line with its knee."""
        if self.curve:
            c = curve_arrays(self.curve)
            out = np.interp(tokens, c.xs, c.ys)
            beyond = tokens > c.xs[-1]
            if beyond.any():
                out = np.where(beyond, c.ys[-1] + c.slope_beyond * (tokens - c.xs[-1]), out)
        else:
            under = np.minimum(tokens, self.knee)
            out = self.below_knee * under + self.per_token * (tokens - under)
        return np.asarray(out, dtype=np.float64)

    @property
    def bent(self) -> bool:
        """The token term is not one line (a knee or a measured curve): a GPU's shape."""
        return self.knee > 0 or bool(self.curve)

    def scaled(self, k: float, k_one_token: float | None = None) -> EngineCost:
        """The line times k; the one-token pass times k_one_token (k when None)."""
        k1 = k if k_one_token is None else k_one_token
        return EngineCost(
            self.fixed * k,
            self.per_row * k,
            self.per_token * k,
            None if self.one_token is None else self.one_token * k1,
            self.knee,
            self.below_knee * k,
            tuple((x, y * k) for x, y in self.curve),
        )

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], knee: bool = True) -> EngineCost:
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
    def with_curve(cls, samples: Sequence[tuple[int, int, float]], curve: Sequence[tuple[int, float]]) -> EngineCost:
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
    ) -> EngineCost:
        def fitted(coef: list[float], knee: float) -> EngineCost:
            return cls(coef[0], coef[1], coef[2], one_token, knee, coef[3] if knee else 0.0)

        def sse(cost: EngineCost) -> float:
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
    """A measured curve as `EngineCost.token_seconds` reads it."""

    xs: np.ndarray  # [points] tokens
    ys: np.ndarray  # [points] seconds
    slope_beyond: float  # seconds per token past the last point (`beyond_slope`)
    least_slope: float  # the smallest slope anywhere (>= 0)


def curve_arrays(curve: tuple[tuple[float, float], ...]) -> _Curve:
    """A curve's arrays. Cached by the tuple's identity (the policy prices with the same curve many times a
    step, and hashing a tuple of ~100 points cost more than the pricing); the entry holds the tuple, so its
    id cannot be reused while cached."""
    hit = _CURVES.get(id(curve))
    if hit is not None and hit[0] is curve:
        return hit[1]
    xs, ys = (np.array(v, dtype=np.float64) for v in zip(*curve))
    slopes = np.diff(ys) / np.diff(xs) if len(xs) > 1 else np.zeros(1)
    arrays = _Curve(xs, ys, beyond_slope(xs, ys), max(0.0, float(slopes.min())))
    if len(_CURVES) >= 16:
        _CURVES.clear()
    _CURVES[id(curve)] = (curve, arrays)
    return arrays


_CURVES: dict[int, tuple[tuple[tuple[float, float], ...], _Curve]] = {}


def beyond_slope(xs: np.ndarray, ys: np.ndarray) -> float:
    """Seconds per token past a measured curve's last point: the slope of the least-squares line through the
    curve's upper half (tokens >= half the last point's; at least its last two points), at least 0. Where a
    sweep ends in the thousands of tokens a GPU's pass is compute bound, its time a line in its tokens; the last
    two points' own slope is the difference of two noisy medians (a prompt chunk puts a step's pass past a
    curve swept to the rows' blocks, and a noisy slope there would price every verify token on top of the
    chunk by it)."""
    if len(xs) < 2:
        return 0.0
    upper = xs >= xs[-1] / 2
    upper[-2:] = True
    return max(0.0, float(np.polyfit(xs[upper], ys[upper], 1)[0]))


# a knee is fitted only where it cuts the line's squared error at least 4x
KNEE_MIN_GAIN = 4.0


@dataclass
class Correction:
    """One engine's running correction of its fitted shape (see `CostModel`), and the passes it observed."""

    scale: float = 1.0  # the factor on the whole shape (a shape without a knee)
    one_token: float = 1.0  # the factor on the shape's one-token pass (the target's, where it has one)
    row_offset: float = 0.0  # a shape with a knee: seconds per row its passes took beyond it
    seen: list[tuple[int, int, float]] = field(default_factory=list)  # (rows, tokens, seconds), for refits


@dataclass
class CostModel:
    """The two engines' costs: the fitted shapes (`target`, `drafter`) times a running correction each
    (`target_correction`, `drafter_correction`).

    The shapes come from a start-up grid at one context length, on a machine whose speed moves; what the
    policy uses (`current`) is each shape times the recent ratio of observed to predicted seconds of that
    engine's passes (`observe_target`, `observe_drafter`). One number per engine stays identifiable from
    whatever shapes the policy picks (a full online refit does not: the policy's own choices make its samples
    collinear), and it follows what the grid cannot see: longer contexts (the drafter attends over all of it),
    other load on the machine, or a start-up grid timed during a burst.

    The target's one-token pass (`EngineCost.one_token`) has a correction of its own (`Correction.one_token`):
    the two drift apart with the context (a one-token pass attends over it with one query, a drafted block
    with several under a mask).

    A shape with a knee (a GPU's: `EngineCost.knee`) is corrected by adding seconds per row instead
    (`Correction.row_offset`, the same moving average of observed - predicted, per row): there the passes a
    grid at a short context cannot see cost more because each row reads a longer KV cache, once whatever its
    block, and a factor on the whole shape would make every drafted token dearer by as much, keeping rows from
    drafting where drafting pays."""

    target: EngineCost
    drafter: EngineCost
    window: int = 256  # observations kept for refits
    scale_weight: float = 0.1  # per observed pass: the correction follows the last ~10 passes
    target_correction: Correction = field(default_factory=Correction)
    drafter_correction: Correction = field(default_factory=Correction)

    def current(self) -> tuple[EngineCost, EngineCost]:
        """The target's and the drafter's costs as the policy should price them now (shape x correction; a
        shape with a knee: shape + a per-row correction, see `observe_target`)."""
        target = _corrected(self.target, self.target_correction, self.target_correction.one_token)
        return target, _corrected(self.drafter, self.drafter_correction, None)

    def corrections(self) -> dict[str, float]:
        """The running factors by what they correct (the server's metric labels them so)."""
        t, d = self.target_correction, self.drafter_correction
        return {"target": t.scale, "target_one_token": t.one_token, "drafter": d.scale}

    def step_time(self, blocks: Sequence[int], new_context: Sequence[int]) -> float:
        target, drafter = self.current()
        drafting = [(b, n) for b, n in zip(blocks, new_context) if b > 1]
        return target(len(blocks), sum(blocks)) + drafter(len(drafting), sum(b + n for b, n in drafting))

    def observe_target(self, rows: int, tokens: int, seconds: float, correct: bool = True) -> None:
        """Record a target pass that ran; with `correct`, move the target's correction towards observed /
        predicted (each ratio clamped to [1/4, 4], so one pass stalled by another process moves it a little
        only). A one-token pass moves the one-token factor where the shape prices that pass apart."""
        one_token = (rows, tokens) == (1, 1) and self.target.one_token is not None
        self._observe(self.target, self.target_correction, rows, tokens, seconds, correct, one_token)

    def observe_drafter(self, rows: int, tokens: int, seconds: float, correct: bool = True) -> None:
        """Record a drafter pass that ran; with `correct`, move the drafter's correction (as `observe_target`)."""
        self._observe(self.drafter, self.drafter_correction, rows, tokens, seconds, correct, False)

    def _observe(
        self, shape: EngineCost, fix: Correction, rows: int, tokens: int, seconds: float, correct: bool, one: bool
    ) -> None:
        fix.seen.append((rows, tokens, seconds))
        del fix.seen[: -self.window]
        predicted = shape(rows, tokens)
        if correct and predicted > 0 and seconds > 0:
            ratio = min(4.0, max(0.25, seconds / predicted))
            if one:
                fix.one_token += self.scale_weight * (ratio - fix.one_token)
            elif shape.bent:  # what the grid missed is per row (see the class), not x all
                residual = (ratio - 1.0) * predicted / rows
                fix.row_offset += self.scale_weight * (residual - fix.row_offset)
            else:
                fix.scale += self.scale_weight * (ratio - fix.scale)

    def refit(self, min_samples: int = 16) -> None:
        """Refit the shapes from observed passes when they span enough distinct shapes (online adaptation);
        a refitted shape starts with no correction."""
        if _refittable(self.target_correction.seen, min_samples):
            self.target = EngineCost.fit(self.target_correction.seen)
            self.target_correction = Correction(seen=self.target_correction.seen)
        if _refittable(self.drafter_correction.seen, min_samples):
            self.drafter = EngineCost.fit(self.drafter_correction.seen)
            self.drafter_correction = Correction(seen=self.drafter_correction.seen)


def _corrected(shape: EngineCost, fix: Correction, k_one_token: float | None) -> EngineCost:
    if not shape.bent:
        return shape.scaled(fix.scale, k_one_token)
    one = None if shape.one_token is None else shape.one_token * (k_one_token or 1.0)
    per_row = max(0.0, shape.per_row + fix.row_offset)
    return EngineCost(shape.fixed, per_row, shape.per_token, one, shape.knee, shape.below_knee, shape.curve)


def _refittable(seen: list[tuple[int, int, float]], min_samples: int) -> bool:
    return len(seen) >= min_samples and len({(r, t) for r, t, _ in seen}) >= 3


def token_sweep(max_tokens: int) -> list[int]:
    """Token counts for `measure_costs(token_curve=)`: every 8 up to 512 (where GPU tiles step), every 32 up
    to 2048, every 128 beyond, up to max_tokens."""
    out = [1] + list(range(8, min(512, max_tokens) + 1, 8))
    out += list(range(544, min(2048, max_tokens) + 1, 32)) + list(range(2176, max_tokens + 1, 128))
    return out


def price(cost: EngineCost, rows: np.ndarray | int, tokens: np.ndarray) -> np.ndarray:
    """`cost(rows, tokens)` over arrays (0 for 0 rows; the one-token pass at its own price; priced on top of the
    riding rows and tokens, see `EngineCost`). `rows` may be
    one count for every pass (a verify pass always holds the whole batch), which skips both exceptions'
    array work where they cannot apply."""
    one_count = np.ndim(rows) == 0
    if cost.riding_rows:  # prompt chunks ride along: the pass is never a one-token pass; their own seconds out
        chunk = np.float64(cost.riding_tokens)
        on_top = cost.token_seconds(np.asarray(tokens, dtype=np.float64) + chunk) - cost.token_seconds(chunk)
        return np.asarray(cost.fixed + cost.per_row * rows + on_top)
    out = cost.fixed + cost.per_row * rows + cost.token_seconds(tokens)
    if cost.one_token is not None and not (one_count and rows != 1):
        out = np.where((rows == 1) & (tokens == 1), cost.one_token, out)
    if one_count:
        return out if rows != 0 else np.zeros_like(out)
    return np.where(rows == 0, 0.0, out)


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
    measured curve (`EngineCost.with_curve`) instead of a line: on a GPU a pass's matrices run in tiles, so
    its time is a staircase in its tokens (`token_sweep`), which no line or knee follows.

    knees: let the fits bend once (`EngineCost.fit`), for GPU-shaped costs. Off for a CPU, whose costs are
    lines: a knee fitted to a CPU grid follows its noise, and a bent shape is corrected per row instead of by
    a factor.

    drafter None: drafting costs nothing extra. The whole grid is timed `repeats` times over and each cell
    keeps its fastest pass, so a burst of load from other processes spoils one pass of a cell, not the
    cell. `clock` reads seconds (a simulation passes its virtual clock)."""
    g = torch.Generator().manual_seed(0)
    setups = [_grid_setup(target, drafter, r, context, g) for r in rows]
    best = _time_grid(setups, blocks, context, repeats, clock, int(target.vocab_size), g)
    curve = _time_curve(target, token_curve, context, repeats, clock, g) if token_curve else {}
    t_samples = [(r, t, s) for (kind, r, t), s in best.items() if kind == "target"]
    d_samples = [(r, t, s) for (kind, r, t), s in best.items() if kind == "drafter"]
    if curve:
        target_cost = EngineCost.with_curve(t_samples, sorted(curve.items()))
    else:
        target_cost = EngineCost.fit(t_samples, knee=knees)
    drafter_cost = EngineCost.fit(d_samples, knee=knees) if len(d_samples) >= 3 else EngineCost()
    model = CostModel(target_cost, drafter_cost)
    for r, t, sec in t_samples:  # online refits start from the start-up grid
        model.observe_target(r, t, sec, correct=False)
    for r, t, sec in d_samples:
        model.observe_drafter(r, t, sec, correct=False)
    return model


class _Setup(NamedTuple):
    """Sessions holding `rows` rows of `context` tokens each (the drafter's context cache filled too)."""

    rows: int
    target: Any  # TargetSession
    handles: list[int]
    drafter: Any  # DrafterSession | None
    drafter_handles: list[int]
    features: torch.Tensor | None  # one row's features, what a drafted row takes in


def _grid_setup(
    target: TargetEngine, drafter: DrafterEngine | None, rows: int, context: int, g: torch.Generator
) -> _Setup:
    vocab = int(target.vocab_size)
    sess = target.new_session()
    handles = [sess.add_row() for _ in range(rows)]
    outs = sess.forward(
        handles, [torch.randint(0, vocab, (context,), generator=g) for _ in handles], last_logits_only=True
    )
    dsess, dh = None, []
    if drafter is not None and outs[0].features is not None:
        dsess = drafter.new_session()
        dh = [dsess.add_row() for _ in range(rows)]
        dsess.draft([DraftRequest(h, o.features, 1, 2) for h, o in zip(dh, outs) if o.features is not None])
    return _Setup(rows, sess, handles, dsess, dh, outs[0].features)


def _time_grid(
    setups: list[_Setup],
    blocks: Sequence[int],
    context: int,
    repeats: int,
    clock: Callable[[], float],
    vocab: int,
    g: torch.Generator,
) -> dict[tuple[str, int, int], float]:
    """Per (engine, rows, tokens) the fastest of `repeats` passes (pass 0 warms up and is not kept)."""
    best: dict[tuple[str, int, int], float] = {}

    def keep(key: tuple[str, int, int], seconds: float) -> None:
        best[key] = min(best.get(key, float("inf")), seconds)

    for rep in range(repeats + 1):
        for s in setups:
            for b in blocks:
                ids = [torch.randint(0, vocab, (b,), generator=g) for _ in s.handles]
                t0 = clock()
                s.target.forward(s.handles, ids)
                seconds = clock() - t0
                for h in s.handles:
                    s.target.rollback(h, context)
                if rep:
                    keep(("target", s.rows, s.rows * b), seconds)
                if s.drafter is None or b < 2 or s.features is None:
                    continue
                t0 = clock()
                s.drafter.draft([DraftRequest(h, s.features[:1], 1, b) for h in s.drafter_handles])
                seconds = clock() - t0
                if rep:
                    keep(("drafter", s.rows, s.rows * (b + 1)), seconds)
    return best


def _time_curve(
    target: TargetEngine,
    token_curve: Sequence[int],
    context: int,
    repeats: int,
    clock: Callable[[], float],
    g: torch.Generator,
) -> dict[int, float]:
    """Per token count, the fastest one-row pass of that many tokens after `context`."""
    vocab = int(target.vocab_size)
    curve: dict[int, float] = {}
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
    return curve
