"""One incremental detokenizer for every text path: stop strings, the server's stream, results, Triton.

Decoding a growing sequence from its start every round costs O(length) per round. Instead each
token is decoded together with the few tokens before it (`ids[prefix:]` against `ids[prefix:read]`,
the scheme vLLM and TGI use), so byte-level BPE merges and SentencePiece's leading spaces come out as
a full decode would, and a token that ends in the middle of a UTF-8 character (U+FFFD) is held back
until later tokens complete it. `text` only ever grows: what it holds, later tokens cannot change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class Tokenizer(Protocol):
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of a token sequence that grows at its end (special tokens skipped), less `skip`: a leading text
    the sequence starts with that the reader already has (a healed prompt's removed text, healing.py)."""

    def __init__(self, tokenizer: Tokenizer, token_ids: Iterable[int] = (), skip: str = ""):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._skip = len(skip)
        self._full = ""  # stable text of the whole sequence, `skip` included
        self.text = ""  # stable text: later tokens cannot change it
        self.offsets: list[int] = []  # len(text) once each token was added
        self._prefix = 0  # ids[_prefix:_read] are the context whose text is already in `text`
        self._read = 0
        self.add(token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; returns the text they made stable."""
        start = len(self.text)
        for t in token_ids:
            self.ids.append(int(t))
            before = self._decode(self.ids[self._prefix : self._read])
            now = self._decode(self.ids[self._prefix :])
            if len(now) > len(before) and not now.endswith(REPLACEMENT):
                self._full += now[len(before) :]
                self.text = self._full[self._skip :]
                self._prefix, self._read = self._read, len(self.ids)
            self.offsets.append(len(self.text))
        return self.text[start:]

    def final_text(self) -> str:
        """The whole text once the sequence has ended: any held-back partial character included."""
        tail = self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
        return (self._full + tail)[self._skip :]

    def text_of(self, n: int) -> str:
        """The text of the first `n` tokens as `text` counts it (a full decode, less `skip`)."""
        return self._decode(self.ids[:n])[self._skip :]

    def tokens_to_reach(self, end: int) -> int:
        """The fewest leading tokens whose stable text is at least `end` characters long."""
        for i, offset in enumerate(self.offsets):
            if offset >= end:
                return i + 1
        return len(self.offsets)


def held_back(text: str, stop_strings: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may still turn out to begin a stop string (so a stream
    must not show them yet)."""
    hold = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def text_delta(tokenizer: Tokenizer, ids: list[int], new: int, final: bool) -> str:
    """Text added by the last `new` tokens of `ids` (for callers that hold no state between chunks, as
    Triton's postprocessing model): the chunks of a stream concatenate to the final text."""
    detok = IncrementalDetokenizer(tokenizer, ids[: len(ids) - new])
    before = len(detok.text)
    detok.add(ids[len(ids) - new :])
    return (detok.final_text() if final else detok.text)[before:]
