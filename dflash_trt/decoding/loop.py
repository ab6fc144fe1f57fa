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
from .acceptance import Proposal, acceptance_rule, greedy_prefix
from .chunking import BACKLOG_STEPS, STALL, STEP_TOKENS, Chunk, ChunkPacer, cut
from .detokenizer import IncrementalDetokenizer, held_back
from .healing import Healing, PromptHealer
from .policy import BlockPolicy, FixedBlocks
from .request import (
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    InputError,
    Round,
    RoundTimings,
    commit_tokens,
    validate_request,
)
from .sampling import next_token
from .step import StepProfile, StepResult, StepRows
from .stopping import StopChecker, truncate_at_stop

NO_DRAFT = Proposal(torch.empty(0, dtype=torch.long))
PREFILL_MODES = ("chunked", "separate")


class BatchRow:
    """One request inside a BatchDecoder: its settings, its output so far and its place in the sessions."""

    def __init__(
        self,
        rid: int,
        prompt_ids: list[int],
        config: GenerationConfig,
        tokenizer: Any,
        can_draft: bool,
        clock: Callable[[], float],
        healing: Healing | None = None,
    ):
        self.id, self.prompt_ids, self.config, self.healing = rid, prompt_ids, config, healing
        self.params = config.sampling
        self.sampled = not self.params.greedy  # the row's sampling regime (greedy and sampled rows accept differently)
        self.generator = self.params.generator()
        self.rule = acceptance_rule(config.acceptance, self.params, self.generator)
        skip = healing.text if healing is not None else ""
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip=skip) if tokenizer is not None else None
        self.stop = StopChecker(frozenset(config.stop_token_ids), tuple(config.stop_strings), self.detokenizer)
        self.can_draft = can_draft
        self.target_row: int | None = None
        self.drafter_row: int | None = None
        self.prefilled = 0  # prompt tokens in the target's cache (chunked prefill takes a prompt in pieces)
        self.prefill_started: float | None = None  # when its first chunk's pass began
        self.generated: list[int] = []
        self.pending: list[torch.Tensor] = []  # features committed but not yet shown to the drafter
        self.backlog = 0  # their rows: context the drafter's next draft for this row takes in
        self.last_block = config.block_size or 1  # its block on the last step (what the next step reserves)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=config.block_size or 0)
        self.finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
        self.stop_string: str | None = None
        self.error: Exception | None = None
        self.drafter_error: Exception | None = None  # set when drafter_fallback took over
        self._shown = ""  # the text its rounds have handed out (`Round.text`)
        self._final: str | None = None
        self.clock = clock
        self.started = clock()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.generated)

    def commit(
        self,
        new: list[int],
        drafted: list[int],
        accepted: int,
        prefill: bool = False,
        timings: RoundTimings | None = None,
    ) -> Round:
        """Commit a round's `new` tokens; `drafted`: the draft tokens it verified (`accepted` of them kept)."""
        new = commit_tokens(self, new, drafted, accepted, prefill)
        return Round(new, len(drafted), accepted, prefill, timings or RoundTimings(), self._new_text())

    def _new_text(self) -> str | None:
        """The text added since the last round that can be shown: the detokenizer holds back a partial
        character, and here the end that may still begin a stop string waits too; once the row is done, the
        rest of its final text (cut at the stop string)."""
        if self.detokenizer is None:
            return None
        if self.done:
            full = self._final_text()
        else:
            full = self.detokenizer.text
            full = full[: len(full) - held_back(full, self.config.stop_strings)]
        if not full.startswith(self._shown):  # cannot happen with sane tokenizers; never repeat text
            return ""
        new, self._shown = full[len(self._shown) :], full
        return new

    def adjusted(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """The target's logits as this request sees them (penalties, logit_bias, min_tokens): row i after the
        committed tokens + draft[:i] (exact, since row i only counts if draft[:i] is accepted). A healed
        prompt's first token is constrained (healing.py)."""
        adjust = self.config.adjust
        out = logits if adjust is None else adjust.apply(logits, self.generated, draft)
        return self.healing.constrain(out) if self.healing is not None and not self.generated else out

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("row still running")
        text = self._final_text() if self.detokenizer is not None else None
        return GenerationResult(list(self.generated), text, self.finish_reason or "error", self.stats)

    def _final_text(self) -> str:
        """The finished row's text, cut at its stop string (decoded once)."""
        if self._final is None:
            assert self.detokenizer is not None
            self._final = truncate_at_stop(self.detokenizer.final_text(), self.stop_string)
        return self._final


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
        self.joining: list[BatchRow] = []
        self.running: list[BatchRow] = []
        self._ids = itertools.count()

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
        can_draft = self.drafter is not None and size != 1
        row = BatchRow(next(self._ids), prompt, config, self.tokenizer, can_draft, self.clock, healing)
        row.stats.block_size = size if can_draft else 1
        return row

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
        sizes, chunks = self._plan(rows)
        t1 = self.clock()
        drafts = self._draft(rows, sizes, prof)
        rows, drafts = self._drop_failed(rows, drafts, result.failed)
        proposals = [NO_DRAFT if d is None else row.rule.propose(d) for row, d in zip(rows, drafts)]
        t2 = self.clock()  # drafting: the drafter's pass and drawing the drafts from its output
        if not rows and not chunks:
            return []
        lengths = [self.target_session.length(self._target_row(r)) for r in rows]
        drafted_ids = [p.tokens.tolist() for p in proposals]  # read once: verify, acceptance and commit use them
        outs = self._verify(rows, drafted_ids, chunks, prof)
        t3 = self.clock()
        rounds = []
        for row, proposal, drafted, out, length in zip(rows, proposals, drafted_ids, outs, lengths):
            ta = self.clock()
            new, accepted = self._accept(row, proposal, drafted, out, length)
            own = self.clock() - ta  # this row's acceptance and rollback; the passes are shared
            row.stats.draft_time_s += t2 - t1
            row.stats.verify_time_s += t3 - t2
            timings = RoundTimings(
                draft_s=t2 - t1, verify_s=t3 - t2 + own, target_s=t3 - t2, accept_s=own, total_s=t3 - t0 + own
            )
            rounds.append((row, row.commit(new, drafted=drafted, accepted=accepted, timings=timings)))
        rounds += self._take_chunks(chunks, outs[len(rows) :])
        t4 = self.clock()
        prof.policy_s, prof.draft_s, prof.verify_s, prof.accept_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        return rounds

    # ---- the parts of a round -----------------------------------------------------------
    def _plan(self, rows: list[BatchRow]) -> tuple[list[int], list[Chunk]]:
        """This step's block sizes and prompt chunks. The chunks are planned first, from what the budget leaves
        after the rows' blocks of the step before (a request's own size; 1 for a row that has not verified), so
        that the policy prices the pass they share; then they are cut to what the chosen blocks leave. Reserving
        every row's largest block instead would starve the prompts whenever the policy drafts little (at a large
        batch, where it matters most); reserving nothing would have the policy price chunks the pass cannot hold."""
        step, waiting = self._step_rows(rows), self._waiting()
        chunks = self._chunks(sum(r.last_block for r in rows), waiting)
        if chunks:
            size = sum(c.size for c in chunks)
            room = self.pacer.verify_room(size, waiting)
            step = replace(step, chunk_rows=len(chunks), chunk_tokens=size, verify_room=room)
        sizes = self.policy.choose(step)
        for r, b in zip(rows, sizes):
            r.last_block = b
        return sizes, cut(chunks, self.pacer.room(sum(sizes), waiting)) if chunks else chunks

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
            cap=np.minimum(self.block_size, bound),
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

    def _draft(self, rows: list[BatchRow], sizes: list[int], prof: StepProfile) -> list[Draft | None]:
        """ONE drafter call for every row whose block is >= 2 (None for the others)."""
        drafts: list[Draft | None] = [None] * len(rows)
        todo = [i for i, (r, s) in enumerate(zip(rows, sizes)) if s >= 2 and r.drafter_row is not None and r.pending]
        if not todo or self.drafter_session is None:
            return drafts
        requests = []
        for i in todo:
            row = rows[i]
            assert row.drafter_row is not None
            feats = row.pending[0] if len(row.pending) == 1 else torch.cat(row.pending)
            requests.append(DraftRequest(row.drafter_row, feats, row.generated[-1], sizes[i]))
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
        self, rows: list[BatchRow], drafts: list[Draft | None], failed: list[BatchRow]
    ) -> tuple[list[BatchRow], list[Draft | None]]:
        """Rows the drafter failed without a fallback leave now (into `failed`); the others go on to
        verification."""
        for r in rows:
            if r.done:
                failed.append(r)
                self._release(r)
        keep = [i for i, r in enumerate(rows) if not r.done]
        return [rows[i] for i in keep], [drafts[i] for i in keep]

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
