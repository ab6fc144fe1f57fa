"""Proposers side by side: the target alone, DFlash, suffix drafting, the hybrid of the two and Hugging
Face's prompt lookup, on the workloads of `bench.workloads`, in one process and one run.

For every prompt of every workload each method runs once, greedy, in an order rotated from one prompt to the next
(so that the shared machine's drift hits them alike). A method's output must be the target alone's token for
token: a difference that is not a numerical tie (a logit gap over `TIE` at the first differing position) fails
the run. Per workload and method: tokens/s over all its prompts (new tokens / seconds), the ratio
to the target alone and to DFlash, and tau (tokens per target pass, bonus included). The decoder is the server's
(`dflash-trt serve` defaults: adaptive block sizes from a cost model measured at start-up), so each proposer is
what a request that names it gets. Prints Markdown tables; writes JSON.

    dflash-trt bench proposers --out results/proposers/results.json
    dflash-trt bench proposers --workloads rewrite long --prompts 4
    dflash-trt bench proposers --target .cache/models/smollm2-135m-instruct --drafter none \
        --workloads chat-rewrite revise extract prose --prompts 3

A target without a DFlash drafter (`--drafter none`: any model a user has) runs the proposers that need none
(suffix, ngram) against the target alone and prompt lookup; the chat workloads (`workloads.CHAT_WORKLOADS`) are
rendered with the target's chat template.

Proposers other than DFlash run where the library has them (`GenerationConfig.proposer`); without it the table
holds the target, DFlash and prompt lookup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..decoding.proposers import DEFAULT_PROPOSER, DFLASH, PROPOSERS, proposer_for
from ..sim.suffix import rounds_of
from .methods import ForwardTimer, hf_method, target_model
from .workloads import CHAT_WORKLOADS, WORKLOADS, Workload

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..decoding import BatchDecoder

TIE = 1e-3  # a logit gap at or under this at the first difference: two code paths breaking a tie apart
# the bars: (method, against, workloads, at least this ratio of tokens/s)
BARS = (
    ("hybrid", "dflash", ("random", "prose-text"), 0.98),
    ("hybrid", "dflash", ("rewrite", "long"), 1.3),
    ("hybrid", "prompt-lookup", tuple(WORKLOADS), 1.0),
    ("suffix", "target", ("prose",), 0.98),
    ("ngram", "target", ("prose",), 0.98),
    ("suffix", "target", ("chat-rewrite", "revise", "extract"), 1.5),
)
ALL_WORKLOADS = {**WORKLOADS, **CHAT_WORKLOADS}


def supported_proposers() -> tuple[str, ...]:
    """The proposers a request can name in this library (DFlash alone before `GenerationConfig.proposer`)."""
    from ..decoding import GenerationConfig

    return PROPOSERS if "proposer" in {f.name for f in dataclasses.fields(GenerationConfig)} else (DEFAULT_PROPOSER,)


def decoder_method(decoder: BatchDecoder, proposer: str | None) -> Callable[[list[int], int], dict[str, Any]]:
    """One greedy request through the decoder: the target alone (None) or with `proposer`."""
    from ..decoding import GenerationConfig

    def run(ids: list[int], max_new: int) -> dict[str, Any]:
        extra: dict[str, Any] = {"block_size": 1} if proposer is None else {}
        if proposer is not None and "proposer" in {f.name for f in dataclasses.fields(GenerationConfig)}:
            extra["proposer"] = proposer
        decoder.forget_finished_outputs()  # no run reads another run's output of the same prompt
        t0 = time.perf_counter()
        [result] = decoder.generate([ids], GenerationConfig(max_new_tokens=max_new, **extra))
        seconds = time.perf_counter() - t0
        s = result.stats
        out = {"tokens": result.token_ids, "seconds": seconds, "tau": s.mean_acceptance_length if s.rounds else 1.0}
        if proposer is not None and proposer_for(proposer).keeps_suffix:  # what the simulator can replay
            out["rounds"] = rounds_of(s.trace())
        return out

    return run


def lookup_method(decoder: BatchDecoder) -> Callable[[list[int], int], dict[str, Any]]:
    """Hugging Face prompt lookup on the decoder's own target module (its defaults in `dflash-trt bench`)."""
    model = target_model(decoder)
    model.generation_config.eos_token_id = None  # fixed-length runs, as the decoder's (no stop tokens)
    timer = ForwardTimer(model)
    pad = decoder.tokenizer.pad_token_id if decoder.tokenizer.pad_token_id is not None else 0
    method = hf_method(
        "prompt-lookup", "prompt-lookup", model, timer, pad, prompt_lookup_num_tokens=10, max_matching_ngram_size=2
    )

    def run(ids: list[int], max_new: int) -> dict[str, Any]:
        r = method.run(ids, max_new, 0.0, 0)
        tau = sum(r.acceptance_lengths) / max(1, len(r.acceptance_lengths))
        return {"tokens": r.token_ids, "seconds": r.seconds, "tau": tau}

    return run


