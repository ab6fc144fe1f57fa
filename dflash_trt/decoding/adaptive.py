"""Adaptive block size per step and per row: the block sizes that maximise expected committed tokens per second.

Model of one batched step (verify rows r = 1..R, row r with block size B_r; B_r = 1 means no drafting):

    time   = target(R, sum_r B_r) + [any row drafts] * drafter(D, sum_{r drafts} (B_r + n_r))
    tokens = sum_r E(alpha_r, B_r),  E(alpha, B) = 1 + alpha + ... + alpha^(B-1)

`target` and `drafter` are linear cost models (fixed + per row + per token; the target's one-token pass, a
request alone not drafting, measured apart: see `LinearCost`), fitted from timed passes at
start-up (`measure_costs`), each scaled by a running correction from the passes the decoder really runs
(`CostModel.observe`; or refitted from them, `refit`). E is the expected
committed tokens of a round when each draft position is accepted with probability alpha given the ones
before it (the bonus token included). alpha_r is each row's running estimate (`AcceptanceTracker`): accepted
drafts over accepted + rejections, with decay, so a row whose drafts keep failing drafts less; a row that
does not draft drifts back towards the prior, so it is tried again later. A compute-bound batch (large
per-token cost) gets shorter blocks because the same extra tokens cost more time.

`choose_blocks` finds the exact maximum of tokens / time. Both are sums over rows plus costs shared by the
step, and the only coupling between rows is the drafter's fixed cost, paid once if any row drafts. So it
solves two cases and keeps the better: "nobody drafts" (every free row at 1), and "the drafter runs", a
ratio of separable sums maximised by Dinkelbach's iteration: given the best rate lam so far, each row
independently takes the size maximising E(alpha_r, B) - lam * (its share of the time), and lam becomes the
rate of that choice, until it stops rising (finitely many steps, each raising lam). One step
is O(rows x block) arithmetic (scripts/bench_choose_blocks.py times it).
Rows with a fixed size (a request's `block_size`) keep it; a probe row (`RowChoice.probe`) drafts its whole
block (its largest size): the backlog it makes the drafter take in costs the same whatever the size, and a
block of 2 would measure one position (at T=1 a hit half the time, whether drafting pays or not).

Probes exist because the estimates feed on themselves: a row that does not draft measures nothing, so one
unlucky early round (or a pessimistic prior) at a batch size where drafting pays only at the true acceptance
would keep it at block 1 for good, and the prior that new rows start from would learn nothing either. The
decoder probes every row that has not drafted lately, all on the same step (`ProbeSchedule`), so the
drafter's fixed cost is paid once per probe step, not once per row; where probes keep missing, the next
probe of that sampling regime (greedy or sampled) comes half as often each time (each probed row's backlog
is the cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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

    `knee` (tokens; 0 = none): a pass of fewer tokens costs as much as one of `knee` tokens, i.e. tokens are
    priced by max(tokens, knee). A GPU's matrices are weight-bandwidth bound until a pass has a few hundred
    tokens (docs/benchmarks.md: Vidur's A100 profile), so one line either prices a small batch's drafted
    tokens as if they were compute bound (fitted through the large passes) or a large batch's as free. `fit`
    takes a knee only where it cuts the squared error of the line by `KNEE_MIN_GAIN`x, so a cost that is a
    line (a CPU's) keeps none."""

    fixed: float = 0.0
    per_row: float = 0.0
    per_token: float = 0.0
    one_token: float | None = None
    knee: float = 0.0

    def __call__(self, rows: int, tokens: int) -> float:
        if rows == 1 and tokens == 1 and self.one_token is not None:
            return self.one_token
        return 0.0 if rows == 0 else self.fixed + self.per_row * rows + self.per_token * max(tokens, self.knee)

    def scaled(self, k: float, k_one_token: float | None = None) -> LinearCost:
        """The line times k; the one-token pass times k_one_token (k when None)."""
        k1 = k if k_one_token is None else k_one_token
        return LinearCost(
            self.fixed * k,
            self.per_row * k,
            self.per_token * k,
            None if self.one_token is None else self.one_token * k1,
            self.knee,
        )

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> LinearCost:
        """Least squares over (rows, tokens, seconds); coefficients clamped at >= 0 (costs never shrink).
        One-token passes, when the other samples span enough shapes (3) for the line, are not on it:
        `one_token` is their mean. A knee (see the class) is tried at each sampled token count between the
        smallest and the largest."""
        single = [s for r, t, s in samples if r == 1 and t == 1]
        rest = [(r, t, s) for r, t, s in samples if not (r == 1 and t == 1)]
        if single and len({(r, t) for r, t, _ in rest}) >= 3:
            fixed, per_row, per_token, knee = cls._fit_knee(rest)
            return cls(fixed, per_row, per_token, one_token=sum(single) / len(single), knee=knee)
        if len(samples) < 3:
            raise ValueError(f"fitting a cost model needs >= 3 samples, got {len(samples)}")
        fixed, per_row, per_token, knee = cls._fit_knee(samples)
        return cls(fixed, per_row, per_token, knee=knee)

    @classmethod
    def _fit_knee(cls, samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float, float]:
        def sse(coef: list[float], knee: float) -> float:
            return sum((coef[0] + coef[1] * r + coef[2] * max(t, knee) - s) ** 2 for r, t, s in samples)

        line = cls._line(samples)
        best, best_err = (line, 0.0), sse(line, 0.0)
        tokens = sorted({t for _, t, _ in samples})
        # a knee is one more parameter: tried only on a grid of >= 5 shapes that the line misses by > 1 % (rms)
        scale = sum(s * s for _, _, s in samples)
        if len({(r, t) for r, t, _ in samples}) < 5 or best_err <= 1e-4 * scale:
            tokens = []
        for knee in tokens[1:-1]:
            coef = cls._line(samples, knee)
            err = sse(coef, knee)
            if err * KNEE_MIN_GAIN < best_err if best[1] == 0.0 else err < best_err:
                best, best_err = (coef, float(knee)), err
        (fixed, per_row, per_token), chosen = best
        return fixed, per_row, per_token, chosen

    @staticmethod
    def _line(samples: Sequence[tuple[int, int, float]], knee: float = 0.0) -> list[float]:
        a = torch.tensor([[1.0, r, max(t, knee)] for r, t, _ in samples], dtype=torch.float64)
        y = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)
        coef: list[float] = torch.linalg.lstsq(a, y).solution.view(-1).clamp_min(0).tolist()
        return coef


