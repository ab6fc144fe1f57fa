"""How each verify row gets its block size, step by step: the one interface every block-size policy implements.

The decoder asks its policy once per step (`choose`), tells it what the step did (`observe`) and that a row
left (`forget`); a policy keeps whatever per-row or per-regime state it needs, keyed by row id, and never
reaches into the decoder. Implementations: `FixedBlocks` here (every row its largest allowed block),
`adaptive.AdaptiveBlocks` (the block sizes of the best expected tokens per second), and the simulator's
references and peers' schedules (`sim/policies.py`).

What the decoder settles before asking (`StepRows.max_block`, `StepRows.fixed`): a row's block is at most the
decoder's block size, the drafter's trained block (1 for a row without a drafter) and the tokens it has
left; a request's own `block_size` is kept. A policy chooses within that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from .step import StepResult, StepRows

if TYPE_CHECKING:
    from .row import BatchRow


class BlockPolicy(Protocol):
    def choose(self, step: StepRows) -> list[int]:
        """Each verify row's block size this step ([rows], each in 1..max_block; a fixed row's own size)."""

    def observe(self, result: StepResult) -> None:
        """What a step did: its rounds (prefills included) and its passes' costs."""

    def forget(self, row: BatchRow) -> None:
        """A row left the decoder (finished, cancelled or failed): drop its state."""


def own_or_max(step: StepRows) -> list[int]:
    """Every row's own block size, else its largest allowed one."""
    return cast(list[int], np.where(step.fixed > 0, step.fixed, step.max_block).tolist())


class FixedBlocks:
    """Every row drafts its largest allowed block (the decoder's block size; 1 = the target alone)."""

    def choose(self, step: StepRows) -> list[int]:
        return own_or_max(step)

    def observe(self, result: StepResult) -> None:
        return None

    def forget(self, row: BatchRow) -> None:
        return None
