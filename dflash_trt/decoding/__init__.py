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

Pieces: `request` (settings, validation, results), `loop` (the step), `step` (what a step hands around),
`acceptance` (greedy match and rejection sampling), `sampling`, `processors` (logits adjustments),
`stopping`, `detokenizer`, `policy` / `adaptive` / `cost` / `estimates` (the block-size policies).
"""

from .adaptive import AdaptiveBlocks
from .loop import BatchDecoder, BatchRow
from .policy import BlockPolicy, FixedBlocks
from .processors import LogitsAdjustment
from .request import (
    ContextLengthError,
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    InputError,
    Round,
    RoundTimings,
)
from .sampling import SamplingParams
from .step import StepProfile, StepResult, StepRows

__all__ = [
    "AdaptiveBlocks",
    "BatchDecoder",
    "BatchRow",
    "BlockPolicy",
    "ContextLengthError",
    "FixedBlocks",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "LogitsAdjustment",
    "Round",
    "RoundTimings",
    "SamplingParams",
    "StepProfile",
    "StepResult",
    "StepRows",
]
