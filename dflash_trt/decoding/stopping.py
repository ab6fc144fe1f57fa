"""When to stop: stop tokens, stop strings (on the incremental detokenizer's text), token budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer


@dataclass
class StopChecker:
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    detokenizer: IncrementalDetokenizer | None = None  # the generation's text (stop strings need one)
    _text_checked: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.stop_strings and self.detokenizer is None:
            raise ValueError("stop strings need a tokenizer; the target directory has none")
        self.stop_strings = tuple(s for s in self.stop_strings if s)

    def stop_token(self, new: Sequence[int]) -> int | None:
        """How many of the `new` tokens to keep when one is a stop token (it is kept), else None."""
        if not self.stop_token_ids:
            return None
        for i, t in enumerate(new):
            if t in self.stop_token_ids:
                return i + 1
        return None

    def stop_string(self) -> tuple[int, str] | None:
        """After the detokenizer took this round's tokens: (tokens of the whole sequence to keep, the
        stop string) for the earliest stop string in the text, or None."""
        if not self.stop_strings or self.detokenizer is None:
            return None
        text = self.detokenizer.text
        longest = max(len(s) for s in self.stop_strings)
        # Only text that could hold a new match: from just before what was already checked.
        window_start = max(0, self._text_checked - longest + 1)
        self._text_checked = len(text)
        best: tuple[int, int, str] | None = None  # (tokens to keep, index, stop string)
        for s in self.stop_strings:
            i = text.find(s, window_start)
            if i >= 0:
                candidate = (self._fewest_tokens_holding(s, self.detokenizer.tokens_to_reach(i + len(s))), i, s)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[0], best[2])

    def _fewest_tokens_holding(self, stop: str, tokens: int) -> int:
        """The stable text can lag a token behind: a U+FFFD that is really an invalid byte sequence is held
        back until the next token shows it is not an incomplete character. Step back while the decode of
        fewer tokens already holds the stop string (once per generation, at the hit)."""
        assert self.detokenizer is not None
        while tokens > 1 and stop in self.detokenizer.text_of(tokens - 1):
            tokens -= 1
        return tokens


def truncate_at_stop(text: str, stop: str | None) -> str:
    if stop is None:
        return text
    i = text.find(stop)
    return text if i < 0 else text[:i]
