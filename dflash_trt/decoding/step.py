"""What one step of the loop hands around: the verify rows as its policy sees them, and what the step did.

`StepRows` goes from the decoder to its block-size policy (`policy.BlockPolicy.choose`); `StepResult` comes
back from `BatchDecoder.step()` to whoever drives the loop (server, Triton BLS, simulator, benchmarks) and to
the policy (`observe`). Everything a caller needs about a step is in its result: nobody reads the decoder's
fields after a step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .request import Round

if TYPE_CHECKING:
    from .row import BatchRow


@dataclass(frozen=True)
class StepRows:
    """The verify rows of one step, one index per row; the per-row facts as arrays (a server's step holds
    hundreds of rows, and the policy runs every step)."""

    rows: Sequence[BatchRow]  # [rows] the rows themselves (ids, prompts, settings)
    max_block: np.ndarray  # [rows] int64: the largest DFlash block the row may use: the decoder's block size, the
    # drafter's trained block (1 without a drafter row) and the tokens the row has left
    fixed: np.ndarray  # [rows] int64: the request's own block size, capped the same way; 0 = none
    sampled: np.ndarray  # [rows] bool: the row samples (T > 0); greedy rows accept differently
    backlog: np.ndarray  # [rows] float64: feature rows the drafter takes in before this row's next draft
    batch: int  # rows in the batch this step, those that joined (prefilled) on it included
    # the joining rows' prompt chunks that ride in this step's target pass (chunked prefill): the policy prices
    # the pass with them, since the step pays for them whatever blocks it chooses
    chunk_rows: int = 0
    chunk_tokens: int = 0
    # the verify tokens the pass holds before the token budget cuts those chunks while prompts queue behind them
    # (`chunking.ChunkPacer.verify_room`); 0 = no such bound
    verify_room: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def of(cls, rows: Sequence[BatchRow], block_size: int, trained_block: int, batch: int) -> StepRows:
        """The rows' facts in one pass: each row's block at most the decoder's `block_size`, the drafter's
        `trained_block` (1 without a drafter row) and what the row has left; a request's own `block_size`
        (capped the same way) is kept. `batch`: the rows running this step."""
        n = len(rows)
        # per row: tokens left, own block size (0: none), has a drafter row, sampled, backlog
        state = np.array(
            [(r.remaining, r.config.block_size or 0, r.drafter_row is not None, r.sampled, r.backlog) for r in rows],
            dtype=np.float64,
        ).reshape(n, 5)
        bound = np.minimum(np.where(state[:, 2] > 0, trained_block, 1), state[:, 0]).astype(np.int64)
        own = state[:, 1].astype(np.int64)
        return cls(
            rows=rows,
            max_block=np.minimum(block_size, bound),
            fixed=np.where(own > 0, np.minimum(own, bound), 0),
            sampled=state[:, 3] > 0,
            backlog=state[:, 4],
            batch=batch,
        )


@dataclass
class StepProfile:
    """Where one step's time went, and its shape (rows, tokens per pass)."""

    prefill_rows: int = 0  # the prefill pass of its own (separate prefill; chunked with no row running)
    prefill_tokens: int = 0
    chunk_rows: int = 0  # prompt chunks that rode in the verify pass (chunked prefill)
    chunk_tokens: int = 0
    draft_rows: int = 0
    draft_tokens: int = 0  # block tokens + new context rows the drafter ran
    verify_rows: int = 0
    verify_tokens: int = 0
    committed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # chosen block size per verify row
    prefill_s: float = 0.0
    policy_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # the verify pass, its prompt chunks included
    accept_s: float = 0.0  # acceptance, sampling, rollbacks, commits, stop checks
    total_s: float = 0.0

    @property
    def target_rows(self) -> int:
        """Rows in the verify pass: the running rows' blocks and the prompt chunks."""
        return self.verify_rows + self.chunk_rows

    @property
    def target_tokens(self) -> int:
        """Tokens in the verify pass: the running rows' blocks and the prompt chunks."""
        return self.verify_tokens + self.chunk_tokens

    @property
    def overhead_s(self) -> float:
        """Python outside the passes and the acceptance: batching, padding, bookkeeping."""
        return max(0.0, self.total_s - self.prefill_s - self.policy_s - self.draft_s - self.verify_s - self.accept_s)


@dataclass
class StepResult:
    """One step: the rounds it committed (prefills included, in row order), the rows whose engine failed
    (`BatchRow.error` set, finish reason "error", already released) and where its time went. Iterating it
    gives the (row, round) pairs."""

    rounds: list[tuple[BatchRow, Round]] = field(default_factory=list)
    failed: list[BatchRow] = field(default_factory=list)
    profile: StepProfile = field(default_factory=StepProfile)
    # the policy's running corrections of its cost model, per engine (observed / predicted seconds), when it
    # has one: set by the policy as it observes the step
    cost_correction: dict[str, float] = field(default_factory=dict)

    def __iter__(self) -> Iterator[tuple[BatchRow, Round]]:
        return iter(self.rounds)

    def __len__(self) -> int:
        return len(self.rounds)

    @property
    def verified(self) -> list[tuple[BatchRow, Round]]:
        """The draft-and-verify rounds (not the prefills' first tokens)."""
        return [(row, rnd) for row, rnd in self.rounds if not rnd.prefill]
