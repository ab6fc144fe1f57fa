"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (JSON or SSE ending in `data: [DONE]`),
/v1/models and /v1/models/{model}. One model, one choice per request; a request naming another model
is a 404 `model_not_found`, as OpenAI answers.

Each endpoint reads as: check the model, start the job (jobs.start_job: limits, tokenizing, the queue), then
answer with one JSON body or one chunk per verified round, each in the envelope its object type has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request

from ...decoding import BatchDecoder, GenerationResult, InputError, prompting
from ...decoding.request import TokenLogprob
from .. import structured
from ..context import Server, ServerDep
from ..errors import ApiError
from ..jobs import (
    JobStream,
    generation_config,
    meta_info,
    spec,
    spec_decode_metrics,
    start_job,
    stream,
    usage,
    wait_result,
)
from ..orchestrator import Job, RoundEvent
from ..responses import ChatCompletion, Completion, Model, ModelList, errors, streamed
from ..schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    OPENAI_DEFAULT_TEMPERATURE,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIFields,
)

GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)
Envelope = Callable[..., dict[str, Any]]  # (choices, **extra) -> one response body or chunk

router = APIRouter(prefix="/v1")


@router.get("/models", response_model=ModelList, responses=errors(401), summary="the served model")
async def list_models(server: ServerDep) -> dict[str, Any]:
    return {"object": "list", "data": [_card(server)]}


@router.get("/models/{model}", response_model=Model, responses=errors(401, 404), summary="one model")
async def retrieve_model(model: str, server: ServerDep) -> dict[str, Any]:
    _check_model(server, model)
    return _card(server)


@router.post(
    "/completions",
    summary="text completion (OpenAI)",
    response_model=Completion,
    response_model_exclude_unset=True,
    responses=streamed(
        Completion, "the completion; with stream: `text_completion` chunks, then `data: [DONE]`", *GENERATION_ERRORS
    ),
)
async def completions(body: CompletionRequest, request: Request, server: ServerDep) -> dict[str, Any] | JobStream:
    _check_model(server, body.model)
    decoder, prompt = server.decoder, body.prompt
    grammar = structured.request_grammar(body)
    job = await start_job(
        request,
        server,
        body,
        lambda: decoder.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt],
        lambda n: generation_config(
            server,
            body,
            _max_tokens(server, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, n),
            _temperature(body),
            text_prompt=isinstance(prompt, str),
            grammar=grammar,
            logprobs=body.logprobs,
        ),
        prompt_param="prompt",
    )
    cid = f"cmpl-{job.id}"
    envelope = _envelope(server, cid, "text_completion")
    tok = decoder.tokenizer
    ids_out = tok is None  # no tokenizer: the token ids are the only output
    offset = 0  # text_offset of the next round's first token

    def choice(
        text: str | None, finish_reason: str | None, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        nonlocal offset
        lp = None
        if body.logprobs is not None:
            lp = structured.completion_logprobs(tok, logprobs or [], offset)
            offset += sum(len(t) for t in lp["tokens"])
        c: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        return {**c, "token_ids": token_ids} if ids_out else c

    if not body.stream:
        result = await wait_result(request, job)
        this = choice(result.text, result.finish_reason, result.token_ids, result.logprobs)
        finished = _finished(server, job, body, cid, this)
        return envelope(usage=usage(result), spec=spec(job, server.drafter_dtype), **finished)

    def on_round(event: RoundEvent) -> Iterator[dict[str, Any]]:
        result, rnd = event.result, event.round
        this = choice(rnd.text, result.finish_reason if result else None, rnd.token_ids, rnd.logprobs)
        yield envelope(**_finished(server, job, body, cid, this)) if result is not None else envelope([this])
        yield from _usage_chunk(envelope, body, result)

    return stream(job, on_round, lambda err: err.body, done_marker=True)


@router.post(
    "/chat/completions",
    summary="chat completion (OpenAI): text messages, tools, structured outputs, logprobs; a 400 for a model "
    "without a chat template",
    response_model=ChatCompletion,
    response_model_exclude_unset=True,
    responses=streamed(
        ChatCompletion,
        "the reply; with stream: `chat.completion.chunk` chunks, then `data: [DONE]`",
        *GENERATION_ERRORS,
    ),
)
async def chat(body: ChatCompletionRequest, request: Request, server: ServerDep) -> dict[str, Any] | JobStream:
    _check_model(server, body.model)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code=structured.CONFLICT)
    tok = server.decoder.tokenizer
    plan = structured.tool_plan(body, tok)
    grammar = structured.request_grammar(body, plan)
    messages = structured.chat_messages(body.messages)
    template_kwargs = dict(body.chat_template_kwargs or {})
    if plan is None:
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        messages = plan.messages(messages)
        if plan.format is None and plan.mode != "none":  # a template that may write tools itself gets them
            template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in plan.tools]
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    asked = body.max_completion_tokens or body.max_tokens
    job = await start_job(
        request,
        server,
        body,
        lambda: chat_prompt_ids(server.decoder, messages, template_kwargs or None),
        lambda n: generation_config(
            server,
            body,
            _max_tokens(server, asked, server.settings.default_max_tokens, n),
            _temperature(body),
            grammar=grammar,
            logprobs=logprobs,
        ),
        prompt_param="messages",
    )
    cid = f"chatcmpl-{job.id}"
    envelope = _envelope(server, cid, "chat.completion.chunk" if body.stream else "chat.completion")

    def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if logprobs is None else structured.chat_logprobs(tok, entries or [])

    if not body.stream:
        result = await wait_result(request, job)
        message, finish_reason = _reply(plan, result.text or "", result.finish_reason)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(result.logprobs),
            "finish_reason": finish_reason,
        }
        return envelope(
            usage=usage(result), spec=spec(job, server.drafter_dtype), **_finished(server, job, body, cid, choice)
        )

    named = plan is not None and plan.mode == "named"
    buffered = plan is not None and plan.mode in ("required", "auto")  # the calls are known at the end
    text: list[str] = []
    held: list[TokenLogprob] = []

    def on_round(event: RoundEvent) -> Iterator[dict[str, Any]]:
        rnd, result = event.round, event.result
        piece = rnd.text or ""
        delta: dict[str, Any] = {"role": "assistant"} if rnd.prefill else {}
        entries = None if buffered else rnd.logprobs
        if buffered:
            text.append(piece)
            held.extend(rnd.logprobs or ())
            if result is not None:
                message, _ = _reply(plan, "".join(text), result.finish_reason)
                calls = message.pop("tool_calls", None)
                delta.update({k: v for k, v in message.items() if k != "role" and v is not None})
                if calls:
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                entries = held
            elif not rnd.prefill:
                return
        elif named:
            assert plan is not None and plan.name is not None
            if rnd.prefill:
                call = structured.ToolCallOut(plan.name, piece).to_openai(index=0)
                delta["tool_calls"] = [call]
            else:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": piece}}]
        else:
            delta["content"] = piece
        chunk_lp = None if buffered and entries is None else chat_logprobs(entries)
        yield envelope([{"index": 0, "delta": delta, "logprobs": chunk_lp, "finish_reason": None}])
        if result is not None:
            _, finish_reason = _reply(plan, "".join(text), result.finish_reason)
            last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
            yield envelope(**_finished(server, job, body, cid, last))
        yield from _usage_chunk(envelope, body, result)

    return stream(job, on_round, lambda err: err.body, done_marker=True)


