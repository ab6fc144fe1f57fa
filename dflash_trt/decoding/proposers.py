"""Proposers: where a row's draft comes from each round, beside the block policy (how long a DFlash block may be)
and the acceptance rule (how the target judges a draft).

    dflash   the DFlash drafter's block, of the size the block policy chose (`policy.BlockPolicy`); the drafts come
             from the step's one batched drafter call
    suffix   a run read out of the request's own tokens after the longest suffix that occurred before
             (`suffix.SuffixAutomaton`); costs no drafter pass, only the verify tokens
    hybrid   per row and round whichever of the two (or none) earns the most expected tokens per second

A proposer is asked once per row and step (`Proposer.pick`, after the block policy chose the row's DFlash block)
and returns a `Pick`: which proposer the round uses, the row's block (its last token + the drafts) and, for a
deterministic run, its tokens. What a proposer keeps per request lives in the row (`RowDrafts`): the suffix
automaton and the two acceptance estimates, each corrected by the rounds that proposer ran. A new draft method is
a class with `name`, `uses_drafter`, `uses_suffix` and `pick`, and a line in `PROPOSER_TYPES`.

A step where no row picks a DFlash block makes no drafter call; the rows' context features wait in their backlog
for their next DFlash draft, as a paused row's do. A row without a drafter (none loaded, or it failed under
`drafter_fallback`) is offered only suffix runs.

The choice (`best_run`, `HybridProposer.pick`) rates each option by expected committed tokens over the seconds the
row's round costs: `Prices.row_s` (its share of a one-token step) plus what the option adds: the step to a pass of
drafts (`draft_s`, once) and a verify token per draft (`token_s`), and for a DFlash block the row's drafter share
and its tokens. Expected tokens of b - 1 drafts at
per-position acceptance alpha: `estimates.expected_tokens(alpha, b)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from .estimates import AcceptanceTracker, expected_tokens
from .suffix import SharedWalk, SuffixAutomaton, SuffixMatch

PROPOSERS = ("dflash", "suffix", "hybrid")
# The longest suffix run verified in one round: a run long enough for a rewrite's unchanged stretches, short enough
# that a miss wastes few verify tokens (the choice prices each run length, this only bounds the search).
SUFFIX_MAX_RUN = 16
# A suffix match's prior per-position acceptance is 1 - PRIOR_HALF / (PRIOR_HALF + m + h - 1) for match length m and
# h recurrences of the context: 0.2 for a one-token match seen once, 0.5 at 4 tokens, 0.8 at 16. A longer context
# that recurred more often predicts its continuation better; the row's own suffix rounds then correct the estimate.
PRIOR_HALF = 4.0
MAX_PRIOR = 0.95


class Pick(NamedTuple):
    """One row's proposal for one round."""

    proposer: str  # "dflash", "suffix" or "none" (the target alone this round)
    block: int  # tokens the row verifies: its last committed token + the drafts (1: none)
    drafts: tuple[int, ...] = ()  # a suffix run's tokens (a DFlash block's come from the drafter call)


NO_PICK = Pick("none", 1)


class Prices(NamedTuple):
    """Seconds a row's round costs, as the step's cost model or measured line prices them: a round of k >= 1
    drafts costs row_s + draft_s + k x token_s (`Prices.verify_s`), plus the drafter's part for a DFlash block.

    draft_s is apart from token_s because a pass of one token is not on the line of the larger ones (on a CPU a
    one-token pass multiplies vectors, a larger one matrices: `cost.LinearCost`): the first draft pays that step
    once, each further one only the line's slope. Folded into a per-token price, the step would be paid again
    by every drafted token, and a 16-token run would look several times dearer than the pass it makes."""

    row_s: float = 1.0  # the row's share of a step where every row verifies one token
    token_s: float = 0.0  # one more verify token
    drafter_row_s: float = 0.0  # the row's share of the drafter pass (a DFlash block only)
    drafter_token_s: float = 0.0  # one more drafted token (a DFlash block only)
    draft_s: float = 0.0  # what any draft adds once: a pass of more tokens than rows over the line's slope

    def verify_s(self, drafts: int) -> float:
        """The row's seconds of a round that verifies `drafts` drafted tokens (0: its last token alone)."""
        return self.row_s + (self.draft_s + self.token_s * drafts if drafts > 0 else 0.0)


def suffix_prior(match: SuffixMatch) -> float:
    """The prior per-position acceptance of a suffix run, from its match length and recurrences (PRIOR_HALF)."""
    return min(MAX_PRIOR, 1.0 - PRIOR_HALF / (PRIOR_HALF + match.length + match.hits - 1))


