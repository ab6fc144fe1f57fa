"""Speculative decoding with a DFlash drafter: one batched loop (`loop.BatchDecoder`) for every entry point.

Terminology
    row           one request inside the loop; a row of the target's and the drafter's sessions.
    block         the tokens one round verifies for a row: its last committed token, then block_size - 1
                  drafted tokens (block size 1: the target alone, plain autoregressive decoding).
    round         one draft-and-verify of a row's block; a step runs one round for every running row.
    bonus token   the token the target picks itself after the accepted drafts (where the first rejected
                  draft stood, or after the last one): every round commits at least one token.
    tau           mean tokens committed per round, bonus included (`GenerationStats.mean_acceptance_length`);
                  the speedup is about tau x t(target step) / t(round).
    feature layers the target layers whose hidden states the drafter is conditioned on
                  (`feature_layer_ids`: the drafter reads them, the target must expose them).
    block policy  chooses each verify row's block size per step (`policy.BlockPolicy`): `FixedBlocks`, or
                  `adaptive.AdaptiveBlocks`, from a cost model of the passes (`cost`) and each row's
                  acceptance estimate (`estimates`).
    probe         a forced full block for a row that has not drafted lately, so that its acceptance
                  estimate is measured again (`estimates.ProbeSchedule`).
    proposer      where a round's drafts come from (`proposers.Proposer`, chosen per request by
                  `GenerationConfig.proposer`): the drafter's block (sized by the block policy), runs read
                  out of the request's own tokens, or a per-round choice between them; the registry
                  (`proposers.PROPOSERS`) lists them. Asked per row after the block policy (`Proposer.pick`
                  -> `Pick`: proposer, block, run); a new method is one subclass of `proposers.Proposer`.
    max_block     the largest DFlash block a row may use this step (`StepRows.max_block`: the decoder's
                  block size, the drafter's trained block, the tokens the row has left).
    block         the tokens a row verifies in a round (`Pick.block`, `BatchRow.block`: its last step's).

A step: the block policy sizes each row's DFlash block within `max_block`; each row's proposer picks its
proposal; ONE drafter call for the rows that picked a DFlash block (none if no row did: the others' features
wait in their backlog); ONE target pass verifies every row's block; the row's acceptance rule judges it (a
suffix run is deterministic: `acceptance.accept_deterministic`).

Pieces: `request` (settings, validation, results), `row` (one request in the loop), `loop` (the step), `sessions`
(the batch's rows in the engines' sessions, and the engine calls), `driving` (running requests to the end),
`step` (what a step hands around), `acceptance` (greedy match and rejection sampling), `proposers` / `suffix` (where
drafts come from), `sampling`, `processors` (logits adjustments), `stopping`, `detokenizer`, `grammar` (structured outputs), `errors`, `policy` /
`adaptive` / `cost` / `estimates` (the block-size policies). No module here imports the loop but this one.
"""

from .adaptive import AdaptiveBlocks
from .grammar import GrammarError, GrammarSpec, compile_grammar
from .loop import BatchDecoder
from .policy import BlockPolicy, FixedBlocks
from .processors import LogitsAdjustment
from .proposers import PROPOSERS, Pick, Proposer
from .request import (
    MAX_TOP_LOGPROBS,
    ContextLengthError,
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    InputError,
    Round,
    RoundTimings,
    TokenLogprob,
)
from .row import BatchRow
from .sampling import SamplingParams
from .step import StepProfile, StepResult, StepRows

__all__ = [
    "AdaptiveBlocks",
    "BatchDecoder",
    "BatchRow",
    "BlockPolicy",
    "ContextLengthError",
    "FixedBlocks",
    "GrammarError",
    "GrammarSpec",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "LogitsAdjustment",
    "MAX_TOP_LOGPROBS",
    "PROPOSERS",
    "Pick",
    "Proposer",
    "Round",
    "RoundTimings",
    "SamplingParams",
    "StepProfile",
    "StepResult",
    "StepRows",
    "TokenLogprob",
    "compile_grammar",
]
