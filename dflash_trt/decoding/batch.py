"""Batched draft-and-verify: every active request advances in one step of at most three passes.

    step:  prefill(rows that joined)                 one target call, prompts padded to the longest
           draft(rows whose block size is >= 2)      ONE drafter call, ragged (own context, own block)
           verify(every running row)                 ONE target call, ragged (own length, own block)
           accept / commit / roll back per row       the same rules, sampling settings and seeds as
                                                     the single-sequence loop (decode.py)

Joining rows are prefilled in their own call at the start of the step, interleaved between verify steps
rather than packed into the verify call: a prompt is tens to thousands of tokens and a verify block is
1..16, so in one call every verifying row's attention would be padded to the longest prompt (the target
packs real tokens for its projections and MLPs, but pads queries per row for attention); in a separate
call only the joining rows pay. They take part in drafting and verification from the next step on.

Each row keeps its own sampling generator and draws from it in the same order as `Generation`, so a
seeded row with a fixed block size returns the same tokens alone or in any batch (up to float rounding
of batched matmuls, which can only matter at near-exact ties). Block sizes come from the row's request
(`GenerationConfig.block_size`), else from a policy: fixed (the drafter's trained size) or adaptive
(`adaptive.choose_blocks`). With adaptive sizes a seed fixes the distribution, not the text.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.base import Draft
from ..runtime.batched import BatchDrafterEngine, BatchTargetEngine, DraftRequest
from .acceptance import Proposal, acceptance_rule
from .adaptive import AcceptancePrior, AcceptanceTracker, CostModel, RowChoice, choose_blocks
from .decode import (
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    Round,
    RoundTimings,
    commit_tokens,
    validate_request,
)
from .detokenizer import IncrementalDetokenizer
from .sampling import next_token
from .stopping import StopChecker, truncate_at_stop


@dataclass
class StepProfile:
    """Where one step's time went, and its shape (rows, tokens per pass)."""

    prefill_rows: int = 0
    prefill_tokens: int = 0
    draft_rows: int = 0
    draft_tokens: int = 0  # block tokens + new context rows the drafter ran
    verify_rows: int = 0
    verify_tokens: int = 0
    committed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # chosen block size per verify row
    prefill_s: float = 0.0
    policy_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0  # acceptance, sampling, rollbacks, commits, stop checks
    total_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        """Python outside the passes and the acceptance: batching, padding, bookkeeping."""
        return max(0.0, self.total_s - self.prefill_s - self.policy_s - self.draft_s - self.verify_s - self.accept_s)


