"""Proposers: where a row's draft comes from each round, beside the block policy (how long a DFlash block may be)
and the acceptance rule (how the target judges a draft).

This module is the registry of proposers: every subclass of `Proposer` with a `name` is one (`PROPOSERS`,
`proposer_for`), and the command lines' choices, the request schema, the benchmarks and the simulator take their
names from it. What a proposer can do is on its class, and the loop asks the class, never the name:

    uses_drafter    its rows hold a drafter row and the target hands them features
    keeps_suffix    its rows keep a suffix automaton (and a walk through the shared one of earlier outputs)
    deterministic   its drafts are tokens chosen without sampling: their proposal distribution is one-hot
                    (`acceptance.accept_deterministic`), so no drafter distribution is judged
    weighs_cost     its choice reads the round's prices (`Prices`); a proposer that does not is never priced
    reproducible    a seed and a fixed block size give the same text: its choice reads no timing and no other
                    request's output
    takes_forced    a row's grammar may add the tokens it forces to its drafts, ahead of and between them
                    (guided.py: deterministic drafts, verified like any other)
    learn(...)      what the row's proposer learns from a round (its acceptance estimates)
    pick(...)       the row's proposal this round

A proposer is asked once per row and step (`Proposer.pick`, after the block policy chose the row's DFlash block)
and returns a `Pick`: the proposer whose drafts the round verifies (None: the target alone), the row's block (its
last token + the drafts) and, for deterministic drafts, their tokens. A hybrid's pick names the proposer it chose,
so a round's record (`request.Round.proposer`) says which one drafted. Proposers keep no per-row state: what a
request keeps lives in its row (`RowDrafts`). A step where no row picks a drafter's block makes no drafter call;
the rows' context features wait in their backlog for their next DFlash draft. A row without a drafter (none
loaded, or it failed under `drafter_fallback`) is offered only the drafter-free proposals.

The rates (`best_run`, `HybridProposer.pick`) are expected committed tokens over the seconds the row's round costs:
`Prices.row_s` (its share of a one-token step) plus what the option adds to the step as the block policy planned it
(`Prices.runs`: the target's pass at the other rows' blocks and the row's 1 + k tokens, less at its 1; from a
measured line instead, the step to a pass of drafts once and a verify token per draft), and for a DFlash block the
row's share of the drafter pass among the rows that draft with it, and its tokens.
Expected tokens of b - 1 drafts at per-position acceptance alpha: `estimates.expected_tokens(alpha, b)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

import numpy as np

from .cost import price
from .estimates import AcceptanceTracker, expected_tokens
from .suffix import SharedWalk, StepBudget, SuffixAutomaton, SuffixMatch

if TYPE_CHECKING:
    from .cost import CostModel

# The longest suffix run verified in one round: a run long enough for a rewrite's unchanged stretches, short enough
# that a miss wastes few verify tokens (the choice prices each run length, this only bounds the search).
SUFFIX_MAX_RUN = 16
# A suffix run's per-token probabilities, as SuffixDecoding makes them (Arctic Inference's `SuffixTree::speculate`,
# csrc/suffix_decoding/suffix_tree.cc at 0a11e6ad; vLLM's suffix method passes the same knobs,
# vllm/config/speculative.py `suffix_decoding_min_token_prob` / `suffix_decoding_max_spec_factor`): from counts.
# Token j of a run is right, given the ones before were, with probability (agreed + W x p0) / (seen + W): `seen` and
# `agreed` count how often its context (the match extended by the run's first j tokens) was the match and the next
# token then came, and how often it was the token the run predicted (suffix.py); p0 = 1 - PRIOR_HALF /
# (PRIOR_HALF + context length) is what a context of that length predicts before it has counts. A frequent short
# context with many continuations thus falls to its counts' low rate instead of rising with its recurrences.
# `dflash-trt bench suffix-prior` fits PRIOR_HALF, PRIOR_WEIGHT and MAX_PRIOR on chat answers (results/suffix-prior
# holds the fit and its held-out check). The fit (1, 1, 0.99) is not coded: it trusts a fresh context of 2-3 tokens
# at 0.67-0.75, which answers repeating their prompt earn but text that does not repeat does not; there, with no
# counts yet, its runs lose to the target alone (docs/benchmarks.md, the suffix prior; test_hybrid_pricing.py's
# text that never repeats).
PRIOR_HALF = 4.0
PRIOR_WEIGHT = 2.0
MAX_PRIOR = 0.95  # no run is certain: the target may always choose otherwise
# A run stops where its cumulative probability (the chance all its tokens so far are right) falls below this
# (Arctic's and vLLM's `min_token_prob`, same default).
MIN_TOKEN_PROB = 0.1
# A run holds at most this factor times its match's length in tokens (Arctic's and vLLM's `max_spec_factor`): a
# short match is weak evidence of a long repeat.
MAX_SPEC_FACTOR = 2.0
# A match shorter than this proposes nothing (TensorRT-LLM's suffix-automaton enhancer drafts from a match of at
# least `threshold` tokens, `SAEnhancerConfig.threshold`, default 4; tensorrt_llm/_torch/speculative/
# suffix_automaton.py at aba25256): one or two tokens of context mostly recur by chance.
MIN_MATCH = 2
# What a suffix run must earn over verifying one token, as a fraction (the adaptive policy's `min_gain` for a
# DFlash block): a margin for what the prices leave out (the run's acceptance work, a prior that overrates a match)
# that a run of a sound match clears many times over, and a run that barely looks worth it does not.
RUN_MIN_GAIN = 0.1
# Suffix runs temper what their counts predict by how runs did (`RunCalibration`): accepted draft tokens over the
# expected ones, a row's own weighed against the decoder's recent runs (`RunPrior`) as this many expected tokens.
CALIBRATION_WEIGHT = 4.0
# The decoder's runs (one pool per sampling regime, as the block policy's acceptance prior): each run's outcome
# first scales the earlier ones by this (about the last 200 runs count), and they weigh against runs that all came
# as this many expected tokens. The pool only moves when runs are taken: after a spell of failed runs, new rows
# take only strong matches' runs until those come true.
RUN_PRIOR_DECAY = 0.995
RUN_PRIOR_WEIGHT = 4.0
# the name of a proposer as the round record writes it when nothing was drafted (the target alone)
NO_DRAFT_NAME = "none"


class Pick(NamedTuple):
    """One row's proposal for one round."""

    proposer: Proposer | None  # whose drafts the round verifies (None: the target alone this round)
    block: int  # tokens the row verifies: its last committed token + the drafts (1: none)
    drafts: tuple[int, ...] = ()  # a deterministic proposer's tokens (a DFlash block's come from the drafter call)

    @property
    def name(self) -> str:
        """The proposer's name as a round's record writes it (`NO_DRAFT_NAME` for the target alone)."""
        return self.proposer.name if self.proposer is not None else NO_DRAFT_NAME


