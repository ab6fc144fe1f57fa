"""`dflash-trt` command line. Subcommand names and flags are a public interface."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_DIR = Path(os.environ.get("DFLASH_TRT_MODELS", REPO_ROOT / "models"))
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFTER = DEMO_DIR / "drafter"
DEMO_MODELS_HINT = ".venv/bin/python scripts/make_demo_models.py"  # what builds DEMO_DIR's models


# Each command group lives beside its code and registers itself: `register(subparsers)`.
# Keep those modules light at import time (import torch etc. inside the command function).
COMMAND_MODULES: tuple[str, ...] = ("dflash_trt.server.commands", "dflash_trt.build.commands", "dflash_trt.train.commands",
                                   "dflash_trt.bench.commands", "dflash_trt.triton.commands")


class CliError(Exception):
    """Printed as one line, exit code 1 (2 for usage errors via argparse)."""


def _int_at_least(minimum: int):
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


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _add_model_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--target", type=Path, default=DEMO_TARGET,
                   help=f"Hugging Face target checkpoint directory (default: demo model {DEMO_TARGET})")
    p.add_argument("--drafter", type=Path, default=DEMO_DRAFTER,
                   help=f"DFlash drafter checkpoint directory, published format (default: {DEMO_DRAFTER})")
    if dtype:  # commands that build engines choose their own precision
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                       help="weights dtype for the PyTorch engines (default: float32, right for CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-trt",
        description="DFlash block-diffusion speculative decoding: one drafter pass proposes a block, "
        "the target verifies it in one pass; output equals the target's own.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate",
        help="generate a continuation with draft-and-verify (or the target alone)",
        description="Generate a continuation of a prompt. Greedy output is token-for-token the target's own; "
        "sampled output has the target's distribution.",
    )
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the target directory)")
    src.add_argument("--input-ids", type=_token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=_float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=_float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--top-k", type=_non_negative_int, default=0, help="sample among the k likeliest tokens; 0 = off")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    g.add_argument("--block-size", type=_positive_int, default=None,
                   help="tokens per draft-and-verify round, up to the drafter's trained size (default: trained size)")
    g.add_argument("--acceptance", choices=["rejection", "exact-match"], default="rejection",
                   help="sampling acceptance rule: speculative rejection sampling with draft probabilities "
                   "(default) or the reference's exact match with greedy drafts; both are lossless")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the text ends before it")
    g.add_argument("--no-draft", action="store_true", help="run the target alone (autoregressive baseline)")
    g.add_argument("--engines", type=Path, default=None, metavar="DIR",
                   help="load the engines `make engines` built (DIR/manifest.json) instead of --target/--drafter")
    g.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, finish_reason, stats")
    g.set_defaults(func=cmd_generate)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from .spec import GenerationConfig, InputError, SamplingParams

    if args.engines is not None:
        decoder = _load_engines(args.engines, args.dtype, args.no_draft)
    else:
        decoder = _load(args.target, None if args.no_draft else args.drafter, args.dtype)
    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        prompt = decoder.encode(args.prompt) if args.prompt is not None else args.input_ids
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            block_size=None if args.no_draft else args.block_size,
            acceptance=args.acceptance,
            stop_token_ids=decoder.default_stop_ids(),
            stop_strings=tuple(args.stop),
        )
        result = decoder.generate(prompt, config)
    except (InputError, ValueError) as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps({
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
        }))
    else:
        print(result.text if result.text is not None else ",".join(map(str, result.token_ids)))
        s = result.stats
        print(
            f"[{s.new_tokens} tokens, {s.rounds} rounds, tau {s.mean_acceptance_length:.2f}, "
            f"{s.tokens_per_second:.1f} tok/s, block {s.block_size}, finish: {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _load(target: Path, drafter: Path | None, dtype: str):
    from .config import ConfigError
    from .loading import load_decoder

    if not target.is_dir():
        hint = f" (the demo models are made by `{DEMO_MODELS_HINT}`)" if target == DEMO_TARGET else ""
        raise CliError(f"target directory not found: {target}{hint}")
    if drafter is not None and not drafter.is_dir():
        raise CliError(f"drafter directory not found: {drafter} (use --no-draft to run the target alone)")
    try:
        return load_decoder(target, drafter, dtype)
    except (ConfigError, FileNotFoundError, ValueError, OSError) as e:
        raise CliError(str(e)) from None


def _load_engines(engines: Path, dtype: str, no_draft: bool):
    from .config import ConfigError
    from .loading import load_decoder_from_engines
    from .runtime.base import EngineUnavailable

    try:  # --no-draft: the drafter is not even loaded (a TensorRT drafter cannot load on a CPU machine)
        return load_decoder_from_engines(engines, dtype, draft=not no_draft)
    except (ConfigError, EngineUnavailable, FileNotFoundError, KeyError, ValueError, OSError) as e:
        raise CliError(f"engines {engines}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"dflash-trt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
