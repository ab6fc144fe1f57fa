"""Sampling parameters and the warped distributions both target and drafter sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Temperatures this small are greedy (as in vLLM): logits / 1e-308 overflow to inf, then NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) restricted to top-k, then to the smallest top-p nucleus, renormalised. [..., V]."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p; the top token always stays, even when
        # top_p is below float32's smallest number and the comparison alone would keep nothing (0/0)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p
        keep[..., 0] = True
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [..., V] (need not sum to 1): inverse CDF, in float64.

    One uniform draw per row against the cumulative sum: the first token whose cumulative mass exceeds it
    (a zero-probability token owns an empty interval, so it is never drawn). torch.multinomial gives the
    same distribution at many times the cost per row."""
    flat = probs.reshape(-1, probs.shape[-1]).double()
    cdf = flat.cumsum(-1)
    # drawn where the generator lives (the same stream whatever device the probabilities are on), a few bytes
    u = torch.rand(flat.shape[0], 1, dtype=torch.float64, generator=generator, device=generator.device)
    u = u.to(flat.device) * cdf[:, -1:]
    picks = torch.searchsorted(cdf, u, right=True).clamp_(max=flat.shape[-1] - 1)
    return picks.view(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The target's own choice from one row of logits: what target-only decoding does."""
    if params.greedy:
        return int(logits.argmax(-1))
    return int(sample(probabilities(logits, params), generator))