def tie_gap(decoder: BatchDecoder, ids: list[int], reference: list[int], other: list[int]) -> float:
    """The target's logit gap at the first position two outputs differ (inf: one is a prefix of the other)."""
    from .measure import divergence_margin

    return divergence_margin(target_model(decoder), ids, reference, other)[1]


def run_workload(
    decoder: BatchDecoder, methods: dict[str, Callable[[list[int], int], dict[str, Any]]], w: Workload
) -> list[dict[str, Any]]:
    """Every method on every prompt of `w`, rotated; one record per (prompt, method)."""
    names, records = list(methods), []
    for i, (text, label) in enumerate(zip(w.prompts, w.labels)):
        ids = prompt_ids(decoder, w, i)
        order = names[i % len(names) :] + names[: i % len(names)]
        runs = {name: methods[name](ids, w.max_new_tokens) for name in order}
        reference = runs["target"]["tokens"]
        for name in names:
            r = runs[name]
            same = r["tokens"] == reference
            records.append(
                {
                    "workload": w.name,
                    "prompt": i,
                    "source": label,
                    "prompt_tokens": len(ids),
                    "method": name,
                    "new_tokens": len(r["tokens"]),
                    "seconds": round(r["seconds"], 4),
                    "tau": round(r["tau"], 3),
                    "identical": same,
                    "tie": None if same else tie_gap(decoder, ids, reference, r["tokens"]) <= TIE,
                    **({"rounds": r["rounds"]} if "rounds" in r else {}),
                }
            )
        print(f"{w.name} {i}: " + ", ".join(f"{n} {runs[n]['seconds']:.2f}s" for n in names), file=sys.stderr)
    return records


def prompt_ids(decoder: BatchDecoder, w: Workload, i: int) -> list[int]:
    """Prompt i of `w` as token ids: a chat workload's conversation through the target's chat template."""
    if not w.messages:
        return decoder.encode(w.prompts[i])
    if getattr(decoder.tokenizer, "chat_template", None) is None:
        raise SystemExit(f"workload {w.name!r} is a chat: the target's tokenizer has no chat template")
    text = decoder.tokenizer.apply_chat_template(w.messages[i], add_generation_prompt=True, tokenize=False)
    return decoder.encode(str(text))


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per workload and method: tokens/s over its prompts, tau (mean over prompts), ratios to target / DFlash."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in records:
        cell = out.setdefault(r["workload"], {}).setdefault(r["method"], {"tokens": 0, "seconds": 0.0, "taus": 0.0})
        cell["tokens"] += r["new_tokens"]
        cell["seconds"] += r["seconds"]
        cell["taus"] += r["tau"]
    prompts = {w: len({r["prompt"] for r in records if r["workload"] == w}) for w in out}
    for w, cells in out.items():
        for c in cells.values():
            c["tokens_per_s"] = round(c["tokens"] / c["seconds"], 2)
            c["tau"] = round(c.pop("taus") / prompts[w], 3)
        for c in cells.values():
            c["vs_target"] = round(c["tokens_per_s"] / cells["target"]["tokens_per_s"], 3)
            if DFLASH.name in cells:
                c["vs_dflash"] = round(c["tokens_per_s"] / cells[DFLASH.name]["tokens_per_s"], 3)
    return out


