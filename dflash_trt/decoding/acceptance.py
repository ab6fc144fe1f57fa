"""Verification: how many drafted tokens the target accepts, and the token that follows them.

Each function gets the drafted tokens d[0..k-1] (for block positions 1..k) and the target's
scores for block positions 0..k (row i predicts the token after position i), and returns
(accepted, next_token): the target keeps d[:accepted] and then next_token, so a round always
yields accepted + 1 tokens. All three are lossless: output matches the target alone exactly
(greedy) or in distribution (sampling).
"""

from __future__ import annotations

import torch

from .sampling import sample


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix where the draft equals the target's argmax; the argmax after it is the bonus."""
    posterior = target_logits.argmax(-1)
    matches = (draft == posterior[: draft.shape[0]]).to(torch.int64)
    accepted = int(matches.cumprod(0).sum())
    return accepted, int(posterior[accepted])


def accept_exact_match(draft: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """The reference's rule at T > 0: sample the target at each position, accept while it equals the draft.

    This is speculative sampling with a one-hot proposal, so it is lossless whatever drafted.
    """
    posterior = sample(target_probs, generator)
    matches = (draft == posterior[: draft.shape[0]]).to(torch.int64)
    accepted = int(matches.cumprod(0).sum())
    return accepted, int(posterior[accepted])


def accept_rejection(
    draft: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. / Chen et al.).

    Draft token x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection the replacement is drawn from norm(max(0, p_i - q_i)); if all k are accepted the
    bonus is drawn from p_k. DFlash drafts every position independently given the context, so
    each x_i is still distributed as q_i given the accepted prefix and the proof holds.
    """
    k = draft.shape[0]
    idx = torch.arange(k)
    p = target_probs[idx, draft]
    q = draft_probs[idx, draft]
    u = torch.rand(k, generator=generator)
    ok = u * q < p  # P(u < p/q) = min(1, p/q)
    accepted = int(ok.to(torch.int64).cumprod(0).sum())
    if accepted == k:
        return k, int(sample(target_probs[k], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    # p == q exactly leaves no residual mass; then p itself is the right distribution.
    dist = residual / total if total > 0 else target_probs[accepted]
    return accepted, int(sample(dist, generator))
