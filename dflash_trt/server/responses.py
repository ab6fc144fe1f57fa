"""Response bodies, for /openapi.json: what each endpoint answers, errors and streams included."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .schemas import ErrorBody

FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]
LOGPROB = "the target's log-probability of the token, in the distribution it was drawn from: after the request's "
LOGPROB += "penalties, logit bias and grammar mask, temperature, top-k and top-p (vLLM's processed_logprobs)"
FINGERPRINT = (
    "the backend configuration seeded text depends on: `drafter-<dtype>` (the dtype the drafter computes in, also "
    "`spec.drafter_dtype`) or `target-alone`; a seeded request with a fixed block_size gives the same text where "
    "it is the same"
)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopTokenLogprob(BaseModel):
    token_id: int
    logprob: float


class NativeTokenLogprob(BaseModel):
    token_id: int
    logprob: float = Field(description=LOGPROB)
    top: list[TopTokenLogprob] = Field(description="the `logprobs` likeliest tokens there, likeliest first")


class GenerateResponse(BaseModel):
    id: str
    text: str | None  # null when the target has no tokenizer
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[NativeTokenLogprob] | None = Field(None, description="only when the request sent logprobs")
    # speculative decoding statistics: rounds, tau, draft / verify time, drafter_dtype (what the drafter computed in)
    spec: dict[str, Any]


class SpeculativeDecodingMetrics(BaseModel):
    """One request's speculative decoding, in vLLM's per-request shape (vllm-project/vllm pull request 48915).
    A spec step is a verify round that drafted (block size > 1)."""

    mean_acceptance_length: float = Field(description="1 + accepted draft tokens / spec steps (bonus token counted)")
    draft_acceptance_rate: float | None = Field(description="accepted / drafted tokens; null when nothing was drafted")
    acceptance_histogram: list[int] = Field(description="index j: the spec steps that accepted exactly j draft tokens")
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int = Field(description="the most draft tokens one step can propose (trained block size - 1)")
    per_step_accepted: list[int] | None = Field(None, description="detailed only: accepted draft tokens per step")
    per_step_drafted: list[int] | None = Field(None, description="detailed only: draft tokens per step")


class ResponseMetrics(BaseModel):
    """Extension, present only when the request sent `spec_decode_metrics`."""

    speculative_decoding: SpeculativeDecodingMetrics


class MetaInfo(BaseModel):
    """SGLang's per-request `meta_info` (python/sglang/srt/managers/tokenizer_manager.py, `_handle_batch_output`
    and `_calculate_spec_decoding_metrics`), present when the request sent `return_meta_info: true`, with the
    fields this server can fill honestly. SGLang puts it in each choice; z-lab's `dflash.benchmark --backend
    openai` reads it at the top level: both carry it. The spec_* fields appear only when the server drafts."""

    id: str = Field(description="the response's id")
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(description="prompt tokens served from a prefix cache: always 0, there is none")
    e2e_latency: float = Field(description="seconds from the request's arrival to its last token")
    spec_verify_ct: int | None = Field(None, description="verify rounds (target passes after the prefill)")
    spec_accept_length: float | None = Field(
        None,
        description="completion tokens / verify rounds, as SGLang counts (the prefill's token included); 0 "
        "without a round",
    )
    spec_accept_rate: float | None = Field(
        None,
        description="accepted / drafted tokens (SGLang divides by rounds x its fixed draft count; with "
        "adaptive block sizes a round drafts fewer); 0 without a draft",
    )
    spec_accept_token_num: int | None = Field(None, description="draft tokens the target accepted")
    spec_draft_token_num: int | None = Field(None, description="draft tokens proposed")


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs, one entry per generated token."""

    tokens: list[str] = Field(description="each token's text (`token_id:<id>` without a tokenizer)")
    token_logprobs: list[float] = Field(description=LOGPROB)
    top_logprobs: list[dict[str, float]] = Field(description="token text -> logprob: the chosen and the likeliest")
    text_offset: list[int] = Field(description="each token's start in the completion's text")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None  # only when the target has no tokenizer
    meta_info: MetaInfo | None = None  # only when the request sent return_meta_info: true


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str = Field(description=FINGERPRINT)
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec: dict[str, Any] | None = None
    metrics: ResponseMetrics | None = None  # only when the request sent spec_decode_metrics
    meta_info: MetaInfo | None = None  # only when the request sent return_meta_info: true


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the top_logprobs likeliest tokens there, likeliest first")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = Field(
        None, description="the calls the reply makes (tools with tool_choice auto, required or a named function)"
    )


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = Field(description="only when the request sent logprobs: true")
    finish_reason: ChatFinishReason
    meta_info: MetaInfo | None = None  # only when the request sent return_meta_info: true


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str = Field(description=FINGERPRINT)
    choices: list[ChatChoice]
    usage: Usage
    spec: dict[str, Any]
    metrics: ResponseMetrics | None = None  # only when the request sent spec_decode_metrics
    meta_info: MetaInfo | None = None  # only when the request sent return_meta_info: true


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    model: str
    drafter: bool


ERRORS = {
    400: "invalid request: a field out of range or of the wrong type, a prompt too long for the context, "
    "an unsupported field",
    401: "missing or wrong API key (when the server has one)",
    404: "unknown model",
    413: "request body too large",
    429: "queue full: retry after Retry-After seconds",
    500: "engine failure (this request only; the server keeps serving)",
    503: "shutting down, or not ready",
    504: "the request took longer than the server's time limit",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses, all with the OpenAI error body."""
    return {code: {"model": ErrorBody, "description": ERRORS[code]} for code in codes}


def streamed(model: type[BaseModel], description: str, *codes: int) -> dict[int | str, dict[str, Any]]:
    """200 as JSON, or (stream: true) as server-sent events, plus the error statuses."""
    return {
        200: {"model": model, "description": description, "content": {"text/event-stream": {"schema": SSE_EVENT}}},
        **errors(*codes),
    }


SSE_EVENT = {
    "type": "object",
    "description": "one server-sent event: a `data: <JSON chunk>` line (or `data: [DONE]`)",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