NO_PICK = Pick(None, 1)


class Prices(NamedTuple):
    """Seconds a row's round costs, as the step's cost model or measured line prices them: a round of k >= 1
    drafts costs row_s + draft_s + k x token_s (`Prices.verify_s`), plus the drafter's part for a DFlash block.

    draft_s is apart from token_s because a pass of one token is not on the line of the larger ones (on a CPU a
    one-token pass multiplies vectors, a larger one matrices: `cost.EngineCost`): the first draft pays that step
    once, each further one only the line's slope. Folded into a per-token price, the step would be paid again
    by every drafted token, and a 16-token run would look several times dearer than the pass it makes."""

    row_s: float = 1.0  # the row's share of a step where every row verifies one token
    token_s: float = 0.0  # one more verify token
    drafter_row_s: float = 0.0  # what the row adds to the drafter pass (a DFlash block only)
    drafter_token_s: float = 0.0  # one more drafted token (a DFlash block only)
    draft_s: float = 0.0  # what any draft adds once: a pass of more tokens than rows over the line's slope
    # what k = 1, 2, ... drafts add to the step, priced at the step's own tokens (`from_cost`); beyond it, the line
    runs: tuple[float, ...] = ()

    def verify_s(self, drafts: int) -> float:
        """The row's seconds of a round that verifies `drafts` drafted tokens (0: its last token alone)."""
        if drafts <= 0:
            return self.row_s
        if drafts <= len(self.runs):
            return self.row_s + self.runs[drafts - 1]
        return self.row_s + self.draft_s + self.token_s * drafts

    @classmethod
    def from_cost(cls, cost: CostModel, blocks: Sequence[int], most: int) -> list[Prices] | None:
        """Each row's prices in a step whose rows verify `blocks` (the block policy's choice), from the engines'
        cost model; None where the model prices a step at 0 s (unfitted).

        A row's run of k <= `most` drafts is priced at the tokens the step really holds: the other rows' blocks,
        then the row's 1 + k (`runs`), so a bent cost (a GPU's tiles) prices the run where the step sits on it,
        not at a few tokens a row. A row's part of the drafter's pass is what the pass costs more with it than
        without it among the rows that draft (those of a block of 2 or more; at least the row pricing its own
        block): the whole pass for a row that drafts alone, the pass's slope where many draft. What a row choosing
        a suffix run saves is that much, not an average share of the pass's fixed cost, which the others pay
        whether it leaves or not. (Each row is priced as if the others stay: the last few drafting rows leaving
        together, which would save the whole pass, is not weighed.)"""
        target, drafter = cost.current()
        rows = len(blocks)
        if not rows or target(rows, rows) <= 0:
            return None
        sizes = np.asarray(blocks, dtype=np.float64)
        rest = sizes.sum() - sizes  # the other rows' tokens
        grid = rest[:, None] + 1.0 + np.arange(most + 1, dtype=np.float64)[None, :]
        step = price(target, rows, grid.ravel()).reshape(rows, most + 1)
        drafting = max(1, int((sizes >= 2).sum()))
        drafted = drafter(drafting, 2 * drafting)
        without = drafter(drafting - 1, 2 * (drafting - 1)) if drafting > 1 else 0.0
        row_s = target(rows, rows) / rows
        extra = np.maximum(0.0, step[:, 1:] - step[:, :1])  # what k drafts add to the step, k = 1..most
        return [
            cls(
                row_s=row_s,
                drafter_row_s=max(0.0, drafted - without),
                drafter_token_s=max(0.0, drafter(drafting, 4 * drafting) - drafted) / (2 * drafting),
                runs=tuple(extra[r].tolist()),
            )
            for r in range(rows)
        ]

    @classmethod
    def from_line(cls, line: tuple[float, float] | None, rows: int) -> Prices | None:
        """A row's prices from a measured line of step seconds (`chunking.ChunkPacer.line`: the step of the rows
        alone, and what a token adds); no drafter price (a policy without a cost model never weighs it)."""
        if line is None or line[0] <= 0:
            return None
        return cls(row_s=line[0] / rows, token_s=line[1])


