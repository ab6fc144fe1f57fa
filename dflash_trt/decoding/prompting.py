"""Chat messages -> prompt token ids, one way for every front end (HTTP server, Triton preprocessing)."""

from __future__ import annotations

from typing import Any

from .request import InputError


class NoChatTemplate(InputError):
    """The tokenizer has no chat template: the model is a completion model. Chat is refused rather than
    rendered in an invented format the model never saw (vLLM refuses the same way)."""

    param = "messages"

    def __init__(self) -> None:
        super().__init__(
            "this model has no chat template, so it cannot take chat messages: it is a completion model. "
            "Send the text to complete as `prompt` to /v1/completions (or /generate) instead"
        )


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The messages rendered by the tokenizer's chat template (with the generation prompt), then encoded
    without special tokens: `apply_chat_template(tokenize=True)` returns a BatchEncoding in
    transformers 5, and the template already writes any BOS it wants. NoChatTemplate without one."""
    if not has_chat_template(tokenizer):
        raise NoChatTemplate()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
