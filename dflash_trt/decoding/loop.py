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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from typing import Any

import torch

from ..runtime.base import Draft, DrafterEngine, DrafterSession, TargetEngine, TargetOutput, TargetSession
from .acceptance import NO_DRAFT, Proposal, Scores
from .chunking import BACKLOG_STEPS, STALL, STEP_TOKENS, Chunk, ChunkPacer, plan_chunks, rest_of_prompts
from .cost import CostModel
from .healing import PromptHealer
from .policy import BlockPolicy, FixedBlocks
from .prompting import default_stop_ids, encode_text
from .proposers import REGISTRY, Pick, Prices, Proposer
from .request import GenerationConfig, GenerationResult, InputError, Round, RoundTimings, validate_request
from .row import BatchRow
from .sampling import next_token
from .step import StepProfile, StepResult, StepRows
from .suffix import SHARED_TOKENS, SharedSuffixes

__all__ = ["PREFILL_MODES", "BatchDecoder"]

PREFILL_MODES = ("chunked", "separate")


class BatchDecoder:
    """All active requests of one worker; `step()` advances every one of them.

    Terminology:
        row       one request in the loop (`row.BatchRow`): *joining* while its prompt enters the target's
                  cache, *running* from its first token on
        block     the tokens a running row verifies in a round: its last committed token + its drafts (1: the
                  target alone); the block policy sizes a DFlash block within the row's `max_block`
        pick      a row's proposal for a round (`proposers.Pick`): whose drafts, the block, deterministic tokens
        chunk     a piece of a joining row's prompt that rides in the verify pass (`chunking.Chunk`)
        round     one row's draft, verify and accept within a step, committed as a `request.Round`
        backlog   context features the target computed for a row that its drafter has not taken in yet

    block_size: rows without their own `block_size` use this size (default: the drafter's trained one; 1: the
    target alone); with an adaptive policy it is the largest size the policy may choose, with a fixed one it
    bounds every row's drafts. clock: seconds for every timing the decoder takes and the policy reads (a
    simulation passes its own). prefill: "chunked" (prompts enter in chunks inside the verify pass, paced by
    `step_tokens`, `stall` and `backlog_steps`: chunking.py) or "separate" (each joining prompt whole, in a
    pass of its own before the verify pass, stalling every running row for it). shared_suffix_tokens: the
    finished outputs kept for later requests' suffix runs (0: none).

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
    ):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if drafter is not None and tuple(drafter.feature_layer_ids) != tuple(target.feature_layer_ids):
            raise ValueError(
                f"target exposes features of layers {target.feature_layer_ids}, drafter needs {drafter.feature_layer_ids}"
            )
        self.trained_block = drafter.block_size if drafter is not None else 1
        if block_size is not None and not 1 <= block_size <= self.trained_block:
            raise ValueError(f"block_size must be in 1..{self.trained_block} for this drafter, got {block_size}")
        self.target, self.drafter, self.tokenizer, self.clock = target, drafter, tokenizer, clock
        self.policy: BlockPolicy = policy or FixedBlocks()
        self.prefill, self.pacer = prefill, ChunkPacer(step_tokens, stall, backlog_steps)
        self.block_size = block_size or self.trained_block
        self.fixed_block = block_size  # None: the policy's choice; else it bounds every row's drafts
        self.joining: list[BatchRow] = []
        self.running: list[BatchRow] = []
        self._ids = itertools.count()
        # the finished outputs of the rows that keep a suffix structure, for the suffix runs of those that follow
        self.shared_suffixes = SharedSuffixes(shared_suffix_tokens) if shared_suffix_tokens else None

    def forget_finished_outputs(self) -> None:
        """Empty the shared suffix structure (same bound): a benchmark running one prompt under several methods
        calls it before each run, so that no run's suffix drafts read an earlier run's output of its prompt."""
        if self.shared_suffixes is not None:
            self.shared_suffixes = SharedSuffixes(self.shared_suffixes.max_tokens)

    # the engines' sessions, made on first use (a non-leader TensorRT-LLM rank never makes one)
    @cached_property
    def target_session(self) -> TargetSession:
        return self.target.new_session()

    @cached_property
    def drafter_session(self) -> DrafterSession | None:
        return self.drafter.new_session() if self.drafter is not None else None

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
        healing = None
        if config.heal_prompt and self.tokenizer is not None:
            prompt, healing = self.healer.heal(prompt)
        size = config.block_size or self.block_size
        proposer = self.proposer(config.proposer)
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
            shared=self.shared_suffixes,
            fixed_block=config.block_size or self.fixed_block,
        )
        row.stats.block_size = size if can_draft else 1
        return row

    @staticmethod
    def proposer(name: str) -> Proposer:
        """The proposer called `name` (`proposers.PROPOSERS`); InputError for any other name."""
        if name not in REGISTRY:
            raise InputError(f"proposer must be one of {tuple(REGISTRY)}, got {name!r}")
        return REGISTRY[name]

    def join(self, row: BatchRow) -> BatchRow:
        """Add a row made by `new_row`; its prefill begins with the next step."""
        self.joining.append(row)
        return row

    def cancel(self, row: BatchRow) -> None:
        """Finish a row now (client gone, deadline): frees its cache slots; its tokens so far stay."""
        if not row.done:
            row.finish_reason = "cancelled"
        self._release(row)

    @property
    def active(self) -> list[BatchRow]:
        return self.joining + self.running

    def _release(self, row: BatchRow) -> None:
        self.policy.forget(row)
        for rows in (self.joining, self.running):
            if row in rows:
                rows.remove(row)
        if row.target_row is not None:
            self.target_session.remove_row(row.target_row)
            row.target_row = None
        self._leave_drafter(row)
        row.leave_suffixes(self.shared_suffixes)

    def _leave_drafter(self, row: BatchRow) -> None:
        if row.drafter_row is not None and self.drafter_session is not None:
            self.drafter_session.remove_row(row.drafter_row)
        row.drafter_row, row.pending, row.backlog = None, [], 0

    # ---- running requests to the end ----------------------------------------------------
    def run(self) -> None:
        while self.active:
            self.step()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        configs: Sequence[GenerationConfig] | GenerationConfig = GenerationConfig(),
    ) -> list[GenerationResult]:
        """Every prompt as one row of the same batch, run to the end. A row's engine error (a drafter that
        raised without `drafter_fallback`) is raised here once all rows are done, as `stream` raises it."""
        if isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        rows = [self.add(p, c) for p, c in zip(prompts, configs)]
        self.run()
        for r in rows:
            if r.error is not None:
                raise r.error
        return [r.result() for r in rows]

    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> Iterator[Round]:
        """One request's rounds as they are committed (the prefill's first token, then one per step); the row is
        cancelled if the caller stops early. Steps the whole batch: use it on a decoder of its own."""
        row = self.add(prompt_ids, config)
        try:
            while not row.done:
                for r, committed in self.step():
                    if r is row:
                        yield committed
            if row.error is not None:
                raise row.error
        finally:
            if not row.done:
                self.cancel(row)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> StepResult:
        """Advance every active row once: the rounds committed, the rows that failed, the step's profile. Rows
        that finished are released, after the policy saw the step."""
        result = StepResult()
        started = self.clock()
        verifying = list(self.running)
        if self.joining and (self.prefill == "separate" or not verifying):
            result.rounds += self._prefill(result.profile)
        if verifying:
            result.rounds += self._round(verifying, result)
        result.profile.committed_tokens = sum(len(r.token_ids) for _, r in result.rounds)
        result.profile.total_s = self.clock() - started
        self.policy.observe(result)
        self.pacer.observe(result.profile)
        for row, _ in result.rounds:
            if row.done:
                self._release(row)
        return result

    def _prefill(self, prof: StepProfile) -> list[tuple[BatchRow, Round]]:
        """Every joining row's prompt (what is left of it) whole, in one target call of its own: separate prefill,
        or chunked prefill with no row running (no row's step to protect)."""
        chunks = rest_of_prompts(self.joining)
        started = self.clock()
        rows, tokens = self._chunk_inputs(chunks)
        features = any(c.row.drafter_row is not None for c in chunks)
        outs = self.target_session.forward(rows, tokens, last_logits_only=True, features=features)
        rounds = self._take_chunks(chunks, outs)
        prof.prefill_rows, prof.prefill_tokens = len(chunks), sum(c.size for c in chunks)
        prof.prefill_s = self.clock() - started
        return rounds

    def _round(self, rows: list[BatchRow], result: StepResult) -> list[tuple[BatchRow, Round]]:
        """One plan -> draft -> verify -> accept round for every running row; the joining rows' prompt chunks ride
        in its target pass. Each row's timings: the shared passes', plus its own acceptance."""
        prof = result.profile
        started = self.clock()
        picks, chunks = self._plan(rows)
        planned = self.clock()
        drafts = self._draft(rows, picks, prof)
        rows, drafts, picks = self._drop_failed(rows, drafts, picks, result.failed)
        proposals = [self._proposal(row, pick, d) for row, pick, d in zip(rows, picks, drafts)]
        drafted = self.clock()  # the drafter's pass and drawing the drafts from its output
        if not rows and not chunks:
            return []
        lengths = [self.target_session.length(row.target_row_id) for row in rows]
        outs = self._verify(rows, proposals, chunks, prof)
        verified = self.clock()
        rounds = []
        for row, pick, proposal, out, length in zip(rows, picks, proposals, outs, lengths):
            accepting = self.clock()
            new, accepted = self._accept(row, proposal, out, length)
            own = self.clock() - accepting  # this row's acceptance and rollback; the passes are shared
            row.stats.draft_time_s += drafted - planned
            row.stats.verify_time_s += verified - drafted
            timings = RoundTimings(
                draft_s=drafted - planned,
                verify_s=verified - drafted + own,
                target_s=verified - drafted,
                accept_s=own,
                total_s=verified - started + own,
            )
            committed = row.commit(new, drafted=proposal.ids, accepted=accepted, timings=timings, used=pick.proposer)
            rounds.append((row, committed))
        rounds += self._take_chunks(chunks, outs[len(rows) :])
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
        prices = self._prices(len(rows)) if any(row.proposer.weighs_cost for row in rows) else Prices()
        return [row.proposer.pick(row, block, prices) for row, block in zip(rows, blocks)]

    def _prices(self, rows: int) -> Prices:
        """A row's round's seconds in a step of `rows` rows: from the policy's cost model where it has one, else
        from the step seconds the chunk pacer measured, else unpriced (every option costs one row's step)."""
        cost = getattr(self.policy, "cost", None)
        prices = Prices.from_cost(cost, rows) if isinstance(cost, CostModel) else None
        return prices or Prices.from_line(self.pacer.line(), rows) or Prices()

    # ---- draft --------------------------------------------------------------------------
    def _draft(self, rows: list[BatchRow], picks: list[Pick], prof: StepProfile) -> list[Draft | None]:
        """ONE drafter call for every row whose pick uses the drafter (None for the others); none when no row's
        does (their features wait in their backlog). A drafter error fails its rows or, under
        `drafter_fallback`, leaves them to the target alone."""
        drafts: list[Draft | None] = [None] * len(rows)
        todo = [i for i, (row, pick) in enumerate(zip(rows, picks)) if row.drafts_with(pick)]
        if not todo or self.drafter_session is None:
            return drafts
        requests = [rows[i].draft_request(picks[i].block) for i in todo]
        try:
            out = self.drafter_session.draft(requests)
        except Exception as e:  # noqa: BLE001 - per-row handling
            for i in todo:
                if rows[i].drafter_failed(e):  # the fallback: the row leaves the drafter for good
                    self._leave_drafter(rows[i])
            return drafts
        for i, draft in zip(todo, out):
            rows[i].pending, rows[i].backlog, drafts[i] = [], 0, draft
        prof.draft_rows = len(todo)
        prof.draft_tokens = sum(q.block_size + int(q.new_features.shape[0]) for q in requests)
        return drafts

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

    @staticmethod
    def _proposal(row: BatchRow, pick: Pick, draft: Draft | None) -> Proposal:
        """The tokens the target verifies for a row: a deterministic proposer's tokens as picked (no distribution:
        its acceptance is the one-hot rule), a drafter's draft through the row's acceptance rule."""
        if pick.proposer is not None and pick.proposer.deterministic:
            return Proposal(torch.tensor(pick.drafts, dtype=torch.long))
        return NO_DRAFT if draft is None else row.rule.propose(draft)

    # ---- verify -------------------------------------------------------------------------
    def _verify(
        self, rows: list[BatchRow], proposals: list[Proposal], chunks: list[Chunk], prof: StepProfile
    ) -> list[TargetOutput]:
        """ONE target call scoring every row's block (its last committed token, then its drafts) and then the
        prompt chunks; the outputs in that order."""
        ids = [[row.generated[-1], *p.ids] for row, p in zip(rows, proposals)]
        sizes = [len(block) for block in ids]
        # one tensor for the batch, viewed per row: a tensor per row costs the host more than the ids do
        blocks = list(torch.split(torch.tensor([t for block in ids for t in block], dtype=torch.long), sizes))
        prof.verify_rows, prof.blocks, prof.verify_tokens = len(rows), sizes, sum(sizes)
        chunk_rows, chunk_tokens = self._chunk_inputs(chunks)
        prof.chunk_rows, prof.chunk_tokens = len(chunks), sum(c.size for c in chunks)
        members = [*rows, *(c.row for c in chunks)]
        return self.target_session.forward(
            [row.target_row_id for row in rows] + chunk_rows,
            blocks + chunk_tokens,
            features=any(row.drafter_row is not None for row in members),
        )

    def _chunk_inputs(self, chunks: list[Chunk]) -> tuple[list[int], list[torch.Tensor]]:
        """The chunks' target rows and tokens; a row's first chunk gives it its rows in the sessions."""
        now = self.clock()
        for c in chunks:
            if c.row.target_row is None:
                c.row.target_row, c.row.prefill_started = self.target_session.add_row(), now
                if c.row.can_draft and self.drafter_session is not None:
                    c.row.drafter_row = self.drafter_session.add_row()
        tokens = [torch.tensor(c.row.prompt_ids[c.start : c.start + c.size], dtype=torch.long) for c in chunks]
        return [c.row.target_row_id for c in chunks], tokens

    # ---- accept -------------------------------------------------------------------------
    def _accept(self, row: BatchRow, proposal: Proposal, out: TargetOutput, length: int) -> tuple[list[int], int]:
        """The row's acceptance rule on its scored block: the accepted drafts plus one token of the target's own
        (the bonus); the target's cache is rolled back to them, the drafter is handed their features. The
        logits stay on the engine's device; only token ids come back."""
        logits = row.adjusted(out.logits, proposal.ids)
        accepted, bonus = row.rule.accept(proposal, Scores.of(logits, out.logits, out.argmax))
        self.target_session.rollback(row.target_row_id, length + accepted + 1)
        if row.drafter_row is not None and out.features is not None:
            row.pending.append(out.features[: accepted + 1])
            row.backlog += accepted + 1
        return proposal.ids[:accepted] + [bonus], accepted

    def _take_chunks(self, chunks: list[Chunk], outs: Sequence[TargetOutput]) -> list[tuple[BatchRow, Round]]:
        """The chunks' outputs: their features join the row's drafter backlog; a prompt's last chunk gives the
        row's first token (the target's logits after the whole prompt), and the row runs from the next step."""
        rounds = []
        for c, out in zip(chunks, outs):
            row = c.row
            row.prefilled += c.size
            if row.drafter_row is not None and out.features is not None:
                row.pending.append(out.features)
                row.backlog += c.size
            if row.prefilled < len(row.prompt_ids):
                continue
            first = next_token(row.adjusted(out.logits[-1:])[-1], row.params, row.generator)
            assert row.prefill_started is not None
            row.stats.prefill_time_s = self.clock() - row.prefill_started
            timings = RoundTimings(target_s=row.stats.prefill_time_s, total_s=row.stats.prefill_time_s)
            self.joining.remove(row)
            self.running.append(row)
            rounds.append((row, row.commit([first], drafted=[], accepted=0, prefill=True, timings=timings)))
        return rounds