def suffix_prior(length: int, half: float = PRIOR_HALF, cap: float = MAX_PRIOR) -> float:
    """What a context of `length` tokens predicts before it has counts (PRIOR_HALF)."""
    return min(cap, 1.0 - half / (half + length))


def continuation_prob(
    seen: int,
    agreed: int,
    length: int,
    half: float = PRIOR_HALF,
    weight: float = PRIOR_WEIGHT,
    cap: float = MAX_PRIOR,
) -> float:
    """The probability a run token is right, given the ones before it were: its context's counts over the prior
    of its context's length (the module's table)."""
    return min(cap, (agreed + weight * suffix_prior(length, half, cap)) / (seen + weight))


def continuation_probs(match: SuffixMatch) -> list[float]:
    """`continuation_prob` of each run token; a token past the counts the match carries has its context's length
    prior alone."""
    counts = match.counts
    return [
        continuation_prob(*(counts[j] if j < len(counts) else (0, 0)), match.length + j)
        for j in range(len(match.continuation))
    ]


def run_reach(match: SuffixMatch) -> list[float]:
    """The run's usable prefix and, per token, the chance it and every token before it are right (its cumulative
    probability): nothing for a match shorter than MIN_MATCH, at most MAX_SPEC_FACTOR x the match's length of
    tokens, cut where the cumulative probability falls below MIN_TOKEN_PROB."""
    if match.length < MIN_MATCH:
        return []
    reach, chance = [], 1.0
    for p in continuation_probs(match)[: int(MAX_SPEC_FACTOR * match.length)]:
        chance *= p
        if chance < MIN_TOKEN_PROB:
            break
        reach.append(chance)
    return reach


@dataclass
class RunPrior:
    """How the decoder's recent suffix runs did against what their counts predicted, the requests of one sampling
    regime together: where a new request's calibration starts. Like the block policy's acceptance prior it pools
    counts of accepted tokens, no tokens: it tells a request how far to trust a match, never what another request
    wrote."""

    expected: float = 0.0  # draft tokens the runs were expected to have accepted (decayed)
    accepted: float = 0.0  # draft tokens they did (decayed)

    @property
    def factor(self) -> float:
        return min(1.0, (self.accepted + RUN_PRIOR_WEIGHT) / (self.expected + RUN_PRIOR_WEIGHT))

    def update(self, expected: float, accepted: int) -> None:
        self.expected = RUN_PRIOR_DECAY * self.expected + expected
        self.accepted = RUN_PRIOR_DECAY * self.accepted + accepted