KNEE_MIN_GAIN = 4.0
KNEE_PRICES = (
    1.0,
    0.5,
    0.25,
    0.125,
    0.0,
)  # token prices (x per_token) choose_blocks tries under a knee  # a knee is fitted only where it cuts the line's squared error at least 4x


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
        if shape.knee <= 0:
            return shape.scaled(self.scale[kind], k_one_token)
        one = None if shape.one_token is None else shape.one_token * (k_one_token or 1.0)
        per_row = max(0.0, shape.per_row + self.row_offset[kind])
        return LinearCost(shape.fixed, per_row, shape.per_token, one, shape.knee)

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
            if shape.knee > 0 and key == kind:  # what the grid missed is per row (see the class), not x all
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


def choose_blocks(rows: Sequence[RowChoice], cost: CostModel, max_iter: int = 100, min_gain: float = 0.0) -> list[int]:
    """Per-row block sizes maximising expected tokens per second of the step (see module docstring).

    min_gain: when nobody has to draft, drafting is chosen only if its expected rate beats not drafting by
    this fraction (a margin for what the linear costs leave out: per-row acceptance work, the drafter's
    backlog of context rows). Probe and fixed rows draft regardless.

    Vectorised over a [rows, sizes] table (numpy): at hundreds of rows a step's choice must stay a small
    fraction of a GPU step, which a per-row Python loop over candidate tuples does not."""
    if not rows:
        return []
    t, d = cost.current()
    n = len(rows)
    top = max(max(1, r.max_block, r.fixed or 1) for r in rows)
    allowed = np.zeros((n, top), dtype=bool)
    for i, r in enumerate(rows):
        if r.fixed is not None:
            allowed[i, r.fixed - 1] = True
        elif r.probe and r.max_block >= 2:
            allowed[i, r.max_block - 1] = True
        else:
            allowed[i, : max(1, r.max_block)] = True
    if t(n, n) <= 0:  # an unfitted (all-zero) model prices the step at 0 s: maximise tokens
        return [int(np.flatnonzero(a)[-1]) + 1 for a in allowed]
    sizes = np.arange(1, top + 1, dtype=np.float64)
    alpha = np.array([[r.alpha] for r in rows], dtype=np.float64)
    ctx = np.array([[r.new_context] for r in rows], dtype=np.float64)
    below = np.minimum(alpha, 1.0)
    geometric = (1.0 - below**sizes) / np.where(below < 1.0, 1.0 - below, 1.0)
    gain = np.where(alpha >= 1.0, sizes, np.where(sizes <= 1, 1.0, geometric))  # expected_tokens per cell
    drafts = sizes > 1
    # each cell's share of the step time: its target tokens, and its drafter row and tokens when it drafts
    share = t.per_token * sizes + np.where(drafts, d.per_row + d.per_token * (sizes + ctx), 0.0)
    shared = t.fixed + t.per_row * n
    index = np.arange(n)

    def rate(pick: np.ndarray) -> float:
        return float(gain[index, pick].sum() / (shared + d.fixed + share[index, pick].sum()))

    def true_rate(pick: np.ndarray) -> float:  # the step time by the costs' own formula (their knees)
        b = pick + 1
        drafting = b > 1
        tokens_d = int((b + ctx[:, 0])[drafting].sum())
        return float(gain[index, pick].sum() / (t(n, int(b.sum())) + d(int(drafting.sum()), tokens_d)))

    # case 1: nobody drafts (possible only when no fixed or probe row must draft)
    first = allowed.argmax(axis=1)  # each row's smallest allowed size
    best_pick: np.ndarray | None = None
    lam = 0.0
    if not first.any():
        best_pick = first
        lam = n / t(n, n) * (1.0 + min_gain)  # a drafting pick must beat this
    # case 2: the drafter runs (its fixed cost paid): Dinkelbach on the separable ratio over the picks where
    # some row drafts, from lam; stop once the rate stops rising. With a knee the step time is not separable
    # (tokens below the knee are free, above it cost per_token): Dinkelbach runs at several token prices
    # (full, fractions, free), each pick is rated at the true cost, the best rate is kept.
    can_draft = allowed[:, 1:].any(axis=1)
    knees = t.knee > 0 or d.knee > 0
    base_pick, base_lam = best_pick, lam
    for price in KNEE_PRICES if knees else (1.0,):
        if knees:
            share = price * t.per_token * sizes + np.where(drafts, d.per_row + price * d.per_token * (sizes + ctx), 0.0)
        pick_p, lam_p = base_pick, base_lam
        for _ in range(max_iter):
            score = np.where(allowed, gain - lam_p * share, -np.inf)
            pick = score.argmax(axis=1)
            if not pick.any():  # the best drafting pick: one row switched, the one that loses least
                if not can_draft.any():  # no row can draft: case 1 was the only choice
                    break
                alt = score[:, 1:].argmax(axis=1) + 1
                loss = np.where(can_draft, score[index, alt] - score[index, pick], -np.inf)
                i = int(loss.argmax())
                pick = pick.copy()
                pick[i] = alt[i]
            new = true_rate(pick) if knees else rate(pick)
            if pick_p is not None and new <= lam_p * (1 + 1e-12):
                break
            pick_p, lam_p = pick, new
        if pick_p is not None and (best_pick is None or lam_p > lam * (1 + 1e-12)):
            best_pick, lam = pick_p, lam_p
    assert best_pick is not None
    return [int(b) + 1 for b in best_pick]


