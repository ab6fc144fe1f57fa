"""Option parsers and loaders shared by the command groups. Only `dflash_trt.cli` imports this."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from ..settings import (
    DEMO_DRAFTER,
    DEMO_MODELS_HINT,
    DEMO_TARGET,
    DRAFTER_DTYPE,
    DRAFTERLESS_PROPOSER,
    NO_DRAFTER,
    drafter_path,
)

if TYPE_CHECKING:
    from ..decoding import BatchDecoder


def add_proposer_arg(
    p: argparse._ActionsContainer,
    many: bool = False,
    extra: str = "",
    default: str | None = None,
    by_drafter: bool = False,
) -> None:
    """`--proposer` (one name; `many`: one or more), the same choices and words on every command: the names and
    their summaries from the registry (`decoding.proposers`); `default`: the library's (DFlash) unless given.
    `by_drafter`: the default is left None, for `resolve_proposer` to choose once it is known whether a drafter
    loaded (`default` with one, `DRAFTERLESS_PROPOSER` without)."""
    from ..decoding.proposers import DEFAULT_PROPOSER, PROPOSERS, proposers_help

    default = default or DEFAULT_PROPOSER
    said = f"{default} with a drafter, {DRAFTERLESS_PROPOSER} without" if by_drafter else default
    p.add_argument(
        "--proposer",
        nargs="+" if many else None,
        choices=PROPOSERS,
        default=None if by_drafter else [default] if many else default,
        help=f"where the drafts come from: {proposers_help()}; all lossless (default {said})" + extra,
    )


def add_drafter_arg(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--drafter",
        type=drafter_path,
        default=None,
        metavar="{DIR,none}",
        help=f"DFlash drafter checkpoint directory, published format; none: no drafter, drafts from the suffix and "
        f"ngram proposers only (no model needed). Default: the demo drafter {DEMO_DRAFTER} with the demo target, "
        f"none with any other target (the demo drafter fits the demo target only)",
    )


def resolve_drafter(target: Path, drafter: Path | str | None) -> Path | None:
    """The drafter folder to load (None: none). Not given: the demo drafter next to the demo target, else none, said
    on stderr: a drafter is trained for one target, and the demo drafter next to another target either fails on
    its hidden size or drafts for a model it never saw."""
    import sys

    if drafter == NO_DRAFTER:
        return None
    if isinstance(drafter, Path):
        return drafter
    if target.resolve() == DEMO_TARGET.resolve():
        return DEMO_DRAFTER
    if not target.is_dir():
        return None  # loading says the target is missing, in one line: a note on the drafter would only hide it
    print(
        f"no --drafter for target {target}: drafts from the {DRAFTERLESS_PROPOSER} / ngram proposers only "
        "(--drafter DIR loads a DFlash drafter; --drafter none says this without the note)",
        file=sys.stderr,
    )
    return None


def resolve_proposer(asked: str | None, has_drafter: bool, default: str) -> str:
    """`--proposer` once the engines are loaded: as asked, else `default` with a drafter and
    `DRAFTERLESS_PROPOSER` without; a proposer that uses the drafter, asked for with none loaded, is an error."""
    from ..decoding.proposers import PROPOSERS, proposer_for

    if asked is None:
        return default if has_drafter else DRAFTERLESS_PROPOSER
    if not has_drafter and proposer_for(asked).uses_drafter:
        free = [name for name in PROPOSERS if not proposer_for(name).uses_drafter]
        raise CliError(
            f"--proposer {asked} drafts with a DFlash drafter and none is loaded: use --proposer "
            f"{' or '.join(free)}, or --drafter DIR"
        )
    return asked


class CliError(Exception):
    """Printed as one line, exit code 1 (2 for usage errors via argparse)."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, with a one-line message otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def stall_factor(text: str) -> float:
    value = finite_float(text)
    if value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number > 1, got {text!r}")
    return value


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def add_model_args(
    p: argparse.ArgumentParser, dtype: bool = True, drafterless: bool = False, none_for: str = ""
) -> None:
    """--target, --drafter (`drafterless`: which may be none, and is by default for a target other than the
    demo's: `add_drafter_arg`; `none_for`: the demo drafter by default, `none` accepted for what it says, the
    command checking that its work needs no drafter) and, with `dtype`, the device flags."""
    p.add_argument(
        "--target",
        type=Path,
        default=DEMO_TARGET,
        help=f"Hugging Face target checkpoint directory (default: demo model {DEMO_TARGET})",
    )
    if drafterless:
        add_drafter_arg(p)
    else:
        p.add_argument(
            "--drafter",
            type=drafter_path if none_for else Path,
            default=DEMO_DRAFTER,
            help=f"DFlash drafter checkpoint directory, published format (default: {DEMO_DRAFTER})"
            + (f"; none: no drafter, {none_for}" if none_for else ""),
        )
    if dtype:  # commands that build engines choose their own precision
        add_device_args(p)