@dataclass
class RunCalibration:
    """How one request's suffix runs did against what their counts predicted (counts gathered on text the request
    may not resemble): a factor on a run's expected accepted tokens, its runs' accepted draft tokens over their
    expected ones, starting from the decoder's (`RunPrior`, weighing CALIBRATION_WEIGHT expected tokens; without
    one, from runs that all came). Never above 1: where runs do as predicted or better the counts stand; where they
    keep failing the request gets fewer and shorter runs, and its DFlash blocks (or the target alone) the rounds."""

    expected: float = 0.0  # draft tokens its runs were expected to have accepted
    accepted: float = 0.0  # draft tokens they did
    prior: RunPrior | None = None  # the decoder's, which each of the row's runs also updates
    # False for a row under a grammar: its drafts mix the tokens the grammar forces (accepted by construction) into
    # the run and cut the run where the grammar forbids it, so a round's outcome is not the run's
    learns: bool = True

    @property
    def factor(self) -> float:
        start = self.prior.factor if self.prior is not None else 1.0
        return min(1.0, (self.accepted + CALIBRATION_WEIGHT * start) / (self.expected + CALIBRATION_WEIGHT))

    def update(self, expected: float, accepted: int) -> None:
        if not self.learns:
            return
        self.expected += expected
        self.accepted += accepted
        if self.prior is not None:
            self.prior.update(expected, accepted)


@dataclass
class RowDrafts:
    """What the proposers keep for one request: its suffix automaton (None unless its proposer keeps one), its
    walk through the decoder's shared automaton of earlier outputs (None without one), how its suffix runs did
    against their prediction and the DFlash acceptance estimate, which the row's proposer updates
    (`Proposer.learn`).

    The DFlash estimate is the block policy's where the policy keeps one (`follow_policy`): the same tracker that
    sized the row's block, seeded from what the row's sampling regime measured and learning from every DFlash
    round. A second estimate of the same drafter, started from a guess and learning only from the rounds a
    hybrid happened to give DFlash, would judge the policy's block on less than the policy knew."""

    suffix: SuffixAutomaton | None = None
    shared: SharedWalk | None = None
    calibration: RunCalibration = field(default_factory=RunCalibration)  # its suffix runs, predicted and kept
    run_expected: float = 0.0  # the accepted draft tokens its last suffix pick's counts predicted (`best_run`)
    dflash_estimate: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    policy_estimate: bool = False  # the block policy keeps (and learns) `dflash_estimate`
    budget: StepBudget | None = None  # the loop's per-step intake of waiting tokens (None: SETTLE_TOKENS a match)

    def follow_policy(self, tracker: AcceptanceTracker) -> None:
        """The block policy's estimate of the row's DFlash acceptance becomes the one the proposers read; the
        policy, not the proposer, learns it from then on."""
        self.dflash_estimate, self.policy_estimate = tracker, True

    def add(self, tokens: list[int]) -> None:
        """Tokens committed (the prompt, then each round's): the suffix automaton grows by them."""
        if self.suffix is not None:
            self.suffix.extend_all(tokens)
        if self.shared is not None:
            self.shared.add(tokens)

    def match(self, most: int) -> SuffixMatch | None:
        """The longer of the request's own match and its match in the earlier outputs (own on a tie). In the
        loop's thread: the request's automaton takes in its waiting tokens here."""
        own = self.suffix.match(most, self.budget) if self.suffix is not None else None
        other = self.shared.match(most) if self.shared is not None else None
        if other is not None and (own is None or other.length > own.length):
            return other
        return own

    @property
    def suffix_states(self) -> int:
        return self.suffix.size if self.suffix is not None else 0

    @property
    def suffix_bytes(self) -> int:
        """The request's suffix structure's memory, in real bytes (`SuffixAutomaton.nbytes`)."""
        return self.suffix.nbytes if self.suffix is not None else 0


def learn_run(drafts: RowDrafts, used: Proposer | None, accepted: int) -> None:
    """After a round the suffix proposer drafted (`used`), its run's outcome against what `best_run` expected."""
    if used is SUFFIX:
        drafts.calibration.update(drafts.run_expected, accepted)