class ProbeSchedule:
    """When rows that have not drafted lately must draft one whole block again (see the module docstring).

    Per sampling regime (greedy: False, sampled: True), not per row: requests are short next to a backoff,
    so a row's own misses would never grow its wait, and every request of a regime where drafting does not
    pay would be probed about once. One probe step serves every stale row of its regime (the drafter's fixed
    cost paid once). A probe step that misses (its rows accepted fewer than half of their drafts) doubles
    that regime's wait, up to 2^max_backoff x `every` steps, so a regime whose traffic changes is still
    tried now and then; a hit resets it (the estimate, and the prior new rows start from, must catch up)."""

    def __init__(self, every: int = 32, max_backoff: int = 4):
        self.every, self.max_backoff = every, max_backoff
        self.misses: dict[bool, int] = {}  # per regime: probe steps in a row that missed
        self.next_step: dict[bool, int] = {}  # per regime: the first step at which it may probe again

    def due(self, step: int, rows: Sequence[tuple[bool, int]]) -> list[bool]:
        """For rows given as (sampled, the step they last drafted at): whether each must probe now."""
        if self.every <= 0:
            return [False] * len(rows)
        open_regimes = {sampled for sampled, _ in rows if step >= self.next_step.get(sampled, 0)}
        return [sampled in open_regimes and last <= step - self.every for sampled, last in rows]

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
) -> CostModel:
    """Time the target (and drafter) on a grid of (rows, block) at a fixed context; fit both costs.

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
    t_samples = [(r, t, s) for (kind, r, t), s in best.items() if kind == "target"]
    d_samples = [(r, t, s) for (kind, r, t), s in best.items() if kind == "drafter"]
    target_cost = LinearCost.fit(t_samples)
    drafter_cost = LinearCost.fit(d_samples) if len(d_samples) >= 3 else LinearCost()
    model = CostModel(target_cost, drafter_cost)
    for kind, samples in (("target", t_samples), ("drafter", d_samples)):
        for r, t, sec in samples:  # online refits start from the start-up grid
            model.observe(kind, r, t, sec, correct=False)
    return model
