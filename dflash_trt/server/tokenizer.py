"""A tokenizer whose calls never overlap: request threads encode while the worker thread decodes.

Hugging Face fast tokenizers raise "Already borrowed" when one thread changes their state
(truncation / padding) while another encodes, so each call holds a lock. The calls are short;
the engines need no lock at all (only the orchestrator's worker thread runs them).
"""

from __future__ import annotations

import threading
from typing import Any

SERIALIZED = ("encode", "decode", "batch_decode", "apply_chat_template", "convert_ids_to_tokens", "__call__")


class SerializedTokenizer:
    """Wraps a tokenizer: the methods in SERIALIZED run one at a time; every other attribute passes through."""

    def __init__(self, tokenizer: Any):  # a Hugging Face tokenizer
        self._tokenizer, self._lock = tokenizer, threading.Lock()

    @property  # type: ignore[misc]  # a proxy's class: what isinstance reads after type()
    def __class__(self) -> type:
        """The wrapped tokenizer's class, so that libraries which check it (llguidance takes only a
        PreTrainedTokenizerFast, to copy its Rust tokenizer) take the wrapper too."""
        return type(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._tokenizer, name)
        if name not in SERIALIZED:
            return value

        def serialized(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)

        return serialized

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)