@dataclass
class RowDrafts:
    """What the proposers keep for one request: its suffix automaton (None unless a suffix proposer serves it), its
    walk through the decoder's shared automaton of earlier outputs (None without one) and the acceptance estimate
    of each proposer's drafts, updated by that proposer's rounds only."""

    suffix: SuffixAutomaton | None = None
    shared: SharedWalk | None = None
    suffix_estimate: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    dflash_estimate: AcceptanceTracker = field(default_factory=AcceptanceTracker)

    def add(self, tokens: list[int]) -> None:
        """Tokens committed (the prompt, then each round's): the suffix automaton grows by them."""
        if self.suffix is not None:
            self.suffix.extend_all(tokens)
        if self.shared is not None:
            self.shared.add(tokens)

    def match(self, most: int) -> SuffixMatch | None:
        """The longer of the request's own match and its match in the earlier outputs (own on a tie)."""
        own = self.suffix.match(most) if self.suffix is not None else None
        other = self.shared.match(most) if self.shared is not None else None
        if other is not None and (own is None or other.length > own.length):
            return other
        return own

    def observe(self, proposer: str, drafted: int, accepted: int) -> None:
        """A round's outcome: its proposer's estimate learns from it; the other one's drifts back to its prior."""
        if self.suffix is None:  # a DFlash row: nothing here reads the estimates
            return
        for name, tracker in (("suffix", self.suffix_estimate), ("dflash", self.dflash_estimate)):
            tracker.update(drafted if name == proposer else 0, accepted if name == proposer else 0)

    def suffix_alpha(self, match: SuffixMatch) -> float:
        """A run's per-position acceptance: the match's prior, corrected by the row's own suffix rounds."""
        self.suffix_estimate.prior_alpha = suffix_prior(match)
        return self.suffix_estimate.alpha

    @property
    def suffix_states(self) -> int:
        return self.suffix.size if self.suffix is not None else 0


def best_run(drafts: RowDrafts, most: int, prices: Prices) -> tuple[Pick, float]:
    """The suffix run of the best expected tokens per second for a row that may verify `most` drafts, and that
    rate (NO_PICK and the rate of verifying one token where no suffix repeats)."""
    none_rate = 1.0 / prices.row_s
    match = drafts.match(min(most, SUFFIX_MAX_RUN)) if most > 0 else None
    if match is None:
        return NO_PICK, none_rate
    alpha = drafts.suffix_alpha(match)
    best, best_rate = NO_PICK, none_rate
    for k in range(1, len(match.continuation) + 1):
        rate = expected_tokens(alpha, k + 1) / prices.verify_s(k)
        if rate > best_rate:
            best, best_rate = Pick("suffix", k + 1, match.continuation[:k]), rate
    return best, best_rate


def dflash_rate(drafts: RowDrafts, block: int, prices: Prices) -> float:
    """Expected tokens per second of the row's DFlash block of `block` tokens (its own estimate)."""
    if block < 2:
        return 1.0 / prices.row_s
    drafter_s = prices.drafter_row_s + prices.drafter_token_s * (block - 1)
    return expected_tokens(drafts.dflash_estimate.alpha, block) / (prices.verify_s(block - 1) + drafter_s)


class ProposingRow(Protocol):
    """What a proposer reads of a row (`row.BatchRow`): its proposers' state and the most tokens a draft may hold
    (what it has left, within a fixed block size)."""

    drafts: RowDrafts

    @property
    def max_drafts(self) -> int: ...


class Proposer(Protocol):
    name: str
    uses_drafter: bool  # its rows hold a drafter row (and the target hands them features)
    uses_suffix: bool  # its rows keep a suffix automaton

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        """The row's proposal this round; `block`: the DFlash block the policy chose for it (1: none)."""


class DFlashProposer:
    """The DFlash drafter's block, as the block policy sized it (the loop's behaviour before proposers)."""

    name, uses_drafter, uses_suffix = "dflash", True, False

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        return Pick("dflash", block) if block >= 2 else NO_PICK


class SuffixProposer:
    """Suffix runs alone: no drafter; the run of the best expected tokens per second, or none."""

    name, uses_drafter, uses_suffix = "suffix", False, True

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        return best_run(row.drafts, row.max_drafts, prices)[0]


class HybridProposer:
    """Per row and round, the DFlash block or the suffix run of the higher expected tokens per second (`best_run`,
    `dflash_rate`); none when neither beats verifying one token. A row that cannot draft gets suffix runs."""

    name, uses_drafter, uses_suffix = "hybrid", True, True

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        run, run_rate = best_run(row.drafts, row.max_drafts, prices)
        if block >= 2 and dflash_rate(row.drafts, block, prices) >= run_rate:
            return Pick("dflash", block)
        return run


PROPOSER_TYPES: dict[str, type[DFlashProposer] | type[SuffixProposer] | type[HybridProposer]] = {
    "dflash": DFlashProposer,
    "suffix": SuffixProposer,
    "hybrid": HybridProposer,
}


def proposer_for(name: str) -> Proposer:
    """The proposer called `name` (PROPOSERS)."""
    if name not in PROPOSER_TYPES:
        raise ValueError(f"proposer must be one of {PROPOSERS}, got {name!r}")
    return PROPOSER_TYPES[name]()