DTYPE_CHOICES = ["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]


def add_device_args(p: argparse._ActionsContainer) -> None:  # a parser or an argument group
    p.add_argument(
        "--device",
        default="cpu",
        metavar="{cpu,cuda,cuda:N}",
        help="where the PyTorch engines run (default cpu); cuda needs a CUDA build of torch and a GPU",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="float32",
        help="weights dtype for the PyTorch engines (default float32, right for CPU; on a GPU use "
        "bfloat16 / bf16 or float16 / fp16)",
    )
    p.add_argument(
        "--drafter-dtype",
        choices=["auto", *DTYPE_CHOICES],
        default=DRAFTER_DTYPE,
        help="dtype of the PyTorch drafter (default: --dtype, for every command, so that a seeded request at a "
        "fixed block size gives the same text from generate, bench, serve and Triton). auto: bfloat16 on a CPU "
        "with AMX or AVX512-BF16 next to a float32 target (a serving batch's drafter passes run faster), else "
        "--dtype; it changes seeded sampled text, as any other drafter dtype does. Greedy output is unchanged "
        "either way: the target verifies every drafted token in --dtype. Responses name the dtype used",
    )


def load_or_fail(
    target: Path, drafter: Path | None, dtype: str, device: str = "cpu", drafter_dtype: str | None = None
) -> BatchDecoder:
    from ..config import ConfigError
    from ..loading import load_decoder

    if not target.is_dir():
        hint = f" (the demo models are made by `{DEMO_MODELS_HINT}`)" if target == DEMO_TARGET else ""
        raise CliError(f"target directory not found: {target}{hint}")
    if drafter is not None and not drafter.is_dir():
        raise CliError(
            f"drafter directory not found: {drafter} (--drafter none: suffix / ngram drafts without a drafter; "
            "--no-draft: the target alone)"
        )
    try:
        return load_decoder(target, drafter, dtype, device, drafter_dtype)
    except (ConfigError, FileNotFoundError, ValueError, OSError) as e:
        raise CliError(str(e)) from None


def load_engines_or_fail(engines: Path, dtype: str, no_draft: bool, device: str = "cpu") -> BatchDecoder:
    from ..config import ConfigError
    from ..loading import load_decoder_from_engines
    from ..runtime.base import EngineUnavailable

    try:  # --no-draft: the drafter is not even loaded (a TensorRT drafter cannot load on a CPU machine)
        return load_decoder_from_engines(engines, dtype, draft=not no_draft, device=device)
    except (ConfigError, EngineUnavailable, FileNotFoundError, KeyError, ValueError, OSError) as e:
        raise CliError(f"engines {engines}: {e}") from None


class TensorParallelRank(Protocol):
    """A target engine that runs on every rank of `mpirun -n tp` (TensorRT-LLM's)."""

    is_leader: bool

    def serve_worker(self) -> None: ...


def serve_worker_rank(decoder: BatchDecoder) -> bool:
    """Under `mpirun -n tp` with a tp > 1 TensorRT-LLM target, every rank loads the engine but only the leader
    runs the loop (and HTTP). On another rank: keep the engine's tensor-parallel work going until the leader
    shuts down, then return True (the caller exits). False on the leader and for every other backend."""
    import json
    import sys

    target = decoder.target
    if getattr(target, "is_leader", True):
        return False
    print(
        json.dumps({"event": "tensor_parallel_worker", "detail": "not the leader rank: serving the engine only"}),
        file=sys.stderr,
    )
    cast(TensorParallelRank, target).serve_worker()  # only a tensor-parallel target has a non-leader rank
    return True


def close_engines(decoder: BatchDecoder) -> None:
    """The leader's shutdown releases the other ranks (TensorRT-LLM executorImpl.cpp, Executor::Impl::shutdown)."""
    close = getattr(decoder.target, "close", None)
    if close is not None:
        close()
