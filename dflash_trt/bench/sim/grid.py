"""The grid of `make bench-sim`: its setups, workloads, concurrencies, seeds and policies, one closed-loop cell
(`run_cell`, a worker process's unit), the cells of a phase (`_cells`), phase 2's tuned tables from phase 1's
fixed blocks (`tuned_tables`) and the Poisson sweep. `cli.py` runs the phases (`sweep`) and says what each mode
runs."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from ...decoding.proposers import DEFAULT_PROPOSER
from ...sim.cost import ProfileCost
from ...sim.policies import FIXED, TUNED
from ...sim.serving import simulate, workload

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SETUPS = (("a100", "llama-3-8b", 1), ("a100", "llama-3-70b", 4), ("h100", "llama-2-7b", 1), ("h100", "llama-2-70b", 4))
WORKLOADS = ("paper", "mixed")
PHASE1 = (*FIXED, "adaptive", "trtllm-schedule", "trtllm-schedule-threshold", "optimum")
SHOWN = (*PHASE1[:-1], *TUNED, "optimum")  # the tables' column order
SEEDS = 3

# The default grid (the package's docstring): every check (checks.py) has a cell in it, within ~12 minutes on 2 CPUs
REDUCED_GROUPS = (
    ("a100", "llama-3-8b", 1, "paper"),
    ("a100", "llama-3-8b", 1, "mixed"),
    ("h100", "llama-2-7b", 1, "paper"),
    ("h100", "llama-2-70b", 4, "mixed"),
)
REDUCED_CONCURRENCY = (1, 8, 32, 128)
REDUCED_SEEDS = 2
PREFILL_AT = 32  # the concurrency at which chunked and separate prefill are run side by side
SLO = {"ttft_s": 2.0, "tpot_s": 0.05}
SGLANG = {"c1": 5.1, "c32": 2.8}  # dflash.md: SGLang, one B200, Qwen3-8B MATH500
BLOCK_OF = {"none": 1, "fixed-4": 4, "fixed-8": 8, "fixed-16": 16}


def requests_for(c: int, scale: float) -> int:
    """max(512, 16 x C) requests (times `scale` in smoke runs): the review found 4 x C too short a steady window
    (ratios read a few percent high)."""
    return max(1, round(scale * max(512, 16 * c)))


def reduced_requests(c: int) -> int:
    """The reduced grid's requests a cell: 32 at C=1 (a cell of single-row steps is the costliest per request;
    one row's steady state needs no long window), max(64, 8 x C) above (twice the 4 x C the review found short)."""
    return 32 if c == 1 else max(64, 8 * c)


