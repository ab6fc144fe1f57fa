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
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch

from ..runtime.base import DrafterEngine, TargetEngine
from .acceptance import accept_exact_match, accept_greedy, accept_rejection
from .processors import LogitsAdjustment
from .sampling import SamplingParams, next_token, probabilities, sample
from .stopping import StopChecker, truncate_at_stop

ACCEPTANCE_RULES = ("rejection", "exact-match")


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
class Round:
    """Tokens committed by one step: the prefill's first token, or a verified block."""

    token_ids: list[int]
    drafted: int  # draft tokens proposed this round
    accepted: int  # of which the target accepted
    prefill: bool = False


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

    def to_dict(self) -> dict:
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


class SpeculativeDecoder:
    """Binds a target engine, an optional drafter engine and an optional tokenizer."""

    def __init__(self, target: TargetEngine, drafter: DrafterEngine | None = None, tokenizer=None):
        if drafter is not None and tuple(drafter.feature_layer_ids) != tuple(target.feature_layer_ids):
            raise ValueError(
                f"target exposes features of layers {target.feature_layer_ids}, drafter needs {drafter.feature_layer_ids}"
            )
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer

    def start(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> "Generation":
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
        self.stop = StopChecker(frozenset(config.stop_token_ids), tuple(config.stop_strings), decoder.tokenizer)
        self.target_session = target.new_session()
        self.drafter_session = drafter.new_session() if self.block_size > 1 else None
        self.generated: list[int] = []
        self.pending_features: torch.Tensor | None = None  # committed but not yet shown to the drafter
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=self.block_size)
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.drafter_error: Exception | None = None  # set when drafter_fallback took over
        self._started = time.perf_counter()

    def _validate(self) -> None:
        cfg, target, drafter = self.config, self.decoder.target, self.decoder.drafter
        if not self.prompt_ids:
            raise InputError("the prompt is empty")
        bad = [t for t in self.prompt_ids if not 0 <= int(t) < target.vocab_size]
        if bad:
            raise InputError(f"token ids out of vocabulary (size {target.vocab_size}): {bad[:5]}")
        if cfg.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
        total = len(self.prompt_ids) + cfg.max_new_tokens
        limit, who = target.max_context, "target"
        drafter_limit = getattr(drafter, "max_context", None) if cfg.block_size != 1 else None  # None: unlimited
        if drafter_limit is not None and drafter_limit < limit:  # e.g. a TensorRT plan's profile
            limit, who = drafter_limit, "drafter"
        if total > limit:
            raise ContextLengthError(
                f"prompt ({len(self.prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) = {total} "
                f"exceeds the {who}'s context length {limit}",
                prompt_alone=len(self.prompt_ids) >= limit,
            )
        if cfg.block_size is not None:
            if drafter is None and cfg.block_size != 1:
                raise InputError(f"no drafter is loaded, so block_size must be 1, got {cfg.block_size}")
            limit = drafter.block_size if drafter is not None else 1
            if not 1 <= cfg.block_size <= limit:
                raise InputError(f"block_size must be in 1..{limit} for this drafter, got {cfg.block_size}")
        if cfg.acceptance not in ACCEPTANCE_RULES:
            raise InputError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {cfg.acceptance!r}")

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
        return self._commit([first], drafted=0, accepted=0, prefill=True)

    def _verify_round(self) -> Round:
        remaining = self.config.max_new_tokens - len(self.generated)
        size = min(self.block_size, remaining)
        last = self.generated[-1]

        t0 = time.perf_counter()
        draft_tokens, draft_probs = self._propose(last, size)
        t1 = time.perf_counter()

        block = torch.tensor([last] + draft_tokens.tolist(), dtype=torch.long)
        committed_len = self.target_session.length
        out = self.target_session.forward(block, features=self.drafter_session is not None)
        accepted, bonus = self._accept(draft_tokens, draft_probs, self._adjusted(out.logits, draft_tokens.tolist()))
        self.target_session.rollback(committed_len + accepted + 1)
        if out.features is not None:
            self.pending_features = out.features[: accepted + 1]
        t2 = time.perf_counter()

        self.stats.draft_time_s += t1 - t0
        self.stats.verify_time_s += t2 - t1
        new = draft_tokens[:accepted].tolist() + [bonus]
        return self._commit(new, drafted=len(draft_tokens), accepted=accepted)

    # ---- proposer / acceptance ----------------------------------------------------------
    def _adjusted(self, logits: torch.Tensor, draft: list[int] = ()) -> torch.Tensor:
        """The target's logits as the request sees them: row i after the committed tokens + draft[:i]."""
        adjust = self.config.adjust
        return logits if adjust is None else adjust.apply(logits.cpu(), self.generated, draft)

    def _propose(self, last: int, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if size < 2 or self.drafter_session is None:
            return torch.empty(0, dtype=torch.long), None
        try:
            draft = self.drafter_session.draft(self.pending_features, last, size)
        except Exception as e:
            if not self.config.drafter_fallback:
                raise
            # Still lossless: from here on the target alone picks every token (block size 1).
            self.drafter_error, self.drafter_session, self.block_size = e, None, 1
            return torch.empty(0, dtype=torch.long), None
        self.pending_features = None
        if self.params.greedy or self.config.acceptance == "exact-match":
            return draft.tokens.cpu(), None
        q = probabilities(draft.logits.cpu(), self.params)
        return sample(q, self.generator), q

    def _accept(self, draft: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
        logits = logits.cpu()
        if draft.numel() == 0:
            return 0, next_token(logits[0], self.params, self.generator)
        if self.params.greedy:
            return accept_greedy(draft, logits)
        p = probabilities(logits, self.params)
        if draft_probs is None:
            return accept_exact_match(draft, p, self.generator)
        return accept_rejection(draft, draft_probs, p, self.generator)

    # ---- bookkeeping --------------------------------------------------------------------
    def _commit(self, new: list[int], drafted: int, accepted: int, prefill: bool = False) -> Round:
        new = new[: self.config.max_new_tokens - len(self.generated)]
        self.generated.extend(new)
        hit = self.stop.first_stop(self.generated, len(new))
        if hit is not None:
            keep, self.stop_string = hit
            cut = len(self.generated) - keep
            if cut:
                del self.generated[keep:]
                new = new[: len(new) - cut]
            self.finish_reason = "stop"
        elif len(self.generated) >= self.config.max_new_tokens:
            self.finish_reason = "length"
        s = self.stats
        s.new_tokens = len(self.generated)
        if not prefill:
            s.rounds += 1
            s.acceptance_lengths.append(len(new))
            s.drafted_tokens += drafted
            s.accepted_draft_tokens += accepted
        s.total_time_s = time.perf_counter() - self._started
        return Round(token_ids=new, drafted=drafted, accepted=accepted, prefill=prefill)

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("generation still running")
        tok = self.decoder.tokenizer
        text = None
        if tok is not None:
            text = truncate_at_stop(tok.decode(self.generated, skip_special_tokens=True), self.stop_string)
        return GenerationResult(list(self.generated), text, self.finish_reason, self.stats)
