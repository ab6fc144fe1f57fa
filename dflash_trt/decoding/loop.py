"""The decoding loop: every active request (a *row*) advances by one step of plan -> draft -> verify -> accept.

    plan     each running row's block (the block policy, `policy.BlockPolicy`) and proposal (its proposer,
             `proposers.Proposer.pick`); the joining rows' prompt chunks (`chunking.plan_chunks`)
    draft    ONE drafter call, ragged, for the rows whose pick uses the drafter
    verify   ONE target call, ragged: each running row's block, then each joining row's next prompt chunk
    accept   per row: the acceptance rule (`acceptance.AcceptanceRule.accept`), rollback, commit; a prompt's
             last chunk gives its row's first token; the policy observes the step, finished rows leave

One request is a batch of one: the CLI, `bench`, the evaluation scripts, the HTTP server, the Triton BLS and the
simulator all run this loop. Each row draws from its own sampling generator in a fixed order (its first token,
then per round its drafts and their acceptance), so a seeded row with a fixed block size returns the same tokens
alone or in any batch, up to the float rounding of batched matmuls; with adaptive sizes a seed fixes the
distribution, not the text.

Terminology:
    row       one request in the loop (`row.BatchRow`): *joining* while its prompt enters the target's
              cache, *running* from its first token on
    block     the tokens a running row verifies in a round: its last committed token + its drafts (1: the
              target alone); the block policy sizes a DFlash block within the row's `max_block`
    pick      a row's proposal for a round (`proposers.Pick`): whose drafts, the block, deterministic tokens
    chunk     a piece of a joining row's prompt that rides in the verify pass (`chunking.Chunk`)
    round     one row's draft, verify and accept within a step, committed as a `request.Round`
    backlog   context features the target computed for a row that its drafter has not taken in yet

Pieces beside the loop: the batch's rows, their places in the engines' sessions and the engine calls
(`sessions.RowBook`), running requests to the end (`driving.RunsToEnd`), the chunks (`chunking`), the
proposers' prices (`proposers.Prices`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

from ..runtime.base import Draft, DrafterEngine, DrafterSession, TargetEngine, TargetSession
from .chunking import BACKLOG_STEPS, STALL, STEP_TOKENS, Chunk, ChunkPacer, plan_chunks
from .cost import CostModel, measure_costs
from .driving import RunsToEnd
from .grammar import compile_grammar
from .healing import PromptHealer
from .policy import BlockPolicy, FixedBlocks
from .prompting import default_stop_ids, encode_text
from .proposers import REGISTRY, SUFFIX_MAX_RUN, Pick, Prices, RunPrior
from .request import GenerationConfig, Round, RoundTimings, check_engines, validate_request
from .row import BatchRow
from .sessions import RowBook
from .sharing import MAX_TENANTS, TenantSuffixes
from .step import StepResult, StepRows
from .suffix import SHARED_TOKENS, SharedSuffixes, StepBudget

__all__ = ["PREFILL_MODES", "BatchDecoder"]

PREFILL_MODES = ("chunked", "separate")
# the larger batch `BatchDecoder.target_cost` times besides one row: the line between them prices the batches between
TARGET_COST_ROWS = 4


def _run_priors() -> dict[bool, RunPrior]:
    """A fresh pool of suffix-run outcomes per sampling regime (keyed by `not SamplingParams.greedy`)."""
    return {False: RunPrior(), True: RunPrior()}


class BatchDecoder(RunsToEnd):
    """All active requests of one worker; `step()` advances every one of them.

    block_size: rows without their own `block_size` use this size (default: the drafter's trained one; 1: the
    target alone); with an adaptive policy it is the largest size the policy may choose, with a fixed one it
    bounds every row's drafts. clock: seconds for every timing the decoder takes and the policy reads (a
    simulation passes its own). prefill: "chunked" (prompts enter in chunks inside the verify pass, paced by
    `step_tokens`, `stall` and `backlog_steps`: chunking.py) or "separate" (each joining prompt whole, in a
    pass of its own before the verify pass, stalling every running row for it). shared_suffix_tokens: the
    tokens of finished outputs kept per tenant for the suffix runs of its later requests (0: none), for at most
    `shared_tenants` tenants; a request shares only with its own tenant (`GenerationConfig.tenant`, sharing.py).

    Threads: `new_row` only validates and builds a row (any thread, e.g. an HTTP handler); `join`, `cancel` and
    `step` belong to the one thread that runs the engines."""

    def __init__(
        self,
        target: TargetEngine,
        drafter: DrafterEngine | None = None,
        tokenizer: Any = None,
        *,
        block_size: int | None = None,
        policy: BlockPolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
        prefill: str = "chunked",
        step_tokens: int = STEP_TOKENS,
        stall: float = STALL,
        backlog_steps: int = BACKLOG_STEPS,
        shared_suffix_tokens: int = SHARED_TOKENS,
        shared_tenants: int = MAX_TENANTS,
    ):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        self.trained_block = check_engines(target, drafter, block_size)
        self.target, self.drafter, self.tokenizer, self.clock = target, drafter, tokenizer, clock
        self.book = RowBook(target, drafter, clock)
        self.policy: BlockPolicy = policy or FixedBlocks()
        self.prefill, self.pacer = prefill, ChunkPacer(step_tokens, stall, backlog_steps)
        self.block_size = block_size or self.trained_block
        self.fixed_block = block_size  # None: the policy's choice; else it bounds every row's drafts
        self._ids = itertools.count()
        # the finished outputs of the rows that keep a suffix structure, per tenant, for the suffix runs of the
        # same tenant's requests that follow
        self.shared_suffixes = TenantSuffixes(shared_suffix_tokens, shared_tenants) if shared_suffix_tokens else None
        self.suffix_budget = StepBudget()  # the waiting tokens all rows' suffix automata take in a step
        # how the rows' suffix runs did against their counts, per sampling regime (sampled or not): where a new row
        # of that regime starts
        self.run_priors = _run_priors()

    def forget_finished_outputs(self) -> None:
        """Empty every tenant's shared suffix structure (same bounds) and start the runs' prior afresh: a benchmark
        running one prompt under several methods calls it before each run, so that no run's suffix drafts read an
        earlier run's output of its prompt or are trusted by how an earlier run's drafts did."""
        self.run_priors = _run_priors()
        if self.shared_suffixes is not None:
            self.shared_suffixes = TenantSuffixes(self.shared_suffixes.max_tokens, self.shared_suffixes.max_tenants)

    def _shared_of(self, config: GenerationConfig) -> SharedSuffixes | None:
        """The shared structure a request with this config reads and feeds: its tenant's (None: no tenant)."""
        return self.shared_suffixes.of(config.tenant) if self.shared_suffixes is not None else None

    @property
    def target_session(self) -> TargetSession:
        return self.book.target_session

    @property
    def drafter_session(self) -> DrafterSession | None:
        return self.book.drafter_session

    @cached_property
    def healer(self) -> PromptHealer:
        return PromptHealer(self.tokenizer, int(self.target.vocab_size))

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def default_stop_ids(self) -> tuple[int, ...]:
        return default_stop_ids(self.tokenizer)

    # ---- membership ---------------------------------------------------------------------
    def add(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> BatchRow:
        """Queue a request; its prefill begins with the next step."""
        return self.join(self.new_row(prompt_ids, config))

    def new_row(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> BatchRow:
        """Validate a request (InputError / ContextLengthError) and make its row, not yet part of the batch.
        Touches no engine and no shared state: safe from any thread."""
        prompt = [int(t) for t in prompt_ids]
        validate_request(prompt, config, self.target, self.drafter)
        healing, grammar = None, None
        if config.grammar is not None:  # GrammarError (a 400) for a grammar that cannot be served
            grammar = compile_grammar(config.grammar, self.tokenizer, int(self.target.vocab_size))
            # the grammar's end of text ends the row; no healing: the grammar decides the output's first token
            ends = tuple(t for t in grammar.end_ids if t not in config.stop_token_ids)
            config = replace(config, stop_token_ids=config.stop_token_ids + ends)
        elif config.heal_prompt and self.tokenizer is not None:
            prompt, healing = self.healer.heal(prompt)
        size = config.block_size or self.block_size
        proposer = REGISTRY[config.proposer]  # a name validate_request knows
        can_draft = self.drafter is not None and size != 1 and proposer.uses_drafter
        row = BatchRow(
            row_id=next(self._ids),
            prompt_ids=prompt,
            config=config,
            tokenizer=self.tokenizer,
            can_draft=can_draft,
            clock=self.clock,
            healing=healing,
            proposer=proposer,
            shared=self._shared_of(config),
            suffix_budget=self.suffix_budget,
            run_prior=self.run_priors[not config.sampling.greedy],
            fixed_block=config.block_size or self.fixed_block,
            grammar=grammar,
        )
        row.stats.block_size = size if can_draft else 1
        return row

    def join(self, row: BatchRow) -> BatchRow:
        """Add a row made by `new_row`; its prefill begins with the next step."""
        return self.book.join(row)

    def cancel(self, row: BatchRow) -> None:
        """Finish a row now (client gone, deadline): frees its cache slots; its tokens so far stay."""
        if not row.done:
            row.finish_reason = "cancelled"
        self._release(row)

    @property
    def active(self) -> list[BatchRow]:
        return self.book.active

    @property
    def joining(self) -> list[BatchRow]:
        return self.book.joining

    @property
    def running(self) -> list[BatchRow]:
        return self.book.running

    def _release(self, row: BatchRow) -> None:
        self.policy.forget(row)
        self.book.leave(row)
        row.leave_suffixes(self._shared_of(row.config))

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> StepResult:
        """Advance every active row once: the rounds committed, the rows that failed, the step's profile. Rows
        that finished are released, after the policy saw the step."""
        result = StepResult()
        started = self.clock()
        self.suffix_budget.renew()
        verifying = list(self.running)
        if self.joining and (self.prefill == "separate" or not verifying):
            result.rounds += self.book.prefill(result.profile)
        if verifying:
            result.rounds += self._round(verifying, result)
        result.profile.committed_tokens = sum(len(r.token_ids) for _, r in result.rounds)
        result.profile.total_s = self.clock() - started
        self.policy.observe(result)
        self.pacer.observe(result.profile)
        self._observe_cost(result)
        for row, _ in result.rounds:
            if row.done:
                self._release(row)
        if self.shared_suffixes is not None:  # finished outputs enter it a bounded part a step
            self.shared_suffixes.settle()
        return result

    def _round(self, rows: list[BatchRow], result: StepResult) -> list[tuple[BatchRow, Round]]:
        """One plan -> draft -> verify -> accept round for every running row; the joining rows' prompt chunks ride
        in its target pass. Each row's timings: the shared passes', plus its own acceptance."""
        prof = result.profile
        started = self.clock()
        picks, chunks = self._plan(rows)
        planned = self.clock()
        drafts = self.book.draft(rows, picks, prof)
        rows, drafts, picks = self._drop_failed(rows, drafts, picks, result.failed)
        proposals = [row.proposal(pick, d) for row, pick, d in zip(rows, picks, drafts)]
        drafted = self.clock()  # the drafter's pass and drawing the drafts from its output
        if not rows and not chunks:
            return []
        lengths = [self.book.target_session.length(row.target_row_id) for row in rows]
        outs = self.book.verify(rows, proposals, chunks, prof)
        verified = self.clock()
        rounds = []
        for row, pick, proposal, out, length in zip(rows, picks, proposals, outs, lengths):
            accepting = self.clock()
            new, accepted = self.book.accept(row, proposal, out, length)
            own = self.clock() - accepting  # this row's acceptance and rollback; the passes are shared
            row.stats.draft_time_s += drafted - planned
            row.stats.verify_time_s += verified - drafted
            timings = RoundTimings.of_round(started, planned, drafted, verified, own)
            committed = row.commit(new, drafted=proposal.ids, accepted=accepted, timings=timings, used=pick.proposer)
            rounds.append((row, committed))
        rounds += self.book.take_chunks(chunks, outs[len(rows) :])
        prof.policy_s, prof.draft_s, prof.verify_s = planned - started, drafted - planned, verified - drafted
        prof.accept_s = self.clock() - verified
        return rounds

    # ---- plan ---------------------------------------------------------------------------
    def _plan(self, rows: list[BatchRow]) -> tuple[list[Pick], list[Chunk]]:
        """This step's picks (each row's block and whose drafts) and prompt chunks (`chunking.plan_chunks`: the
        policy prices the pass with the chunks, which are then cut to what the chosen blocks leave)."""
        picks: list[Pick] = []

        def choose(step: StepRows) -> int:
            picks.extend(self._pick(rows, self.policy.choose(step)))
            for row, pick in zip(rows, picks):
                row.block = pick.block
            return sum(row.block for row in rows)

        step = StepRows.of(rows, self.block_size, self.trained_block, batch=len(self.running))
        joining = self.joining if self.prefill == "chunked" else []
        chunks = plan_chunks(self.pacer, joining, sum(row.block for row in rows), step, choose)
        return picks, chunks

    def _pick(self, rows: list[BatchRow], blocks: list[int]) -> list[Pick]:
        """Each row's proposal from its proposer, given the DFlash block the policy chose for it; priced only
        where some row's proposer weighs prices."""
        if not any(row.proposer.weighs_cost for row in rows):
            return [row.proposer.pick(row, block, Prices()) for row, block in zip(rows, blocks)]
        prices = self._prices(rows, blocks)
        return [row.proposer.pick(row, block, p) for row, block, p in zip(rows, blocks, prices)]

    def _prices(self, rows: list[BatchRow], blocks: list[int]) -> list[Prices]:
        """Each row's round's seconds in this step, its blocks as the policy chose them: from `run_cost`; where
        that prices a step at 0 s, from the step seconds the chunk pacer measured, else unpriced (every option
        costs one row's step)."""
        most = max(SUFFIX_MAX_RUN, max((row.max_drafts for row in rows), default=0))
        priced = Prices.from_cost(self.run_cost, blocks, most)
        if priced is not None:
            return priced
        return [Prices.from_line(self.pacer.line(), len(rows)) or Prices()] * len(rows)

    @property
    def run_cost(self) -> CostModel:
        """The cost model the rows' runs are priced by: the policy's where it keeps one, else the target's own
        (`target_cost`, timed on first reading)."""
        cost = getattr(self.policy, "cost", None)
        return cost if isinstance(cost, CostModel) else self.target_cost

    @cached_property
    def target_cost(self) -> CostModel:
        """The target's cost, for a decoder whose policy has no cost model (no drafter, fixed blocks) and whose
        rows weigh prices: timed on first need (`cost.measure_costs`, the target alone, one row and
        `TARGET_COST_ROWS`, blocks of 1, 2 and SUFFIX_MAX_RUN) in a session of its own, then corrected by every
        verify pass the decoder runs (`_observe_cost`). Without it a run is priced by the pacer's line, which
        leaves out the step from a one-token pass to a pass of drafts (`proposers.Prices`): on a CPU that step
        is most of what a missed run costs, and suffix runs on text that does not repeat lose to the target
        alone. Timing it delays that first step by the grid's passes (a second or so on a CPU)."""
        return measure_costs(
            self.target,
            None,
            rows=(1, TARGET_COST_ROWS),
            blocks=(1, 2, SUFFIX_MAX_RUN),
            context=min(128, self.target.max_context // 2),
            repeats=3,
            clock=self.clock,
        )

    def _observe_cost(self, result: StepResult) -> None:
        """The decoder's own target cost (`target_cost`, where it was timed) follows the verify passes it runs."""
        prof = result.profile
        if "target_cost" in self.__dict__ and prof.verify_rows and not prof.chunk_rows:
            self.target_cost.observe_target(prof.verify_rows, prof.verify_tokens, prof.verify_s)

    def _drop_failed(
        self, rows: list[BatchRow], drafts: list[Draft | None], picks: list[Pick], failed: list[BatchRow]
    ) -> tuple[list[BatchRow], list[Draft | None], list[Pick]]:
        """Rows the drafter failed without a fallback leave now (into `failed`); the others go on to verify."""
        for row in rows:
            if row.done:
                failed.append(row)
                self._release(row)
        keep = [i for i, row in enumerate(rows) if not row.done]
        return [rows[i] for i in keep], [drafts[i] for i in keep], [picks[i] for i in keep]