def _reply(plan: structured.ToolPlan | None, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished reply and its finish_reason: with tool calls, `tool_calls` (content
    null unless the model also wrote text), finish_reason "tool_calls", but "stop" for a named function, as
    OpenAI answers a forced call; "length" stays "length"."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = plan.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        return message, finish_reason
    message["tool_calls"] = [c.to_openai() for c in calls]
    if finish_reason == "stop" and plan.mode != "named":
        finish_reason = "tool_calls"
    return message, finish_reason


def _envelope(server: Server, cid: str, obj: str) -> Envelope:
    """The body every response and chunk of one request shares around its choices; `system_fingerprint` in each,
    as OpenAI sends it: the backend configuration a seed's text depends on (Server.system_fingerprint)."""
    created, model, fingerprint = int(time.time()), server.settings.model_name, server.system_fingerprint

    def envelope(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": cid,
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": choices,
            **extra,
        }

    return envelope


def _finished(server: Server, job: Job, body: OpenAIFields, cid: str, choice: dict[str, Any]) -> dict[str, Any]:
    """The envelope's arguments for the response (or the stream's chunk) that finishes: `choices` with the
    finishing choice, the metrics asked for (spec_decode_metrics) and SGLang's meta_info (return_meta_info), in
    the choice, where SGLang puts it, and at the top level, where z-lab's benchmark client reads it."""
    out = _metrics(server, job, body)
    if body.return_meta_info:
        out["meta_info"] = meta_info(job, cid, speculative=server.decoder.drafter is not None)
        choice = {**choice, "meta_info": out["meta_info"]}
    return {"choices": [choice], **out}


def _usage_chunk(envelope: Envelope, body: OpenAIFields, result: GenerationResult | None) -> Iterator[dict[str, Any]]:
    """The stream's usage chunk (no choices) after the last round, when stream_options.include_usage asks."""
    if result is not None and body.stream_options is not None and body.stream_options.include_usage:
        yield envelope([], usage=usage(result))


def _metrics(server: Server, job: Job, body: OpenAIFields) -> dict[str, Any]:
    """{"metrics": ...} when the request sent spec_decode_metrics, else nothing (the response is unchanged)."""
    m = spec_decode_metrics(job, body.spec_decode_metrics, max(0, server.limits.max_block_size - 1))
    return {} if m is None else {"metrics": m}


def _card(server: Server) -> dict[str, Any]:
    return {
        "id": server.settings.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "dflash-trt",
        "max_model_len": server.limits.max_context,
    }


def _check_model(server: Server, model: str | None) -> None:
    if model is not None and model != server.settings.model_name:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{server.settings.model_name}'",
            param="model",
            code="model_not_found",
        )


def _temperature(body: OpenAIFields) -> float:
    return OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature


def _max_tokens(server: Server, asked: int | None, default: int, prompt_len: int) -> int:
    """What the client asked for (too much is a 400), else the default clipped to the context left."""
    return asked or max(1, min(default, server.limits.max_context - prompt_len))


def chat_prompt_ids(
    decoder: BatchDecoder, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """The messages rendered by the tokenizer's chat template (dflash_trt.decoding.prompting, shared with
    the Triton preprocessing model); a 400 pointing to /v1/completions when the model has none."""
    tok = decoder.tokenizer
    if tok is None:
        raise InputError("chat needs a tokenizer; this target has none (use /v1/completions with token ids)")
    return prompting.chat_prompt_ids(tok, messages, template_kwargs)
