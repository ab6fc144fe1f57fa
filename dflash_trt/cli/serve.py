"""`dflash-trt serve`: load the engines, then serve them with uvicorn (light at import: no torch here)."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..decoding import BatchDecoder
    from ..server.tenancy import SuffixSharing

API_KEY_ENV = "DFLASH_TRT_API_KEY"
API_KEY_FILE_ENV = "DFLASH_TRT_API_KEY_FILE"


def _port(text: str) -> int:
    from .options import non_negative_int

    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {value}")
    return value


def _seconds(text: str, allow_zero: bool = False) -> float:
    from .options import finite_float

    value = finite_float(text)  # finite
    if value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {text}")
    return value


def _gib(text: str) -> float:
    from .options import finite_float

    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 GiB, got {text}")
    return value


def _drain_seconds(text: str) -> float:
    return _seconds(text, allow_zero=True)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the models over HTTP (native /generate and OpenAI-compatible endpoints)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "HTTP server: POST /generate, /v1/completions, /v1/chat/completions (all with SSE streaming), "
            "GET /v1/models, /health, /ready, /metrics. Every active request is a row of one batch: each step runs "
            "ONE drafter pass and ONE target pass that verifies every row's block, then accepts per row; new requests' "
            "prompts enter that target pass in chunks (--prefill). Block sizes are chosen per step and per request "
            "(adaptive, from a cost model measured at start-up) unless --block-size or --no-adaptive fixes them; "
            "a request's own block_size wins. With adaptive sizes a seed fixes the distribution, not the text: "
            "send a fixed block_size for reproducible sampled text.",
            100,
        ),
        epilog="A tensor-parallel TensorRT-LLM target (tp = N > 1 in engines.toml) runs one process per GPU:\n"
        "  mpirun -n N --allow-run-as-root dflash-trt serve --engines engines --host 0.0.0.0\n"
        "Rank 0 runs the HTTP server and the loop; the other ranks only serve the engine (TensorRT-LLM leader mode).\n"
        "A GPU without TensorRT: dflash-trt serve --device cuda --dtype bf16 (PyTorch engines on the GPU).",
    )
    from .options import add_device_args

    src = _model_args(p)
    _block_args(p)
    _prefill_args(p)
    add_device_args(src)  # listed after the block-size flags in the usage line
    _network_args(p)
    _limit_args(p)
    p.set_defaults(func=cmd_serve)


def _model_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The models group (the device flags join it later)."""
    from ..settings import DEMO_TARGET

    src = p.add_argument_group("models (default: the demo models)")
    src.add_argument(
        "--target",
        type=Path,
        default=DEMO_TARGET,
        help=f"Hugging Face target checkpoint directory (default: {DEMO_TARGET})",
    )
    from .options import add_drafter_arg

    add_drafter_arg(src)
    src.add_argument(
        "--engines",
        type=Path,
        default=None,
        help="load the engines `make engines` built (DIR/manifest.json) instead of --target/--drafter",
    )
    src.add_argument(
        "--no-draft",
        action="store_true",
        help="serve the target alone, no drafts from any proposer (the baseline: block size 1 for every request)",
    )
    return src


