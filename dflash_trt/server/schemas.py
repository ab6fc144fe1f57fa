"""Request bodies of the HTTP API and the OpenAI-style error body: static pydantic models.

The models hold every bound that does not depend on the served model. The bounds that do (context length,
vocabulary, the drafter's trained block size) live in `limits.Limits`, which checks them where the request is
built and writes the same bounds into `/openapi.json`, so validation and the document say the same thing.
The decoder still checks what only a whole request can tell (prompt + max_tokens against the context).

Both APIs take types strictly: "10" or true is not an integer, "yes" is not a boolean (a whole
number written 4.0 is an integer, as JSON Schema reads it). Every endpoint refuses a field it does not know
with a 400 naming it, as OpenAI answers (a client asking for structure must never silently get free text);
the extensions it does know (vLLM's and SGLang's sampling and structured-output fields, ours) are declared
here. The OpenAI-compatible endpoints accept explicit nulls (OpenAI's clients send them); every field OpenAI
defines that would change the output is either implemented or refused with a 400 that names it. No field names
a file path: a request can only carry text, token ids, numbers and the grammars they ask for.
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
from ..decoding.request import MAX_TOP_LOGPROBS

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
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_whole)]
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
    "functions": ((None, []), "not supported: send `tools` (OpenAI's deprecated name for them is not taken)"),
    "function_call": ((None, "none", "auto"), "not supported: send `tool_choice`"),
    "modalities": ((None, ["text"]), "only text is supported"),
}


# ---- structured outputs: what a request may ask its output to match -------------------------------------
GrammarText = Annotated[Text, Field(min_length=1, description="bounded by the grammar compiler's size limit")]
JsonSchemaObject = Annotated[
    dict[str, Any],
    Field(description="a JSON Schema (the grammar compiler bounds its size and compile time; a 400 says which)"),
]
# vLLM's json fields take any JSON Schema: an object, or the boolean schemas true (anything) and false (nothing)
JsonSchemaValue = JsonSchemaObject | bool


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object (StructuredOutputsParams, docs/features/structured_outputs.md of vLLM
    v0.12+, where it replaced the `guided_*` fields): exactly one of these, never null. Its other members
    (structural_tag, whitespace_pattern, ...) are refused by name."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        populate_by_name=True,
        title="StructuredOutputs",
        json_schema_extra={"minProperties": 1, "maxProperties": 1},
    )

    # not Optional: absent, never null (exactly one is sent); hence None defaults on non-null types
    json_: Annotated[
        JsonSchemaValue | GrammarText,
        Field(alias="json", description="a JSON Schema (an object, true / false, or its JSON text)"),
    ] = None  # type: ignore[assignment]
    regex: Annotated[GrammarText, Field(description="the output matches this regular expression")] = None  # type: ignore[assignment]
    choice: Annotated[
        list[NonEmptyText], Field(min_length=1, max_length=1024, description="the output is exactly one of these")
    ] = None  # type: ignore[assignment]
    grammar: Annotated[GrammarText, Field(description="a context-free grammar: Lark, or GBNF (`root ::= ...`)")] = None  # type: ignore[assignment]
    json_object: Annotated[Literal[True], Field(description="true: any JSON object")] = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [f.alias or k for k, f in type(self).model_fields.items() if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {given or 'none'})")
        return self


class StructuredFields(BaseModel):
    """The structured-output request fields vLLM takes on every endpoint: `structured_outputs` (current) and
    the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (vLLM up to v0.11; removed in
    v0.12.0). At most one way per request; the server decodes under the grammar they name, losslessly under
    speculation."""

    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM's): the output matches this; exactly one member"
    )
    guided_json: JsonSchemaValue | GrammarText | None = Field(
        None, description="extension (vLLM's, older): structured_outputs.json"
    )
    guided_regex: GrammarText | None = Field(None, description="extension (vLLM's, older): structured_outputs.regex")
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1, max_length=1024)] | None = Field(
        None, description="extension (vLLM's, older): structured_outputs.choice"
    )
    guided_grammar: GrammarText | None = Field(
        None, description="extension (vLLM's, older): structured_outputs.grammar"
    )


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: JsonSchemaObject | None = Field(None, alias="schema", description="null: any JSON object")
    strict: bool | None = Field(
        None,
        description="true: every keyword of the schema is enforced (a schema using one the grammar cannot enforce "
        "is a 400); false or null: such keywords are ignored, the rest enforced. Objects stay as open as the schema "
        "writes them: close them with additionalProperties false",
    )


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_object"] = Field(description="any JSON object")


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]
FunctionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: FunctionName
    description: Text | None = None
    parameters: JsonSchemaObject | None = Field(None, description="a JSON Schema of the arguments; null: none")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: FunctionName


class NamedToolChoice(BaseModel):
    """Call this function: its arguments are generated under its parameters' schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: FunctionName
    arguments: Text


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message (sent back in the conversation)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


class OutputFields(StructuredFields):
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
    logprobs: TopLogprobs | None = Field(
        None,
        description="return each generated token's logprob (the target's, after penalties and the grammar mask), "
        "and with k > 0 the k likeliest tokens' too; null: none",
    )

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

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

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

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, title="CompletionRequest")

    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] | TokenIds
    heal_prompt: HealPrompt = None
    max_tokens: MaxTokens | None = Field(
        None, description=f"default {COMPLETIONS_DEFAULT_MAX_TOKENS} (OpenAI's), clipped to the context left"
    )
    echo: Literal[False] | None = Field(None, description="not supported: false or null")
    best_of: Literal[1] | None = None
    logprobs: TopLogprobs | None = Field(
        None,
        description="the generated tokens' logprobs (the target's, after penalties and the grammar mask) and the "
        "this many likeliest tokens' at each position (0: only the chosen one's); null: none",
    )
    response_format: ResponseFormat | None = Field(
        None, description="extension (vLLM's): json_object or json_schema constrains the completion as in chat"
    )
    suffix: Literal[""] | None = Field(None, description="not supported: null or empty")

    @field_validator("prompt")
    @classmethod
    def _one_text(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        return v[0] if isinstance(v, list) and v and isinstance(v[0], str) else v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = Field(
        None, description="assistant: the tool calls it made"
    )
    tool_call_id: StrictStr | None = Field(None, description="tool: the call this message answers")

    @field_validator("content")
    @classmethod
    def _join_parts(cls, v: str | list["TextPart"] | None) -> str | None:
        """OpenAI content may be a list of parts; only text parts are supported."""
        return "".join(p.text for p in v) if isinstance(v, list) else v


class ChatCompletionRequest(OpenAIFields):
    """POST /v1/chat/completions (OpenAI): text messages, tools, structured outputs."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, title="ChatCompletionRequest")

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_tokens: MaxTokens | None = Field(None, description="default: the server's --default-max-tokens")
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = Field(
        None,
        description="true: each generated token's logprob (the target's, after penalties and the grammar mask)",
    )
    top_logprobs: TopLogprobs | None = Field(
        None, description="with logprobs: the this many likeliest tokens at each position too"
    )
    response_format: ResponseFormat | None = Field(
        None, description="json_object: any JSON object; json_schema: JSON matching the schema (strict honoured)"
    )
    tools: Annotated[list[Tool], Field(max_length=128)] | None = Field(
        None,
        description="functions the model may call. tool_choice required or a named function: the call is "
        "generated under a JSON schema of it (any chat model); auto: the model decides, in its chat "
        "template's tool format, which the server must know (a 400 says when it does not)",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="null: auto with tools, none without"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call; null or true: any number")
    functions: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = Field(
        None, description="not supported (OpenAI's deprecated name for tools): null or []"
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
