"""The draft-and-verify loop, one verified round at a time.

    prefill: target(prompt) -> first token + features of every prompt token
    round:   drafter(new features, [last, MASK x (B-1)]) -> B-1 drafts        (proposer)
             target([last, d1 .. d_{B-1}]) -> logits + features               (scorer)
             accept -> keep d[:a] + one target token; roll the target back    (acceptance)
             the features of the a+1 committed block tokens feed the next round

`Generation` is a step-wise object so that a CLI, an HTTP scheduler or a Triton BLS model
can drive it (stream each round, interleave requests, stop early). With block size 1 (or no
drafter) the same code is plain autoregressive decoding with the target: the baseline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from ..runtime.base import DrafterEngine, DrafterSession, TargetEngine
from .acceptance import ACCEPTANCE_RULES, Proposal, acceptance_rule
from .detokenizer import IncrementalDetokenizer
from .processors import LogitsAdjustment
from .sampling import SamplingParams, next_token
from .stopping import StopChecker, truncate_at_stop

__all__ = [
    "ACCEPTANCE_RULES",
    "CommitState",
    "ContextLengthError",
    "Generation",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "InputError",
    "Round",
    "RoundTimings",
    "SpeculativeDecoder",
    "commit_tokens",
    "validate_request",
]


class InputError(ValueError):
    """A request the engines cannot serve as given (bad ids, lengths, settings)."""


class ContextLengthError(InputError):
    def __init__(self, message: str, prompt_alone: bool = False):
        super().__init__(message)
        self.prompt_alone = prompt_alone  # the prompt leaves no room for even one new token


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    block_size: int | None = None  # None: the drafter's trained size; 1: target alone
    acceptance: str = "rejection"  # at T > 0: "rejection" (draft probabilities) or "exact-match" (reference)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    drafter_fallback: bool = False  # if the drafter raises, go on with the target alone (a server keeps serving)
    adjust: LogitsAdjustment | None = None  # penalties, logit_bias, min_tokens: on the target's logits


@dataclass
class RoundTimings:
    """Seconds one step spent in each part (wall clock, perf_counter)."""

    draft_s: float = 0.0  # proposing: the drafter's call and drawing the drafts from its output
    verify_s: float = 0.0  # verifying: the target's forward, the acceptance rule, the rollback
    target_s: float = 0.0  # of which the target's forward (the prefill's forward in the first step)
    accept_s: float = 0.0  # of which the acceptance rule
    rollback_s: float = 0.0  # of which the target's KV cache rollback
    total_s: float = 0.0  # the whole step, bookkeeping (stop check, text) included


@dataclass
class Round:
    """Tokens committed by one step: the prefill's first token, or a verified block."""

    token_ids: list[int]
    drafted: int  # draft tokens proposed this round
    accepted: int  # of which the target accepted
    prefill: bool = False
    timings: RoundTimings = field(default_factory=RoundTimings)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per round, bonus included
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    block_size: int = 1
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """tau: mean tokens per verify round, bonus token included."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean_acceptance_length"] = round(self.mean_acceptance_length, 4)
        d["tokens_per_second"] = round(self.tokens_per_second, 2)
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats


class CommitState(Protocol):
    """What `commit_tokens` reads and updates: one sequence's output so far (a Generation, a batch row)."""

    config: GenerationConfig
    stop: StopChecker
    detokenizer: IncrementalDetokenizer | None
    generated: list[int]
    stats: GenerationStats
    finish_reason: str | None
    stop_string: str | None
    _started: float


def commit_tokens(state: CommitState, new: list[int], drafted: int, accepted: int, prefill: bool = False) -> list[int]:
    """Append one round's tokens to a sequence and return those kept. The order: the token budget, stop
    tokens, then stop strings (cutting the text back to the stop), then the budget as a finish reason;
    updates the stats (a prefill counts no round)."""
    new = new[: state.config.max_new_tokens - len(state.generated)]
    keep = state.stop.stop_token(new)
    if keep is not None:
        new = new[:keep]
        state.finish_reason = "stop"
    state.generated.extend(new)
    if state.detokenizer is not None:
        state.detokenizer.add(new)
    hit = state.stop.stop_string() if keep is None else None
    if hit is not None:
        keep, state.stop_string = hit
        cut = len(state.generated) - keep
        if cut:
            del state.generated[keep:]
            new = new[: len(new) - cut]
        state.finish_reason = "stop"
    elif state.finish_reason is None and len(state.generated) >= state.config.max_new_tokens:
        state.finish_reason = "length"
    s = state.stats
    s.new_tokens = len(state.generated)
    if not prefill:
        s.rounds += 1
        s.acceptance_lengths.append(len(new))
        s.drafted_tokens += drafted
        s.accepted_draft_tokens += accepted
    s.total_time_s = time.perf_counter() - state._started
    return new