def best_run(drafts: RowDrafts, most: int, prices: Prices) -> tuple[Pick, float]:
    """The suffix run of the best expected tokens per second for a row that may verify `most` drafts, and that
    rate (NO_PICK and the rate of verifying one token where no usable run repeats or no run beats that rate by
    RUN_MIN_GAIN). A run of k tokens is expected to commit 1 + the sum of its first k cumulative probabilities
    (`run_reach`), that sum tempered by how the row's runs did (`RunCalibration`); the pick's sum as the counts
    predict it (untempered: the calibration compares outcomes with the counts) is kept for `learn_run`."""
    none_rate = 1.0 / prices.row_s
    match = drafts.match(min(most, SUFFIX_MAX_RUN)) if most > 0 else None
    if match is None:
        return NO_PICK, none_rate
    best, best_rate, reach, factor = NO_PICK, none_rate * (1.0 + RUN_MIN_GAIN), 0.0, drafts.calibration.factor
    for k, chance in enumerate(run_reach(match), start=1):
        reach += chance
        rate = (1.0 + factor * reach) / prices.verify_s(k)
        if rate > best_rate:
            best, best_rate, drafts.run_expected = Pick(SUFFIX, k + 1, match.continuation[:k]), rate, reach
    return best, best_rate if best.proposer is not None else none_rate


def dflash_rate(drafts: RowDrafts, block: int, prices: Prices) -> float:
    """Expected tokens per second of the row's DFlash block of `block` tokens (its own estimate)."""
    if block < 2:
        return 1.0 / prices.row_s
    drafter_s = prices.drafter_row_s + prices.drafter_token_s * (block - 1)
    return expected_tokens(drafts.dflash_estimate.alpha, block) / (prices.verify_s(block - 1) + drafter_s)


class ProposingRow(Protocol):
    """What a proposer reads of a row (`row.BatchRow`): its tokens so far, its proposers' state and the most
    tokens a draft may hold (what it has left, within a fixed block size)."""

    prompt_ids: list[int]
    generated: list[int]
    drafts: RowDrafts

    @property
    def max_drafts(self) -> int: ...


REGISTRY: dict[str, Proposer] = {}  # name -> the proposer (they keep no per-row state: one instance serves all)


class Proposer:
    """A draft method: its capabilities (the module's table) and `pick`. A subclass with a `name` registers
    itself; the base class is no proposer."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for --help and the request schema: where its drafts come from
    uses_drafter: ClassVar[bool] = False
    keeps_suffix: ClassVar[bool] = False
    deterministic: ClassVar[bool] = False
    weighs_cost: ClassVar[bool] = False
    reproducible: ClassVar[bool] = True
    takes_forced: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            if cls.name in REGISTRY or cls.name == NO_DRAFT_NAME:
                raise ValueError(f"a proposer is already called {cls.name!r}")
            REGISTRY[cls.name] = cls()

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        """The row's proposal this round; `block`: the DFlash block the policy chose for it (1: none)."""
        raise NotImplementedError

    def learn(self, drafts: RowDrafts, used: Proposer | None, drafted: int, accepted: int) -> None:
        """What this row's proposer learns from a round whose drafts `used` proposed (None: nothing drafted),
        `accepted` of `drafted` kept: nothing unless its choice reads an estimate."""

    def __repr__(self) -> str:
        return f"<proposer {self.name}>"


class DFlashProposer(Proposer):
    """The DFlash drafter's block, as the block policy sized it (its acceptance estimate is the policy's)."""

    name, summary = "dflash", "the drafter's block"
    uses_drafter = True

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        return Pick(self, block) if block >= 2 else NO_PICK


class SuffixProposer(Proposer):
    """Suffix runs alone: no drafter; the run of the best expected tokens per second, or none."""

    name = "suffix"
    summary = "runs of the request's own earlier tokens after the longest repeated suffix: no drafter pass"
    keeps_suffix = deterministic = weighs_cost = True
    reproducible = False  # the run length weighs timed prices; the shared structure holds other requests' outputs

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        return best_run(row.drafts, row.max_drafts, prices)[0]

    def learn(self, drafts: RowDrafts, used: Proposer | None, drafted: int, accepted: int) -> None:
        learn_run(drafts, used, accepted)


