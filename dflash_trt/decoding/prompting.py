"""Prompts -> token ids, one way for every front end (CLI, HTTP server, Triton preprocessing): text, and chat
messages through the tokenizer's chat template."""

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


class TemplateVariablesError(InputError):
    """A request's chat_template_kwargs made the chat template fail."""

    param = "chat_template_kwargs"


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """The messages rendered by the tokenizer's chat template (with the generation prompt), then encoded
    without special tokens: `apply_chat_template(tokenize=True)` returns a BatchEncoding in
    transformers 5, and the template already writes any BOS it wants. NoChatTemplate without one.
    template_kwargs: extra variables the template reads (e.g. `enable_thinking`), as vLLM and SGLang pass
    a request's `chat_template_kwargs`."""
    if not has_chat_template(tokenizer):
        raise NoChatTemplate()
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    except Exception as e:
        # the request's variables broke the template (a name clashed: TypeError; the template raised: a jinja2
        # error, matched by module since jinja2 comes with the chat template support, not as our dependency)
        if not template_kwargs or not (isinstance(e, TypeError) or type(e).__module__.startswith("jinja2")):
            raise
        raise TemplateVariablesError(f"the chat template failed with these chat_template_kwargs: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's token ids, without special tokens (InputError without a tokenizer, or for text that is not
    valid Unicode)."""
    if tokenizer is None:
        raise InputError("this target has no tokenizer: pass token ids instead of text")
    try:
        text.encode("utf-8")  # a lone surrogate (from JSON "\\ud800") makes tokenizers raise TypeError
    except UnicodeEncodeError as e:
        raise InputError(f"the text is not valid Unicode: lone surrogate at character {e.start}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def default_stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens a request stops at unless it says otherwise: the tokenizer's end of text, if it has one."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return (eos,) if isinstance(eos, int) else ()
