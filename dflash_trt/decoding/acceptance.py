"""Verification: how many drafted tokens the target accepts, and the token that follows them.

Each function gets the drafted tokens d[0..k-1] (for block positions 1..k) and the target's
scores for block positions 0..k (row i predicts the token after position i), and returns
(accepted, next_token): the target keeps d[:accepted] and then next_token, so a round always
yields accepted + 1 tokens. All three are lossless: output matches the target alone exactly
(greedy) or in distribution (sampling).

A round uses one AcceptanceRule, chosen once per generation by `acceptance_rule`: it says both how
the drafter's output becomes draft tokens (`propose`) and how the target judges them (`accept`), a round
without drafts included (the target's own next token). The loop has no other path: the greedy rule reads
the pass's argmax, computed once for the batch, where the request's logits are the pass's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol

import torch

from ..runtime.base import Draft
from .sampling import SamplingParams, next_token, probabilities, sample

ACCEPTANCE_RULES = ("rejection", "exact-match")


def greedy_prefix(draft: list[int], posterior: list[int]) -> tuple[int, int]:
    """The longest prefix where the draft d[0..k-1] equals the target's argmax after each of the block's k + 1
    positions (`posterior`); the argmax after it is the bonus. Plain Python on token ids: it runs once per row
    per step, and a handful of tiny tensor ops per row is what the host pays at hundreds of rows."""
    accepted = 0
    for proposed, chosen in zip(draft, posterior):
        if proposed != chosen:
            break
        accepted += 1
    return accepted, posterior[accepted]


def accept_exact_match(draft: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """The reference's rule at T > 0: sample the target at each position, accept while it equals the draft.

    This is speculative sampling with a one-hot proposal, so it is lossless whatever drafted.
    """
    posterior = sample(target_probs, generator)
    matches = (draft.to(posterior.device) == posterior[: draft.shape[0]]).to(torch.int64)
    accepted = int(matches.cumprod(0).sum())
    return accepted, int(posterior[accepted])


def accept_deterministic(
    draft: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling of a deterministic draft (a suffix run: the tokens that followed an earlier occurrence
    of the context, chosen without sampling), at T > 0.

    Rule: the proposal at position i is one-hot, q_i = e_{x_i}, given the accepted prefix (the run is a function of
    the committed tokens, which include that prefix). Rejection sampling (`accept_rejection`) accepts x_i with
    probability min(1, p_i(x_i) / q_i(x_i)) = p_i(x_i) and at a rejection draws from norm(max(0, p_i - q_i)) =
    p_i restricted to y != x_i, renormalised by 1 - p_i(x_i). Sampling y ~ p_i and accepting while y = x_i
    (`accept_exact_match`) is the same law: P(y = x_i) = p_i(x_i), and y given y != x_i is that restriction. So a
    position emits x with probability p_i(x_i) [x = x_i] + (1 - p_i(x_i)) p_i(x) [x != x_i] / (1 - p_i(x_i)) =
    p_i(x): the target's distribution, whatever the run. Where p_i(x_i) = 1 the rejection branch has probability
    0. After all k drafts are accepted the bonus is drawn from p_k, as in every rule here. Greedy rows need none of
    this: the longest prefix equal to the target's argmax (`greedy_prefix`) keeps the target's own tokens."""
    return accept_exact_match(draft, target_probs, generator)