def _block_args(p: argparse.ArgumentParser) -> None:
    from ..settings import SERVER_PROPOSER
    from .options import add_proposer_arg, positive_int

    blk = p.add_argument_group("block size (tokens verified per row per step; default: adaptive)")
    one = blk.add_mutually_exclusive_group()
    one.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="every request's block size unless it sends its own (1..the drafter's trained size; "
        "1 = the target alone, with the drafter still loaded for requests that ask for more)",
    )
    one.add_argument(
        "--no-adaptive",
        action="store_true",
        help="use the drafter's trained block size instead of choosing one per step and request "
        "(adaptive: the sizes that maximise expected tokens per second, from each request's "
        "acceptance so far and the cost of a batched pass, measured at start-up)",
    )
    add_proposer_arg(
        blk,
        extra="; a request's own `proposer` wins (without a drafter, one that needs none)",
        default=SERVER_PROPOSER,
        by_drafter=True,
    )
    from ..decoding.sharing import MAX_TENANTS
    from ..decoding.suffix import SHARED_TOKENS
    from .options import non_negative_int

    blk.add_argument(
        "--suffix-sharing",
        type=_sharing,
        default="off",
        metavar="{off,key,header:NAME,all}",
        help="whose finished outputs a request's suffix and hybrid drafts may also match (a client's next turn "
        "resends what it received). A PRIVACY BOUNDARY: a client that shares can read the others' outputs back, "
        "a guessed token at a time, from how many tokens are drafted for it or how fast they come (docs/api.md, "
        "Suffix sharing). off (default): nobody shares, each request matches its own prompt and output; key: the "
        "clients of one API key share (several keys, one a line in --api-key-file: one tenant each); "
        "header:NAME: one tenant per value of header NAME, which your gateway must set and overwrite; all: every "
        "client is one tenant (one party's server only, e.g. a local agent)",
    )
    blk.add_argument(
        "--suffix-shared-tokens",
        type=non_negative_int,
        default=SHARED_TOKENS,
        metavar="N",
        help="with --suffix-sharing: tokens of finished outputs kept per tenant; the oldest are evicted past N "
        f"(default {SHARED_TOKENS}); 0: none kept",
    )
    blk.add_argument(
        "--suffix-tenants",
        type=positive_int,
        default=MAX_TENANTS,
        metavar="N",
        help="with --suffix-sharing: tenants whose outputs are kept at once, each up to --suffix-shared-tokens; "
        f"past N the least recently served tenant's are dropped (default {MAX_TENANTS})",
    )


def _sharing(text: str) -> SuffixSharing:
    from ..server.tenancy import SuffixSharing

    try:
        return SuffixSharing.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _prefill_args(p: argparse.ArgumentParser) -> None:
    from ..decoding.chunking import BACKLOG_STEPS, STALL, STEP_TOKENS
    from ..decoding.loop import PREFILL_MODES
    from .options import non_negative_int, positive_int, stall_factor

    pre = p.add_argument_group("prefill (how a new request's prompt enters the batch)")
    pre.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default="chunked",
        help="chunked (default): prompts enter in chunks inside the step's verify pass (see --step-tokens and "
        "--prefill-stall), so a long prompt arriving lengthens the streaming requests' steps a little instead of "
        "freezing them for its whole prefill; separate: each new prompt whole, in a pass of its own before the "
        "verify pass (the first token a little sooner, every streaming request stalled meanwhile)",
    )
    pre.add_argument(
        "--step-tokens",
        type=positive_int,
        default=STEP_TOKENS,
        metavar="N",
        help=f"chunked prefill: the token budget of one step's target pass; the running requests' blocks are "
        f"reserved first, the prompt chunks get the rest (at least N/4 before --prefill-stall cuts them). "
        f"Smaller: shorter stalls for the streaming requests, a longer wait for a new request's first token "
        f"(default {STEP_TOKENS})",
    )
    pre.add_argument(
        "--prefill-stall",
        type=stall_factor,
        default=STALL,
        metavar="X",
        help=f"chunked prefill: a step with prompt chunks takes at most about X times the running requests' own "
        f"step (timed from the steps served), however many tokens --step-tokens allows, unless prompts queue "
        f"behind the one entering (see --prefill-backlog-steps). Smaller: smoother streams, new requests wait "
        f"longer for their first token; > 1 (default {STALL})",
    )
    pre.add_argument(
        "--prefill-backlog-steps",
        type=non_negative_int,
        default=BACKLOG_STEPS,
        metavar="N",
        help=f"chunked prefill: while prompts queue behind the one entering, each step takes at least 1/N of the "
        f"queued prompt tokens whatever --prefill-stall allows (within --step-tokens), so the queue cannot grow "
        f"without end when requests arrive faster than the bound lets them in: a new request waits about N steps "
        f"to enter. Larger: smoother streams under load, longer waits for the first token; 0: no floor, the "
        f"bound holds at any load and the queue may grow (default {BACKLOG_STEPS})",
    )


