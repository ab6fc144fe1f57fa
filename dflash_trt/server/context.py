"""What the routes share, handed to them by dependency injection (`ServerDep`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Annotated, cast

from fastapi import Depends, Request

from ..decoding import BatchDecoder, BlockPolicy
from ..runtime.base import cuda_devices, pass_clock
from .metrics import ServerMetrics
from .scheduler import Orchestrator
from .schemas import Limits, request_models
from .tokenizer import with_serialized_tokenizer


@dataclass
class ServerSettings:
    api_key: str | None = None
    model_name: str = "dflash-trt"
    max_active: int = 8  # the most requests in one batched step (rows of the batch)
    max_queue: int = 64  # waiting requests beyond max_active; more get 429
    request_timeout_s: float = 300.0
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256  # chat requests without max_tokens (clipped to the context)
    # (completions without max_tokens get OpenAI's 16, /generate its documented 128)
    drain_timeout_s: float = 30.0
    # /health fails (503) once no decoding step has ended for this many seconds while requests wait or run, so
    # that a liveness probe restarts a server whose engines hang (a stuck collective); 0: never.
    health_stall_s: float = 300.0
    block_size: int | None = None  # every request's block size unless it asks for its own (1: target alone)
    adaptive: bool = True  # without block_size: choose block sizes per step and row (else the drafter's trained size)
    # adaptive: refit the cost model from the served steps every N steps (0: never, the default). Off because
    # the policy picks the shapes it then observes: mostly block 1 gives passes whose tokens equal their rows,
    # a collinear fit that cannot tell per-token from per-row cost and, on a loaded machine, inflates drafting
    # until every row stays at block 1 (measured: docs/benchmarks.md, measurements behind design choices).
    refit_every: int = 0


log = logging.getLogger("dflash_trt.server")


def batch_decoder(decoder: BatchDecoder, settings: ServerSettings) -> BatchDecoder:
    """The serving decoder on the loaded engines; with adaptive block sizes, the cost model is measured now
    (`BlockPolicy.measured`: what a GPU's start-up adds to a CPU's is said there). On a GPU every timing,
    the grid's and the loop's, waits for the device (`pass_clock`)."""
    target, drafter = decoder.target, decoder.drafter
    adaptive = settings.adaptive and settings.block_size is None and drafter is not None
    clock = pass_clock(target, drafter) if cuda_devices(target, drafter) else decoder.clock
    policy = BlockPolicy(refit_every=settings.refit_every)
    if adaptive:
        assert drafter is not None
        t0 = time.perf_counter()
        policy = BlockPolicy.measured(target, drafter, settings.max_active, clock, refit_every=settings.refit_every)
        assert policy.cost is not None
        t, d = policy.cost.target, policy.cost.drafter
        log.info(
            "adaptive block sizes: cost model measured in %.1f s (rows up to %d, blocks 1/4/8%s): target %.2f ms "
            "+ %.3f ms/row + %s (one token alone: %s), drafter %.2f ms + %.3f ms/row + %.3f ms/token",
            time.perf_counter() - t0,
            settings.max_active,
            f", one-row token curve at {len(t.curve)} counts" if t.curve else "",
            1e3 * t.fixed,
            1e3 * t.per_row,
            "the token curve" if t.curve else f"{1e3 * t.per_token:.3f} ms/token",
            "-" if t.one_token is None else f"{1e3 * t.one_token:.2f} ms",
            1e3 * d.fixed,
            1e3 * d.per_row,
            1e3 * d.per_token,
        )
    return BatchDecoder(target, drafter, decoder.tokenizer, block_size=settings.block_size, policy=policy, clock=clock)


class Server:
    """The serving decoder (on the loaded engines, its tokenizer serialized between request threads), the
    orchestrator stepping it, the metrics, the settings, and the limits the request models enforce."""

    def __init__(self, decoder: BatchDecoder, settings: ServerSettings):
        loaded, self.settings = with_serialized_tokenizer(decoder), settings
        self.limits = Limits.from_decoder(loaded, settings.model_name)
        self.models = request_models(self.limits)
        self.metrics = ServerMetrics(settings.model_name, max(0, self.limits.max_block_size - 1))
        self.decoder = batch_decoder(loaded, settings)  # the one decoder serving every request
        self.orchestrator = Orchestrator(self.decoder, self.metrics, settings.max_active, settings.max_queue)
        self.started = False


def get_server(request: Request) -> Server:
    return cast(Server, request.app.state.server)  # create_app puts it there


ServerDep = Annotated[Server, Depends(get_server)]