def accept_rejection(
    draft: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. / Chen et al.).

    Draft token x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection the replacement is drawn from norm(max(0, p_i - q_i)); if all k are accepted the
    bonus is drawn from p_k. DFlash drafts every position independently given the context, so
    each x_i is still distributed as q_i given the accepted prefix and the proof holds.

    DFlash 2 drafts position by position (`sample_path`): x_i ~ q_i(. | x_<i), q_i the selector's softmax over
    its k candidates, zero elsewhere in the vocabulary. The proof needs only that x_i, given the prefix the
    target has accepted (which is the drafted x_<i), is distributed as the q_i that judges it, and that p_i is
    the target's distribution after that same prefix (the verify pass scores the drafted block). Then a round
    emits x at position i with probability q_i(x) min(1, p_i(x)/q_i(x)) + (1 - sum_y min(p_i, q_i)(y))
    max(0, p_i(x) - q_i(x)) / Z, and Z = sum_y max(0, p_i - q_i)(y) = 1 - sum_y min(p_i, q_i)(y), so that is
    min(p_i, q_i)(x) + max(0, p_i(x) - q_i(x)) = p_i(x). A token outside the candidates (q_i = 0) is never
    drafted and comes from the residual, which keeps all of its p_i. q_i need not match the target's warping
    (top-k / top-p apply to p only, as in the reference's _rejection_sample).
    """
    k = draft.shape[0]
    device = target_probs.device  # the target's device: only the k draft ids and k uniforms move there
    draft, draft_probs = draft.to(device), draft_probs.to(device)
    idx = torch.arange(k, device=device)
    p = target_probs[idx, draft]
    q = draft_probs[idx, draft]
    u = torch.rand(k, generator=generator, device=generator.device).to(device)
    ok = u * q < p  # P(u < p/q) = min(1, p/q)
    accepted = int(ok.to(torch.int64).cumprod(0).sum())
    if accepted == k:
        return k, int(sample(target_probs[k], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    # p == q exactly leaves no residual mass; then p itself is the right distribution.
    dist = residual / total if total > 0 else target_probs[accepted]
    return accepted, int(sample(dist, generator))


def sample_path(draft: Draft, temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash 2 at T > 0: walk the selector's candidates (models/selector.py), drawing position p's candidate
    from softmax(step_scores[p, previous choice] / T) over its k candidates. Returns the tokens [P] and each
    position's proposal distribution on the vocabulary [P, V] (the k probabilities, zeros elsewhere), the q
    of `accept_rejection`."""
    assert draft.candidates is not None and draft.step_scores is not None
    candidates, scores = draft.candidates, draft.step_scores.float()
    q = torch.zeros(candidates.shape[0], draft.logits.shape[-1], device=scores.device)
    chosen, tokens = 0, []
    for p in range(candidates.shape[0]):
        row = torch.softmax(scores[p, chosen] / temperature, dim=-1)
        chosen = int(sample(row, generator))
        q[p, candidates[p]] = row
        tokens.append(int(candidates[p, chosen]))
    return torch.tensor(tokens, dtype=torch.long), q


@dataclass(frozen=True)
class Proposal:
    """The tokens one row's round verifies, and for drafts drawn from a distribution, that distribution."""

    tokens: torch.Tensor  # [k] the draft tokens, on the CPU
    probs: torch.Tensor | None = None  # [k, vocab] the distribution they were drawn from (rejection sampling),
    # on the drafter's device; None for deterministic drafts (one-hot)

    @cached_property
    def ids(self) -> list[int]:
        """The draft tokens as ids, read once (the verify pass, acceptance and the commit use them)."""
        return self.tokens.tolist()


NO_DRAFT = Proposal(torch.empty(0, dtype=torch.long))


class Scores(NamedTuple):
    """The target's scores of one row's block of k + 1 positions (its last committed token, then k drafts)."""

    logits: torch.Tensor  # [k + 1, vocab] as the request sees them (its adjustments applied), engine's device
    argmax: Callable[[], list[int]]  # [k + 1] the greedy token after each position, computed on demand

    @classmethod
    def of(cls, logits: torch.Tensor, pass_logits: torch.Tensor, pass_argmax: Callable[[], list[int]]) -> Scores:
        """`logits` as the request sees them; where they are the pass's own (`pass_logits`: nothing adjusted them),
        their argmax is the pass's (`pass_argmax`, one for the batch: a handful of tensor ops per row is what the
        host pays at hundreds of rows)."""
        return cls(logits, pass_argmax if logits is pass_logits else lambda: logits.argmax(-1).tolist())


class AcceptanceRule(Protocol):
    def propose(self, draft: Draft) -> Proposal:
        """The drafter's output -> the tokens the target verifies."""

    def accept(self, proposal: Proposal, scores: Scores) -> tuple[int, int]:
        """(accepted, next token) from the target's scores of the block; with no drafts, the target's own next
        token."""


class GreedyRule:
    """T = 0: the drafter's argmax; the longest prefix matching the target's argmax."""

    def propose(self, draft: Draft) -> Proposal:
        return Proposal(draft.tokens.cpu())

    def accept(self, proposal: Proposal, scores: Scores) -> tuple[int, int]:
        return greedy_prefix(proposal.ids, scores.argmax())


class SampledRule:
    """T > 0: a round without drafts samples the target's own next token; one with drafts is judged by the
    subclass's rule (`judge`)."""

    def __init__(self, params: SamplingParams, generator: torch.Generator):
        self.params, self.generator = params, generator

    def accept(self, proposal: Proposal, scores: Scores) -> tuple[int, int]:
        if not proposal.ids:
            return 0, next_token(scores.logits[0], self.params, self.generator)
        return self.judge(proposal, scores.logits)

    def judge(self, proposal: Proposal, target_logits: torch.Tensor) -> tuple[int, int]:
        """(accepted, next token) for k >= 1 drafts from the target's logits [k + 1, vocab]."""
        raise NotImplementedError


class ExactMatchRule(SampledRule):
    """T > 0, the reference's rule: the drafter's argmax; accepted while the target's samples equal it."""

    def propose(self, draft: Draft) -> Proposal:
        return Proposal(draft.tokens.cpu())

    def judge(self, proposal: Proposal, target_logits: torch.Tensor) -> tuple[int, int]:
        return accept_exact_match(proposal.tokens, probabilities(target_logits, self.params), self.generator)


class RejectionRule(SampledRule):
    """T > 0, speculative sampling: drafts drawn from the drafter's distribution q, judged against p."""

    def propose(self, draft: Draft) -> Proposal:
        if draft.candidates is not None:  # DFlash 2: the selector's own proposal (accept_rejection: exact)
            tokens, q = sample_path(draft, self.params.temperature, self.generator)
            return Proposal(tokens, q)
        q = probabilities(draft.logits, self.params)  # on the drafter's device; only the tokens come back
        return Proposal(sample(q, self.generator).cpu(), q)

    def judge(self, proposal: Proposal, target_logits: torch.Tensor) -> tuple[int, int]:
        p = probabilities(target_logits, self.params)
        if proposal.probs is None:  # a deterministic draft (a suffix run): its q is one-hot
            return accept_deterministic(proposal.tokens, p, self.generator)
        return accept_rejection(proposal.tokens, proposal.probs, p, self.generator)


def acceptance_rule(name: str, params: SamplingParams, generator: torch.Generator) -> AcceptanceRule:
    """The rule for a generation: greedy at T = 0, else `name` ("rejection" or "exact-match")."""
    if params.greedy:
        return GreedyRule()
    if name == "exact-match":
        return ExactMatchRule(params, generator)
    if name == "rejection":
        return RejectionRule(params, generator)
    raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {name!r}")