def validate_request(prompt_ids: Sequence[int], cfg: GenerationConfig, target: Any, drafter: Any) -> None:
    """Raise InputError (ContextLengthError for lengths) unless these engines can serve this request.
    Shared by the single-sequence `Generation` and the batched loop, so both refuse the same requests."""
    if not prompt_ids:
        raise InputError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= int(t) < target.vocab_size]
    if bad:
        raise InputError(f"token ids out of vocabulary (size {target.vocab_size}): {bad[:5]}")
    if cfg.max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    total = len(prompt_ids) + cfg.max_new_tokens
    limit, who = target.max_context, "target"
    drafter_limit = getattr(drafter, "max_context", None) if drafter is not None and cfg.block_size != 1 else None
    if drafter_limit is not None and drafter_limit < limit:  # e.g. a TensorRT plan's profile; None: unlimited
        limit, who = drafter_limit, "drafter"
    if total > limit:
        raise ContextLengthError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) = {total} "
            f"exceeds the {who}'s context length {limit}",
            prompt_alone=len(prompt_ids) >= limit,
        )
    if cfg.block_size is not None:
        if drafter is None and cfg.block_size != 1:
            raise InputError(f"no drafter is loaded, so block_size must be 1, got {cfg.block_size}")
        limit = drafter.block_size if drafter is not None else 1
        if not 1 <= cfg.block_size <= limit:
            raise InputError(f"block_size must be in 1..{limit} for this drafter, got {cfg.block_size}")
    if cfg.acceptance not in ACCEPTANCE_RULES:
        raise InputError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {cfg.acceptance!r}")


