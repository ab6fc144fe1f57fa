"""What the adaptive policy estimates per row and per regime: acceptance, its prior, when to probe.

alpha, a row's per-position acceptance, is a running estimate (`AcceptanceTracker`): accepted drafts over
accepted + rejections, with decay, so a row whose drafts keep failing drafts less; a row that does not draft
drifts back towards the prior, so it is tried again later. New rows start from what recent requests of their
sampling regime measured (`AcceptancePrior`), leaning on it as strongly as those requests were alike (`Spread`).

Probes exist because the estimates feed on themselves: a row that does not draft measures nothing, so one
unlucky early round (or a pessimistic prior) at a batch size where drafting pays only at the true acceptance
would keep it at block 1 for good, and the prior that new rows start from would learn nothing either. Rows
that have not drafted lately are probed, a few per regime on the same step (`ProbeSchedule`), so the
drafter's fixed cost is paid once per probe step, not once per row; where probes keep missing, the next probe
of that sampling regime (greedy or sampled) comes half as often each time (each probed row's backlog is the
cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


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


# How strongly a new row's estimate leans on its regime's prior, in pseudo-observations (`AcceptancePrior.strength`):
# never less than a tracker's own default (one failed first round must not end a row's drafting). The prior does
# not decay and a row's own trials do (about 1 / (1 - decay) rounds' worth are kept), so at the cap a row that
# departs from its regime moves its estimate part of the way, more the longer its blocks; the cap bounds that.
MAX_PRIOR_WEIGHT = 64.0


class Spread(NamedTuple):
    """A regime's finished requests, as moving means over requests: their measured acceptance, its square, and
    its binomial sampling variance (what a request's own few trials add to the spread between requests)."""

    mean: float = 0.0
    square: float = 0.0
    noise: float = 0.0
    requests: int = 0

    def between(self) -> float:
        """The variance of acceptance between requests: the measured spread less each one's own noise."""
        return self.square - self.mean * self.mean - self.noise

    def add(self, measured: float, noise: float, weight: float) -> Spread:
        w = max(weight, 1.0 / (self.requests + 1))  # plain means until the moving ones have requests enough
        return Spread(
            (1 - w) * self.mean + w * measured,
            (1 - w) * self.square + w * measured * measured,
            (1 - w) * self.noise + w * noise,
            self.requests + 1,
        )


@dataclass
class AcceptancePrior:
    """Where a new request's estimate starts: per sampling regime (greedy or sampled), the acceptance that
    recently finished requests of that regime measured (a moving average over requests). A drafter hits far
    more often at T=0 than at T=1; from one shared guess every request would spend its first rounds learning
    its regime again, and at T=1 that is several failed blocks per request.

    And how strongly it leans on that start (`strength`): a beta prior fitted by moments to the spread of
    acceptance between the regime's finished requests, each request's own sampling noise taken out. Where
    requests accept alike, a row's few rounds say less about it than the prior does, and trusting them drafts
    long blocks for the rows they happen to overrate; where they differ (some prompts the drafter knows, some
    it does not) a row must be told apart quickly, and the prior stays weak."""

    start: float = 0.6
    weight: float = 0.2  # per finished request
    min_rounds: int = 2  # requests that drafted fewer rounds say too little
    spread_weight: float = 0.05  # per finished request: a variance needs more requests than a mean
    min_requests: int = 8  # before this many, the spread is not known and the prior is the tracker's default
    alpha: dict[bool, float] = field(default_factory=dict)
    spread: dict[bool, Spread] = field(default_factory=dict)  # per regime, moving by `spread_weight`

    def tracker(self, sampled: bool) -> AcceptanceTracker:
        return AcceptanceTracker(prior_alpha=self.alpha.get(sampled, self.start), prior_weight=self.strength(sampled))

    def strength(self, sampled: bool) -> float:
        """Pseudo-observations of the prior for a new row of this regime: a beta distribution with the regime's
        mean and between-request variance v has m(1 - m) / v - 1 of them; within [the tracker's default,
        MAX_PRIOR_WEIGHT]."""
        least = AcceptanceTracker.prior_weight
        spread = self.spread.get(sampled, Spread())
        if spread.requests < self.min_requests:
            return least
        v = spread.between()  # about the spread's own mean, not `alpha` (which follows the regime faster)
        if v <= 0.0:  # requests differ no more than their own noise says they would
            return MAX_PRIOR_WEIGHT
        return min(MAX_PRIOR_WEIGHT, max(least, spread.mean * (1.0 - spread.mean) / v - 1.0))

    def observe(self, sampled: bool, row: AcceptanceTracker) -> None:
        trials = row.total_accepted + row.total_rejected
        if row.drafted_rounds < self.min_rounds or trials == 0:  # (a perfect drafter's rounds reject nothing)
            return
        measured = row.total_accepted / trials
        old = self.alpha.get(sampled, self.start)
        self.alpha[sampled] = (1 - self.weight) * old + self.weight * measured
        own_noise = measured * (1.0 - measured) / trials
        self.spread[sampled] = self.spread.get(sampled, Spread()).add(measured, own_noise, self.spread_weight)


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
        probe on one step, those of least backlog (0: every stale row, for a CPU's batches of a few short rows,
        where every probe is cheap). Among hundreds of stale rows (a GPU's batches), probing them all makes the
        drafter take in every row's backlog and the target verify a whole block per row in one step; a few rows
        tell whether the regime hits, a hit row drafts on, and the prior new rows start from learns from it.
        More rows cost mixed traffic where drafting barely pays, fewer find too few of the rows worth drafting
        (`GPU_PROBE_ROWS`)."""
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
