"""The simulator's two calibrations: (a) against the CPU figures `make bench-load` measured on the demo pair
(data/measured/demo-load.json), (b) against SGLang's published DFlash curve on a GPU."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...sim.acceptance import AcceptanceProfile
from ...sim.cost import LinearPassCost, PassCost, ProfileCost
from ...sim.measured import read
from ...sim.serving import Workload, host_step_s, simulate, workload
from ...sim.suffix import Proposing
from .grid import SGLANG, _pacing


def calibrate_cpu(load_path: Path) -> dict[str, Any] | None:
    """(a): the simulator on the CPU grid the load benchmark measured, against its engines-alone figures."""
    if not load_path.exists():
        return None
    data = read(load_path, "demo-load")
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
    host = 1e-3 * sum(prof.get(k, 0.0) for k in ("policy_ms", "accept_ms", "overhead_ms")) or host_step_s(1)
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
    out: dict[str, Any] = {
        "concurrency": c,
        "requests": n_req,
        "osl": osl,
        "host_step_s": host,
        "k": round(k, 3),
        "modes": {},
    }
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


def simulate_stream(cost: PassCost, work: Workload, policy: str, reqs: list[Any], c: int, host: float) -> float:
    """`steady_state` of `dflash-trt bench load` (dflash_trt/bench/load.py) on the simulated engines: c in flight, a finished row replaced at
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


def calibrate_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """(b): fixed block 16 over the target alone, MATH500-like requests at T = 0 and T = 1 acceptance,
    `args.gpu_osl` new tokens (2048: the published conditions), concurrency 1 and 32, on the A100 profile and
    the B200-like what-if. Every request the same length, so a cell's tokens/s is over its whole run (all C
    rows start together, as in a benchmark client at that concurrency)."""
    out: dict[str, Any] = {"osl": args.gpu_osl, "published": SGLANG, "model": "llama-3-8b", "tp": 1, "runs": {}}
    for name, cost in (("a100", ProfileCost()), ("b200-like-what-if", ProfileCost.what_if("b200-like-what-if"))):
        for wl in ("math500", "math500-t1"):
            work = workload(wl, prompt_len="lognormal:150,0.4,32-1024", output_len=f"fixed:{args.gpu_osl}")
            cell: dict[str, Any] = {}
            for c in (1, 32):
                for p in ("none", "fixed-16", "adaptive"):
                    pacing = _pacing(args) | {"proposing": Proposing()}  # DFlash, as the published figures
                    r = simulate(cost, work, p, concurrency=c, requests=max(args.gpu_requests, c), **pacing)
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


def pass_ratios(cost: ProfileCost, past: int = 1024) -> dict[str, Any]:
    """What the profile says about the decay: at 32 rows, a verify pass of block 16 over one of 1 token (the
    whole target pass, and the layer ops alone), at `past` tokens cached (mid-generation of 2048)."""
    whole = cost.target([16] * 32, [past] * 32, 512) / cost.target([1] * 32, [past] * 32, 32)
    ops = cost.op(512) / cost.op(32)
    one = cost.target([16], [past], 16) / cost.target([1], [past], 1)
    return {"verify16_over_1_c32": round(whole, 2), "layer_ops_512_over_32": round(ops, 2), "c1": round(one, 3)}