class SpeculativeDecoder:
    """Binds a target engine, an optional drafter engine and an optional tokenizer."""

    def __init__(self, target: TargetEngine, drafter: DrafterEngine | None = None, tokenizer: Any = None):
        if drafter is not None and tuple(drafter.feature_layer_ids) != tuple(target.feature_layer_ids):
            raise ValueError(
                f"target exposes features of layers {target.feature_layer_ids}, drafter needs {drafter.feature_layer_ids}"
            )
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer

    def start(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> Generation:
        return Generation(self, list(prompt_ids), config)

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> GenerationResult:
        gen = self.start(prompt_ids, config)
        for _ in gen:
            pass
        return gen.result()

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


class Generation:
    """One request's state; iterate it (or call step()) to run one round at a time."""

    def __init__(self, decoder: SpeculativeDecoder, prompt_ids: list[int], config: GenerationConfig):
        self.decoder, self.config = decoder, config
        self.prompt_ids = prompt_ids
        self._validate()
        target, drafter = decoder.target, decoder.drafter
        self.block_size = 1 if drafter is None else (config.block_size or drafter.block_size)
        self.params = config.sampling
        self.generator = self.params.generator()
        self.rule = acceptance_rule(config.acceptance, self.params, self.generator)  # chosen once
        self.detokenizer = IncrementalDetokenizer(decoder.tokenizer) if decoder.tokenizer is not None else None
        self.stop = StopChecker(frozenset(config.stop_token_ids), tuple(config.stop_strings), self.detokenizer)
        self.target_session = target.new_session()
        self.drafter_session: DrafterSession | None = (
            drafter.new_session() if drafter is not None and self.block_size > 1 else None
        )
        self.generated: list[int] = []
        self.pending_features: torch.Tensor | None = None  # committed but not yet shown to the drafter
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=self.block_size)
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.drafter_error: Exception | None = None  # set when drafter_fallback took over
        self._started = time.perf_counter()

    def _validate(self) -> None:
        validate_request(self.prompt_ids, self.config, self.decoder.target, self.decoder.drafter)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def __iter__(self) -> Iterator[Round]:
        while not self.done:
            yield self.step()

    def step(self) -> Round:
        if self.done:
            raise RuntimeError("generation already finished")
        if not self.generated:
            return self._prefill()
        return self._verify_round()

    # ---- the two kinds of step ----------------------------------------------------------
    def _prefill(self) -> Round:
        t0 = time.perf_counter()
        want_features = self.drafter_session is not None
        out = self.target_session.forward(
            torch.tensor(self.prompt_ids, dtype=torch.long), last_logits_only=True, features=want_features
        )
        first = next_token(self._adjusted(out.logits[-1:])[-1], self.params, self.generator)
        self.pending_features = out.features
        self.stats.prefill_time_s = time.perf_counter() - t0
        timings = RoundTimings(target_s=self.stats.prefill_time_s)
        return self._commit([first], drafted=0, accepted=0, timings=timings, started=t0, prefill=True)

    def _verify_round(self) -> Round:
        """Propose (drafter), score (target), accept (the rule), roll back, commit."""
        t0 = time.perf_counter()
        remaining = self.config.max_new_tokens - len(self.generated)
        size = min(self.block_size, remaining)
        last = self.generated[-1]
        proposal = self._propose(last, size)
        t1 = time.perf_counter()

        block = torch.tensor([last] + proposal.tokens.tolist(), dtype=torch.long)
        committed_len = self.target_session.length
        out = self.target_session.forward(block, features=self.drafter_session is not None)
        t2 = time.perf_counter()
        logits = self._adjusted(out.logits.cpu(), proposal.tokens.tolist())
        if proposal.tokens.numel() == 0:  # the target alone: its own next token
            accepted, bonus = 0, next_token(logits[0], self.params, self.generator)
        else:
            accepted, bonus = self.rule.accept(proposal, logits)
        t3 = time.perf_counter()
        self.target_session.rollback(committed_len + accepted + 1)
        if out.features is not None:
            self.pending_features = out.features[: accepted + 1]
        t4 = time.perf_counter()

        timings = RoundTimings(
            draft_s=t1 - t0, verify_s=t4 - t1, target_s=t2 - t1, accept_s=t3 - t2, rollback_s=t4 - t3
        )
        self.stats.draft_time_s += timings.draft_s
        self.stats.verify_time_s += timings.verify_s
        new = proposal.tokens[:accepted].tolist() + [bonus]
        return self._commit(new, drafted=len(proposal.tokens), accepted=accepted, timings=timings, started=t0)

    def _adjusted(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """The target's logits as the request sees them: row i after the committed tokens + draft[:i]
        (penalties, logit_bias, min_tokens; exact, since row i only counts if draft[:i] is accepted)."""
        adjust = self.config.adjust
        return logits if adjust is None else adjust.apply(logits.cpu(), self.generated, draft)

    def _propose(self, last: int, size: int) -> Proposal:
        nothing = Proposal(torch.empty(0, dtype=torch.long))
        if size < 2 or self.drafter_session is None:
            return nothing
        assert self.pending_features is not None  # set by the prefill and by every verified round
        try:
            draft = self.drafter_session.draft(self.pending_features, last, size)
        except Exception as e:
            if not self.config.drafter_fallback:
                raise
            # Still lossless: from here on the target alone picks every token (block size 1).
            self.drafter_error, self.drafter_session, self.block_size = e, None, 1
            return nothing
        self.pending_features = None
        return self.rule.propose(draft)

    # ---- bookkeeping --------------------------------------------------------------------
    def _commit(
        self, new: list[int], drafted: int, accepted: int, timings: RoundTimings, started: float, prefill: bool = False
    ) -> Round:
        new = commit_tokens(self, new, drafted, accepted, prefill)
        timings.total_s = self.stats.total_time_s + self._started - started
        return Round(token_ids=new, drafted=drafted, accepted=accepted, prefill=prefill, timings=timings)

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("generation still running")
        assert self.finish_reason is not None  # done
        text = None
        if self.detokenizer is not None:
            text = truncate_at_stop(self.detokenizer.final_text(), self.stop_string)
        return GenerationResult(list(self.generated), text, self.finish_reason, self.stats)
