"""What the routes share, handed to them by dependency injection (`ServerDep`), and the API key check
(`require_api_key`, a FastAPI security dependency on every router but the probes')."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Annotated, Any, cast

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..decoding import AdaptiveBlocks, BatchDecoder, BlockPolicy, FixedBlocks
from ..decoding.chunking import BACKLOG_STEPS, STALL, STEP_TOKENS
from ..decoding.sharing import MAX_TENANTS
from ..decoding.suffix import SHARED_TOKENS
from ..runtime.base import cuda_devices, pass_clock
from ..settings import SERVER_PROPOSER
from .errors import ApiError
from .limits import Limits
from .metrics import ServerMetrics
from .orchestrator import Orchestrator
from .tenancy import SuffixSharing
from .tokenizer import SerializedTokenizer


@dataclass
class ServerSettings:
    # the keys a request may send (`Authorization: Bearer KEY`); none: no auth. `api_key`: one key, added to them
    api_keys: tuple[str, ...] = ()
    api_key: InitVar[str | None] = None
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
    proposer: str = SERVER_PROPOSER  # requests without their own `proposer` (decoding/proposers.py)
    adaptive: bool = True  # without block_size: choose block sizes per step and row (else the drafter's trained size)
    # adaptive: refit the cost model from the served steps every N steps (0: never, the default). Off because
    # the policy picks the shapes it then observes: mostly block 1 gives passes whose tokens equal their rows,
    # a collinear fit that cannot tell per-token from per-row cost, and its error feeds the next choices
    # (docs/design.md#the-cost-model).
    refit_every: int = 0
    # how joining prompts enter the batch (decoding/loop.py): "chunked" (inside the verify pass, at most what
    # step_tokens leaves after the rows' blocks, a step at most about prefill_stall x the rows' own unless prompts
    # queue: then at least 1 / prefill_backlog_steps of them, 0: never; so a long prompt never freezes the rows
    # that stream; decoding/chunking.py) or "separate"
    prefill: str = "chunked"
    step_tokens: int = STEP_TOKENS
    prefill_stall: float = STALL
    prefill_backlog_steps: int = BACKLOG_STEPS
    # bytes of K/V cache sized at start-up for max_active rows (`reserve_caches`): up to the target's whole
    # context, fewer positions (a power of two) where that would take more; 0: grow on demand
    cache_reserve_bytes: int = 1 << 30
    # who shares finished outputs for suffix drafts (tenancy.py; off: nobody, each request matches its own tokens),
    # the tokens of them kept per tenant (decoding/sharing.py; 0: none) and the most tenants kept at once
    suffix_sharing: SuffixSharing = SuffixSharing()
    shared_suffix_tokens: int = SHARED_TOKENS
    suffix_tenants: int = MAX_TENANTS

    def __post_init__(self, api_key: str | None) -> None:
        if api_key:
            self.api_keys = (api_key, *self.api_keys)
        self.suffix_sharing.check(len(self.api_keys))


log = logging.getLogger("dflash_trt.server")


def batch_decoder(decoder: BatchDecoder, settings: ServerSettings, tokenizer: Any = None) -> BatchDecoder:
    """The serving decoder on the engines of `decoder` (the loaded one: only its engines, tokenizer and clock
    are read), with `tokenizer` in place of its tokenizer when given; with adaptive block sizes, the cost model
    is measured now (`AdaptiveBlocks.measured`: what a GPU's start-up adds to a CPU's is said there). On a GPU
    every timing, the grid's and the loop's, waits for the device (`pass_clock`)."""
    target, drafter = decoder.target, decoder.drafter
    tokenizer = decoder.tokenizer if tokenizer is None else tokenizer
    adaptive = settings.adaptive and settings.block_size is None and drafter is not None
    clock = pass_clock(target, drafter) if cuda_devices(target, drafter) else decoder.clock
    policy: BlockPolicy = FixedBlocks()
    if adaptive:
        assert drafter is not None
        t0 = time.perf_counter()
        policy = AdaptiveBlocks.measured(target, drafter, settings.max_active, clock, refit_every=settings.refit_every)
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
    return BatchDecoder(
        target,
        drafter,
        tokenizer,
        block_size=settings.block_size,
        policy=policy,
        clock=clock,
        prefill=settings.prefill,
        step_tokens=settings.step_tokens,
        stall=settings.prefill_stall,
        backlog_steps=settings.prefill_backlog_steps,
        # nothing kept where nobody shares: a request of no tenant neither reads nor feeds the structure
        shared_suffix_tokens=settings.shared_suffix_tokens if settings.suffix_sharing.scope != "off" else 0,
        shared_tenants=settings.suffix_tenants,
    )


def reserve_caches(decoder: BatchDecoder, rows: int, budget_bytes: int) -> int:
    """Size the engines' K/V caches for `rows` rows before serving, so that no step grows them: a growth copies
    the whole cache inside one step (`runtime.rows.SlotCacheRows.reserve`), a stall every stream feels. Positions:
    the target's context, or the largest power of two whose caches (target and drafter) fit `budget_bytes`; past
    them a cache still grows on demand. Sessions without slot caches (TensorRT-LLM's paged cache, per-row
    Hugging Face sessions) size themselves and are left alone. Returns the positions reserved (0: none)."""
    sessions = [decoder.target_session, decoder.drafter_session]
    caches = [s for s in sessions if s is not None and hasattr(s, "reserve") and hasattr(s, "position_bytes")]
    if budget_bytes <= 0 or not caches:
        return 0
    per_position = rows * sum(s.position_bytes() for s in caches)
    positions = int(decoder.target.max_context)
    if positions * per_position > budget_bytes:
        positions = 1 << max(0, (budget_bytes // per_position).bit_length() - 1)
    if positions < 16:
        return 0
    for s in caches:
        s.reserve(rows, positions)
    log.info(
        "K/V caches reserved for %d rows x %d positions (%.0f MiB)", rows, positions, positions * per_position / 2**20
    )
    return positions


class Server:
    """The one serving decoder (built from the loaded engines, its tokenizer serialized between request
    threads), the orchestrator stepping it, the metrics, the settings, and the served model's limits."""

    def __init__(self, loaded: BatchDecoder, settings: ServerSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        tokenizer = None if loaded.tokenizer is None else SerializedTokenizer(loaded.tokenizer)
        self.decoder = batch_decoder(loaded, settings, tokenizer)  # the one decoder serving every request
        reserve_caches(self.decoder, settings.max_active, settings.cache_reserve_bytes)
        self.limits = Limits.from_decoder(self.decoder, settings.model_name)
        self.metrics = ServerMetrics(settings.model_name, max(0, self.limits.max_block_size - 1))
        self.orchestrator = Orchestrator(self.decoder, self.metrics, settings.max_active, settings.max_queue, clock)
        self.started = False
        # What the drafter computes in (None: no drafter). Seeded sampled text depends on it (rejection sampling
        # compares the target's probabilities with the drafter's), so every generation response says it:
        # `spec.drafter_dtype`, and on the OpenAI routes `system_fingerprint`, OpenAI's field for the backend
        # configuration a seed's determinism depends on (it names the dtype, or `target-alone`).
        self.drafter_dtype = None if self.decoder.drafter is None else self.decoder.drafter.dtype
        self.system_fingerprint = "target-alone" if self.drafter_dtype is None else f"drafter-{self.drafter_dtype}"


def get_server(request: Request) -> Server:
    return cast(Server, request.app.state.server)  # create_app puts it there


ServerDep = Annotated[Server, Depends(get_server)]


_bearer = HTTPBearer(auto_error=False, description="one of the server's API keys (--api-key, --api-key-file)")


def require_api_key(
    request: Request,
    server: ServerDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 unless the request carries `Authorization: Bearer <one of the server's keys>` (each compared in
    constant time, every key tried); the matched key's place in the list is the request's `api_key_index`, its
    tenant under `--suffix-sharing key` (tenancy.py)."""
    keys = server.settings.api_keys
    sent = credentials.credentials.encode() if credentials is not None else None
    matched = [i for i, key in enumerate(keys) if sent is not None and hmac.compare_digest(sent, key.encode())]
    if keys and not matched:
        raise ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if matched:
        request.state.api_key_index = matched[0]