class BatchRow:
    """One request inside a BatchDecoder: the per-row state `Generation` keeps for a single sequence."""

    def __init__(self, rid: int, prompt_ids: list[int], config: GenerationConfig, tokenizer: Any, can_draft: bool):
        self.id, self.prompt_ids, self.config = rid, prompt_ids, config
        self.params = config.sampling
        self.generator = self.params.generator()
        self.rule = acceptance_rule(config.acceptance, self.params, self.generator)  # the single-sequence rules
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = StopChecker(frozenset(config.stop_token_ids), tuple(config.stop_strings), self.detokenizer)
        self.can_draft = can_draft
        self.target_row: int | None = None
        self.drafter_row: int | None = None
        self.generated: list[int] = []
        self.pending: list[torch.Tensor] = []  # features committed but not yet shown to the drafter
        self.acceptance = AcceptanceTracker()
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=config.block_size or 0)
        self.last_draft_step = -(1 << 30)  # the decoder's verify step at which this row last drafted (or joined)
        self.probe_due = False
        self.finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
        self.stop_string: str | None = None
        self.error: Exception | None = None
        self.drafter_error: Exception | None = None
        self._started = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.generated)

    def commit(
        self, new: list[int], drafted: int, accepted: int, prefill: bool = False, timings: RoundTimings | None = None
    ) -> Round:
        new = commit_tokens(self, new, drafted, accepted, prefill)  # the same rules as Generation._commit
        return Round(
            token_ids=new, drafted=drafted, accepted=accepted, prefill=prefill, timings=timings or RoundTimings()
        )

    def adjusted(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """The target's logits as this request sees them (penalties, logit_bias, min_tokens), exactly as
        `Generation._adjusted`: row i after the committed tokens + draft[:i]."""
        adjust = self.config.adjust
        return logits if adjust is None else adjust.apply(logits, self.generated, draft)

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("row still running")
        text = None
        if self.detokenizer is not None:
            text = truncate_at_stop(self.detokenizer.final_text(), self.stop_string)
        return GenerationResult(list(self.generated), text, self.finish_reason or "error", self.stats)


class BatchDecoder:
    """All active requests of one worker; `step()` advances every one of them.

    block_size: rows without their own `block_size` use this size (default: the drafter's trained one;
    1 = the target alone); with `adaptive` it is the largest size the policy may choose.
    adaptive: choose each row's block size per step (`cost` is then required: measure it with
    `adaptive.measure_costs`); otherwise rows without their own `block_size` use `block_size`.
    refit_every: with adaptive, refit the cost model from the observed passes every N steps (0 = never).
    probe_every: with adaptive, a probe (see `adaptive`) every N x 2^k verify steps per sampling regime
    (greedy, sampled; k: that regime's probes in a row that missed, at most `max_probe_backoff`): each row of
    the regime that has not drafted in the last N steps drafts one block, so that no estimate freezes, at a
    cost that backs off where probes keep missing (0 = never).
    clock: the seconds every step and pass is timed with (StepProfile, RoundTimings, the cost model's
    observations): wall time by default; a simulation passes its virtual clock (dflash_trt.sim).
    min_gain: with adaptive, draft only when the cost model expects it to beat not drafting by this fraction
    (measured on the demo pair at 32 rows: the linear model underestimates a drafting step by 10-25 %).

    Threads: `new_row` only validates and builds a row (any thread, e.g. an HTTP handler); `join`,
    `cancel` and `step` belong to the one thread that runs the engines."""

    def __init__(
        self,
        target: BatchTargetEngine,
        drafter: BatchDrafterEngine | None = None,
        tokenizer: Any = None,
        *,
        block_size: int | None = None,
        adaptive: bool = False,
        cost: CostModel | None = None,
        refit_every: int = 0,
        probe_every: int = 32,
        min_gain: float = 0.1,
        max_probe_backoff: int = 4,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if drafter is not None and tuple(drafter.feature_layer_ids) != tuple(target.feature_layer_ids):
            raise ValueError(
                f"target exposes features of layers {target.feature_layer_ids}, drafter needs {drafter.feature_layer_ids}"
            )
        if adaptive and cost is None:
            raise ValueError("adaptive block sizes need a cost model (adaptive.measure_costs)")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.clock = clock
        trained = drafter.block_size if drafter is not None else 1
        if block_size is not None and not 1 <= block_size <= trained:
            raise ValueError(f"block_size must be in 1..{trained} for this drafter, got {block_size}")
        self.block_size = block_size or trained
        self.adaptive, self.cost, self.refit_every = adaptive, cost, refit_every
        self.probe_every, self.min_gain, self.max_probe_backoff = probe_every, min_gain, max_probe_backoff
        self.probe_misses: dict[bool, int] = {}  # per regime (sampled?): probes in a row that missed
        self._next_probe: dict[bool, int] = {}  # per regime: the first verify step at which it may probe again
        self._steps = 0  # verify steps so far
        self.prior = AcceptancePrior()  # new rows start from what recent requests of their regime measured
        self.target_session = target.new_batch()
        self.drafter_session = drafter.new_batch() if drafter is not None else None
        self.joining: list[BatchRow] = []
        self.running: list[BatchRow] = []
        self.last_profile = StepProfile()
        self._ids = itertools.count()

    # ---- membership ---------------------------------------------------------------------
    def add(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> BatchRow:
        """Queue a request; it is prefilled at the start of the next step."""
        return self.join(self.new_row(prompt_ids, config))

    def new_row(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> BatchRow:
        """Validate a request (InputError / ContextLengthError, the rules of `Generation`) and make its row,
        not yet part of the batch. Touches no engine and no shared state: safe from any thread."""
        prompt = [int(t) for t in prompt_ids]
        validate_request(prompt, config, self.target, self.drafter)
        size = config.block_size or self.block_size
        can_draft = self.drafter_session is not None and size != 1
        row = BatchRow(next(self._ids), prompt, config, self.tokenizer, can_draft)
        row.acceptance = self.prior.tracker(not row.params.greedy)
        row.stats.block_size = size if can_draft else 1
        return row

    def join(self, row: BatchRow) -> BatchRow:
        """Add a row made by `new_row`; it is prefilled at the start of the next step."""
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
        if row.done and row.target_row is not None:
            self.prior.observe(not row.params.greedy, row.acceptance)
        if row in self.joining:
            self.joining.remove(row)
        if row in self.running:
            self.running.remove(row)
        if row.target_row is not None:
            self.target_session.remove_row(row.target_row)
            row.target_row = None
        if row.drafter_row is not None and self.drafter_session is not None:
            self.drafter_session.remove_row(row.drafter_row)
            row.drafter_row = None
        row.pending = []

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[tuple[BatchRow, Round]]:
        """Advance every active row once; returns the rounds committed (rows that finished are released)."""
        prof = StepProfile()
        t_start = self.clock()
        verifying = list(self.running)
        rounds: list[tuple[BatchRow, Round]] = []
        if self.joining:
            rounds += self._prefill(prof)
        if verifying:
            rounds += self._verify(verifying, prof)
        for row, _ in rounds:
            if row.done:
                self._release(row)
        prof.committed_tokens = sum(len(r.token_ids) for _, r in rounds)
        prof.total_s = self.clock() - t_start
        self.last_profile = prof
        return rounds

    def run(self) -> None:
        while self.active:
            self.step()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        configs: Sequence[GenerationConfig] | GenerationConfig = GenerationConfig(),
    ) -> list[GenerationResult]:
        """Every prompt as one row of the same batch, run to the end."""
        if isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        rows = [self.add(p, c) for p, c in zip(prompts, configs)]
        self.run()
        return [r.result() for r in rows]

    def _prefill(self, prof: StepProfile) -> list[tuple[BatchRow, Round]]:
        rows, self.joining = self.joining, []
        t0 = self.clock()
        for row in rows:
            row.target_row = self.target_session.add_row()
            row.last_draft_step = self._steps  # first probe (if it never drafts) probe_every steps from now
            if row.can_draft and self.drafter_session is not None:
                row.drafter_row = self.drafter_session.add_row()
        want = any(r.drafter_row is not None for r in rows)
        outs = self.target_session.forward(
            [r.target_row for r in rows if r.target_row is not None],
            [torch.tensor(r.prompt_ids, dtype=torch.long) for r in rows],
            last_logits_only=True,
            features=want,
        )
        rounds = []
        for row, out in zip(rows, outs):
            first = next_token(row.adjusted(out.logits[-1:])[-1], row.params, row.generator)  # on the engine's device
            if row.drafter_row is not None and out.features is not None:
                row.pending = [out.features]
            row.stats.prefill_time_s = self.clock() - t0
            timings = RoundTimings(target_s=row.stats.prefill_time_s, total_s=row.stats.prefill_time_s)
            rounds.append((row, row.commit([first], drafted=0, accepted=0, prefill=True, timings=timings)))
            self.running.append(row)
        prof.prefill_rows, prof.prefill_tokens = len(rows), sum(len(r.prompt_ids) for r in rows)
        prof.prefill_s = self.clock() - t0
        return rounds

    def _limits(self, rows: list[BatchRow]) -> tuple[list[int], list[int | None]]:
        """Each row's largest size this step (the server's size: default, or the policy's cap) and its fixed size."""
        trained = self.drafter.block_size if self.drafter is not None else 1
        limits = [min(trained if r.drafter_row is not None else 1, r.remaining) for r in rows]
        caps = [min(self.block_size, lim) for lim in limits]
        fixed = [None if r.config.block_size is None else min(r.config.block_size, lim) for r, lim in zip(rows, limits)]
        return caps, fixed

    def _block_sizes(self, rows: list[BatchRow]) -> list[int]:
        caps, fixed = self._limits(rows)
        if not self.adaptive or self.cost is None:
            return [f if f is not None else c for f, c in zip(fixed, caps)]
        # new_context=1: a row's backlog of features is a sunk cost, paid whenever it next drafts whatever the
        # size; charging it would keep a row that skipped drafting from ever drafting again (its backlog grows).
        # A probe makes the drafter take in the row's whole backlog (its prompt too, the first time), so probes
        # back off, per sampling regime rather than per row: requests are short next to a backoff (64 tokens
        # here), so a row's own misses never grew its wait, and every request of a regime where drafting does
        # not pay was probed about once (demo pair, 4 rows, T=1: adaptive 0.78-0.91x the target alone across
        # runs, each request's probe a drafter pass over ~170 backlog features that accepted ~1 token). One
        # probe step serves every stale row of the regime (the drafter's fixed cost paid once); if they miss,
        # the regime's next probe waits twice as long (up to 2^max_probe_backoff x probe_every steps, so a
        # regime whose traffic changes is still tried now and then); a hit resets it (see _verify). A probe
        # drafts the row's whole block (see `adaptive`).
        for r in rows:
            r.probe_due = False
        if self.probe_every > 0:
            for regime in {not r.params.greedy for r in rows}:
                if self._steps < self._next_probe.get(regime, 0):
                    continue
                for r in rows:
                    if (not r.params.greedy) == regime and r.last_draft_step <= self._steps - self.probe_every:
                        r.probe_due = True
        choices = [RowChoice(r.acceptance.alpha, c, 1, f, probe=r.probe_due) for r, c, f in zip(rows, caps, fixed)]
        return choose_blocks(choices, self.cost, min_gain=self.min_gain)

    def _verify(self, rows: list[BatchRow], prof: StepProfile) -> list[tuple[BatchRow, Round]]:
        t0 = self.clock()
        sizes = self._block_sizes(rows)
        t1 = self.clock()
        drafts = self._draft(rows, sizes, prof)
        failed = [r for r in rows if r.done]  # the drafter failed them (no fallback): they leave now
        if failed:
            keep = [i for i, r in enumerate(rows) if not r.done]
            rows, sizes, drafts = [rows[i] for i in keep], [sizes[i] for i in keep], [drafts[i] for i in keep]
            for r in failed:
                self._release(r)
        t2 = self.clock()
        if not rows:
            return []
        blocks, proposals = [], []
        for row, draft in zip(rows, drafts):
            proposal = Proposal(torch.empty(0, dtype=torch.long)) if draft is None else row.rule.propose(draft)
            proposals.append(proposal)
            blocks.append(torch.tensor([row.generated[-1]] + proposal.tokens.tolist(), dtype=torch.long))
        committed = [self.target_session.length(r.target_row) for r in rows]  # type: ignore[arg-type]
        outs = self.target_session.forward(
            [r.target_row for r in rows],  # type: ignore[misc]
            blocks,
            features=any(r.drafter_row is not None for r in rows),
        )
        t3 = self.clock()
        rounds = []
        probed: dict[bool, tuple[int, int]] = {}  # per regime: this step's probes' accepted and drafted tokens
        for row, proposal, out, length in zip(rows, proposals, outs, committed):
            ta = self.clock()
            tokens = proposal.tokens
            # logits stay on the engine's device: adjustment and acceptance run there; only token ids come back
            logits = row.adjusted(out.logits, tokens.tolist())
            if tokens.numel() == 0:  # the target alone: its own next token
                accepted, bonus = 0, next_token(logits[0], row.params, row.generator)
            else:
                accepted, bonus = row.rule.accept(proposal, logits)
            self.target_session.rollback(row.target_row, length + accepted + 1)  # type: ignore[arg-type]
            if row.drafter_row is not None and out.features is not None:
                row.pending.append(out.features[: accepted + 1])
            row.acceptance.update(int(tokens.numel()), accepted)
            if row.probe_due and tokens.numel():
                acc, drafted = probed.get(not row.params.greedy, (0, 0))
                probed[not row.params.greedy] = (acc + accepted, drafted + int(tokens.numel()))
            row.stats.draft_time_s += t2 - t1
            row.stats.verify_time_s += t3 - t2
            new = tokens[:accepted].tolist() + [bonus]
            own = self.clock() - ta  # this row's acceptance and rollback; the passes are shared
            timings = RoundTimings(
                draft_s=t2 - t1, verify_s=t3 - t2 + own, target_s=t3 - t2, accept_s=own, total_s=t3 - t0 + own
            )
            rounds.append((row, row.commit(new, drafted=int(tokens.numel()), accepted=accepted, timings=timings)))
        for regime, (acc, drafted) in probed.items():  # probes that missed (accepted < half of the drafts)
            # confirm the low estimates: the regime's next probe waits twice as long; a hit resets the wait
            k = 0 if 2 * acc >= drafted else min(self.probe_misses.get(regime, 0) + 1, self.max_probe_backoff)
            self.probe_misses[regime] = k
            self._next_probe[regime] = self._steps + self.probe_every * (1 << k)
        t4 = self.clock()
        prof.verify_rows, prof.verify_tokens, prof.blocks = (
            len(rows),
            sum(len(b) for b in blocks),
            [len(b) for b in blocks],
        )
        prof.policy_s, prof.draft_s, prof.verify_s, prof.accept_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        self._steps += 1
        if self.cost is not None and self.adaptive:
            self.cost.observe("target", len(rows), prof.verify_tokens, t3 - t2)
            if prof.draft_rows:
                self.cost.observe("drafter", prof.draft_rows, prof.draft_tokens, prof.draft_s)
            if self.refit_every and self._steps % self.refit_every == 0:
                self.cost.refit()  # online: the passes this worker really ran, at its real contexts
        return rounds

    def _draft(self, rows: list[BatchRow], sizes: list[int], prof: StepProfile) -> list[Draft | None]:
        drafts: list[Draft | None] = [None] * len(rows)
        todo = [i for i, (r, s) in enumerate(zip(rows, sizes)) if s >= 2 and r.drafter_row is not None and r.pending]
        if not todo or self.drafter_session is None:
            return drafts
        requests = []
        for i in todo:
            row = rows[i]
            feats = row.pending[0] if len(row.pending) == 1 else torch.cat(row.pending)
            requests.append(DraftRequest(row.drafter_row, feats, row.generated[-1], sizes[i]))  # type: ignore[arg-type]
        try:
            out = self.drafter_session.draft(requests)
        except Exception as e:  # noqa: BLE001 - per-row handling below
            for i in todo:
                self._drafter_failed(rows[i], e)
            return drafts
        for i, d in zip(todo, out):
            row = rows[i]
            row.pending = []
            row.last_draft_step = self._steps
            drafts[i] = d
        prof.draft_rows, prof.draft_tokens = len(todo), sum(q.block_size + q.new_features.shape[0] for q in requests)
        return drafts

    def _drafter_failed(self, row: BatchRow, error: Exception) -> None:
        if not row.config.drafter_fallback:
            row.error, row.finish_reason = error, "error"
            return
        # Still lossless: from here on the target alone picks this row's tokens (block size 1). Its drafter
        # cache may be half-written, so the row leaves the drafter for good.
        row.drafter_error, row.can_draft = error, False
        if row.drafter_row is not None and self.drafter_session is not None:
            self.drafter_session.remove_row(row.drafter_row)
        row.drafter_row, row.pending = None, []
