"""One request inside the decoding loop (a *row*): its settings, its output so far, its place in the engines'
sessions and what its proposers keep for it. The loop (`loop.BatchDecoder`) steps rows; the policy, the step's
records and the chunk planner read them, so the row lives here, below all of them (no module of this package
imports the loop but the package's front door)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..runtime.base import Draft, DraftRequest
from .acceptance import NO_DRAFT, Proposal, acceptance_rule
from .detokenizer import IncrementalDetokenizer, held_back
from .grammar import CompiledGrammar
from .guided import GuidedRow
from .healing import Healing
from .logprobs import token_logprobs
from .proposers import DFLASH, NO_DRAFT_NAME, Pick, Proposer, RowDrafts, RunCalibration, RunPrior
from .request import (
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    Round,
    RoundTimings,
    TokenLogprob,
    commit_tokens,
)
from .stopping import StopChecker, truncate_at_stop
from .suffix import SharedSuffixes, SharedWalk, StepBudget, SuffixAutomaton


class BatchRow:
    """One request inside a BatchDecoder: its settings, its output so far and its place in the sessions."""

    def __init__(
        self,
        *,
        row_id: int,
        prompt_ids: list[int],
        config: GenerationConfig,
        tokenizer: Any,
        can_draft: bool,
        clock: Callable[[], float],
        healing: Healing | None = None,
        proposer: Proposer | None = None,
        shared: SharedSuffixes | None = None,
        suffix_budget: StepBudget | None = None,
        run_prior: RunPrior | None = None,
        fixed_block: int | None = None,
        grammar: CompiledGrammar | None = None,
    ):
        self.id, self.prompt_ids, self.config, self.healing = row_id, prompt_ids, config, healing
        self.params = config.sampling
        self.sampled = not self.params.greedy  # the row's sampling regime (greedy and sampled rows accept differently)
        self.generator = self.params.generator()
        self.rule = acceptance_rule(config.acceptance, self.params, self.generator)
        skip = healing.text if healing is not None else ""
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip=skip) if tokenizer is not None else None
        self.stop = StopChecker(frozenset(config.stop_token_ids), tuple(config.stop_strings), self.detokenizer)
        self.can_draft = can_draft  # may hold a drafter row (a DFlash proposer, a drafter loaded, block > 1)
        self.proposer: Proposer = proposer or DFLASH
        # a block size the request or the decoder fixed (None: the policy's choice): it bounds a suffix run as it
        # bounds a DFlash block, so block size 1 is the target alone whatever the proposer
        self.fixed_block = fixed_block
        uses = self.proposer.keeps_suffix
        self.drafts = RowDrafts(
            SuffixAutomaton() if uses else None,
            SharedWalk(shared) if uses and shared is not None else None,
            budget=suffix_budget,
            calibration=RunCalibration(prior=run_prior, learns=grammar is None),
        )
        self.drafts.add(prompt_ids)
        self.guide = GuidedRow(grammar) if grammar is not None else None  # its grammar's state (guided.py)
        self.logprobs: list[TokenLogprob] | None = [] if config.logprobs is not None else None
        self.round_logprobs: list[TokenLogprob] = []  # the next commit's tokens' (`note_logprobs`)
        self.target_row: int | None = None
        self.drafter_row: int | None = None
        self.prefilled = 0  # prompt tokens in the target's cache (chunked prefill takes a prompt in pieces)
        self.prefill_started: float | None = None  # when its first chunk's pass began
        self.generated: list[int] = []
        self.pending: list[torch.Tensor] = []  # features committed but not yet shown to the drafter
        self.backlog = 0  # their rows: context the drafter's next draft for this row takes in
        self.block = config.block_size or 1  # its block on the last step (what the next step reserves)
        self.stats = GenerationStats(
            prompt_tokens=len(prompt_ids), block_size=config.block_size or 0, proposer=config.proposer
        )
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

    @property
    def target_row_id(self) -> int:
        """Its row in the target's session (set by its prompt's first chunk)."""
        assert self.target_row is not None
        return self.target_row

    def drafts_with(self, pick: Pick) -> bool:
        """Whether this round's pick takes a draft from the row's drafter row: a drafter's block, and the row has
        a drafter row and context features it has not yet shown it."""
        uses = pick.proposer is not None and pick.proposer.uses_drafter
        return uses and pick.block >= 2 and self.drafter_row is not None and bool(self.pending)

    def draft_request(self, block: int) -> DraftRequest:
        """The row's part of the drafter call: its backlog of features, its last token, a block of `block`."""
        assert self.drafter_row is not None
        features = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        return DraftRequest(self.drafter_row, features, self.generated[-1], block)

    def proposal(self, pick: Pick, draft: Draft | None) -> Proposal:
        """The tokens the target verifies for the row this round: a deterministic proposer's tokens as picked (no
        distribution: its acceptance is the one-hot rule), a drafter's draft through the row's acceptance rule."""
        if pick.proposer is not None and pick.proposer.deterministic:
            proposal = Proposal(torch.tensor(pick.drafts, dtype=torch.long))
        else:
            proposal = NO_DRAFT if draft is None else self.rule.propose(draft)
        if self.guide is None:
            return proposal
        forced = self.config.forced_drafts and self.proposer.takes_forced
        most = self.max_drafts if forced else len(proposal.ids)
        return self.guide.propose(proposal, most, forced, self.generator)

    def drafter_failed(self, error: Exception) -> bool:
        """The drafter raised on this row: without `drafter_fallback` the row fails; with it, still lossless, the
        target alone picks its tokens from here on (its drafter cache may be half-written, so it leaves the
        drafter for good). Whether it falls back (the caller removes its drafter row)."""
        if not self.config.drafter_fallback:
            self.error, self.finish_reason = error, "error"
            return False
        self.drafter_error, self.can_draft = error, False
        return True

    def leave_suffixes(self, shared: SharedSuffixes | None) -> None:
        """The row leaves the loop: a finished output joins the shared suffix structure (for later requests'
        runs) where the row kept one; its own suffix structures go with it."""
        if self.drafts.suffix is not None and shared is not None and self.finish_reason in ("stop", "length"):
            shared.add(self.generated)
        self.drafts.suffix = self.drafts.shared = None

    @property
    def max_drafts(self) -> int:
        """The most tokens a draft may hold this round: the tokens left after the one the target adds, within a
        fixed block size."""
        most = self.remaining if self.fixed_block is None else min(self.remaining, self.fixed_block)
        return most - 1

    def commit(
        self,
        new: list[int],
        drafted: list[int],
        accepted: int,
        prefill: bool = False,
        timings: RoundTimings | None = None,
        used: Proposer | None = None,
    ) -> Round:
        """Commit a round's `new` tokens; `drafted`: the draft tokens it verified (`accepted` of them kept),
        proposed by `used` (None: nothing drafted). The proposers' structures and estimates learn from it."""
        name = used.name if used is not None and drafted else NO_DRAFT_NAME
        if self.guide is not None:
            self.guide.settle(accepted, new)
        new = commit_tokens(self, new, drafted, accepted, prefill, name)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.round_logprobs[: len(new)]
            self.logprobs.extend(logprobs)
            del self.logprobs[len(self.generated) :]  # a stop string may cut tokens of earlier rounds
            self.round_logprobs = []
        self.drafts.add(new)
        if not prefill:
            self.proposer.learn(self.drafts, used if drafted else None, len(drafted), accepted)
        self.stats.suffix_states = self.drafts.suffix_states
        return Round(new, len(drafted), accepted, prefill, timings or RoundTimings(), self._new_text(), name, logprobs)

    def note_logprobs(self, logits: torch.Tensor, new: list[int]) -> None:
        """Where the request asks for logprobs: those of the round's tokens `new`, token i drawn from row i of the
        request's `logits` (`adjusted`), for the next `commit`."""
        if self.logprobs is not None:
            assert self.config.logprobs is not None
            self.round_logprobs = token_logprobs(logits, new, self.params, self.config.logprobs)

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
        prompt's first token is constrained (healing.py). A row with a grammar: each row i masked to what the
        grammar admits there (guided.py), after the adjustments."""
        adjust = self.config.adjust
        out = logits if adjust is None else adjust.apply(logits, self.generated, draft)
        if self.healing is not None and not self.generated:
            out = self.healing.constrain(out)
        return out if self.guide is None else self.guide.constrain(out)

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("row still running")
        text = self._final_text() if self.detokenizer is not None else None
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return GenerationResult(list(self.generated), text, self.finish_reason or "error", self.stats, logprobs)

    def _final_text(self) -> str:
        """The finished row's text, cut at its stop string (decoded once)."""
        if self._final is None:
            assert self.detokenizer is not None
            self._final = truncate_at_stop(self.detokenizer.final_text(), self.stop_string)
        return self._final
