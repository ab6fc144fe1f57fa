"""`dflash-trt generate`: one continuation, printed as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .options import (
    CliError,
    add_model_args,
    add_proposer_arg,
    close_engines,
    finite_float,
    load_engines_or_fail,
    load_or_fail,
    non_negative_int,
    positive_int,
    resolve_drafter,
    resolve_proposer,
    serve_worker_rank,
    token_ids,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser(
        "generate",
        help="generate a continuation with draft-and-verify (or the target alone)",
        description="Generate a continuation of a prompt. Greedy output is token-for-token the target's own; "
        "sampled output has the target's distribution.",
    )
    add_model_args(g, drafterless=True)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the target directory)")
    src.add_argument("--input-ids", type=token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="sample among the k likeliest tokens; 0 = off")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    g.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="tokens per draft-and-verify round, up to the drafter's trained size (default: trained size)",
    )
    g.add_argument(
        "--acceptance",
        choices=["rejection", "exact-match"],
        default="rejection",
        help="sampling acceptance rule: speculative rejection sampling with draft probabilities "
        "(default) or the reference's exact match with greedy drafts; both are lossless",
    )
    add_proposer_arg(g, by_drafter=True)
    g.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable); the text ends before it"
    )
    g.add_argument(
        "--no-draft",
        action="store_true",
        help="run the target alone, no drafts from any proposer (the autoregressive baseline)",
    )
    g.add_argument(
        "--no-heal-prompt",
        action="store_true",
        help="keep a --prompt's last token as encoded; by default, when the tokenizer could have merged it with "
        "what follows (a prompt ending in a newline), it is backed up and the first generated token must start "
        "with its text (token healing; --input-ids are never healed)",
    )
    g.add_argument(
        "--engines",
        type=Path,
        default=None,
        metavar="DIR",
        help="load the engines `make engines` built (DIR/manifest.json) instead of --target/--drafter",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: token_ids, text, finish_reason, stats, drafter_dtype (the dtype the drafter "
        "computed in, null without one: seeded sampled text depends on it)",
    )
    g.add_argument(
        "--trace",
        action="store_true",
        help='with --json, add "trace": one object per verify round, {"block_size": B, "drafted": [the B-1 '
        'drafted token ids], "accepted": n, "proposer": the proposer that drafted, or "none"}, to see where the target rejects the drafts '
        "(B = 1: the target alone)",
    )
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from ..decoding import GenerationConfig, InputError, SamplingParams
    from ..decoding.proposers import DEFAULT_PROPOSER

    if args.trace and not args.json:
        raise CliError("--trace adds the rounds to the JSON output: pass --json too")
    if args.engines is not None:
        decoder = load_engines_or_fail(args.engines, args.dtype, args.no_draft, args.device)
    else:
        drafter = None if args.no_draft else resolve_drafter(args.target, args.drafter)
        decoder = load_or_fail(args.target, drafter, args.dtype, args.device, args.drafter_dtype)
    if serve_worker_rank(decoder):
        return 0
    try:
        proposer = resolve_proposer(args.proposer, decoder.drafter is not None or args.no_draft, DEFAULT_PROPOSER)
    except CliError:
        close_engines(decoder)
        raise
    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        prompt = decoder.encode(args.prompt) if args.prompt is not None else args.input_ids
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            block_size=1 if args.no_draft else args.block_size,  # block 1: no proposer drafts
            acceptance=args.acceptance,
            proposer=proposer,
            stop_token_ids=decoder.default_stop_ids(),
            stop_strings=tuple(args.stop),
            heal_prompt=args.prompt is not None and not args.no_heal_prompt,
        )
        [result] = decoder.generate([prompt], config)
    except (InputError, ValueError) as e:
        raise CliError(str(e)) from None
    finally:
        close_engines(decoder)
    if args.json:
        out: dict[str, object] = {
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
            "drafter_dtype": None if decoder.drafter is None else decoder.drafter.dtype,
        }
        if args.trace:
            out["trace"] = result.stats.trace()
        print(json.dumps(out))
    else:
        print(result.text if result.text is not None else ",".join(map(str, result.token_ids)))
        s = result.stats
        print(
            f"[{s.new_tokens} tokens, {s.rounds} rounds, tau {s.mean_acceptance_length:.2f}, "
            f"{s.tokens_per_second:.1f} tok/s, block {s.block_size}, finish: {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0
