"""Request-level changes to the target's logits (OpenAI's penalties and logit_bias, vLLM's min_tokens),
applied inside draft-and-verify without losing exactness.

In a verified block, row i of the target's logits predicts the token after the committed tokens plus
drafts d[0..i-1]. Row i only matters if all those drafts are accepted, so adjusting it as if they were
already committed is exactly what the target alone would do at that position. Acceptance (greedy
argmax, or rejection sampling against the adjusted distribution) then stays lossless; the drafter's
proposal needs no adjustment (rejection sampling is exact for any proposal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitsAdjustment:
    frequency_penalty: float = 0.0  # logit -= count of the token among the generated ones x this
    presence_penalty: float = 0.0  # logit -= this, once the token was generated at all
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # the tokens in min_tokens_suppress cannot come before this many generated
    min_tokens_suppress: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
        min_tokens_suppress: Sequence[int] = (),
    ) -> LogitsAdjustment | None:
        """The adjustment, or None when it would change nothing."""
        adj = cls(
            float(frequency_penalty),
            float(presence_penalty),
            tuple(sorted((int(k), float(v)) for k, v in (logit_bias or {}).items())),
            int(min_tokens),
            tuple(min_tokens_suppress),
        )
        return adj if adj.active else None

    @property
    def active(self) -> bool:
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
            or (self.min_tokens > 0 and self.min_tokens_suppress)
        )

    def apply(self, logits: torch.Tensor, generated: Sequence[int], draft: Sequence[int] = ()) -> torch.Tensor:
        """logits [R, V], row i following `generated` + draft[:i] (R <= len(draft) + 1): adjusted copy, float32."""
        rows, vocab = logits.shape
        out = logits.float().clone()
        dev = out.device  # adjusted where the logits are: only token ids and the request's settings move there
        if self.logit_bias:
            ids = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long, device=dev)
            bias = torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32, device=dev)
            keep = ids < vocab
            out[:, ids[keep]] += bias[keep]
        if self.frequency_penalty or self.presence_penalty:
            counts = torch.zeros(rows, vocab, device=dev)
            if generated:
                ids = torch.tensor(list(generated), dtype=torch.long, device=dev)
                counts += torch.bincount(ids, minlength=vocab)[:vocab]
            for i in range(1, rows):
                counts[i:, int(draft[i - 1])] += 1
            out -= counts * self.frequency_penalty + (counts > 0).float() * self.presence_penalty
        if self.min_tokens > 0 and self.min_tokens_suppress:
            early = max(0, min(rows, self.min_tokens - len(generated)))  # rows that come before min_tokens
            if early:
                suppress = torch.tensor(
                    [t for t in self.min_tokens_suppress if t < vocab], dtype=torch.long, device=dev
                )
                out[:early, suppress] = float("-inf")
        return out
