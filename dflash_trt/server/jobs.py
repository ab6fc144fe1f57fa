"""From a validated request to a job on the orchestrator, and from its events back to a response:
one JSON result, or server-sent events, one per verified round. Shared by the native and OpenAI routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..decoding import ContextLengthError, GenerationConfig, GenerationResult, InputError, SamplingParams
from ..decoding.grammar import GrammarError, GrammarSpec
from ..decoding.processors import LogitsAdjustment
from ..decoding.proposers import DEFAULT_PROPOSER, PROPOSERS, proposer_for
from ..settings import DRAFTERLESS_PROPOSER
from .errors import ApiError, job_error
from .orchestrator import ErrorEvent, Job, RoundEvent
from .schemas import RequestBody, stop_tuple
from .structured import INVALID_GRAMMAR

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from ..decoding.row import BatchRow
    from .context import Server

T = TypeVar("T")


def generation_config(
    server: Server,
    body: RequestBody,
    max_tokens: int,
    temperature: float,
    text_prompt: bool = False,
    grammar: GrammarSpec | None = None,
    logprobs: int | None = None,
) -> GenerationConfig:
    """The decoder's config for a request; nulls mean the defaults. A text prompt (`text_prompt`) is healed
    unless the request says `heal_prompt: false`. `grammar`: what the output must match (structured.py reads it
    from the request); `logprobs`: None, or the alternatives per token to return (0: the chosen token's alone)."""
    eos = server.decoder.default_stop_ids()
    return GenerationConfig(
        max_new_tokens=max_tokens,
        sampling=SamplingParams(temperature, _or(body.top_p, 1.0), _or(body.top_k, 0), body.seed),
        block_size=body.block_size,
        proposer=request_proposer(body.proposer, body.block_size, server),
        stop_token_ids=() if body.ignore_eos else eos,
        stop_strings=stop_tuple(body.stop),
        drafter_fallback=True,
        # under a grammar the output starts where the grammar does: a healed prompt's last token would have to be
        # regenerated as the output's first, outside the grammar
        heal_prompt=text_prompt and grammar is None and getattr(body, "heal_prompt", None) is not False,
        grammar=grammar,
        logprobs=logprobs,
        adjust=LogitsAdjustment.of(
            frequency_penalty=_or(body.frequency_penalty, 0.0),
            presence_penalty=_or(body.presence_penalty, 0.0),
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
            min_tokens=_or(body.min_tokens, 0),
            min_tokens_suppress=eos,
        ),
    )


def request_proposer(asked: str | None, block_size: int | None, server: Server) -> str:
    """The request's proposer: its own, else the server's; but a request that fixes its block size and names none
    gets the library's default (DFlash) where the server's is not reproducible (`Proposer.reproducible`: the
    hybrid's and the suffix runs' choices weigh timed costs and match other requests' outputs). A fixed block size
    is how a client asks for reproducible seeded text (docs/api.md, Seeds).

    A server without a drafter drafts only with proposers that need none: one that uses the drafter, named by a
    request that may draft (block size above 1), is a 400; unnamed, the server's default is replaced by
    `DRAFTERLESS_PROPOSER` where it would use the drafter."""
    has_drafter, default = server.decoder.drafter is not None, server.settings.proposer
    if not has_drafter and proposer_for(default).uses_drafter:
        default = DRAFTERLESS_PROPOSER
    if asked is not None:
        drafts = (block_size or server.settings.block_size or 0) != 1
        if not has_drafter and drafts and proposer_for(asked).uses_drafter:
            free = [name for name in PROPOSERS if not proposer_for(name).uses_drafter]
            raise ApiError(
                400,
                f"proposer {asked!r} drafts with a DFlash drafter and this server has none: use one of {free}",
                param="proposer",
            )
        return asked
    if block_size is not None and not proposer_for(default).reproducible:
        return DEFAULT_PROPOSER if has_drafter else default
    return default


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


async def start_job(
    request: Request,
    server: Server,
    body: RequestBody,
    make_prompt: Callable[[], list[int]],
    make_config: Callable[[int], GenerationConfig],
    prompt_param: str,
) -> Job:
    """Check the served model's limits, tokenize, validate against the engines, enqueue. Input problems
    are 400s; a full queue (429) and a draining server (503) answer before any tokenizing (the
    orchestrator's QueueFull / ShuttingDown, answered by errors.py).

    No engine lock: BatchDecoder.new_row() only validates (the loop's rules) and makes the row;
    only the orchestrator's worker runs the engines."""
    server.limits.check(body)
    orch = server.orchestrator
    orch.check_admission()
    tenant = server.settings.suffix_sharing.tenant(request)  # whose finished outputs it shares (tenancy.py)

    def prepare() -> BatchRow:
        ids = make_prompt()
        return server.decoder.new_row(ids, dataclasses.replace(make_config(len(ids)), tenant=tenant))

    try:
        row = await run_in_threadpool(prepare)
        job = Job(
            id=request.state.request_id,
            row=row,
            loop=asyncio.get_running_loop(),
            deadline=orch.clock() + server.settings.request_timeout_s,
            submitted=orch.clock(),
        )
        orch.submit(job)
    except ContextLengthError as e:
        raise ApiError(
            400, str(e), param=prompt_param if e.prompt_alone else "max_tokens", code="context_length_exceeded"
        ) from None
    except GrammarError as e:  # compiled with the tokenizer, here: beyond its bounds, or admitting no string
        raise ApiError(400, str(e), param=getattr(e, "param", None), code=INVALID_GRAMMAR) from None
    except (InputError, ValueError) as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
    request.state.job = job
    return job


async def wait_result(request: Request, job: Job) -> GenerationResult:
    """Wait for the job's last round; a client that hangs up cancels it at once (the next round)."""
    watch = asyncio.create_task(_cancel_on_disconnect(request, job))
    try:
        while True:
            event = await job.events.get()
            if isinstance(event, ErrorEvent):
                raise job_error(event.kind, event.message)
            if event.result is not None:
                return event.result
    finally:
        watch.cancel()
        job.cancel()  # no-op when finished; frees the slot when this handler is cancelled


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """The body is read, so the next ASGI message can only be the client hanging up: wait for it.
    (Polling between rounds never fires while rounds keep coming, every few milliseconds.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


class JobStream(StreamingResponse):
    """A streaming response that cancels its job however the response ends (disconnect included)."""

    def __init__(self, content: AsyncIterator[str], job: Job):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _sse(data: str | dict[str, Any]) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def stream(
    job: Job,
    on_round: Callable[[RoundEvent], Iterable[dict[str, Any]]],
    on_error: Callable[[ApiError], dict[str, Any]],
    done_marker: bool,
) -> JobStream:
    """SSE: on_round(RoundEvent) gives the chunks of a round (the last round carries the result)."""

    async def events() -> AsyncIterator[str]:
        while True:
            event = await job.events.get()
            if isinstance(event, ErrorEvent):
                yield _sse(on_error(job_error(event.kind, event.message)))
                break
            for chunk in on_round(event):
                yield _sse(chunk)
            if event.result is not None:
                break
        if done_marker:
            yield _sse("[DONE]")

    return JobStream(events(), job)


def usage(result: GenerationResult) -> dict[str, int]:
    s = result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.new_tokens,
        "total_tokens": s.prompt_tokens + s.new_tokens,
    }


def spec(job: Job, drafter_dtype: str | None) -> dict[str, Any]:
    """The request's speculative statistics, whether its drafter failed (the rest on the target alone), and the
    dtype the drafter computed in (null: no drafter; seeded sampled text depends on it)."""
    d = job.row.stats.to_dict()
    d["drafter_fallback"] = job.row.drafter_error is not None
    d["drafter_dtype"] = drafter_dtype
    return d


def spec_decode_metrics(job: Job, level: str | None, num_spec_tokens: int) -> dict[str, Any] | None:
    """The request's speculative-decoding statistics in vLLM's per-request shape (the response's top-level
    `metrics.speculative_decoding`, vllm-project/vllm pull request 48915, `--per-request-spec-decode-metrics
    summary|detailed`), or None when the request did not ask (`spec_decode_metrics` absent or null).

    A spec step is a verify round that drafted (block size > 1); num_spec_tokens is the most one round can
    draft (the drafter's trained block size - 1): with adaptive block sizes a round may draft fewer.
    acceptance_histogram[j]: the steps that accepted exactly j draft tokens. mean_acceptance_length counts the
    bonus token (1 + accepted / steps; 1 without any step); draft_acceptance_rate is null without a draft.
    "detailed" adds per_step_accepted and per_step_drafted, one entry per spec step in order."""
    if level is None:
        return None
    stats = job.row.stats
    steps = [(d, a) for d, a in zip(stats.drafted_per_round, stats.accepted_per_round) if d > 0]
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    width = max([num_spec_tokens, *(d for d, _ in steps)])
    histogram = [0] * (width + 1)
    for _, a in steps:
        histogram[a] += 1
    out: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_histogram": histogram,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": num_spec_tokens,
    }
    if level == "detailed":
        out["per_step_accepted"] = [a for _, a in steps]
        out["per_step_drafted"] = [d for d, _ in steps]
    return {"speculative_decoding": out}


def meta_info(job: Job, response_id: str, speculative: bool) -> dict[str, Any]:
    """SGLang's `meta_info` for a finished request (responses.MetaInfo states each field). SGLang's own
    formulas: spec_accept_length = completion tokens / verify rounds, so the prefill's token counts (our
    `spec.mean_acceptance_length` leaves it out); spec_verify_ct counts every verify round, drafted or not.
    The spec_* fields only when the server drafts (SGLang adds them only with a speculative algorithm)."""
    s = job.row.stats
    out: dict[str, Any] = {
        "id": response_id,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.new_tokens,
        "cached_tokens": 0,
        "e2e_latency": job.latency,  # the job has finished: its result is what this describes
    }
    if speculative:
        out["spec_verify_ct"] = s.rounds
        out["spec_accept_length"] = s.new_tokens / s.rounds if s.rounds else 0
        out["spec_accept_rate"] = s.accepted_draft_tokens / s.drafted_tokens if s.drafted_tokens else 0.0
        out["spec_accept_token_num"] = s.accepted_draft_tokens
        out["spec_draft_token_num"] = s.drafted_tokens
    return out


__all__ = [
    "meta_info",
    "RoundEvent",
    "generation_config",
    "start_job",
    "wait_result",
    "stream",
    "usage",
    "spec",
    "spec_decode_metrics",
]
