"""CLI: `triton-repo` (write a model repository), `triton-serve` (run tritonserver locally), `triton-client`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

from ..settings import DEMO_DRAFTER, DEMO_TARGET


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..settings import drafter_path

    p = sub.add_parser(
        "triton-repo",
        help="write a Triton model repository (ensemble + BLS draft-and-verify)",
        description="Write a complete Triton model repository: preprocessing, dflash_bls (decoupled "
        "BLS loop), postprocessing, the dflash / dflash_sync ensembles, dflash_drafter and "
        "dflash_target. The repository is validated before the command returns.",
    )
    src = p.add_argument_group("source (one of; default: the demo models)")
    src.add_argument(
        "--engines",
        type=Path,
        metavar="DIR",
        help="engines built by `make engines` (DIR/manifest.json names the backends to serve)",
    )
    src.add_argument(
        "--target",
        type=Path,
        metavar="DIR",
        help=f"target checkpoint with its tokenizer (default: demo model {DEMO_TARGET})",
    )
    src.add_argument(
        "--drafter",
        type=drafter_path,
        metavar="DIR",
        help=f"DFlash drafter checkpoint, exported to ONNX here (default: {DEMO_DRAFTER}). The repository's BLS "
        "loop drafts with it: `none` is refused (a target without a drafter is served by `dflash-trt serve "
        "--drafter none`, with suffix and ngram drafts)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="REPO", help="folder to write the repository into")
    p.add_argument("--force", action="store_true", help="replace REPO if it exists")
    p.add_argument(
        "--max-batch-size", type=int, default=8, help="max batch of the ensembles and text models (default 8)"
    )
    p.add_argument(
        "--default-max-tokens", type=int, default=64, help="max_tokens when a request gives none (default 64)"
    )
    p.add_argument("--chat-template", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per model instance (0: library default)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device of the PyTorch target (default cpu; cuda is written for but never run in this project: no GPU "
        "here); a TensorRT-LLM target (--engines) runs its output layer on its executor's GPU whatever this says",
    )
    p.add_argument(
        "--symlink-weights",
        action="store_true",
        help="link checkpoints and drafter graphs instead of copying them (saves disk; the repository "
        "then only works on this machine)",
    )
    p.set_defaults(func=cmd_repo)

    p = sub.add_parser(
        "triton-serve",
        help="run tritonserver (bundled by nvidia-pytriton) on a model repository",
        description="Start a real tritonserver on loopback from the server venv (make triton-env) "
        "and keep it running until Ctrl-C. For production use NVIDIA's Triton container.",
    )
    p.add_argument("--repo", type=Path, required=True, help="model repository (dflash-trt triton-repo)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    p.add_argument("--metrics-port", type=int, default=8002, help="metrics port (default 8002)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--venv",
        type=Path,
        default=None,
        help="server venv with nvidia-pytriton (default .venv-triton, or $DFLASH_TRITON_VENV)",
    )
    p.add_argument("--log", type=Path, default=None, help="server log file (default beside the repository)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "triton-client",
        help="generate through a Triton server's dflash ensemble",
        description="Reference tritonclient caller. HTTP and unary gRPC use dflash_sync; --stream "
        "(gRPC) uses the decoupled dflash ensemble and prints each round as it arrives.",
    )
    p.add_argument(
        "--url", default=None, help="server address host:port (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)"
    )
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="default grpc")
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeatable: several prompts go as one batch)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default: the repository's)")
    p.add_argument("--temperature", type=float, default=None, help="0 (default) is greedy")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stream", action="store_true", help="stream one response per verified round (gRPC only)")
    p.add_argument("--json", action="store_true", help="print one JSON object: texts, finish_reasons, responses")
    p.set_defaults(func=cmd_client)


def cmd_repo(args: argparse.Namespace) -> int:
    from .. import settings
    from ..builders.triton_repo import RepoOptions, write_repository
    from ..settings import NO_DRAFTER
    from ..triton.config import ConfigError
    from .options import CliError

    if args.engines is not None and (args.target or args.drafter):
        raise CliError("--engines replaces --target/--drafter: give one or the other")
    if args.drafter == NO_DRAFTER:
        raise CliError(
            "--drafter none: the Triton repository's BLS loop drafts with the DFlash drafter it exports and has no "
            "drafterless form; serve a target without a drafter with `dflash-trt serve --target DIR --drafter none` "
            "(suffix and ngram drafts)"
        )
    if args.engines is None:  # checkpoints, the demo models by default (as every other command)
        args.target = args.target or settings.DEMO_TARGET
        args.drafter = args.drafter or settings.DEMO_DRAFTER
        for role, path, demo in (
            ("target", args.target, settings.DEMO_TARGET),
            ("drafter", args.drafter, settings.DEMO_DRAFTER),
        ):
            if not path.is_dir():
                hint = f" (the demo models are made by `{settings.DEMO_MODELS_HINT}`)" if path == demo else ""
                raise CliError(f"{role} directory not found: {path}{hint}")
    options = RepoOptions(
        args.max_batch_size,
        args.default_max_tokens,
        args.chat_template,
        args.threads,
        args.device,
        args.symlink_weights,
    )
    try:
        out = write_repository(
            args.out,
            engines=args.engines,
            target=args.target,
            drafter=args.drafter,
            options=options,
            overwrite=args.force,
        )
    except (ConfigError, FileNotFoundError, FileExistsError, KeyError, ValueError, OSError) as e:
        raise CliError(str(e)) from None
    print(f"wrote Triton model repository {out} (ensembles: dflash [streaming, gRPC], dflash_sync [HTTP/gRPC])")
    return 0


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt  # so `finally` stops the server (the default SIGTERM action would orphan it)


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import time

    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    from ..triton.config import validate_repository
    from ..triton.server import TritonServer, TritonUnavailable
    from .options import CliError

    errors = validate_repository(args.repo)
    if errors:
        raise CliError("invalid model repository:\n  " + "\n  ".join(errors))
    try:
        server = TritonServer(
            args.repo,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            venv=args.venv,
            log_path=args.log,
            host=args.host,
        )
    except TritonUnavailable as e:
        raise CliError(str(e)) from None
    try:
        server.start()
        print(
            f"tritonserver ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics "
            f"{args.host}:{server.metrics_port}; log {server.log_path}. Ctrl-C stops it.",
            flush=True,
        )
        while server.alive():
            time.sleep(1)
        print(f"tritonserver exited:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except TritonUnavailable as e:
        raise CliError(str(e)) from None
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def cmd_client(args: argparse.Namespace) -> int:
    from ..triton.client import generate
    from .options import CliError

    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    if args.stream and args.protocol != "grpc":
        raise CliError("--stream needs --protocol grpc (Triton's HTTP endpoint refuses decoupled models)")
    show = None
    if args.stream and not args.json and len(args.prompt) == 1:
        show = lambda chunk: print(chunk[0], end="", flush=True)  # noqa: E731
    try:
        reply = generate(
            url,
            args.prompt,
            protocol=args.protocol,
            stream=args.stream,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            on_chunk=show,
        )
    except Exception as e:  # noqa: BLE001 - tritonclient raises its own exception types; show the message
        message_of = getattr(e, "message", None)
        message = str(message_of()) if callable(message_of) else str(e)
        raise CliError(f"{url}: {message}") from None
    if args.json:
        print(
            json.dumps({"texts": reply.texts, "finish_reasons": reply.finish_reasons, "responses": len(reply.chunks)})
        )
    elif show:
        print()
    else:
        for text in reply.texts:
            print(text)
    return 0