class HybridProposer(Proposer):
    """Per row and round, the DFlash block or the suffix run of the higher expected tokens per second (`best_run`,
    `dflash_rate`). Where the block policy chose a DFlash block it weighed that block against no draft already:
    the hybrid takes the block unless a suffix run earns more, and never falls back to no draft on a lower
    estimate of its own. Without a block (1) the suffix run or none; a row that cannot draft gets suffix runs."""

    name, summary = "hybrid", "per row and round whichever of dflash and suffix earns more tokens per second"
    uses_drafter = keeps_suffix = weighs_cost = True
    reproducible = False

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        run, run_rate = best_run(row.drafts, row.max_drafts, prices)
        if block < 2:
            return run
        if run.proposer is None or dflash_rate(row.drafts, block, prices) >= run_rate:
            return Pick(DFLASH, block)
        return run

    def learn(self, drafts: RowDrafts, used: Proposer | None, drafted: int, accepted: int) -> None:
        learn_run(drafts, used, accepted)
        if not drafts.policy_estimate:  # else the policy learns it, from every DFlash round of the row
            # its outcome where DFlash drafted; else it drifts back to its prior (a round of no DFlash draft)
            own = used is DFLASH
            drafts.dflash_estimate.update(drafted if own else 0, accepted if own else 0)


DFLASH, SUFFIX = REGISTRY["dflash"], REGISTRY["suffix"]


class NgramProposer(Proposer):
    """Prompt lookup, as Hugging Face's `PromptLookupCandidateGenerator.get_candidates` does it
    (transformers, src/transformers/generation/candidate_generator.py at 00a11b6a): the row's last n tokens, n
    from `max_ngram_size` down to 1, are looked up in its tokens so far (prompt and output); the first
    occurrence, left to right, that has tokens after it proposes up to `num_output_tokens` of them (within what
    the row may draft). No drafter and nothing priced: a deterministic draft wherever the n-gram recurs. Unlike
    Hugging Face's it does not cut the run at an end-of-text token: the loop's stop rules cut what is committed,
    so a draft past one costs only its verify tokens."""

    name = "ngram"
    summary = "prompt lookup: the tokens that followed the last n-gram's first earlier occurrence"
    deterministic = True

    def __init__(self, max_ngram_size: int = 2, num_output_tokens: int = 10):  # Hugging Face's defaults
        if max_ngram_size < 1 or num_output_tokens < 1:
            raise ValueError(
                f"max_ngram_size and num_output_tokens must be >= 1, got {max_ngram_size}, {num_output_tokens}"
            )
        self.max_ngram_size, self.num_output_tokens = max_ngram_size, num_output_tokens

    def pick(self, row: ProposingRow, block: int, prices: Prices) -> Pick:
        run = self.lookup(row.prompt_ids + row.generated, min(self.num_output_tokens, row.max_drafts))
        return Pick(self, len(run) + 1, run) if run else NO_PICK

    def lookup(self, tokens: list[int], most: int) -> tuple[int, ...]:
        """Up to `most` tokens that followed the first earlier occurrence of the longest matching tail n-gram."""
        count = len(tokens)
        if most < 1:
            return ()
        for n in range(min(self.max_ngram_size, count - 1), 0, -1):
            tail, at = tokens[-n:], 0
            while True:
                try:
                    at = tokens.index(tail[0], at)
                except ValueError:
                    break
                if at + n < count and tokens[at : at + n] == tail:  # the tail itself has nothing after it
                    return tuple(tokens[at + n : min(at + n + most, count)])
                at += 1
        return ()


# ---- the registry's names: every proposer class above is in them ----------------------------------------------
PROPOSERS = tuple(REGISTRY)
DEFAULT_PROPOSER = DFLASH.name  # what a request that names none drafts with (the library's; a server sets its own)


def proposer_for(name: str) -> Proposer:
    """The proposer called `name` (PROPOSERS)."""
    if name not in REGISTRY:
        raise ValueError(f"proposer must be one of {PROPOSERS}, got {name!r}")
    return REGISTRY[name]


def drafter_drafted(name: str) -> bool:
    """Whether a round recorded as drafted by `name` (`request.Round.proposer`; `NO_DRAFT_NAME`: nothing drafted)
    verified the drafter's tokens."""
    proposer = REGISTRY.get(name)
    return proposer is not None and proposer.uses_drafter


def proposers_help() -> str:
    """The proposers and where each one's drafts come from, for --help and the request schema."""
    return ", ".join(f"{p.name} ({p.summary})" for p in REGISTRY.values())
