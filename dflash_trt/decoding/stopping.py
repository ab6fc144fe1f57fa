"""When to stop: stop tokens, stop strings (needs a tokenizer), token budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class StopChecker:
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: object | None = None
    _text_checked: int = field(default=0, repr=False)

    def __post_init__(self):
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the target directory has none")
        self.stop_strings = tuple(s for s in self.stop_strings if s)

    def first_stop(self, generated: Sequence[int], n_new: int) -> tuple[int, str | None] | None:
        """Check the last n_new tokens of `generated`. Returns (tokens to keep, matched stop string or None)."""
        start = len(generated) - n_new
        for i in range(start, len(generated)):
            if generated[i] in self.stop_token_ids:
                return i + 1, None
        if not self.stop_strings:
            return None
        text = self.tokenizer.decode(list(generated), skip_special_tokens=True)
        longest = max(len(s) for s in self.stop_strings)
        # Only text that could contain a new match: from just before what was already checked.
        window_start = max(0, self._text_checked - longest + 1)
        hit = self._find(text, window_start)
        self._text_checked = len(text)
        if hit is None:
            return None
        # The fewest tokens whose text already contains the stop string.
        for keep in range(max(start, 1), len(generated) + 1):
            prefix = self.tokenizer.decode(list(generated[:keep]), skip_special_tokens=True)
            found = self._find(prefix, window_start)
            if found is not None:
                return keep, found[1]
        return len(generated), hit[1]

    def _find(self, text: str, start: int) -> tuple[int, str] | None:
        best = None
        for s in self.stop_strings:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best


def truncate_at_stop(text: str, stop: str | None) -> str:
    if stop is None:
        return text
    i = text.find(stop)
    return text if i < 0 else text[:i]
