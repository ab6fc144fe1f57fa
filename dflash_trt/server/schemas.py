"""Request bodies of the HTTP API, built from the loaded engines, and the OpenAI-style error body.

`Limits` is the one source of the bounds that depend on the engines (context length, vocabulary,
the drafter's trained block size): `request_models(limits)` puts them into the pydantic models, so
validation and `/openapi.json` say the same thing. The decoder still checks what only a whole
request can tell (prompt + max_tokens against the context).

Both APIs take types strictly: "10" or true is not an integer, "yes" is not a boolean (a whole
number written 4.0 is an integer, as JSON Schema reads it). Our own
`/generate` also refuses unknown fields. The OpenAI-compatible endpoints accept explicit nulls
(OpenAI's clients send them) and ignore fields they do not know; every field OpenAI defines that
would change the output is either implemented or refused with a 400 that names it. No field names
a file path: a request can only carry text, token ids and numbers.
"""

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from ..decoding import BatchDecoder

MAX_SEED = 2**53 - 1  # JSON numbers are doubles to many clients and validators: exact up to 2**53
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (clipped to the context left)
GENERATE_DEFAULT_MAX_TOKENS = 128
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a client that names no temperature expects sampling
MAX_STOPS = 16


@dataclass(frozen=True)
class Limits:
    """What the loaded engines accept."""

    max_context: int  # prompt + generated tokens, the target's context length
    vocab_size: int
    max_block_size: int  # the drafter's trained block size (1: no drafter)
    model_name: str

    @classmethod
    def from_decoder(cls, decoder: "BatchDecoder", model_name: str) -> "Limits":
        drafter = decoder.drafter
        return cls(
            max_context=decoder.target.max_context,
            vocab_size=decoder.target.vocab_size,
            max_block_size=drafter.block_size if drafter is not None else 1,
            model_name=model_name,
        )


def _unicode(text: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"); it is not text, and tokenizers raise on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: lone surrogate at character {e.start}") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]  # every string that reaches the tokenizer
NonEmptyText = Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode)]
StopField = (
    Annotated[Text, Field(min_length=1)]
    | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOPS)]
    | None
)
Temperature = Annotated[float, Field(ge=0.0, le=100.0, description="0 is greedy; below 1e-5 counts as 0")]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]


def _whole(v: Any) -> Any:  # raw JSON input, before validation
    """JSON Schema's integer includes 4.0; strict pydantic's does not. Booleans and strings stay refused."""
    return int(v) if type(v) is float and v.is_integer() else v


