"""`dflash-trt eval` (`make eval`): acceptance and speedup of DFlash on held-out prompts, against the target alone.

For each prompt it runs the target alone and DFlash, in alternating order, checks the outputs are
identical (greedy), and records tau (mean tokens per round, bonus included) and the time ratio.
Prompts: prefixes of standard-library files the demo models never saw (default); `--prompt-set
functions`: held-out functions cut after their docstring, each completion checked as code
(`dflash_trt.bench.quality`: the body parses with two or more real statements); `bodies`, `in-file`,
`rewrite`, `long`: the proposer workloads cut from installed packages (`dflash_trt.bench.workloads`; the first
three checked as code the same way, long wants --max-new-tokens 512); or a prompt file
from `dflash_trt.train.prompts` (--prompt-file: chat prompts through the chat template, code prompts
raw, generation stopping at the tokenizer's end tokens), plus --long-prompts N prompts of about
--long-tokens tokens (held-out file prefixes) to check acceptance holds on long contexts. At
--temperature > 0 both runs sample (exact rejection-sampling rule), so only tau and time are compared.
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dflash_trt.bench.prompts import held_out_code_prompts, held_out_function_prompts
from dflash_trt.bench.quality import check_body
from dflash_trt.bench.workloads import WORKLOADS
from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.decoding.sampling import SamplingParams
from dflash_trt.settings import DRAFTER_DTYPE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts (default 20)")
    p.add_argument(
        "--prompt-set",
        choices=("prefixes", "functions", *WORKLOADS),
        default="prefixes",
        help="prefixes: the first lines of held-out files; functions: held-out functions' signature and "
        "docstring, each completion checked as code; bodies / in-file / rewrite / long: from installed packages "
        "(dflash_trt.bench.workloads) (default prefixes)",
    )
    p.add_argument(
        "--server-defaults",
        action="store_true",
        help="DFlash as `dflash-trt serve` runs it by default: adaptive block sizes from a cost model measured "
        "at start-up, the default drafter dtype (--block-size and --drafter-dtype then do not apply)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's trained size")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--prompt-file",
        type=Path,
        default=None,
        help="JSONL prompt set (dflash_trt.train.prompts, e.g. .cache/smollm2-drafter/prompts-held-out.jsonl); "
        "the first --prompts of it",
    )
    p.add_argument("--long-prompts", type=int, default=0, help="also N long held-out code prompts (default 0)")
    p.add_argument("--long-tokens", type=int, default=1000, help="tokens per long prompt (default 1000)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs compared)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights and activations of both models (default float32; bfloat16 is fast on CPUs with AMX)",
    )
    p.add_argument(
        "--drafter-dtype",
        default=None,
        help="the drafter's dtype (default --dtype, as every `dflash-trt` command; auto: bfloat16 on a CPU with "
        "AMX or AVX512-BF16 next to a float32 target; see dflash_trt.loading.drafter_dtype)",
    )
    p.add_argument(
        "--out", type=Path, default=Path("results/acceptance.json"), help="the JSON written (default %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    """Exit 1 when a greedy output differs from the target alone's."""
    from dflash_trt.loading import load_decoder

    if args.threads:
        torch.set_num_threads(args.threads)

    drafter_dtype = DRAFTER_DTYPE if args.server_defaults else args.drafter_dtype
    decoder = load_decoder(args.target, args.drafter, dtype=args.dtype, drafter_dtype_name=drafter_dtype)
    # the PyTorch drafter engine load_decoder builds
    drafter: Any = decoder.drafter
    if args.server_defaults:
        from dflash_trt.server.context import ServerSettings, batch_decoder

        decoder, args.block_size = batch_decoder(decoder, ServerSettings()), None
    prompts = build_prompts(decoder, args)  # (kind, token ids, function head or None)
    greedy = args.temperature == 0
    stops: tuple[int, ...] = ()
    if args.prompt_file is not None:
        from dflash_trt.train.regen import stop_token_ids

        stops = tuple(stop_token_ids(decoder.tokenizer))
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    cfg_spec = GenerationConfig(
        max_new_tokens=args.max_new_tokens, block_size=args.block_size, sampling=sampling, stop_token_ids=stops
    )
    cfg_base = GenerationConfig(
        max_new_tokens=args.max_new_tokens, block_size=1, sampling=sampling, stop_token_ids=stops
    )
    decoder.generate([prompts[0][1]], cfg_spec)  # warm-up (allocations, kernels)

    rows: list[dict[str, Any]] = []
    mismatches = 0
    for i, (kind, ids, head) in enumerate(prompts):
        order = [("base", cfg_base), ("dflash", cfg_spec)]
        if i % 2:
            order.reverse()  # interleave so drift on a shared machine hits both alike
        runs = {}
        for name, cfg in order:
            t = time.perf_counter()
            [runs[name]] = decoder.generate([ids], cfg)
            runs[name].stats.total_time_s = time.perf_counter() - t
        same = runs["base"].token_ids == runs["dflash"].token_ids if greedy else None
        mismatches += same is False
        s = runs["dflash"].stats
        rows.append(
            {
                "prompt": i,
                "kind": kind,
                "prompt_tokens": len(ids),
                "new_tokens": s.new_tokens,
                "base_new_tokens": runs["base"].stats.new_tokens,
                "identical": same,
                "tau": round(s.mean_acceptance_length, 3),
                "rounds": s.rounds,
                "base_s": round(runs["base"].stats.total_time_s, 4),
                "dflash_s": round(s.total_time_s, 4),
                # per-token time ratio: sampled runs (and EOS stops) may produce different lengths
                "speedup": round(
                    (runs["base"].stats.total_time_s / max(1, runs["base"].stats.new_tokens))
                    / (s.total_time_s / max(1, s.new_tokens)),
                    3,
                ),
                "draft_s": round(s.draft_time_s, 4),
                "verify_s": round(s.verify_time_s, 4),
            }
        )
        if head is not None:  # judged on the target's own text (DFlash's is the same at T = 0)
            text = decoder.tokenizer.decode(runs["base"].token_ids)
            check = check_body(head, text)
            rows[-1].update(parses=check.parses, statements=check.statements, is_code=check.is_code, completion=text)
        print(
            f"prompt {i:2d}: tau {rows[-1]['tau']:.2f}  speedup {rows[-1]['speedup']:.2f}x  identical {same}",
            file=sys.stderr,
        )

    taus = [r["tau"] for r in rows]
    speedups = [r["speedup"] for r in rows]
    summary = {
        "prompts": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "block_size": "adaptive" if args.server_defaults else args.block_size or drafter.block_size,
        "mean_tau": round(statistics.mean(taus), 3),
        "min_tau": min(taus),
        "max_tau": max(taus),
        "median_speedup": round(statistics.median(speedups), 3),
        "speedup_p10_p90": [
            round(sorted(speedups)[len(speedups) // 10], 3),
            round(sorted(speedups)[(9 * len(speedups)) // 10], 3),
        ],
        "total_time_speedup": round(sum(r["base_s"] for r in rows) / sum(r["dflash_s"] for r in rows), 3),
        # functions: the share of completions whose body parses with two or more real statements
        "code_bodies": round(statistics.mean(r["is_code"] for r in rows if "is_code" in r), 3)
        if any("is_code" in r for r in rows)
        else None,
        "server_defaults": args.server_defaults,
        "all_identical": (mismatches == 0) if greedy else None,
        "threads": torch.get_num_threads(),
        "temperature": args.temperature,
        "dtype": args.dtype,
        "drafter_dtype": drafter.dtype,
        "by_kind": {
            k: {
                "prompts": len(rs),
                "mean_tau": round(statistics.mean(r["tau"] for r in rs), 3),
                "median_speedup": round(statistics.median(r["speedup"] for r in rs), 3),
            }
            for k in sorted({r["kind"] for r in rows})
            for rs in [[r for r in rows if r["kind"] == k]]
        },
    }
    print(
        "| prompt | kind | prompt tokens | new tokens | tau | speedup | identical | code body |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        body = "-" if "is_code" not in r else f"{'yes' if r['is_code'] else 'no'} ({r['statements']} statements)"
        print(
            f"| {r['prompt']} | {r['kind']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['tau']:.2f} | "
            f"{r['speedup']:.2f}x | {r['identical']} | {body} |"
        )
    for k, v in summary["by_kind"].items():
        print(f"{k}: {v['prompts']} prompts, mean tau {v['mean_tau']:.2f}, median speedup {v['median_speedup']:.2f}x")
    print(
        f"\nmean tau {summary['mean_tau']:.2f}, median speedup {summary['median_speedup']:.2f}x "
        f"(total-time ratio {summary['total_time_speedup']:.2f}x), identical outputs: {summary['all_identical']}"
        + ("" if summary["code_bodies"] is None else f", code bodies {100 * summary['code_bodies']:.0f} %")
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "per_prompt": rows}, indent=1))
    return 0 if mismatches == 0 else 1


def build_prompts(decoder: BatchDecoder, args: argparse.Namespace) -> list[tuple[str, list[int], str | None]]:
    """(kind, token ids, the function head for prompts whose completion is checked as code)."""
    tok = decoder.tokenizer
    prompts: list[tuple[str, list[int], str | None]]
    if args.prompt_file is not None:
        from dflash_trt.train.prompts import encode_prompt, load_prompts

        chosen = load_prompts(args.prompt_file)[: args.prompts]
        prompts = [(p.kind, encode_prompt(tok, p), None) for p in chosen]
    elif args.prompt_set == "functions":
        prompts = [("function", decoder.encode(f.text), f.text) for f in held_out_function_prompts(args.prompts)]
    elif args.prompt_set in WORKLOADS:
        w = WORKLOADS[args.prompt_set](args.prompts)
        # the function whose body is asked for is the prompt's last part (after the context or earlier version)
        prompts = [(w.name, decoder.encode(t), None if w.name == "long" else t.split("\n\n\n")[-1]) for t in w.prompts]
    else:
        prompts = [("code", decoder.encode(t), None) for t in held_out_code_prompts(args.prompts)]
    if args.long_prompts:
        texts = held_out_code_prompts(args.long_prompts, prefix_chars=args.long_tokens * 6)
        for text in texts:
            ids = decoder.encode(text)
            if len(ids) < args.long_tokens * 0.8:
                continue  # a file with very long tokens: not long enough
            prompts.append(("long", ids[: args.long_tokens], None))
    return prompts
