"""Request bodies of the HTTP API and the OpenAI-style error body: static pydantic models.

The models hold every bound that does not depend on the served model. The bounds that do (context length,
vocabulary, the drafter's trained block size) live in `limits.Limits`, which checks them where the request is
built and writes the same bounds into `/openapi.json`, so validation and the document say the same thing.
The decoder still checks what only a whole request can tell (prompt + max_tokens against the context).

Both APIs take types strictly: "10" or true is not an integer, "yes" is not a boolean (a whole
number written 4.0 is an integer, as JSON Schema reads it). Our own
`/generate` also refuses unknown fields. The OpenAI-compatible endpoints accept explicit nulls
(OpenAI's clients send them) and ignore fields they do not know; every field OpenAI defines that
would change the output is either implemented or refused with a 400 that names it. No field names
a file path: a request can only carry text, token ids and numbers.
"""

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

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

from ..decoding.proposers import PROPOSERS, proposers_help

if TYPE_CHECKING:
    ProposerName = str
else:  # the registry's names as one Literal: the JSON schema lists them, validation refuses any other
    ProposerName = Literal[PROPOSERS]

MAX_SEED = 2**53 - 1  # JSON numbers are doubles to many clients and validators: exact up to 2**53
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (clipped to the context left)
GENERATE_DEFAULT_MAX_TOKENS = 128
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a client that names no temperature expects sampling
MAX_STOPS = 16


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


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Bounded integers; the bounds of the served model (limits.Limits) are added where the request is built.
TopK = Annotated[int, Field(ge=0, le=1_000_000, description="0: off"), BeforeValidator(_whole)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED), BeforeValidator(_whole)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_whole)]
MaxTokens = Annotated[
    int,
    Field(ge=1, description="new tokens at most; the prompt plus this must fit the context (max_model_len)"),
    BeforeValidator(_whole),
]
MinTokens = Annotated[int, Field(ge=0), BeforeValidator(_whole)]
BlockSize = Annotated[int, Field(ge=1), BeforeValidator(_whole)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
HealPrompt = Annotated[
    bool | None,
    Field(
        description=(
            "extension: heal a text prompt's last token (token healing): when the tokenizer could have merged it "
            "with what follows (a prompt ending in a newline, say), the prompt is backed up by that token and the "
            "first generated token must start with its text, which the completion then leaves out; null: true. "
            "Token-id prompts are never healed: they are the tokens the client chose"
        )
    ),
]
TOKEN_KEY = r"^(0|[1-9][0-9]{0,9})$"  # a token id written as a JSON object key
BIAS = {"type": "number", "minimum": -100.0, "maximum": 100.0}
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_KEY)], Annotated[float, Field(ge=-100.0, le=100.0)]],
    Field(max_length=300),
    WithJsonSchema(
        {"type": "object", "additionalProperties": False, "maxProperties": 300, "patternProperties": {TOKEN_KEY: BIAS}}
    ),
]


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


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


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
            "tokens per verified round, 1..the drafter's trained block size (the maximum); 1 = the "
            "target alone; null = the server's choice (adaptive). Greedy output is the same whatever the size; "
            "a seeded sampled request returns the same text only with a fixed size"
        ),
    )
    proposer: ProposerName | None = Field(
        None,
        description=(
            f"where the drafts come from: {proposers_help()}; null = the server's --proposer (dflash where the "
            "request fixes block_size and the server's is not reproducible, so that seeded text is). Output is "
            "the same whatever the proposer (greedy) or has the same distribution (sampled)"
        ),
    )


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
    heal_prompt: HealPrompt = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'input_ids' (token ids)")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = None


class OpenAIFields(OutputFields):
    """Fields both OpenAI endpoints share. null means "the default", as OpenAI reads it."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: StrictStr | None = Field(None, description="the only model, or null; another is a 404")
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
    return_meta_info: bool | None = Field(
        None,
        description=(
            "extension (SGLang's): true adds `meta_info` to the response and to its choice: prompt / completion "
            "tokens, e2e_latency and, when the server drafts, spec_verify_ct (verify rounds), spec_accept_length "
            "(completion tokens / verify rounds), spec_accept_rate, spec_accept_token_num, spec_draft_token_num; "
            "on a stream, in the chunk that carries the finish reason; false or null: none"
        ),
    )
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
    heal_prompt: HealPrompt = None
    max_tokens: MaxTokens | None = Field(
        None, description=f"default {COMPLETIONS_DEFAULT_MAX_TOKENS} (OpenAI's), clipped to the context left"
    )
    echo: Literal[False] | None = Field(None, description="not supported: false or null")
    best_of: Literal[1] | None = None
    logprobs: Literal[0] | None = Field(None, description="not supported: null or 0")
    suffix: Literal[""] | None = Field(None, description="not supported: null or empty")

    @field_validator("prompt")
    @classmethod
    def _one_text(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        return v[0] if isinstance(v, list) and v and isinstance(v[0], str) else v


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
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="extension (vLLM's, SGLang's): extra variables for the chat template, e.g. "
        '{"enable_thinking": false}; names the renderer itself takes (tokenize, tools, ...) are refused',
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or ()) & RENDERER_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the server, not a template variable")
        return v


# apply_chat_template's own parameters: a template variable of the same name would replace the server's choice
RENDERER_ARGUMENTS = frozenset(
    {
        "self",
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


RequestBody = GenerateRequest | CompletionRequest | ChatCompletionRequest
REQUEST_MODELS: tuple[type[OutputFields], ...] = (GenerateRequest, CompletionRequest, ChatCompletionRequest)


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