def checks(summary: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """The issue's bars that this run's methods and workloads can be held to."""
    found = []
    for method, against, workloads, bar in BARS:
        for w in workloads:
            cells = summary.get(w, {})
            if method in cells and against in cells:
                ratio = cells[method]["tokens_per_s"] / cells[against]["tokens_per_s"]
                found.append(
                    {"check": f"{w}: {method} >= {bar}x {against}", "ratio": round(ratio, 3), "ok": ratio >= bar}
                )
    return found


def tables(summary: dict[str, dict[str, dict[str, float]]], found: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | method | tokens/s | x target | x DFlash | tau |",
        "|---|---|---|---|---|---|",
    ]
    for w, cells in summary.items():
        for m, c in cells.items():
            vs = f"{c['vs_dflash']:.2f}x" if "vs_dflash" in c else "-"
            lines.append(f"| {w} | {m} | {c['tokens_per_s']:.1f} | {c['vs_target']:.2f}x | {vs} | {c['tau']:.2f} |")
    lines += ["", "| check | ratio | holds |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['ratio']:.3f} | {'yes' if c['ok'] else 'NO'} |" for c in found]
    return "\n".join(lines)


# what `--drafter none` means here (cli/bench.py gives the command options.add_model_args with it)
NO_DRAFTER_MEANS = "the target alone, its proposers needing no drafter"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`dflash-trt bench proposers`'s flags (--target / --drafter: options.add_model_args)."""
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=tuple(ALL_WORKLOADS),
        default=["bodies", "in-file", "rewrite", "long"],
        help="the workloads (default: %(default)s; chat ones need a chat template)",
    )
    p.add_argument("--prompts", type=int, default=6, help="prompts per workload (default 6; long: half, >= 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens a request (default: the workload's)")
    p.add_argument("--proposers", nargs="+", choices=PROPOSERS, default=None, help="default: all the library has")
    p.add_argument("--no-prompt-lookup", action="store_true", help="leave Hugging Face's prompt lookup out")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results/proposers/results.json"),
        help="the JSON written (default %(default)s)",
    )


def build(args: argparse.Namespace) -> tuple[BatchDecoder, dict[str, Callable[[list[int], int], dict[str, Any]]]]:
    """The server's decoder (adaptive block sizes, the default drafter dtype) and the methods to compare on it."""
    from ..loading import load_decoder
    from ..server.context import ServerSettings, batch_decoder
    from ..settings import NO_DRAFTER

    if args.drafter == NO_DRAFTER:
        args.drafter = None
    decoder = batch_decoder(load_decoder(args.target, args.drafter), ServerSettings())
    proposers = [p for p in args.proposers or supported_proposers() if p in supported_proposers()]
    if decoder.drafter is None:  # a row of a drafter's proposer would be the suffix runs alone
        proposers = [p for p in proposers if not proposer_for(p).uses_drafter]
    methods = {"target": decoder_method(decoder, None)}
    methods |= {p: decoder_method(decoder, p) for p in proposers}
    if not args.no_prompt_lookup:
        methods["prompt-lookup"] = lookup_method(decoder)
    return decoder, methods


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    decoder, methods = build(args)
    workloads = [ALL_WORKLOADS[w](max(2, args.prompts // 2) if w == "long" else args.prompts) for w in args.workloads]
    if args.max_new_tokens:
        workloads = [dataclasses.replace(w, max_new_tokens=args.max_new_tokens) for w in workloads]
    first = prompt_ids(decoder, workloads[0], 0)
    for run in methods.values():  # warm-up: allocations, kernels, the cost model's first steps
        run(first, 16)
    load_before, t0 = os.getloadavg(), time.time()
    records = [r for w in workloads for r in run_workload(decoder, methods, w)]
    summary = summarise(records)
    found = checks(summary)
    wrong = [r for r in records if not r["identical"] and not r["tie"]]
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "minutes": round((time.time() - t0) / 60, 1),
        "command": "dflash-trt bench proposers "
        + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "proposers"] else sys.argv[1:]),
        "target": str(args.target),
        "drafter": None if args.drafter is None else str(args.drafter),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": torch.get_num_threads()},
        "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "workloads": {
            w.name: {"prompts": len(w.prompts), "max_new_tokens": w.max_new_tokens, "sources": w.sources}
            for w in workloads
        },
        "summary": summary,
        "checks": found,
        "not_identical": wrong,
        "per_prompt": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(tables(summary, found))
    print(f"\ngreedy outputs equal to the target alone: {'all' if not wrong else f'NOT {len(wrong)} runs'}")
    return 1 if wrong else 0