def _network_args(p: argparse.ArgumentParser) -> None:
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    net.add_argument(
        "--port",
        type=_port,
        default=8000,
        help="port (default 8000); 0 picks a free one, reported on stderr as "
        '{"event": "listening", "host": ..., "port": N}',
    )
    net.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but the probes' /health and /ready "
        f"(default: ${API_KEY_ENV} if set, else the keys in --api-key-file, else no auth)",
    )
    net.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"read the API keys from this file, one a line (a mounted Secret: the keys stay out of the "
        f"environment that mpirun hands to every rank; blank lines and lines starting with # are skipped); each "
        f"key is a tenant for --suffix-sharing key. An empty or unreadable file is an error, never 'no auth' "
        f"(default: ${API_KEY_FILE_ENV} if set)",
    )
    net.add_argument(
        "--model-name", default=None, help="model id in /v1/models and responses (default: target dir name)"
    )


def _limit_args(p: argparse.ArgumentParser) -> None:
    from .options import non_negative_int, positive_int

    lim = p.add_argument_group("limits")
    lim.add_argument(
        "--max-active",
        type=positive_int,
        default=8,
        help="the most requests in one batched step (rows of the batch); more wait in the queue (default 8)",
    )
    lim.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=64,
        help="requests waiting beyond --max-active; more get 429 with Retry-After (default 64)",
    )
    lim.add_argument("--request-timeout", type=_seconds, default=300.0, help="seconds per request (default 300)")
    lim.add_argument(
        "--cache-reserve-gib",
        type=_gib,
        default=1.0,
        help="GiB of K/V cache (target and drafter) sized at start-up for --max-active rows: the target's whole "
        "context, or the most positions (a power of two) that fit; growing a cache later copies it inside a "
        "step, a stall every stream feels. 0: grow on demand (default 1)",
    )
    lim.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=1 << 20,
        help="largest request body; more gets 413 (default 1 MiB)",
    )
    lim.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=256,
        help="chat requests without max_tokens generate at most this many, clipped to the context "
        "left (default 256); /v1/completions without max_tokens keeps OpenAI's default of 16 and "
        "/generate its own default of 128",
    )
    lim.add_argument(
        "--drain-timeout",
        type=_drain_seconds,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds to let in-flight requests finish while new ones get 503 "
        "(default 30); a second signal exits at once",
    )
    lim.add_argument(
        "--health-stall-seconds",
        type=_drain_seconds,
        default=300.0,
        help="GET /health answers 503 once no decoding step has ended for this many seconds while requests "
        "wait or run (a hung engine or collective), so a liveness probe restarts the server (default 300; "
        "0: never)",
    )
    lim.add_argument(
        "--pid-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="the serving process (rank 0 under mpirun) writes its pid here once the engines are loaded and "
        "removes it on exit: a pod's preStop hook signals that process to drain, not mpirun, which would "
        "end every rank at once (deploy/README.md)",
    )
    lim.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")


