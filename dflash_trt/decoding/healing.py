"""Healed prompt boundaries ("token healing"): a text prompt whose last token the tokenizer would have merged
with what follows is backed up by that token, and the first generated token must start with its text.

Why: a BPE tokenizer encodes the prompt without knowing what comes after it, so a prompt that ends inside
what is usually one token ends on a token the model seldom saw there. A function's docstring followed by the
newline an editor adds ends on a lone newline token, where training text always had the newline merged with
the next line's indentation; the model then closes the function instead of writing its body. Backing up the
newline and letting the model choose a token that starts with it (newline + indentation) gives it the
boundary it was trained on (Hugging Face's
`generate(token_healing=True)` does the same).

Rules:
 1. Only a prompt of two or more tokens is healed, and only when some other token's text starts with the last
    token's text (else nothing could have merged with it); a last token that decodes to no text, or to part of
    a character, is kept.
 2. The first generated token is constrained to the tokens whose text starts with the removed text (the removed
    token itself is one of them, so the constraint can always be met); every later token is free. Greedy
    output is therefore the target's own for the healed prompt, with or without drafting: the first token
    comes from the target's prefill alone.
 3. The removed text is part of the prompt the client sent, so the completion's text leaves it out: the text
    starts after it. The token ids returned still include the first token whole.
 4. Token-id prompts are never healed: those are the tokens the client chose, and they need not be this
    tokenizer's encoding of any text.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .detokenizer import REPLACEMENT


@dataclass(frozen=True)
class Healing:
    """A healed prompt's constraint on its first generated token."""

    text: str  # the removed last token's text: the first generated token starts with it
    allowed: tuple[int, ...]  # the token ids whose text starts with `text`

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """[positions, vocab] logits with every token outside `allowed` at -inf in row 0 (the first token)."""
        out = logits.clone()
        keep = torch.tensor(self.allowed, dtype=torch.long, device=logits.device)
        first = torch.full_like(out[0], float("-inf"))
        first[keep] = out[0, keep]
        out[0] = first
        return out


class PromptHealer:
    """Heals prompts for one tokenizer and a target of `vocab_size` logits (ids the target cannot score are never
    allowed). The texts of the tokens are decoded and sorted once, on first use; a last token's allowed set is the
    run of sorted texts that start with its text (two bisections), made per request and kept by nothing after it:
    a healer that served for days holds what it held after its first request (a set kept per last token seen
    grows towards the vocabulary's prefix pairs, tens of MiB for a 128k vocabulary). Safe from any thread (HTTP
    handlers heal their own requests)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._texts: list[str] | None = None
        self._sorted: tuple[list[str], list[int]] = ([], [])  # texts in sorted order, and their token ids
        self._lock = threading.Lock()

    def texts(self) -> list[str]:
        with self._lock:
            if self._texts is None:
                size = len(self.tokenizer)
                if self.vocab_size is not None:
                    size = min(size, self.vocab_size)
                texts = [self.tokenizer.decode([i], skip_special_tokens=True) for i in range(size)]
                order = sorted(range(size), key=texts.__getitem__)
                self._sorted = ([texts[i] for i in order], order)
                self._texts = texts
            return self._texts

    def allowed(self, tail: str) -> tuple[int, ...]:
        """The token ids whose text starts with `tail`, in id order."""
        self.texts()
        keys, ids = self._sorted
        lo = bisect.bisect_left(keys, tail)
        # texts cut to len(tail) stay sorted, so those equal to tail (the texts starting with it) are one run
        hi = bisect.bisect_right(keys, tail, lo, key=lambda text: text[: len(tail)])
        return tuple(sorted(ids[lo:hi]))

    def heal(self, ids: Sequence[int]) -> tuple[list[int], Healing | None]:
        """The prompt backed up by its last token and the constraint on the first token, or the prompt as it
        is and None (rule 1)."""
        ids = [int(t) for t in ids]
        texts = self.texts()
        if len(ids) < 2 or not 0 <= ids[-1] < len(texts):
            return ids, None
        tail = texts[ids[-1]]
        if not tail or REPLACEMENT in tail:
            return ids, None
        allowed = self.allowed(tail)
        if len(allowed) < 2:
            return ids, None
        return ids[:-1], Healing(tail, allowed)
