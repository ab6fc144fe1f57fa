"""Request bodies of the HTTP API and the OpenAI-style error body.

Our own `/generate` is strict (unknown fields and loose types are errors); the OpenAI-compatible
endpoints accept the fields OpenAI clients send and ignore the ones that do not change the output
of a single-choice completion. No field names a file path: a request can only carry text, token
ids and numbers.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

MAX_SEED = 2**63 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (clipped to the context left)
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
StopField = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=16)], None]


def stop_tuple(stop: StopField) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


class SamplingFields(BaseModel):
    """Shared knobs; ranges are checked here so that engines only ever see valid numbers."""

    model_config = ConfigDict(allow_inf_nan=False)

    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: StopField = None
    stream: bool = False


class GenerateRequest(SamplingFields):
    """POST /generate: our native API. Exactly one of prompt / input_ids."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: StrictStr | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 128
    block_size: Annotated[int, Field(ge=1, le=1024)] | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'input_ids' (token ids)")
        return self


class CompletionRequest(SamplingFields):
    """POST /v1/completions (OpenAI). `prompt` is text, one text in a list, or token ids."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    prompt: Union[StrictStr, Annotated[list[StrictStr], Field(min_length=1, max_length=1)], Annotated[list[TokenId], Field(min_length=1)]]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None  # None: COMPLETIONS_DEFAULT_MAX_TOKENS
    n: Literal[1] = 1
    echo: Literal[False] = False
    logprobs: None = None
    best_of: Literal[1] | None = None
    stream_options: dict | None = None
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_text(cls, v):
        return v[0] if isinstance(v, list) and v and isinstance(v[0], str) else v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        """OpenAI content may be a list of parts; only text parts are supported."""
        if isinstance(v, list):
            texts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                texts.append(part["text"])
            return "".join(texts)
        return v


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions (OpenAI)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    n: Literal[1] = 1
    logprobs: Literal[False] | None = None
    stream_options: dict | None = None
    user: str | None = None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
