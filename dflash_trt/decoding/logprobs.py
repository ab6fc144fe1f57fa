"""Logprobs of generated tokens (`TokenLogprob`): the target's log-probabilities of the distribution each token was
drawn from. That distribution is the request's: the target's logits after its penalties, logit bias and min_tokens
(processors.py) and its grammar's mask (guided.py), then its temperature, top-k and top-p (sampling.py) - what
vLLM calls "processed_logprobs" (`logprobs_mode`, vLLM v0.10.2 and later). At temperature 0 the token is the
argmax and the distribution reported is softmax of the same adjusted, masked logits at temperature 1 (top-k and
top-p, which greedy decoding ignores, are not applied).

A drafted token that the target accepted was drawn from the verify pass's row at its position, which is the
distribution the target alone would have drawn it from (the row's adjustments and mask are those of the same
prefix), so logprobs are the same with speculation on and off, up to the float rounding of a batched pass."""

from __future__ import annotations

from dataclasses import replace

import torch

from .request import TokenLogprob
from .sampling import SamplingParams, probabilities


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top: int) -> list[TokenLogprob]:
    """`tokens[i]`'s logprob under row i of `logits` [>= len(tokens), vocab] (the request's adjusted, masked
    logits), with the `top` most likely tokens of that row's distribution (none with -inf: forbidden)."""
    if not tokens:
        return []
    reported = replace(params, temperature=1.0, top_k=0, top_p=1.0) if params.greedy else params
    logp = probabilities(logits[: len(tokens)], reported).log().cpu()
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    out = []
    for t, lp, vs, ix in zip(tokens, chosen, values.tolist(), ids.tolist()):
        out.append(TokenLogprob(t, lp, tuple((i, v) for i, v in zip(ix, vs) if v != float("-inf"))))
    return out
