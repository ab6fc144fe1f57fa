"""Serving simulated from measured profiles: the real batched loop and block-size policies on simulated GPUs.

    python scripts/bench_sim.py [--out results/sim] [--full | --smoke] [--setups ...] [--concurrency ...]

Two grids. The default, REDUCED (about 12 minutes with --jobs 2 on 2 CPUs, 2 seeds): A100 Llama-3-8B tp=1 on
`paper` and `mixed`, H100 Llama-2-7B tp=1 on `paper`, H100 Llama-2-70B tp=4 on `mixed`, at concurrency
1/8/32/128, 32 requests at C=1 and max(64, 8 x C) above. `--full` (about 8 CPU-hours: 4 hours with --jobs 2):
concurrency 1..256 x workloads ("paper": each request from one of the paper's Qwen3-8B T=0 benchmarks;
"mixed": half the requests accept poorly, tau ~2 at block 16) x every setup x 3 seeds, at max(512, 16 x C)
requests a cell, on Vidur's measured profiles: A100 Llama-3-8B tp=1 and Llama-3-70B tp=4, H100 Llama-2-7B
tp=1 and Llama-2-70B tp=4 (dflash_trt/sim). Both run every policy, in two phases:

  1. none, fixed-4/8/16, adaptive, trtllm-schedule (as DFlashDecodingConfig configures it: no acceptance
     threshold), trtllm-schedule-threshold (the threshold set: a named variant) and optimum (the exact
     per-step optimum with true acceptance and true pass costs: the bound);
  2. tuned-table and vllm-table: TensorRT-LLM's and vLLM's per-batch-size tables, each entry the best of
     none / fixed-4 / fixed-8 / fixed-16 at that concurrency in phase 1 (mean over the seeds).

Prefill: the grid runs with `--prefill` (default chunked, the loop's default, at a GPU server's token budget:
STEP_TOKENS_OF in dflash_trt/sim/policies.py, vLLM's per-GPU defaults, and the loop's time bound,
`--prefill-stall`); at C=32 chunked and separate prefill are run side by side. Also a Poisson open-loop sweep and two calibrations:

  (a) CPU: the simulator with the CPU cost grid and host overhead `make bench-load` recorded
      (results/load/results.json) against the measured engines-alone tokens/s;
  (b) GPU: the speedup of a fixed block 16 over the target alone on MATH500-like requests (T = 0 and T = 1
      acceptance) from concurrency 1 to 32 at 2048 new tokens, the published conditions, against SGLang's
      published DFlash curve (B200: 5.1x -> 2.8x), on the A100 profile and a B200-like what-if.

Writes results.json (`runs`: one item per closed-loop cell and seed), README.md (tables, checks, and
explanations computed from the run) and sim.png. Nothing here runs a model; every figure is simulated.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

from dflash_trt.bench.sim_report import cpu_calibration, criteria_table, poisson_table
from dflash_trt.cli.options import non_negative_int, stall_factor
from dflash_trt.decoding.chunking import BACKLOG_STEPS, STALL
from dflash_trt.sim.acceptance import AcceptanceProfile
from dflash_trt.sim.cost import LinearPassCost, ProfileCost
from dflash_trt.sim.policies import FIXED, STEP_TOKENS_OF, TUNED
from dflash_trt.sim.serving import HOST_STEP_S, Workload, simulate, workload

ROOT = Path(__file__).resolve().parents[1]

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SETUPS = (("a100", "llama-3-8b", 1), ("a100", "llama-3-70b", 4), ("h100", "llama-2-7b", 1), ("h100", "llama-2-70b", 4))
WORKLOADS = ("paper", "mixed")
PHASE1 = (*FIXED, "adaptive", "trtllm-schedule", "trtllm-schedule-threshold", "optimum")
SHOWN = (*PHASE1[:-1], *TUNED, "optimum")  # the tables' column order
SEEDS = 3
# The default grid (module docstring): every check of issue 40 has a cell in it, within ~12 minutes on 2 CPUs
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


def run_cell(cell: tuple) -> dict:
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
    if r.optimum_gap is not None:
        item["optimum_gap"] = round(r.optimum_gap, 5)
    if policy == "adaptive":
        item["policy_cpu_s_per_steady_step"] = r.policy_cpu_s_per_steady_step
        item["simulated_steady_step_s"] = r.simulated_steady_step_s
    return item


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _cells(args, policies: tuple[str, ...], tables: dict | None = None) -> list[tuple]:
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


def tuned_tables(runs: list[dict]) -> dict[str, dict[int, int]]:
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


def _pacing(args, prefill: str | None = None) -> dict:
    """The prefill mode (default the grid's) and the grid's chunk pacing, as `simulate` takes them."""
    mode = prefill or args.prefill
    return {"prefill": mode, "stall": args.prefill_stall, "backlog_steps": args.prefill_backlog_steps}


def sweep(args) -> tuple[list[dict], dict, list[dict], dict | None, dict | None]:
    """Phase 1, the tables it tunes, phase 2, on `args.jobs` processes (the largest cells first); the Poisson
    sweep and the calibrations beside phase 1."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    runs: list[dict] = []
    with ctx.Pool(args.jobs, initializer=_one_thread) as pool:
        pois = pool.apply_async(poisson, (args,))
        cal = set() if args.smoke else set(args.calibrations)
        cpu = pool.apply_async(calibrate_cpu, (args.load_results,)) if "cpu" in cal else None
        gpu = pool.apply_async(calibrate_gpu, (args,)) if "gpu" in cal else None
        phase1 = tuple(p for p in PHASE1 if p in args.policies)
        cells = sorted(_cells(args, phase1), key=lambda x: -x[4] * (3 if x[5] in ("adaptive", "optimum") else 1))
        for item in pool.imap_unordered(run_cell, cells):
            runs.append(item)
            print(json.dumps(item), flush=True)
        tables = tuned_tables(runs)
        cells = sorted(_cells(args, tuple(p for p in TUNED if p in args.policies), tables), key=lambda x: -x[4])
        for item in pool.imap_unordered(run_cell, cells):
            runs.append(item)
            print(json.dumps(item), flush=True)
        pois_runs, cpu_cal, gpu_cal = pois.get(), cpu and cpu.get(), gpu and gpu.get()
    return runs, tables, pois_runs, cpu_cal, gpu_cal


def poisson(args) -> list[dict]:
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


def calibrate_cpu(load_path: Path) -> dict | None:
    """(a): the simulator on the CPU grid the load benchmark measured, against its engines-alone figures."""
    if not load_path.exists():
        return None
    data = json.loads(load_path.read_text())
    proc = data.get("in_process") or {}
    if not proc.get("engines_alone") or not proc.get("cost_model"):
        return None
    prof = proc.get("step_profile", {})
    grid = LinearPassCost.from_cost_model(proc["cost_model"])
    # the grid keeps each cell's fastest pass on a shared machine; the verify passes that ran in the same
    # benchmark (its step profile: mean rows, tokens, ms at 16 rows) took k x the grid's price for them
    k = 1.0
    if prof.get("verify_ms") and prof.get("mean_rows"):
        rows, tokens = round(prof["mean_rows"]), round(prof["mean_verify_tokens"])
        new = [tokens // rows + (i < tokens % rows) for i in range(rows)]
        k = 1e-3 * prof["verify_ms"] / grid.target(new, [0] * rows, tokens)
    # the loop's own host time per step there (policy + acceptance + bookkeeping), measured at 16 rows
    host = 1e-3 * sum(prof.get(k, 0.0) for k in ("policy_ms", "accept_ms", "overhead_ms")) or HOST_STEP_S
    code = [p for p in proc["per_prompt"] if p["set"] == "code"]
    profiles = tuple(AcceptanceProfile.from_tau(f"prompt{p['prompt']}", p["tau_single_b8"], 8) for p in code)
    ea = proc["engines_alone"]
    c, n_req = ea["concurrency"], ea["requests"]
    osl = data["settings"]["osl"]
    # the engines-alone stream: the code prompts in order, wrapping; each prompt its own recorded acceptance
    work = Workload("demo-code", profiles, (1.0,) * len(profiles), "fixed:1", f"fixed:{osl}")
    reqs = []
    for i in range(n_req):
        p = code[i % len(code)]
        reqs.append(([i % len(code)] + [len(code) + (7 * i + j) % 200 for j in range(p["prompt_tokens"] - 1)], osl))
    out: dict = {"concurrency": c, "requests": n_req, "osl": osl, "host_step_s": host, "k": round(k, 3), "modes": {}}
    for mode, policy in (("target", "none"), ("adaptive", "adaptive")):
        measured = ea["tokens_per_s"][mode]
        raw = simulate_stream(grid, work, policy, reqs, c, host)
        r = simulate_stream(LinearPassCost.from_cost_model(proc["cost_model"], k), work, policy, reqs, c, host)
        out["modes"][mode] = {
            "simulated_tokens_per_s": round(r, 1),
            "measured_tokens_per_s": measured,
            "error": round(r / measured - 1, 3),
            "raw_grid_tokens_per_s": round(raw, 1),
            "raw_grid_error": round(raw / measured - 1, 3),
        }
    return out


def simulate_stream(cost, work: Workload, policy: str, reqs: list, c: int, host: float) -> float:
    """`steady_state` of scripts/bench_load.py on the simulated engines: c in flight, a finished row replaced at
    once, tokens over the whole run (the CPU cost grid is the demo pair's, trained block 8)."""
    from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder, GenerationConfig, SamplingParams
    from dflash_trt.decoding.cost import measure_costs
    from dflash_trt.sim.engines import sim_engines

    target, drafter, clock = sim_engines(cost, work.profiles, block_size=8)
    if policy == "none":
        dec = BatchDecoder(target, None, clock=clock)
    else:  # bench_load's grid: rows 1/4/16, blocks 1/4/8, context 150
        grid = measure_costs(target, drafter, rows=(1, 4, 16), blocks=(1, 4, 8), context=150, repeats=2, clock=clock)
        dec = BatchDecoder(target, drafter, policy=AdaptiveBlocks(grid), clock=clock)
    clock.now = 0.0
    cfg = [GenerationConfig(max_new_tokens=n, sampling=SamplingParams(0.0), stop_token_ids=()) for _, n in reqs]
    rows = [dec.add(p, k) for (p, _), k in zip(reqs[:c], cfg[:c])]
    nxt, tokens = len(rows), 0
    while rows:
        dec.step()
        clock.advance(host)
        for r in [r for r in rows if r.done]:
            rows.remove(r)
            tokens += len(r.result().token_ids)
            if nxt < len(reqs):
                rows.append(dec.add(reqs[nxt][0], cfg[nxt]))
                nxt += 1
    return tokens / clock.now


def calibrate_gpu(args) -> dict:
    """(b): fixed block 16 over the target alone, MATH500-like requests at T = 0 and T = 1 acceptance,
    `args.gpu_osl` new tokens (2048: the published conditions), concurrency 1 and 32, on the A100 profile and
    the B200-like what-if. Every request the same length, so a cell's tokens/s is over its whole run (all C
    rows start together, as in a benchmark client at that concurrency)."""
    out: dict = {"osl": args.gpu_osl, "published": SGLANG, "model": "llama-3-8b", "tp": 1, "runs": {}}
    for name, cost in (("a100", ProfileCost()), ("b200-like-what-if", ProfileCost.what_if("b200-like-what-if"))):
        for wl in ("math500", "math500-t1"):
            work = workload(wl, prompt_len="lognormal:150,0.4,32-1024", output_len=f"fixed:{args.gpu_osl}")
            cell: dict = {}
            for c in (1, 32):
                for p in ("none", "fixed-16", "adaptive"):
                    r = simulate(cost, work, p, concurrency=c, requests=max(args.gpu_requests, c), **_pacing(args))
                    cell[f"{p}_c{c}"] = round(r.tokens / r.sim_seconds, 1)
            s1, s32 = cell["fixed-16_c1"] / cell["none_c1"], cell["fixed-16_c32"] / cell["none_c32"]
            cell.update(speedup_c1=round(s1, 2), speedup_c32=round(s32, 2), decay=round(s32 / s1, 3))
            cell["adaptive_speedup_c1"] = round(cell["adaptive_c1"] / cell["none_c1"], 2)
            cell["adaptive_speedup_c32"] = round(cell["adaptive_c32"] / cell["none_c32"], 2)
            cell["decay_error"] = round(cell["decay"] / (SGLANG["c32"] / SGLANG["c1"]) - 1, 3)
            out["runs"][f"{name}/{wl}"] = cell
        out[f"pass_ratio_{name}"] = pass_ratios(cost)
    out["published_decay"] = round(SGLANG["c32"] / SGLANG["c1"], 3)
    return out


def pass_ratios(cost: ProfileCost, past: int = 1024) -> dict:
    """What the profile says about the decay: at 32 rows, a verify pass of block 16 over one of 1 token (the
    whole target pass, and the layer ops alone), at `past` tokens cached (mid-generation of 2048)."""
    whole = cost.target([16] * 32, [past] * 32, 512) / cost.target([1] * 32, [past] * 32, 32)
    ops = cost.op(512) / cost.op(32)
    one = cost.target([16], [past], 16) / cost.target([1], [past], 1)
    return {"verify16_over_1_c32": round(whole, 2), "layer_ops_512_over_32": round(ops, 2), "c1": round(one, 3)}


def _cell(r: dict) -> tuple:
    """A run's cell: setup, workload, prefill and concurrency (its seeds and policies share it)."""
    return (r["gpu"], r["model"], r["tp"], r["workload"], r["prefill"], r["concurrency"])


def _ttft_p50_s(runs: list[dict], cells: Iterable[tuple]) -> dict[tuple, dict[str, float]]:
    """Per cell in `cells`, per policy: TTFT p50 in seconds, the mean over seeds."""
    wanted, out = set(cells), {}
    for r in runs:
        if _cell(r) in wanted:
            out.setdefault(_cell(r), {}).setdefault(r["policy"], []).append(r["ttft_ms"]["p50"] / 1e3)
    return {k: {p: statistics.mean(v) for p, v in pol.items()} for k, pol in out.items()}


def _ratios(runs: list[dict], num: str, den: str) -> dict[tuple, list[float]]:
    """Per (setup, workload, prefill, C): num / den tokens/s for each seed both ran (paired: the same requests)."""
    by: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in runs:
        by.setdefault(_cell(r), {}).setdefault(r["policy"], {})[r["seed"]] = r["tokens_per_s"]
    out = {}
    for key, pol in by.items():
        if num in pol and den in pol:
            seeds = sorted(set(pol[num]) & set(pol[den]))
            out[key] = [pol[num][s] / pol[den][s] for s in seeds if pol[den][s] > 0]
    return out


def criteria(runs: list[dict], gpu: dict | None) -> list[dict]:
    """The issue's done-when checks, each per setup and workload over every concurrency run."""
    checks = []
    for num, den, floor in (("adaptive", "optimum", 0.98), ("adaptive", "tuned-table", 1.0)):
        groups: dict[tuple, list[tuple[int, list[float]]]] = {}
        for key, ratios in _ratios(runs, num, den).items():
            groups.setdefault(key[:5], []).append((key[5], ratios))
        for (g, model, tp, wl, prefill), items in sorted(groups.items()):
            low_c, low = min(((c, statistics.mean(v)) for c, v in items), key=lambda x: x[1])
            spread = next(v for c, v in items if c == low_c)
            checks.append(
                {
                    "what": f"{g} {model} tp={tp} {wl} ({prefill} prefill): {num} >= {floor}x {den} at every "
                    f"concurrency (mean of paired seeds)",
                    "passed": low >= floor,
                    "within_spread": max(spread) >= floor,
                    "figure": f"lowest {low:.3f}x at C={low_c} (seeds {min(spread):.3f}-{max(spread):.3f})",
                }
            )
    checks += prefill_checks(runs)
    if gpu:
        for key, cell in gpu["runs"].items():
            checks.append(
                {
                    "what": f"calibration (b) {key}: speedup decay C=1 -> 32 within +-25 % of SGLang's",
                    "passed": abs(cell["decay_error"]) <= 0.25,
                    "figure": f"{cell['speedup_c1']}x -> {cell['speedup_c32']}x (decay {cell['decay']}) vs "
                    f"{SGLANG['c1']}x -> {SGLANG['c32']}x ({gpu['published_decay']}): {100 * cell['decay_error']:+.0f} %",
                }
            )
    return checks


def prefill_pairs(runs: list[dict]) -> dict[tuple, dict[str, float]]:
    """Adaptive at C=32, chunked against separate prefill, per setup and workload (means over seeds): both ITL
    p99s, the tokens/s ratio and chunked prefill's mean step."""
    by: dict[tuple, dict[str, list[dict]]] = {}
    for r in runs:
        if r["concurrency"] == PREFILL_AT and r["policy"] == "adaptive":
            by.setdefault((r["gpu"], r["model"], r["tp"], r["workload"]), {}).setdefault(r["prefill"], []).append(r)
    out = {}
    for key, modes in sorted(by.items()):
        if {"chunked", "separate"} <= set(modes):
            ch, se = modes["chunked"], modes["separate"]
            out[key] = {
                "p99_separate": statistics.mean(r["itl_p99_s"] for r in se),
                "p99_chunked": statistics.mean(r["itl_p99_s"] for r in ch),
                "tps": statistics.mean(r["tokens_per_s"] for r in ch) / statistics.mean(r["tokens_per_s"] for r in se),
                "step": statistics.mean(r.get("simulated_steady_step_s", math.nan) for r in ch),
            }
    return out


def prefill_checks(runs: list[dict]) -> list[dict]:
    """Chunked against separate prefill at C=32, adaptive, per setup and workload: ITL p99 at least 2x lower,
    tokens/s not lower (means over seeds); the figure gives both p99s in units of chunked prefill's mean step
    (`prefill_reach`)."""
    checks = []
    for (g, model, tp, wl), v in prefill_pairs(runs).items():
        lower = v["p99_separate"] / v["p99_chunked"]
        figure = f"ITL p99 {lower:.2f}x lower, tokens/s {v['tps']:.3f}x"
        if v["step"] > 0:
            figure += f"; in chunked's mean steps: separate {v['p99_separate'] / v['step']:.2f}, chunked "
            figure += f"{v['p99_chunked'] / v['step']:.2f}"
        checks.append(
            {
                "what": f"{g} {model} tp={tp} {wl} C={PREFILL_AT} adaptive: chunked prefill ITL p99 >= 2x lower "
                "than separate, tokens/s not lower",
                "passed": lower >= 2 and v["tps"] >= 1.0,
                "figure": figure,
            }
        )
    return checks


def prefill_reach(runs: list[dict]) -> list[str]:
    """Why the C=32 prefill check can or cannot reach 2x, computed from the run."""
    pairs = {k: v for k, v in prefill_pairs(runs).items() if v["step"] > 0}
    if not pairs:
        return []
    short = [
        f"{g.upper()} {m} `{wl}` ({v['p99_separate'] / v['step']:.2f})"
        for (g, m, _, wl), v in pairs.items()
        if v["p99_separate"] < 2 * v["step"]
    ]
    return [
        "- ITL p99 at C=32 in units of chunked prefill's mean step (the checks' figures): a row that gains one token "
        "in a step waits the whole step, so while the same prompts get in as fast, no way of admitting them brings "
        "chunked prefill's p99 much below one mean step (every step equal: their work spread evenly; a tighter "
        "bound shortens the steps only by keeping prompts out, and fewer rows decode), and a 2x lower p99 at "
        "tokens/s not lower needs separate prefill's at 2 or more. "
        + (f"Below 2 here: {', '.join(short)}." if short else "Every group here is at 2 or more.")
    ]


def summary(runs: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Per (setup, workload, prefill, C): per policy the mean, lowest and highest tokens/s over the seeds."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in runs:
        cell = out.setdefault(_cell(r), {}).setdefault(r["policy"], {"tps": [], "itl_p99": [], "block": []})
        cell["tps"].append(r["tokens_per_s"])
        cell["itl_p99"].append(r["itl_p99_s"])
        cell["block"].append(r["mean_block"])
    return out


def tables(runs: list[dict], tuned: dict) -> list[str]:
    """Per setup, workload and prefill: mean tokens/s by concurrency and policy, the seeds' spread of the two
    ratios the checks judge, and the tuned table's choice."""
    s = summary(runs)
    lines: list[str] = []
    for group in sorted({k[:5] for k in s}):
        g, model, tp, wl, prefill = group
        lines += [
            "",
            f"## {g.upper()} {model} tp={tp}, `{wl}`, {prefill} prefill: output tokens/s (mean of seeds)",
            "",
            "| C | " + " | ".join(SHOWN) + " | tuned block | adaptive / optimum | adaptive / tuned-table |",
            "|---|" + "---|" * (len(SHOWN) + 3),
        ]
        table = tuned.get(f"{g}/{model}/{tp}/{wl}/{prefill}", {})
        for c in sorted(k[5] for k in s if k[:5] == group):
            cell = s[(*group, c)]
            vals = [f"{statistics.mean(cell[p]['tps']):.0f}" if p in cell else "-" for p in SHOWN]
            pair = []
            for den in ("optimum", "tuned-table"):
                if "adaptive" in cell and den in cell:
                    v = [a / b for a, b in zip(cell["adaptive"]["tps"], cell[den]["tps"])]
                    pair.append(f"{statistics.mean(v):.3f} ({min(v):.3f}-{max(v):.3f})")
                else:
                    pair.append("-")
            block = table.get(c, table.get(str(c), "-"))  # type: ignore[call-overload]
            lines.append(f"| {c} | " + " | ".join(vals) + f" | {block} | " + " | ".join(pair) + " |")
    return lines


def explanations(runs: list[dict]) -> list[str]:
    """Sentences computed from the run: where adaptive is furthest from the optimum and the tuned table, the
    optimum's certificate, and what the threshold variant does."""
    lines = ["", "## What the run says (computed from results.json)", ""]
    for den in ("optimum", "tuned-table", "trtllm-schedule", "trtllm-schedule-threshold"):
        r = _ratios(runs, "adaptive", den)
        if r:
            key, v = min(r.items(), key=lambda kv: statistics.mean(kv[1]))
            g = math.exp(statistics.mean(math.log(statistics.mean(x)) for x in r.values()))
            lines.append(
                f"- adaptive / {den}: geomean {g:.3f}x over {len(r)} cells; lowest {statistics.mean(v):.3f}x "
                f"({'/'.join(str(x) for x in key)})."
            )
    gaps = [r["optimum_gap"] for r in runs if "optimum_gap" in r]
    if gaps:
        lines.append(
            f"- the optimum's certificate: its chosen step rates are within {100 * statistics.mean(gaps):.2f} % "
            f"(mean over cells; worst cell {100 * max(gaps):.2f} %) of a proven upper bound of the per-step "
            "optimum (dflash_trt/sim/optimum.py): per step, adaptive / optimum is exact to that margin (the run: below)."
        )
    lines += prefill_reach(runs)
    lines += above_optimum(runs)
    lines += below_tuned(runs)
    return lines


def above_optimum(runs: list[dict]) -> list[str]:
    """Where adaptive reads more than 1 % above the per-step optimum: the cells, both TTFT p50s, and the highest
    ratio with separate prefill."""
    ratios = {k: statistics.mean(v) for k, v in _ratios(runs, "adaptive", "optimum").items()}
    high = {k: v for k, v in ratios.items() if v > 1.01}
    if not high:
        return []
    ttft = _ttft_p50_s(runs, high)
    separate = [v for k, v in ratios.items() if k[4] == "separate"]
    cells = "; ".join(
        f"{'/'.join(str(x) for x in k)} {v:.3f}x (TTFT p50 {ttft[k]['adaptive']:.2f} s against "
        f"{ttft[k]['optimum']:.2f} s)"
        for k, v in sorted(high.items(), key=lambda kv: -kv[1])
    )
    return [
        f"- adaptive reads above the per-step optimum in {len(high)} of {len(ratios)} cells, all with "
        f"{' / '.join(sorted({k[4] for k in high}))} prefill: {cells}. With separate prefill adaptive / optimum is "
        f"at most {max(separate, default=math.nan):.3f}x. The optimum maximises each step's rate for the rows in it; "
        "under chunked prefill a step's blocks also shape how fast the waiting prompts get in (the time bound "
        "prices a prompt token from the steps the policy shaped), and where prompts are long against outputs that "
        "decides how many rows decode: the optimum's prompts wait longer here. So under chunked prefill it bounds "
        "a step, not the run, and the check reads adaptive against it one way only.",
    ]


def below_tuned(runs: list[dict]) -> list[str]:
    """Where adaptive reads below the tuned table: which prefill, the seeds' spread, the cells' TTFT (how long
    prompts wait to enter), and whether the per-step optimum is below the table there too."""
    ratios = _ratios(runs, "adaptive", "tuned-table")
    low = {k: statistics.mean(v) for k, v in ratios.items() if statistics.mean(v) < 1}
    if not low:
        return []
    ttft = _ttft_p50_s(runs, low)
    opt = {k: statistics.mean(v) for k, v in _ratios(runs, "optimum", "tuned-table").items() if k in low}
    modes = sorted({k[4] for k in low})
    spread = sum(max(ratios[k]) >= 1.0 for k in low)
    lines = [
        f"- adaptive is below the tuned table in {len(low)} of {len(ratios)} cells ({' / '.join(modes)} prefill), "
        f"1.0x inside the seeds' spread in {spread} of them; the per-step optimum is below it in "
        f"{sum(v < 1 for v in opt.values())}. Per cell: adaptive / tuned-table (seeds), optimum / tuned-table, "
        "TTFT p50 of adaptive against the tuned table (mean of seeds):"
    ]
    slow = False
    for k, v in sorted(low.items(), key=lambda kv: kv[1]):
        a, b = ttft[k].get("adaptive", math.nan), ttft[k].get("tuned-table", math.nan)
        slow |= k[4] == "chunked" and a > 1.2 * b
        lines.append(
            f"  - {'/'.join(str(x) for x in k)}: {v:.3f}x ({min(ratios[k]):.4f}-{max(ratios[k]):.4f}), "
            f"{opt.get(k, math.nan):.3f}x, TTFT p50 {a:.2f} s against {b:.2f} s."
        )
    if slow:
        lines.append(
            "  - Where adaptive's prompts wait longer under chunked prefill (the reading, from the TTFT above, not "
            "isolated): a step's blocks shape how fast waiting prompts get in (the budget left after the rows' "
            "blocks, and the time bound's price of a prompt token), so fewer rows decode. Adaptive and the "
            "optimum price one step, not that, so there the per-step optimum is no bound on the run."
        )
    return lines


def gpu_section(g: dict) -> list[str]:
    """Calibration (b) and why it lands where it does, from the run and the profile."""
    lines = [
        "",
        "## Calibration (b): the published GPU curve",
        "",
        f"Fixed block 16 over the target alone, MATH500-like requests, {g['osl']} new tokens (the published",
        "conditions), Llama-3-8B tp=1; SGLang's DFlash on one B200 (Qwen3-8B MATH500): "
        f"{SGLANG['c1']}x -> {SGLANG['c32']}x (decay {g['published_decay']}).",
        "",
        "| profile / acceptance | C=1 | C=32 | decay | vs published | adaptive C=1 | adaptive C=32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, c in g["runs"].items():
        lines.append(
            f"| {key} | {c['speedup_c1']}x | {c['speedup_c32']}x | {c['decay']} | {100 * c['decay_error']:+.0f} % | "
            f"{c['adaptive_speedup_c1']}x | {c['adaptive_speedup_c32']}x |"
        )
    a, w = g["pass_ratio_a100"], g["pass_ratio_b200-like-what-if"]
    lines += [
        "",
        "Which term decides it: at 32 rows and 1024 cached tokens the A100 profile prices a block-16 verify pass",
        f"at {a['verify16_over_1_c32']}x a one-token pass (its layer ops alone: {a['layer_ops_512_over_32']}x for 512",
        f"against 32 tokens); the B200-like what-if (datasheet ratios, not a profile) at {w['verify16_over_1_c32']}x",
        f"(layer ops {w['layer_ops_512_over_32']}x). At C=1 the same block costs {a['c1']}x (A100). The decay follows",
        "that ratio: the GPU's FLOPs per byte of bandwidth decides where a 512-token pass turns compute bound.",
    ]
    return lines


def plot(runs: list[dict], path: Path, prefill: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary(runs)
    panels = sorted({k[:5] for k in s if prefill is None or k[4] == prefill})  # the grid's (not the side-by-side)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, group in zip(axes[0], panels):
        for policy in SHOWN:
            pts = sorted(
                (k[5], statistics.mean(v[policy]["tps"])) for k, v in s.items() if k[:5] == group and policy in v
            )
            if pts:
                style = {"lw": 2.5, "color": "black"} if policy == "adaptive" else {"lw": 1.2}
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=policy, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{group[0]} {group[1]} tp={group[2]}, {group[3]}, {group[4]}", fontsize=8)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s (simulated)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("Simulated from measured profiles (Vidur A100 / H100 op profiles), not measured on a GPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


LEAVES_OUT = [
    "",
    "## What the simulation leaves out",
    "",
    "- Kernel launch gaps outside CUDA graphs (a pass is its ops' profiled medians plus one named launch",
    "  constant; graphs on only add the padding to captured sizes), and overlap of host work with the GPU.",
    "- Paged-KV fragmentation, KV capacity limits and preemption (every row fits), prefix caching.",
    "- Network jitter and multi-node communication (one DGX node's profiled all-reduce).",
    "- Measured op times past a profile's largest token count (4096 on the H100): passes beyond it are priced in",
    "  proportion to their tokens (compute bound), not measured.",
    "- Vidur's measured attention kernels (absent from the snapshot: attention is a bandwidth/FLOP model,",
    "  checked against FlashAttention-2's published A100 rate).",
    "- Sampling at T > 0 in the loop: T = 1 enters as the paper's T = 1 acceptance only.",
    "- The per-position shape of acceptance (assumed decay 0.99 per position; tau per benchmark exact), and",
    "  acceptance that varies within a request.",
    "- Llama-3 on H100 and any B200 (Vidur profiles H100 for Llama-2 only; the B200 is a labelled what-if",
    "  from datasheet ratios), and the Qwen3-8B of the published curve (Llama-3-8B has its shape class).",
    "- The serving frameworks' own scheduling costs beyond one host constant per step.",
]


def mode_lines(s: dict) -> list[str]:
    """What the grid that ran holds, and (reduced) what it leaves out of the full one."""
    groups = s.get("groups")
    if not groups:
        return []
    held = "; ".join(f"{g.upper()} {m} tp={tp} `{wl}`" for g, m, tp, wl in groups)
    conc = "/".join(str(c) for c in s["concurrency"])
    what = f"{held}; C = {conc}; {s['seeds']} seed{'s' if s['seeds'] > 1 else ''}; {s['requests_rule']}"
    if s["mode"].startswith("reduced"):
        return [
            f"**Mode: reduced**, the default grid, sized for `make bench-sim` to take about 12 minutes on 2 CPUs: {what}.",
            f"Chunked and separate prefill side by side at C={PREFILL_AT}. It leaves out the other concurrencies and",
            "setup x workload pairs and has shorter steady windows and fewer seeds than the full grid (ratios read",
            "with a wider spread); `scripts/bench_sim.py --full` runs every setup on both workloads at C = 1..256, 3",
            "seeds, max(512, 16 x C) requests a cell (about 8 CPU-hours).",
            "",
        ]
    return [f"**Mode: {s['mode']}**: {what}.", ""]


def readme(res: dict) -> str:
    s = res["settings"]
    lines = [
        "# Serving simulated from measured profiles (A100, H100)",
        "",
        "**Simulated, not measured on a GPU.** The real batched loop (`BatchDecoder`) and block-size policies run",
        "on fake engines whose passes advance a virtual clock by the time Vidur's measured operator profiles give",
        "for their shape (`dflash_trt/sim`, data in `data/profiles/vidur/`). Acceptance: per-position rates",
        "fitted to the paper's Qwen3-8B block-16 tau per benchmark.",
        f"Made by `make bench-sim` ({s['minutes']} min wall on {s['machine']}"
        + (f", {s['jobs']} worker process{'es' if s['jobs'] > 1 else ''}" if s.get("jobs") else "")
        + f", mode {s['mode']}).",
        *([f"**{s['note']}**"] if s.get("note") else []),
        "",
        *mode_lines(s),
        f"Closed loop, {s['requests_rule']}, {s['seeds']} seeds; prompts `{s['prompt_len']}`, outputs",
        f"`{s['output_len']}` tokens; host {1e3 * s['host_step_s']:.2f} ms per step; greedy (T=0); chunk steps at",
        f"most about {s.get('prefill_stall', STALL)}x the rows' own (`--prefill-stall`) unless prompts queue, then",
        f"at least 1/{s.get('prefill_backlog_steps', BACKLOG_STEPS)} of them a step (`--prefill-backlog-steps`). "
        "Peers: see",
        "dflash_trt/sim/policies.py (trtllm-schedule as DFlashDecodingConfig configures it, no threshold;",
        "tuned-table and vllm-table tuned per concurrency from the fixed blocks none/4/8/16; optimum: the exact",
        "per-step bound).",
        "",
        "![tokens/s vs concurrency](sim.png)",
        "",
    ]
    lines += criteria_table(res["checks"], "Checks (issue 40)")
    lines += explanations(res["runs"])
    lines += tables(res["runs"], res["tuned_tables"])
    if res.get("poisson"):
        lines += poisson_table(res["poisson"], "Open loop (Poisson), A100 Llama-3-8B tp=1, `paper`")
    cal = res.get("calibration", {})
    if cal.get("cpu"):
        lines += cpu_calibration(cal["cpu"])
    if cal.get("gpu"):
        lines += gpu_section(cal["gpu"])
    return "\n".join(lines + LEAVES_OUT) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "sim", help="output folder")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--full",
        action="store_true",
        help="the whole grid instead of the reduced default: 4 setups x 2 workloads x C=1..256 x 10 policies x 3\n"
        "seeds at max(512, 16 x C) requests a cell; about 8 CPU-hours (4 hours wall with --jobs 2)",
    )
    mode.add_argument("--smoke", action="store_true", help="a few cells only (seconds): checks the pipeline")
    ap.add_argument("--note", help="a line for README.md (how the machine was shared while it ran, ...)")
    ap.add_argument("--readme-only", action="store_true", help="rewrite README.md from the folder's results.json")
    ap.add_argument("--load-results", type=Path, default=ROOT / "results" / "load" / "results.json")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one per CPU)")
    ap.add_argument("--prefill", choices=("chunked", "separate"), default="chunked", help="the grid's prefill mode")
    ap.add_argument(
        "--prefill-stall",
        type=stall_factor,
        default=STALL,
        help=f"chunked prefill's time bound: a step with chunks at most about this many times the rows' own\n"
        f"(the server's --prefill-stall; default {STALL})",
    )
    ap.add_argument(
        "--prefill-backlog-steps",
        type=non_negative_int,
        default=BACKLOG_STEPS,
        help=f"chunked prefill's floor for prompts queued behind the one entering: at least 1/N of them a step\n"
        f"(the server's --prefill-backlog-steps; 0: none; default {BACKLOG_STEPS})",
    )
    ap.add_argument(
        "--no-compare-prefill",
        dest="compare_prefill",
        action="store_false",
        help=f"skip running chunked and separate prefill side by side at C={PREFILL_AT}",
    )
    ap.add_argument("--setups", nargs="+", help="gpu:model:tp items (replace the mode's setup x workload pairs)")
    ap.add_argument("--workloads", nargs="+", help="workloads (with --setups or alone: every setup x these)")
    ap.add_argument(
        "--groups",
        nargs="+",
        help="gpu:model:tp:workload items: exactly these setup x workload pairs (e.g. the reduced grid's four on\n"
        "the full grid's requests and seeds: --full --groups "
        + " ".join(":".join(map(str, g)) for g in REDUCED_GROUPS)
        + ")",
    )
    ap.add_argument("--concurrency", nargs="+", type=int, help="concurrencies (default: the mode's)")
    ap.add_argument("--seeds", type=int, help=f"seeds per cell (default: {REDUCED_SEEDS} reduced, {SEEDS} full)")
    ap.add_argument(
        "--policies",
        nargs="+",
        choices=SHOWN,
        default=list(SHOWN),
        help="the policies to run (default: all); tuned-table and vllm-table need none and fixed-4/8/16",
    )
    ap.add_argument("--rates", nargs="*", type=float, help="Poisson arrival rates, req/s (default 4 16; none: skip)")
    ap.add_argument(
        "--calibrations", nargs="*", default=["cpu", "gpu"], help="calibrations to run (default: cpu gpu; none: skip)"
    )
    return ap


def _grid(args: argparse.Namespace, ap: argparse.ArgumentParser) -> tuple[list[tuple], tuple[int, ...], int, str]:
    """The mode's groups, concurrencies, seeds and requests rule (setting `args.requests`), then what
    --setups, --workloads or --groups replace."""
    if args.full:
        groups = [(*s, wl) for s in SETUPS for wl in WORKLOADS]
        conc, seeds, args.requests = CONCURRENCY, SEEDS, functools.partial(requests_for, scale=1.0)
        rule = "max(512, 16 x C) requests per cell, steady window"
    elif args.smoke:
        groups, conc, seeds = [(*SETUPS[0], "mixed")], (2,), 1
        args.requests, rule = functools.partial(requests_for, scale=16 / 512), "16 requests per cell"
        args.rates, args.poisson_requests = (8,), 8
    else:
        groups, conc, seeds, args.requests = list(REDUCED_GROUPS), REDUCED_CONCURRENCY, REDUCED_SEEDS, reduced_requests
        rule = "32 requests at C=1, max(64, 8 x C) above, steady window"
    if args.setups or args.workloads:
        setups = [(g, m, int(t)) for g, m, t in (x.split(":") for x in args.setups)] if args.setups else SETUPS
        groups = [(*st, wl) for st in setups for wl in (args.workloads or WORKLOADS)]
    if args.groups:
        if args.setups or args.workloads:
            ap.error("--groups replaces --setups and --workloads")
        try:
            groups = [(g, m, int(t), wl) for g, m, t, wl in (x.split(":") for x in args.groups)]
        except ValueError:
            ap.error("--groups: gpu:model:tp:workload items, e.g. a100:llama-3-8b:1:paper")
    return groups, conc, seeds, rule


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    if set(TUNED) & set(args.policies) and not set(FIXED) <= set(args.policies):
        ap.error(f"--policies: {' and '.join(TUNED)} are tuned from the fixed runs; add {' '.join(FIXED)}")
    if args.readme_only:
        (args.out / "README.md").write_text(readme(json.loads((args.out / "results.json").read_text())))
        return
    rates = (4, 16) if args.rates is None else tuple(args.rates)
    args.rates, args.poisson_requests, args.gpu_osl, args.gpu_requests = rates, 256, 2048, 4
    args.mode = "smoke" if args.smoke else "full" if args.full else "reduced"
    custom = [f for f in ("setups", "workloads", "groups", "concurrency", "seeds") if getattr(args, f) is not None]
    custom += ["policies"] if set(args.policies) != set(SHOWN) else []
    custom += ["prefill-stall"] if args.prefill_stall != STALL else []
    custom += ["prefill-backlog-steps"] if args.prefill_backlog_steps != BACKLOG_STEPS else []
    groups, conc, seeds, rule = _grid(args, ap)
    args.groups = groups
    args.concurrency = args.concurrency or conc
    args.seeds = args.seeds or seeds
    t0 = time.perf_counter()
    runs, tuned, pois, cpu, gpu = sweep(args)
    checks = criteria(runs, gpu)
    w = workload("paper")
    res = {
        "settings": {
            "groups": [list(g) for g in args.groups],  # (gpu, model, tp, workload) pairs the grid ran
            "policies": [p for p in SHOWN if p in args.policies],
            "concurrency": list(args.concurrency),
            "seeds": args.seeds,
            "prefill": args.prefill,
            "step_tokens": STEP_TOKENS_OF,
            "prefill_stall": args.prefill_stall,
            "prefill_backlog_steps": args.prefill_backlog_steps,
            "requests_rule": rule,
            "prompt_len": w.prompt_len,
            "output_len": w.output_len,
            "host_step_s": HOST_STEP_S,
            "slo": SLO,
            "machine": f"{os.cpu_count()} CPUs",
            "jobs": args.jobs,
            "minutes": round((time.perf_counter() - t0) / 60, 1),
            "mode": args.mode + (f" ({', '.join(custom)} set by hand)" if custom else ""),
            **({"note": args.note} if args.note else {}),
        },
        "runs": sorted(
            runs, key=lambda r: (r["gpu"], r["model"], r["workload"], r["concurrency"], r["policy"], r["seed"])
        ),
        "tuned_tables": tuned,
        "poisson": pois,
        "calibration": {"cpu": cpu, "gpu": gpu},
        "checks": checks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(runs, args.out / "sim.png", args.prefill)
    (args.out / "README.md").write_text(readme(res))
    for c in checks:
        print(("PASS " if c["passed"] else "FAIL ") + c["what"] + ": " + c["figure"], flush=True)
    print(f"wrote {args.out} in {res['settings']['minutes']} min", flush=True)


if __name__ == "__main__":
    main()