def Int(**bounds: Any) -> Any:  # an Annotated[int, ...] type, made at run time
    """An integer with bounds (ge, le, description): the bounds go on the integer itself, so that the
    JSON schema says minimum / maximum (on the wrapper pydantic would write them as unknown keys)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


# Type checkers see the bounded integers as plain int: their bounds (some of them the loaded engines') are
# pydantic metadata made at run time, here and in request_models.
if TYPE_CHECKING:
    TopK = int
    Seed = int
    TokenId = int
    MaxTokens = int
    MinTokens = int
    BlockSize = int
else:
    TopK = Int(ge=0, le=1_000_000, description="0: off")
    Seed = Int(ge=0, le=MAX_SEED)
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


# OpenAI fields this server cannot honour exactly: the values that leave the output unchanged, and why
# others are refused (a 400 naming the field; never silently ignored).
UNSUPPORTED: dict[str | tuple[str, str], tuple[tuple[object, ...], str]] = {
    "n": ((None, 1), "must be 1: one choice per request"),
    "best_of": ((None, 1), "must be 1: one choice per request"),
    "echo": ((None, False), "not supported"),
    "suffix": ((None, ""), "not supported"),
    "logprobs": ((None, 0), "not supported"),  # completions: an integer
    ("ChatCompletionRequest", "logprobs"): ((None, False), "not supported"),  # chat: a boolean
    "top_logprobs": ((None, 0), "not supported (no logprobs)"),
    "tools": ((None, []), "not supported: this server generates text only"),
    "functions": ((None, []), "not supported: this server generates text only"),
    "tool_choice": ((None, "none", "auto"), "cannot require a tool: this server has none"),
    "function_call": ((None, "none", "auto"), "cannot require a function: this server has none"),
    "response_format": ((None, {"type": "text"}), "only plain text is supported"),
    "modalities": ((None, ["text"]), "only text is supported"),
}


def token_id_pattern(largest: int) -> str:
    """A regular expression for the decimal integers 0..largest (no leading zeros): logit_bias keys."""
    s = str(largest)
    parts = ["0"] + ["[1-9]" + "[0-9]" * (d - 1) for d in range(1, len(s))]
    for i, digit in enumerate(s):  # same length as `largest`: equal up to i, smaller at i, anything after
        lo, hi = (1 if i == 0 else 0), int(digit) - 1
        if hi >= lo:
            parts.append(s[:i] + f"[{lo}-{hi}]" + "[0-9]" * (len(s) - i - 1))
    parts.append(s)
    return "^(" + "|".join(dict.fromkeys(parts)) + ")$"


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# The request models are classes made per app (request_models); type checkers see them as these protocols.
class RequestBody(Protocol):
    """The fields every request body has that generation_config reads."""

    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | list[str] | None
    frequency_penalty: float | None
    presence_penalty: float | None
    logit_bias: dict[str, float] | None
    min_tokens: int | None
    ignore_eos: bool | None
    block_size: int | None


class GenerateBody(RequestBody, Protocol):
    prompt: str | None
    input_ids: list[int]  # absent (None) exactly when prompt is given, as GenerateRequest declares it
    max_tokens: int
    temperature: float
    stream: bool


class OpenAIBody(RequestBody, Protocol):
    model: str | None
    temperature: float | None
    stream: bool | None
    stream_options: "StreamOptions | None"


class CompletionBody(OpenAIBody, Protocol):
    prompt: str | list[int]  # a list of one text is its text (CompletionRequest._one_text)
    max_tokens: int | None


class ChatBody(OpenAIBody, Protocol):
    messages: "list[ChatMessage]"
    max_tokens: int | None
    max_completion_tokens: int | None


@dataclass
class RequestModels:
    generate: type[BaseModel]
    completion: type[BaseModel]
    chat: type[BaseModel]


def request_models(limits: Limits) -> RequestModels:
    """The three request bodies, bounded by what the loaded engines accept."""
    ctx = limits.max_context
    if not TYPE_CHECKING:
        TokenId = Int(ge=0, le=limits.vocab_size - 1)
        MaxTokens = Int(
            ge=1,
            le=max(1, ctx - 1),
            description=(f"new tokens at most; the prompt plus this must fit the context ({ctx} tokens)"),
        )
        MinTokens = Int(ge=0, le=ctx)
        BlockSize = Int(ge=1, le=limits.max_block_size)
    TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=ctx)]
    bias_schema = {
        "type": "object",
        "additionalProperties": False,
        "maxProperties": 300,
        "patternProperties": {
            token_id_pattern(limits.vocab_size - 1): {"type": "number", "minimum": -100.0, "maximum": 100.0}
        },
    }
    LogitBias = Annotated[
        dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")], Annotated[float, Field(ge=-100.0, le=100.0)]],
        Field(max_length=300),
        WithJsonSchema(bias_schema),
    ]

    class OutputFields(BaseModel):
        """What changes the output, shared by the three endpoints (applied to the target's logits at every
        verified position, so speculative decoding stays lossless), and the block size of its rounds."""

        frequency_penalty: Penalty | None = Field(None, description="OpenAI's: minus count x this per token")
        presence_penalty: Penalty | None = Field(None, description="OpenAI's: minus this once a token occurred")
        logit_bias: LogitBias | None = Field(
            None, description="token id (as a string) -> bias added to its logit, -100..100"
        )
        min_tokens: MinTokens | None = Field(
            None, description="end-of-text cannot be generated before this many tokens (vLLM's)"
        )
        ignore_eos: bool | None = Field(None, description="do not stop at end-of-text (vLLM's)")
        block_size: BlockSize | None = Field(
            None,
            description=(
                f"tokens per verified round, 1..the drafter's trained block size ({limits.max_block_size}); 1 = the "
                "target alone; null = the server's choice (adaptive). Greedy output is the same whatever the size; "
                "a seeded sampled request returns the same text only with a fixed size"
            ),
        )

        @field_validator("logit_bias")
        @classmethod
        def _in_vocabulary(cls, v: dict[str, float] | None) -> dict[str, float] | None:
            bad = [k for k in (v or {}) if int(k) >= limits.vocab_size]
            if bad:
                raise ValueError(f"token ids out of vocabulary (size {limits.vocab_size}): {bad[:5]}")
            return v

    class GenerateRequest(OutputFields):
        """POST /generate: our native API. Exactly one of prompt / input_ids."""

        model_config = ConfigDict(
            extra="forbid",
            strict=True,
            allow_inf_nan=False,
            title="GenerateRequest",
            json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["input_ids"]}]},
        )

        # not Optional: absent, never null (exactly one of the two is sent); hence a None default typed str / list
        prompt: NonEmptyText = None  # type: ignore[assignment]
        input_ids: TokenIds = None  # type: ignore[assignment]
        max_tokens: MaxTokens = GENERATE_DEFAULT_MAX_TOKENS
        temperature: Temperature = 0.0
        top_p: TopP = 1.0
        top_k: TopK = 0
        seed: Seed | None = None
        stop: StopField = None
        stream: bool = False

        @model_validator(mode="after")
        def _one_prompt(self) -> "GenerateRequest":
            if (self.prompt is None) == (self.input_ids is None):
                raise ValueError("give exactly one of 'prompt' (text) or 'input_ids' (token ids)")
            return self

    class OpenAIFields(OutputFields):
        """Fields both OpenAI endpoints share. null means "the default", as OpenAI reads it."""

        model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

        model: StrictStr | None = Field(
            None,
            description="the only model, or null; another is a 404",
            json_schema_extra={"enum": [limits.model_name, None]},
        )
        temperature: Temperature | None = Field(
            None, description=f"default {OPENAI_DEFAULT_TEMPERATURE} (OpenAI's); 0 is greedy"
        )
        top_p: TopP | None = None
        top_k: TopK | None = None
        seed: Seed | None = None
        stop: StopField = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        n: Literal[1] | None = Field(None, description="one choice per request")
        user: StrictStr | None = None
        spec_decode_metrics: Literal["summary", "detailed"] | None = Field(
            None,
            description=(
                "extension: add this request's speculative-decoding statistics to the response as "
                "`metrics.speculative_decoding` (vLLM's per-request shape; on a stream, in the chunk that carries "
                "the finish reason); detailed adds the accepted and drafted tokens of every step; null: none"
            ),
        )

        @field_validator(*(k for k in UNSUPPORTED if isinstance(k, str)), mode="before", check_fields=False)
        @classmethod
        def _supported(cls, v: Any, info: ValidationInfo) -> Any:
            name = str(info.field_name)  # always set for a field validator
            allowed, why = UNSUPPORTED.get((cls.__name__, name)) or UNSUPPORTED[name]
            v = _whole(v)
            if not any(type(v) is type(a) and v == a for a in allowed):
                raise ValueError(f"{why} (send {' or '.join(json.dumps(a) for a in allowed)})")
            return v

    class CompletionRequest(OpenAIFields):
        """POST /v1/completions (OpenAI). `prompt` is text, a list of one text, or token ids."""

        model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, title="CompletionRequest")

        prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] | TokenIds
        max_tokens: MaxTokens | None = Field(
            None, description=(f"default {COMPLETIONS_DEFAULT_MAX_TOKENS} (OpenAI's), clipped to the context left")
        )
        echo: Literal[False] | None = Field(None, description="not supported: false or null")
        best_of: Literal[1] | None = None
        logprobs: Literal[0] | None = Field(None, description="not supported: null or 0")
        suffix: Literal[""] | None = Field(None, description="not supported: null or empty")

        @field_validator("prompt")
        @classmethod
        def _one_text(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
            return v[0] if isinstance(v, list) and v and isinstance(v[0], str) else v

    class ChatCompletionRequest(OpenAIFields):
        """POST /v1/chat/completions (OpenAI): text messages only, no tools."""

        model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, title="ChatCompletionRequest")

        messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
        max_tokens: MaxTokens | None = Field(None, description="default: the server's --default-max-tokens")
        max_completion_tokens: MaxTokens | None = None
        logprobs: Literal[False] | None = Field(None, description="not supported: false or null")
        top_logprobs: Literal[0] | None = Field(None, description="not supported: null or 0")
        response_format: TextFormat | None = Field(None, description="only {'type': 'text'}")
        tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = Field(
            None, description="not supported: no tools (null or [])"
        )
        tool_choice: Literal["none", "auto"] | None = Field(None, description="without tools: none or auto")
        parallel_tool_calls: bool | None = None
        functions: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = Field(
            None, description="not supported: null or []"
        )
        function_call: Literal["none", "auto"] | None = None
        modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = None

    return RequestModels(GenerateRequest, CompletionRequest, ChatCompletionRequest)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"] = Field(description="json_object and json_schema are not supported")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None

    @field_validator("content")
    @classmethod
    def _join_parts(cls, v: str | list["TextPart"] | None) -> str | None:
        """OpenAI content may be a list of parts; only text parts are supported."""
        return "".join(p.text for p in v) if isinstance(v, list) else v


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error response: OpenAI's shape."""

    error: ErrorDetail
