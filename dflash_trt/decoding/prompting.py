"""Chat messages -> prompt token ids, one way for every front end (HTTP server, Triton preprocessing)."""

from __future__ import annotations

from typing import Any

FALLBACK_CHAT_FORMAT = "{role}: {content}\n"  # per message, then "assistant:" (tokenizers without a chat template)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The tokenizer's chat template when it has one; otherwise `role: content` lines then `assistant:`.
    Rendered to text first, then encoded without special tokens: `apply_chat_template(tokenize=True)`
    returns a BatchEncoding in transformers 5, and the template already writes any BOS it wants."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(FALLBACK_CHAT_FORMAT.format(**m) for m in messages) + "assistant:"
    return list(tokenizer.encode(text, add_special_tokens=False))
