"""The decoding loop: every active request (a *row*) advances by one step: a drafter pass and a target pass.

    step:  plan: block sizes and prompt chunks       the policy (`policy.BlockPolicy`) within the rows' limits;
                                                     the joining rows' prompts within the step's budget of
                                                     tokens and of time (`chunking.ChunkPacer`)
           draft(rows whose block is >= 2)           ONE drafter call, ragged (own context, own block)
           target(every running row + the chunks)    ONE target call, ragged: each running row's block, each
                                                     joining row's next piece of its prompt
           accept / commit / roll back per row       acceptance rule, stop rules, the row's own generator
           take the chunks                           a prompt's last chunk gives the row's first token
           observe                                   the policy sees the step's result, then finished rows leave

One request is a batch of one: the CLI, `bench`, the evaluation scripts, the HTTP server and the Triton
BLS all run this loop.

Chunked prefill (`prefill="chunked"`, the default): a prompt enters in chunks inside the same target pass as
the running rows' verify blocks, so a long prompt arriving never freezes the rows that stream: the chunks
get what the token budget `step_tokens` leaves after the running rows' chosen blocks (at least a quarter of
it, so a full batch never starves a prompt), cut further so that a step with chunks takes at most about
`stall` times the rows' own step (chunking.py). A row whose prompt is not all in is not drafted for; the
drafter is handed its prompt's features chunk by chunk, as the target computes them. With no row running, a
step holds only prompts and the budget protects nobody: the prompts go in whole. `prefill="separate"`
prefills every joining row whole in a call of its own at the start of the step, before the verify pass: a
third pass, which stalls every running row for the whole prefill.

Each row keeps its own sampling generator and draws from it in a fixed order (the first token, then per
round the drafts' sampling and their acceptance), so a seeded row with a fixed block size returns the same tokens alone or in
any batch (up to float rounding of batched matmuls, which can only matter at near-exact ties). With
adaptive sizes a seed fixes the distribution, not the text.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..runtime.base import (
    Draft,
    DrafterEngine,
    DrafterSession,
    DraftRequest,
    TargetEngine,
    TargetOutput,
    TargetSession,
)
from .acceptance import Proposal, greedy_prefix
from .chunking import BACKLOG_STEPS, STALL, STEP_TOKENS, Chunk, ChunkPacer, cut
from .cost import CostModel
from .healing import PromptHealer
from .policy import BlockPolicy, FixedBlocks
from .proposers import REGISTRY, Pick, Prices, Proposer
from .request import GenerationConfig, GenerationResult, InputError, Round, RoundTimings, validate_request
from .row import BatchRow
from .sampling import next_token
from .step import StepProfile, StepResult, StepRows
from .suffix import SHARED_TOKENS, SharedSuffixes

__all__ = ["PREFILL_MODES", "BatchDecoder"]

NO_DRAFT = Proposal(torch.empty(0, dtype=torch.long))
PREFILL_MODES = ("chunked", "separate")


class BatchDecoder:
    """All active requests of one worker; `step()` advances every one of them.

    block_size: rows without their own `block_size` use this size (default: the drafter's trained one;
    1 = the target alone); with an adaptive policy it is the largest size the policy may choose.
    clock: seconds for every timing the decoder takes and the policy reads (a simulation passes its own).
    prefill: "chunked" (prompts enter in chunks inside the verify pass, within what the budget `step_tokens`
    leaves after the rows' blocks, a step with chunks at most about `stall` times the rows' own unless prompts
    queue behind the one entering: each step then takes at least 1 / `backlog_steps` of them, 0: never) or
    "separate" (each joining prompt whole, in a pass of its own before the verify pass); see decoding/chunking.py.

    Threads: `new_row` only validates and builds a row (any thread, e.g. an HTTP handler); `join`,
    `cancel` and `step` belong to the one thread that runs the engines."""

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
        self.prefill, self.pacer = prefill, ChunkPacer(step_tokens, stall, backlog_steps)
        if drafter is not None and tuple(drafter.feature_layer_ids) != tuple(target.feature_layer_ids):
            raise ValueError(
                f"target exposes features of layers {target.feature_layer_ids}, drafter needs {drafter.feature_layer_ids}"
            )
        self.policy: BlockPolicy = policy or FixedBlocks()
        self.target, self.drafter, self.tokenizer, self.clock = target, drafter, tokenizer, clock
        self.trained_block = drafter.block_size if drafter is not None else 1
        if block_size is not None and not 1 <= block_size <= self.trained_block:
            raise ValueError(f"block_size must be in 1..{self.trained_block} for this drafter, got {block_size}")
        self.block_size = block_size or self.trained_block
        self.fixed_block = block_size  # None: the policy's choice; else it bounds every row's drafts (`new_row`)
        self.joining: list[BatchRow] = []
        self.running: list[BatchRow] = []
        self._ids = itertools.count()
        # the finished suffix / hybrid requests' outputs, for the suffix runs of those that follow (0: none)
        self.shared_suffixes = SharedSuffixes(shared_suffix_tokens) if shared_suffix_tokens else None

    def forget_finished_outputs(self) -> None:
        """Empty the shared suffix structure (same bound). A benchmark that runs one prompt under several methods
        calls it before each run: otherwise a later run's suffix drafts read an earlier run's output of the same
        prompt, which no real request has, and its acceptance is inflated."""
        if self.shared_suffixes is not None:
            self.shared_suffixes = SharedSuffixes(self.shared_suffixes.max_tokens)

    # ---- the engines' sessions, made on first use (a non-leader TensorRT-LLM rank never makes one) ----
    @cached_property
    def target_session(self) -> TargetSession:
        return self.target.new_session()

    @cached_property
    def drafter_session(self) -> DrafterSession | None:
        return self.drafter.new_session() if self.drafter is not None else None

    # ---- text ---------------------------------------------------------------------------
    @cached_property
    def healer(self) -> PromptHealer:
        return PromptHealer(self.tokenizer, int(self.target.vocab_size))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError("this target has no tokenizer: pass token ids instead of text")
        try:
            text.encode("utf-8")  # a lone surrogate (from JSON "\\ud800") makes tokenizers raise TypeError
        except UnicodeEncodeError as e:
            raise InputError(f"the text is not valid Unicode: lone surrogate at character {e.start}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def default_stop_ids(self) -> tuple[int, ...]:
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        return (eos,) if isinstance(eos, int) else ()

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
            next(self._ids),
            prompt,
            config,
            self.tokenizer,
            can_draft,
            self.clock,
            healing,
            proposer,
            self.shared_suffixes,
            config.block_size or self.fixed_block,
        )
        row.stats.block_size = size if can_draft else 1
        return row

    def proposer(self, name: str) -> Proposer:
        """The proposer called `name` (`proposers.PROPOSERS`)."""
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
        if row in self.joining:
            self.joining.remove(row)
        if row in self.running:
            self.running.remove(row)
        if row.target_row is not None:
            self.target_session.remove_row(row.target_row)
            row.target_row = None
        self._leave_drafter(row)
        if (
            row.drafts.suffix is not None
            and self.shared_suffixes is not None
            and row.finish_reason in ("stop", "length")
        ):
            self.shared_suffixes.add(row.generated)
        row.drafts.suffix = row.drafts.shared = None  # the request's suffix structures go with it (size: stats)

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
        """One request's rounds as they are committed (the prefill's first token, then one per step);
        the row is cancelled if the caller stops early. Steps the whole batch: use it on a decoder of
        its own."""
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
        t_start = self.clock()
        verifying = list(self.running)
        if self.joining and (self.prefill == "separate" or not verifying):
            result.rounds += self._prefill(result.profile)
        if verifying:
            result.rounds += self._round(verifying, result)
        result.profile.committed_tokens = sum(len(r.token_ids) for _, r in result.rounds)
        result.profile.total_s = self.clock() - t_start
        self.policy.observe(result)
        self.pacer.observe(result.profile)
        for row, _ in result.rounds:
            if row.done:
                self._release(row)
        return result

    def _prefill(self, prof: StepProfile) -> list[tuple[BatchRow, Round]]:
        """Every joining row's prompt (what is left of it) whole, in one target call of its own."""
        chunks = self._rest_of_prompts()
        t0 = self.clock()
        rows, tokens = self._chunk_inputs(chunks)
        outs = self.target_session.forward(
            rows, tokens, last_logits_only=True, features=any(c.row.drafter_row is not None for c in chunks)
        )
        rounds = self._take_chunks(chunks, outs)
        prof.prefill_rows, prof.prefill_tokens = len(chunks), sum(c.size for c in chunks)
        prof.prefill_s = self.clock() - t0
        return rounds

    def _round(self, rows: list[BatchRow], result: StepResult) -> list[tuple[BatchRow, Round]]:
        """One draft-and-verify round for every running row; the joining rows' prompt chunks ride in its
        target pass."""
        prof = result.profile
        t0 = self.clock()
        picks, chunks = self._plan(rows)
        t1 = self.clock()
        drafts = self._draft(rows, picks, prof)
        rows, drafts, picks = self._drop_failed(rows, drafts, picks, result.failed)
        proposals = [self._proposal(row, pick, d) for row, pick, d in zip(rows, picks, drafts)]
        t2 = self.clock()  # drafting: the drafter's pass and drawing the drafts from its output
        if not rows and not chunks:
            return []
        lengths = [self.target_session.length(self._target_row(r)) for r in rows]
        drafted_ids = [p.tokens.tolist() for p in proposals]  # read once: verify, acceptance and commit use them
        outs = self._verify(rows, drafted_ids, chunks, prof)
        t3 = self.clock()
        rounds = []
        for row, pick, proposal, drafted, out, length in zip(rows, picks, proposals, drafted_ids, outs, lengths):
            ta = self.clock()
            new, accepted = self._accept(row, proposal, drafted, out, length)
            own = self.clock() - ta  # this row's acceptance and rollback; the passes are shared
            row.stats.draft_time_s += t2 - t1
            row.stats.verify_time_s += t3 - t2
            timings = RoundTimings(
                draft_s=t2 - t1, verify_s=t3 - t2 + own, target_s=t3 - t2, accept_s=own, total_s=t3 - t0 + own
            )
            rounds.append(
                (row, row.commit(new, drafted=drafted, accepted=accepted, timings=timings, used=pick.proposer))
            )
        rounds += self._take_chunks(chunks, outs[len(rows) :])
        t4 = self.clock()
        prof.policy_s, prof.draft_s, prof.verify_s, prof.accept_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        return rounds

    # ---- the parts of a round -----------------------------------------------------------
    def _plan(self, rows: list[BatchRow]) -> tuple[list[Pick], list[Chunk]]:
        """This step's proposals (each row's block and where its drafts come from) and prompt chunks. The chunks
        are planned first, from what the budget leaves after the rows' blocks of the step before (a request's own
        size; 1 for a row that has not verified), so that the policy prices the pass they share; then they are
        cut to what the chosen blocks leave. Reserving every row's largest block instead would starve the prompts
        whenever the policy drafts little (at a large batch, where it matters most); reserving nothing would have
        the policy price chunks the pass cannot hold."""
        step, waiting = self._step_rows(rows), self._waiting()
        chunks = self._chunks(sum(r.block for r in rows), waiting)
        if chunks:
            size = sum(c.size for c in chunks)
            room = self.pacer.verify_room(size, waiting)
            step = replace(step, chunk_rows=len(chunks), chunk_tokens=size, verify_room=room)
        picks = self._pick(rows, self.policy.choose(step))
        for r, p in zip(rows, picks):
            r.block = p.block
        return picks, cut(chunks, self.pacer.room(sum(r.block for r in rows), waiting)) if chunks else chunks

    def _pick(self, rows: list[BatchRow], blocks: list[int]) -> list[Pick]:
        """Each row's proposal, from its proposer given the DFlash block the policy chose for it."""
        prices = self._prices(len(rows)) if any(r.proposer.weighs_cost for r in rows) else Prices()
        return [r.proposer.pick(r, b, prices) for r, b in zip(rows, blocks)]

    def _prices(self, n: int) -> Prices:
        """A row's round's seconds for the proposers' choice: from the policy's cost model where it has one
        (`AdaptiveBlocks.cost`), else from the step seconds the chunk pacer measured (no drafter price: fixed
        blocks never weigh it), else unpriced (every option costs one row's step)."""
        cost = getattr(self.policy, "cost", None)
        prices = Prices.from_cost(cost, n) if isinstance(cost, CostModel) else None
        return prices or Prices.from_line(self.pacer.line(), n) or Prices()

    @staticmethod
    def _proposal(row: BatchRow, pick: Pick, draft: Draft | None) -> Proposal:
        """The tokens the target verifies for a row: a suffix run as picked (deterministic: no distribution, so
        its acceptance is the one-hot rule, acceptance.py), a DFlash draft through the row's acceptance rule."""
        if pick.proposer is not None and pick.proposer.deterministic:
            return Proposal(torch.tensor(pick.drafts, dtype=torch.long))
        return NO_DRAFT if draft is None else row.rule.propose(draft)

    def _step_rows(self, rows: list[BatchRow]) -> StepRows:
        """The rows' facts as the policy reads them, in one pass: each row's block at most the decoder's block
        size, the drafter's trained block (1 without a drafter row) and what the row has left; a request's own
        `block_size` (capped the same way) is kept."""
        n = len(rows)
        # per row: tokens left, own block size (0: none), has a drafter row, sampled, backlog
        state = np.array(
            [(r.remaining, r.config.block_size or 0, r.drafter_row is not None, r.sampled, r.backlog) for r in rows],
            dtype=np.float64,
        ).reshape(n, 5)
        bound = np.minimum(np.where(state[:, 2] > 0, self.trained_block, 1), state[:, 0]).astype(np.int64)
        own = state[:, 1].astype(np.int64)
        return StepRows(
            rows=rows,
            max_block=np.minimum(self.block_size, bound),
            fixed=np.where(own > 0, np.minimum(own, bound), 0),
            sampled=state[:, 3] > 0,
            backlog=state[:, 4],
            batch=len(self.running),  # rows whose prompt completed on an earlier step of this one were moved here
        )

    def _chunks(self, reserved: int, waiting: int) -> list[Chunk]:
        """The joining rows' next pieces of their prompts, in order of arrival, within what the pacer gives a
        step beside `reserved` tokens of verify blocks and `waiting` prompt tokens queued behind the first. None
        with separate prefill."""
        if self.prefill != "chunked":
            return []
        return cut(self._rest_of_prompts(), self.pacer.room(reserved, waiting))

    def _rest_of_prompts(self) -> list[Chunk]:
        """Every joining row's prompt from where its prefill stands to its end, in order of arrival."""
        return [Chunk(r, r.prefilled, len(r.prompt_ids) - r.prefilled) for r in self.joining]

    def _waiting(self) -> int:
        """The prompt tokens queued behind the joining row whose prompt is entering (the first, by arrival)."""
        return sum(len(r.prompt_ids) - r.prefilled for r in self.joining[1:])

    def _chunk_inputs(self, chunks: list[Chunk]) -> tuple[list[int], list[torch.Tensor]]:
        """The chunks' target rows and tokens; a row's first chunk gives it its rows in the sessions."""
        now = self.clock()
        for c in chunks:
            if c.row.target_row is None:
                c.row.target_row, c.row.prefill_started = self.target_session.add_row(), now
                if c.row.can_draft and self.drafter_session is not None:
                    c.row.drafter_row = self.drafter_session.add_row()
        tokens = [torch.tensor(c.row.prompt_ids[c.start : c.start + c.size], dtype=torch.long) for c in chunks]
        return [self._target_row(c.row) for c in chunks], tokens

    def _take_chunks(self, chunks: list[Chunk], outs: Sequence[TargetOutput]) -> list[tuple[BatchRow, Round]]:
        """The chunks' outputs: their features join the row's drafter backlog; a prompt's last chunk gives the
        row's first token (as the target alone would: its logits after the whole prompt), and the row runs,
        drafting and verifying, from the next step."""
        rounds = []
        for c, out in zip(chunks, outs):
            row = c.row
            row.prefilled += c.size
            if row.drafter_row is not None and out.features is not None:
                row.pending.append(out.features)
                row.backlog += c.size
            if row.prefilled < len(row.prompt_ids):
                continue
            first = next_token(row.adjusted(out.logits[-1:])[-1], row.params, row.generator)  # on the engine's device
            assert row.prefill_started is not None
            row.stats.prefill_time_s = self.clock() - row.prefill_started
            timings = RoundTimings(target_s=row.stats.prefill_time_s, total_s=row.stats.prefill_time_s)
            self.joining.remove(row)
            self.running.append(row)
            rounds.append((row, row.commit([first], drafted=[], accepted=0, prefill=True, timings=timings)))
        return rounds

    def _draft(self, rows: list[BatchRow], picks: list[Pick], prof: StepProfile) -> list[Draft | None]:
        """ONE drafter call for every row that picked a DFlash block (None for the others); none when no row
        did (their features wait in their backlog)."""
        drafts: list[Draft | None] = [None] * len(rows)
        todo = [
            i
            for i, (r, p) in enumerate(zip(rows, picks))
            if p.proposer is not None
            and p.proposer.uses_drafter
            and p.block >= 2
            and r.drafter_row is not None
            and r.pending
        ]
        if not todo or self.drafter_session is None:
            return drafts
        requests = []
        for i in todo:
            row = rows[i]
            assert row.drafter_row is not None
            feats = row.pending[0] if len(row.pending) == 1 else torch.cat(row.pending)
            requests.append(DraftRequest(row.drafter_row, feats, row.generated[-1], picks[i].block))
        try:
            out = self.drafter_session.draft(requests)
        except Exception as e:  # noqa: BLE001 - per-row handling below
            for i in todo:
                self._drafter_failed(rows[i], e)
            return drafts
        for i, d in zip(todo, out):
            rows[i].pending, rows[i].backlog = [], 0
            drafts[i] = d
        prof.draft_rows = len(todo)
        prof.draft_tokens = sum(q.block_size + int(q.new_features.shape[0]) for q in requests)
        return drafts

    def _drafter_failed(self, row: BatchRow, error: Exception) -> None:
        if not row.config.drafter_fallback:
            row.error, row.finish_reason = error, "error"
            return
        # Still lossless: from here on the target alone picks this row's tokens (block size 1). Its drafter
        # cache may be half-written, so the row leaves the drafter for good.
        row.drafter_error, row.can_draft = error, False
        self._leave_drafter(row)

    def _drop_failed(
        self, rows: list[BatchRow], drafts: list[Draft | None], picks: list[Pick], failed: list[BatchRow]
    ) -> tuple[list[BatchRow], list[Draft | None], list[Pick]]:
        """Rows the drafter failed without a fallback leave now (into `failed`); the others go on to
        verification."""
        for r in rows:
            if r.done:
                failed.append(r)
                self._release(r)
        keep = [i for i, r in enumerate(rows) if not r.done]
        return [rows[i] for i in keep], [drafts[i] for i in keep], [picks[i] for i in keep]

    def _verify(
        self, rows: list[BatchRow], drafted: list[list[int]], chunks: list[Chunk], prof: StepProfile
    ) -> list[TargetOutput]:
        """ONE target call scoring every row's block (its last committed token, then its drafts), with the prompt
        chunks after them; the outputs in that order."""
        ids = [[r.generated[-1], *d] for r, d in zip(rows, drafted)]
        sizes = [len(b) for b in ids]
        # one tensor for the batch, viewed per row: a tensor per row costs the host more than the ids do
        blocks = list(torch.split(torch.tensor([t for b in ids for t in b], dtype=torch.long), sizes))
        prof.verify_rows, prof.blocks = len(rows), sizes
        prof.verify_tokens = sum(prof.blocks)
        chunk_rows, chunk_tokens = self._chunk_inputs(chunks)
        prof.chunk_rows, prof.chunk_tokens = len(chunks), sum(c.size for c in chunks)
        members = [*rows, *(c.row for c in chunks)]
        return self.target_session.forward(
            [self._target_row(r) for r in rows] + chunk_rows,
            blocks + chunk_tokens,
            features=any(r.drafter_row is not None for r in members),
        )

    def _accept(
        self, row: BatchRow, proposal: Proposal, drafted: list[int], out: TargetOutput, length: int
    ) -> tuple[list[int], int]:
        """The acceptance rule on one row's scored block (`drafted`: the proposal's token ids): the accepted
        drafts plus one token of the target's own (the bonus); the target's cache is rolled back to them, the
        drafter is handed their features."""
        # the logits stay on the engine's device: adjustment and acceptance run there; only token ids come back
        logits = row.adjusted(out.logits, drafted)
        if not row.sampled and logits is out.logits:  # greedy on the pass's own logits: its argmax, one for the batch
            accepted, bonus = greedy_prefix(drafted, out.argmax())
        elif not drafted:  # the target alone: its own next token
            accepted, bonus = 0, next_token(logits[0], row.params, row.generator)
        else:
            accepted, bonus = row.rule.accept(proposal, logits)
        self.target_session.rollback(self._target_row(row), length + accepted + 1)
        if row.drafter_row is not None and out.features is not None:
            row.pending.append(out.features[: accepted + 1])
            row.backlog += accepted + 1
        return drafted[:accepted] + [bonus], accepted

    @staticmethod
    def _target_row(row: BatchRow) -> int:
        assert row.target_row is not None  # set by its prompt's first chunk
        return row.target_row
