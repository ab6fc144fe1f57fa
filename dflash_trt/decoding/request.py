"""What a request is and what it returns: its settings, its validation, its committed tokens and stats."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

from .acceptance import ACCEPTANCE_RULES
from .detokenizer import IncrementalDetokenizer
from .errors import ContextLengthError as ContextLengthError  # re-exported: where a request's errors were
from .errors import InputError as InputError
from .grammar import GrammarSpec
from .processors import LogitsAdjustment
from .proposers import DEFAULT_PROPOSER, NO_DRAFT_NAME, PROPOSERS
from .sampling import SamplingParams
from .stopping import StopChecker

# the most alternatives a token's logprobs list (`GenerationConfig.logprobs`): OpenAI's bound on top_logprobs
MAX_TOP_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the target's distribution it was drawn from (after the
    request's penalties and logit bias, its grammar's mask and its temperature, top-k and top-p; at temperature
    0, of softmax(logits) under the same adjustments and mask): vLLM's "processed_logprobs". `top`: the k most
    likely tokens of that distribution, most likely first (k = `GenerationConfig.logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # back up the prompt's last token when the tokenizer would have merged it with what follows (healing.py);
    # for prompts encoded from text, never for token ids the client chose
    heal_prompt: bool = False
    # where the drafts come from: a name of `proposers.PROPOSERS`
    proposer: str = DEFAULT_PROPOSER
    # what the output must follow (grammar.py: a JSON schema, a regex, choices, an EBNF); None: free text
    grammar: GrammarSpec | None = None
    # draft the tokens the grammar forces (where the proposer takes them: `Proposer.takes_forced`); off, a guided
    # row drafts only what its proposer proposes (the comparison `dflash-trt bench forced` makes)
    forced_drafts: bool = True
    # None: no logprobs; 0: each generated token's own (`TokenLogprob`); k: and the top k (k <= MAX_TOP_LOGPROBS)
    logprobs: int | None = None
    # whose finished outputs the request's suffix runs also match and its own output joins (sharing.py): a tenant
    # that may read its requests' outputs; None: nothing shared, the request matches its own tokens only
    tenant: str | None = None


@dataclass(slots=True)
class RoundTimings:
    """Seconds one step spent in each part (the decoder's clock)."""

    draft_s: float = 0.0  # proposing: the drafter's call and drawing the drafts from its output
    verify_s: float = 0.0  # verifying: the target's forward, the acceptance rule and the rollback
    target_s: float = 0.0  # of which the target's forward (the prefill's forward in the first step)
    accept_s: float = 0.0  # of which the acceptance rule
    total_s: float = 0.0  # the whole step, bookkeeping (stop check, text) included

    @classmethod
    def of_round(cls, started: float, planned: float, drafted: float, verified: float, own: float) -> RoundTimings:
        """A verified round's timings from its step's clock readings (the step began, its plan, drafter and target
        passes ended: shared by the step's rows) and the seconds of the row's own acceptance and rollback."""
        return cls(
            draft_s=drafted - planned,
            verify_s=verified - drafted + own,
            target_s=verified - drafted,
            accept_s=own,
            total_s=verified - started + own,
        )


@dataclass(slots=True)
class Round:
    """Tokens committed by one step: the prefill's first token, or a verified block."""

    token_ids: list[int]
    drafted: int  # draft tokens proposed this round
    accepted: int  # of which the target accepted
    prefill: bool = False
    timings: RoundTimings = field(default_factory=RoundTimings)
    # the text this round adds that can be shown now (None without a tokenizer): a partial character, and an
    # end that may still begin a stop string, wait for a later round; the last round carries the rest
    text: str | None = None
    proposer: str = NO_DRAFT_NAME  # the proposer whose drafts it verified (`NO_DRAFT_NAME`: none; a prefill)
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids` where the request asked for them


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per round, bonus included
    drafted_ids_per_round: list[list[int]] = field(default_factory=list)  # the draft tokens each round proposed
    accepted_per_round: list[int] = field(default_factory=list)  # of which the target accepted
    proposer_per_round: list[str] = field(default_factory=list)  # where each round's drafts came from
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    block_size: int = 1
    proposer: str = DEFAULT_PROPOSER  # the request's proposer (a hybrid's rounds say which one each used)
    drafted_by: dict[str, int] = field(default_factory=dict)  # draft tokens per proposer that drafted
    accepted_by: dict[str, int] = field(default_factory=dict)  # of which the target accepted
    suffix_states: int = 0  # states of the request's suffix automaton (its memory measure; 0 without one)
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

    @property
    def drafted_per_round(self) -> list[int]:
        """Draft tokens each round proposed (0: none)."""
        return [len(ids) for ids in self.drafted_ids_per_round]

    def trace(self) -> list[dict[str, Any]]:
        """One object per verify round, for debugging acceptance: the block verified (B: the last committed
        token and its B-1 drafts), the drafted ids, how many of them the target accepted and, where the loop
        recorded it, the proposer they came from. A round without a draft (the target alone) has B = 1.
        `commit_tokens` appends to every list in one call; lists of different lengths (stats put together
        elsewhere) are refused rather than pairing a round's drafts with another round's acceptance."""
        if len(self.drafted_ids_per_round) != len(self.accepted_per_round):
            raise RuntimeError(
                f"trace: {len(self.drafted_ids_per_round)} rounds' drafted ids for {len(self.accepted_per_round)} "
                "rounds' acceptance (a decoding path committed rounds without recording their drafts)"
            )
        rounds = [
            {"block_size": len(ids) + 1, "drafted": ids, "accepted": a}
            for ids, a in zip(self.drafted_ids_per_round, self.accepted_per_round)
        ]
        if self.proposer_per_round:
            if len(self.proposer_per_round) != len(rounds):
                raise RuntimeError(f"trace: {len(self.proposer_per_round)} rounds' proposers for {len(rounds)} rounds")
            for r, name in zip(rounds, self.proposer_per_round):
                r["proposer"] = name
        return rounds

    def to_dict(self) -> dict[str, Any]:
        """The totals (the per-round lists beside `acceptance_lengths` are for traces and per-step reports)."""
        d = asdict(self)
        del d["accepted_per_round"], d["drafted_ids_per_round"], d["proposer_per_round"]
        d["mean_acceptance_length"] = round(self.mean_acceptance_length, 4)
        d["tokens_per_second"] = round(self.tokens_per_second, 2)
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop", "length", "cancelled" (client gone, deadline) or "error"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, in order, where the request asked


class CommitState(Protocol):
    """What `commit_tokens` reads and updates: one sequence's output so far (a row of the loop)."""

    config: GenerationConfig
    stop: StopChecker
    detokenizer: IncrementalDetokenizer | None
    generated: list[int]
    stats: GenerationStats
    finish_reason: str | None
    stop_string: str | None
    started: float
    clock: Callable[[], float]


def commit_tokens(
    state: CommitState,
    new: list[int],
    drafted: list[int],
    accepted: int,
    prefill: bool = False,
    proposer: str = NO_DRAFT_NAME,
) -> list[int]:
    """Append one round's tokens to a sequence and return those kept. The order: the token budget, stop
    tokens, then stop strings (cutting the text back to the stop), then the budget as a finish reason;
    updates the stats (a prefill counts no round; a round records its `drafted` ids with its counts and its
    `proposer`, so the trace can never pair one round's drafts with another's acceptance)."""
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
        s.drafted_tokens += len(drafted)
        s.accepted_draft_tokens += accepted
        s.drafted_ids_per_round.append(drafted)
        s.accepted_per_round.append(accepted)
        s.proposer_per_round.append(proposer)
        if drafted:
            s.drafted_by[proposer] = s.drafted_by.get(proposer, 0) + len(drafted)
            s.accepted_by[proposer] = s.accepted_by.get(proposer, 0) + accepted
    s.total_time_s = state.clock() - state.started
    return new


def check_engines(target: Any, drafter: Any, block_size: int | None) -> int:
    """The drafter's trained block size (1 without a drafter), once the drafter reads the features the target
    exposes and `block_size` (None: the trained one) is within it; ValueError otherwise."""
    if drafter is not None and tuple(drafter.feature_layer_ids) != tuple(target.feature_layer_ids):
        raise ValueError(
            f"target exposes features of layers {target.feature_layer_ids}, drafter needs {drafter.feature_layer_ids}"
        )
    trained: int = drafter.block_size if drafter is not None else 1
    if block_size is not None and not 1 <= block_size <= trained:
        raise ValueError(f"block_size must be in 1..{trained} for this drafter, got {block_size}")
    return trained


def validate_request(prompt_ids: Sequence[int], cfg: GenerationConfig, target: Any, drafter: Any) -> None:
    """Raise InputError (ContextLengthError for lengths) unless these engines can serve this request."""
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
    if cfg.proposer not in PROPOSERS:
        raise InputError(f"proposer must be one of {PROPOSERS}, got {cfg.proposer!r}")
    if cfg.logprobs is not None and not 0 <= cfg.logprobs <= MAX_TOP_LOGPROBS:
        raise InputError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {cfg.logprobs}")
    if cfg.acceptance not in ACCEPTANCE_RULES:
        raise InputError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {cfg.acceptance!r}")
