"""The batch's rows and their places in the engines' sessions (`RowBook`): the one piece of the loop that calls
the engines.

A row joins (`join`), runs from its prompt's last chunk on (`take_chunks`), and leaves (`leave`). It gets its target row (and, if it drafts, its drafter row) with its first prompt chunk, hands the features
the target computed for it to its drafter through `row.pending` / `row.backlog`, and gives its rows back when
it leaves. The loop (`loop.BatchDecoder`) decides which rows take part in a step and what they propose; this
class runs the step's engine calls for them: the prefill pass, the drafter's pass, the verify pass, and each
row's rollback after its acceptance."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import torch

from ..runtime.base import Draft, DrafterEngine, DrafterSession, TargetEngine, TargetOutput, TargetSession
from .acceptance import Proposal, Scores
from .chunking import Chunk, rest_of_prompts
from .proposers import Pick
from .request import Round, RoundTimings
from .row import BatchRow
from .sampling import next_token
from .step import StepProfile

__all__ = ["RowBook"]


class RowBook:
    """The rows of one batch, *joining* (their prompts entering the target's cache) or *running*, in the order
    they joined and began running; the target's and the drafter's sessions, made on first use (a non-leader
    TensorRT-LLM rank never makes one), and every row's rows in them. `clock` times the rows' prefills."""

    def __init__(self, target: TargetEngine, drafter: DrafterEngine | None, clock: Callable[[], float]):
        self.target, self.drafter, self.clock = target, drafter, clock
        self.joining: list[BatchRow] = []
        self.running: list[BatchRow] = []

    @cached_property
    def target_session(self) -> TargetSession:
        return self.target.new_session()

    @cached_property
    def drafter_session(self) -> DrafterSession | None:
        return self.drafter.new_session() if self.drafter is not None else None

    # ---- joining and leaving --------------------------------------------------------------
    def join(self, row: BatchRow) -> BatchRow:
        self.joining.append(row)
        return row

    @property
    def active(self) -> list[BatchRow]:
        return self.joining + self.running

    def chunk_inputs(self, chunks: list[Chunk]) -> tuple[list[int], list[torch.Tensor]]:
        """The chunks' target rows and tokens; a row's first chunk gives it its rows in the sessions."""
        now = self.clock()
        for c in chunks:
            if c.row.target_row is None:
                c.row.target_row, c.row.prefill_started = self.target_session.add_row(), now
                if c.row.can_draft and self.drafter_session is not None:
                    c.row.drafter_row = self.drafter_session.add_row()
        tokens = [torch.tensor(c.row.prompt_ids[c.start : c.start + c.size], dtype=torch.long) for c in chunks]
        return [c.row.target_row_id for c in chunks], tokens

    def leave(self, row: BatchRow) -> None:
        """The row leaves the batch: its rows in both sessions are freed."""
        for rows in (self.joining, self.running):
            if row in rows:
                rows.remove(row)
        if row.target_row is not None:
            self.target_session.remove_row(row.target_row)
            row.target_row = None
        self.leave_drafter(row)

    def leave_drafter(self, row: BatchRow) -> None:
        """Free the row's drafter row and drop the features waiting for it."""
        if row.drafter_row is not None and self.drafter_session is not None:
            self.drafter_session.remove_row(row.drafter_row)
        row.drafter_row, row.pending, row.backlog = None, [], 0

    # ---- the step's engine calls ----------------------------------------------------------
    def prefill(self, prof: StepProfile) -> list[tuple[BatchRow, Round]]:
        """Every joining row's prompt (what is left of it) whole, in one target call of its own with only the last
        position's logits back: separate prefill, or chunked prefill with no row running (no row's step to
        protect)."""
        chunks = rest_of_prompts(self.joining)
        started = self.clock()
        rows, tokens = self.chunk_inputs(chunks)
        features = any(c.row.drafter_row is not None for c in chunks)
        outs = self.target_session.forward(rows, tokens, last_logits_only=True, features=features)
        rounds = self.take_chunks(chunks, outs)
        prof.prefill_rows, prof.prefill_tokens = len(chunks), sum(c.size for c in chunks)
        prof.prefill_s = self.clock() - started
        return rounds

    def draft(self, rows: list[BatchRow], picks: list[Pick], prof: StepProfile) -> list[Draft | None]:
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
                    self.leave_drafter(rows[i])
            return drafts
        for i, draft in zip(todo, out):
            rows[i].pending, rows[i].backlog, drafts[i] = [], 0, draft
        prof.draft_rows = len(todo)
        prof.draft_tokens = sum(q.block_size + int(q.new_features.shape[0]) for q in requests)
        return drafts

    def verify(
        self, rows: list[BatchRow], proposals: list[Proposal], chunks: list[Chunk], prof: StepProfile
    ) -> list[TargetOutput]:
        """ONE target call scoring every row's block (its last committed token, then its drafts) and then the
        prompt chunks; the outputs in that order."""
        ids = [[row.generated[-1], *p.ids] for row, p in zip(rows, proposals)]
        sizes = [len(block) for block in ids]
        # one tensor for the batch, viewed per row: a tensor per row costs the host more than the ids do
        blocks = list(torch.split(torch.tensor([t for block in ids for t in block], dtype=torch.long), sizes))
        prof.verify_rows, prof.blocks, prof.verify_tokens = len(rows), sizes, sum(sizes)
        chunk_rows, chunk_tokens = self.chunk_inputs(chunks)
        prof.chunk_rows, prof.chunk_tokens = len(chunks), sum(c.size for c in chunks)
        members = [*rows, *(c.row for c in chunks)]
        return self.target_session.forward(
            [row.target_row_id for row in rows] + chunk_rows,
            blocks + chunk_tokens,
            features=any(row.drafter_row is not None for row in members),
        )

    # ---- what the passes give the rows ----------------------------------------------------
    def accept(self, row: BatchRow, proposal: Proposal, out: TargetOutput, length: int) -> tuple[list[int], int]:
        """The row's acceptance rule on its scored block: the accepted drafts plus one token of the target's own
        (the bonus); the target's cache is rolled back to them, the drafter is handed their features. The
        logits stay on the engine's device; only token ids come back."""
        logits = row.adjusted(out.logits, proposal.ids)
        accepted, bonus = row.rule.accept(proposal, Scores.of(logits, out.logits, out.argmax))
        self.target_session.rollback(row.target_row_id, length + accepted + 1)
        if row.drafter_row is not None and out.features is not None:
            row.pending.append(out.features[: accepted + 1])
            row.backlog += accepted + 1
        new = proposal.ids[:accepted] + [bonus]
        row.note_logprobs(logits, new)
        return new, accepted

    def take_chunks(self, chunks: list[Chunk], outs: Sequence[TargetOutput]) -> list[tuple[BatchRow, Round]]:
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
            logits = row.adjusted(out.logits[-1:])
            first = next_token(logits[-1], row.params, row.generator)
            row.note_logprobs(logits, [first])
            assert row.prefill_started is not None
            row.stats.prefill_time_s = self.clock() - row.prefill_started
            timings = RoundTimings(target_s=row.stats.prefill_time_s, total_s=row.stats.prefill_time_s)
            self.joining.remove(row)
            self.running.append(row)
            rounds.append((row, row.commit([first], drafted=[], accepted=0, prefill=True, timings=timings)))
        return rounds