def cmd_serve(args: argparse.Namespace) -> int:
    from ..runtime.kernel_caches import bound_kernel_caches
    from ..server.serving import serve_app, setup_logging
    from .options import CliError

    bound_kernel_caches()  # before any kernel runs: the caches read their capacity once
    setup_logging()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    decoder, name = _load_models(args)
    from .options import close_engines, serve_worker_rank

    if serve_worker_rank(decoder):  # tp > 1: only the leader rank serves HTTP
        return 0
    from ..server.app import ServerSettings, create_app
    from ..settings import SERVER_PROPOSER
    from .options import resolve_proposer

    try:  # --no-draft serves block 1 whatever the proposer: no proposer is refused there
        proposer = resolve_proposer(args.proposer, decoder.drafter is not None or args.no_draft, SERVER_PROPOSER)
    except CliError:
        close_engines(decoder)
        raise
    settings = ServerSettings(
        api_keys=_api_keys(args, decoder),
        model_name=args.model_name or name,
        max_active=args.max_active,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        drain_timeout_s=args.drain_timeout,
        health_stall_s=args.health_stall_seconds,
        block_size=1 if args.no_draft else args.block_size,
        proposer=proposer,
        adaptive=not args.no_adaptive,
        prefill=args.prefill,
        step_tokens=args.step_tokens,
        prefill_stall=args.prefill_stall,
        prefill_backlog_steps=args.prefill_backlog_steps,
        cache_reserve_bytes=int(args.cache_reserve_gib * 2**30),
        suffix_sharing=args.suffix_sharing,
        shared_suffix_tokens=args.suffix_shared_tokens,
        suffix_tenants=args.suffix_tenants,
    )
    limit = decoder.drafter.block_size if decoder.drafter is not None else 1
    if args.block_size is not None and args.block_size > limit:
        close_engines(decoder)
        raise CliError(
            f"--block-size must be in 1..{limit} for "
            f"{'this drafter' if decoder.drafter is not None else 'the target alone (--no-draft)'}, "
            f"got {args.block_size}"
        )
    try:  # batching the engines can fail (a target without a batched session): one line, engines closed
        app = create_app(decoder, settings)
    except ValueError as e:
        close_engines(decoder)
        raise CliError(f"cannot serve these engines: {e}") from None
    if args.pid_file is not None:
        args.pid_file.parent.mkdir(parents=True, exist_ok=True)
        args.pid_file.write_text(f"{os.getpid()}\n")
    try:
        serve_app(app, args.host, args.port)
    finally:
        close_engines(decoder)
        if args.pid_file is not None:
            args.pid_file.unlink(missing_ok=True)
    return 0


def _api_keys(args: argparse.Namespace, decoder: BatchDecoder) -> tuple[str, ...]:
    """The keys: --api-key, else $DFLASH_TRT_API_KEY, else the file's (--api-key-file, else
    $DFLASH_TRT_API_KEY_FILE; one a line), else none (no auth). A file that was named must hold a key: a missing
    or empty Secret then stops the server (engines closed) instead of silently serving without authentication;
    so does --suffix-sharing key without keys."""
    from .options import CliError, close_engines

    key = args.api_key or os.environ.get(API_KEY_ENV)
    keys: tuple[str, ...] = (str(key),) if key else ()
    path = args.api_key_file or (Path(os.environ[API_KEY_FILE_ENV]) if os.environ.get(API_KEY_FILE_ENV) else None)
    problem = ""
    if not keys and path is not None:
        try:
            lines = (line.strip() for line in path.read_text().splitlines())
            keys = tuple(line for line in lines if line and not line.startswith("#"))
            problem = "" if keys else "is empty: put the key in it, or name no key file to serve without one"
        except OSError as e:
            problem = f"cannot be read ({e.strerror})"
    if problem:
        close_engines(decoder)
        raise CliError(f"--api-key-file {path} {problem}")
    try:
        args.suffix_sharing.check(len(keys))
    except ValueError as e:
        close_engines(decoder)
        raise CliError(f"--suffix-sharing {args.suffix_sharing}: {e}") from None
    return keys


def _load_models(args: argparse.Namespace) -> tuple[BatchDecoder, str]:
    from .options import load_engines_or_fail, load_or_fail

    if args.engines is not None:
        return load_engines_or_fail(args.engines, args.dtype, args.no_draft, args.device), args.engines.resolve().name
    from .options import resolve_drafter

    drafter = None if args.no_draft else resolve_drafter(args.target, args.drafter)
    return load_or_fail(args.target, drafter, args.dtype, args.device, args.drafter_dtype), args.target.resolve().name