def run_cell(cell: tuple[Any, ...]) -> dict[str, Any]:
    """One closed-loop cell (a worker process's unit of work): gpu, model, tp, workload, concurrency, policy,
    requests, seed, tuned table (or None), the prefill mode and chunk pacing (`_pacing`)."""
    gpu, model, tp, wl, c, policy, n, seed, table, pacing = cell
    t0 = time.perf_counter()
    cost = ProfileCost(gpu, model, tp)
    tab = {int(k): v for k, v in table.items()} if table else None
    r = simulate(cost, workload(wl), policy, concurrency=c, requests=n, seed=seed, table=tab, **pacing)
    item = {
        "gpu": cost.label,
        "model": model,
        "tp": tp,
        "workload": wl,
        "policy": policy,
        "prefill": r.prefill,
        "concurrency": c,
        "seed": seed,
        "requests": r.requests,
        "tokens_per_s": round(r.tokens_per_s, 1),
        "ttft_ms": {k: round(1e3 * v, 1) for k, v in r.ttft_s.items()},
        "itl_ms": {k: round(1e3 * v, 2) for k, v in r.itl_s.items()},
        "itl_p99_s": round(r.itl_s["p99"], 5),
        "goodput_rps": round(r.goodput_rps, 3),
        "mean_block": round(r.mean_block, 2),
        "tau": round(r.tau, 2),
        "steps": r.steps,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if (
        r.proposer != DEFAULT_PROPOSER
    ):  # the rounds per proposer: how often the hybrid took the suffix run, and its yield
        item["proposer"], item["proposers"] = r.proposer, r.proposers
    if r.optimum_gap is not None:
        item["optimum_gap"] = round(r.optimum_gap, 5)
    if policy == "adaptive":
        item["policy_cpu_s_per_steady_step"] = r.policy_cpu_s_per_steady_step
        item["simulated_steady_step_s"] = r.simulated_steady_step_s
    return item


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _cells(
    args: argparse.Namespace, policies: tuple[str, ...], tables: dict[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    cells = []
    for gpu, model, tp, wl in args.groups:
        for c in args.concurrency:
            prefills = [args.prefill]
            if args.compare_prefill and c == PREFILL_AT:
                prefills = ["chunked", "separate"]
            for prefill, seed, policy in ((p, s, q) for p in prefills for s in range(args.seeds) for q in policies):
                key = f"{gpu}/{model}/{tp}/{wl}/{prefill}"
                table = (tables or {}).get(key)
                pacing = _pacing(args, prefill)
                cells.append((gpu, model, tp, wl, c, policy, args.requests(c), seed, table, pacing))
    return cells


def tuned_tables(runs: list[dict[str, Any]]) -> dict[str, dict[int, int]]:
    """Per setup, workload and prefill: concurrency -> the best of none / fixed-4 / fixed-8 / fixed-16 (mean
    tokens/s over the seeds)."""
    means: dict[tuple[str, int, str], list[float]] = {}
    for r in runs:
        if r["policy"] in BLOCK_OF:
            key = f"{r['gpu']}/{r['model']}/{r['tp']}/{r['workload']}/{r['prefill']}"
            means.setdefault((key, r["concurrency"], r["policy"]), []).append(r["tokens_per_s"])
    out: dict[str, dict[int, int]] = {}
    for (key, c, policy), v in sorted(means.items()):
        best = out.setdefault(key, {})
        prev = best.get(c)
        prev_mean = statistics.mean(means[(key, c, _name(prev))]) if prev else -1.0
        if statistics.mean(v) > prev_mean:
            best[c] = BLOCK_OF[policy]
    return out


def _name(block: int) -> str:
    return next(p for p, b in BLOCK_OF.items() if b == block)


def _pacing(args: argparse.Namespace, prefill: str | None = None) -> dict[str, Any]:
    """The prefill mode (default the grid's), the grid's chunk pacing and its proposer (`args.proposing`, set by
    cli.main: the proposer and the suffix trace it replays), as `simulate` takes them."""
    mode = prefill or args.prefill
    pacing = {"prefill": mode, "stall": args.prefill_stall, "backlog_steps": args.prefill_backlog_steps}
    return pacing | {"proposing": args.proposing}


def poisson(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    cost = ProfileCost("a100", "llama-3-8b", 1)
    work = workload("paper")
    for rate in args.rates:
        for policy in ("none", "fixed-8", "adaptive", "trtllm-schedule"):
            r = simulate(cost, work, policy, rate=rate, requests=args.poisson_requests, **_pacing(args))
            out.append(
                {
                    "gpu": "a100",
                    "model": "llama-3-8b",
                    "tp": 1,
                    "workload": "paper",
                    "policy": policy,
                    "prefill": r.prefill,
                    "rate_rps": rate,
                    "tokens_per_s": round(r.tokens_per_s, 1),
                    "ttft_ms": {k: round(1e3 * v, 1) for k, v in r.ttft_s.items()},
                    "itl_ms": {k: round(1e3 * v, 2) for k, v in r.itl_s.items()},
                    "goodput_rps": round(r.goodput_rps, 3),
                    "mean_batch": round(r.mean_batch, 1),
                }
            )
            print("poisson", json.dumps(out[-1]), flush=True)
    return out
