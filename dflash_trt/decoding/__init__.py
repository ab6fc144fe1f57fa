"""Speculative decoding: proposer (drafter session), scorer (target session), acceptance, bookkeeping."""

from .decode import (
    ContextLengthError,
    Generation,
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    InputError,
    Round,
    RoundTimings,
    SpeculativeDecoder,
)
from .sampling import SamplingParams

__all__ = [
    "ContextLengthError",
    "Generation",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "Round",
    "RoundTimings",
    "SamplingParams",
    "SpeculativeDecoder",
]
