"""Serving simulated from measured profiles: the real batched loop and block-size policies on simulated A100s.

    python scripts/bench_sim.py [--out results/sim] [--smoke | --reduced]

Sweeps (closed loop) concurrency 1..256 x policies (none, fixed-4/8/16, adaptive, trtllm-schedule,
vllm-table) x workloads ("paper": each request from one of the paper's Qwen3-8B T=0 benchmarks; "mixed":
half the requests accept poorly, tau ~2 at block 16) on Llama-3-8B tp=1 and Llama-3-70B tp=4 priced by
Vidur's A100 profiles (dflash_trt/sim); a Poisson open-loop sweep; the headroom on "mixed" at C=32 (the
fixed blocks, adaptive and the oracle, which knows every row's acceptance, over several seeds); two
calibrations:

  (a) CPU: the simulator with the CPU cost grid and host overhead `make bench-load` recorded
      (results/load/results.json: in_process.cost_model, step_profile) and the demo pair's recorded
      per-prompt acceptance, on the engines-alone request stream (C=16, T=0, 64 requests, 64 new tokens),
      against the measured engines-alone tokens/s (target alone and adaptive);
  (b) GPU: the speedup of a fixed block 16 over the target alone on MATH500-like requests from
      concurrency 1 to 32, against SGLang's published DFlash curve (B200: 5.1x -> 2.8x).

Writes results.json (`runs`: one item per closed-loop cell), README.md (tables, criteria) and sim.png.
Nothing here runs a model; every figure is simulated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from dflash_trt.bench.sim_report import (
    cpu_calibration,
    criteria_table,
    gpu_calibration,
    headroom_section,
    poisson_table,
    throughput_tables,
)
from dflash_trt.sim.acceptance import AcceptanceProfile
from dflash_trt.sim.cost import LinearPassCost, ProfileCost
from dflash_trt.sim.policies import POLICIES
from dflash_trt.sim.serving import HOST_STEP_S, Workload, simulate, workload

ROOT = Path(__file__).resolve().parents[1]

HEADROOM_POLICIES = ("fixed-4", "fixed-8", "fixed-16", "adaptive", "oracle")

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
JUDGED_ROWS = 256  # the concurrency at which the policy's CPU time per step is judged (<= 2 % of a step)
SETUPS = (("a100", "llama-3-8b", 1), ("a100", "llama-3-70b", 4))
WORKLOADS = ("paper", "mixed")
SLO = {"ttft_s": 2.0, "tpot_s": 0.05}
SGLANG = {"c1": 5.1, "c32": 2.8}  # dflash.md: SGLang, one B200, Qwen3-8B MATH500


def requests_for(c: int, scale: float) -> int:
    """max(32, 4 x C), at most 512: at 2 x C the steady window (first end to last admission) held C requests
    only, and at 32 rows on `mixed` the ratios read 7-10 % above those of 4-8 x C (docs/benchmarks.md)."""
    return max(round(32 * scale), min(round(512 * scale), round(scale * 4 * c)))


def run_cell(cell: tuple[str, str, int, str, int, str, int, int]) -> dict:
    """One closed-loop cell (a worker process's unit of work): gpu, model, tp, workload, concurrency, policy,
    requests, seed."""
    gpu, model, tp, wl, c, policy, n, seed = cell
    t0 = time.perf_counter()
    r = simulate(ProfileCost(gpu, model, tp), workload(wl), policy, concurrency=c, requests=n, seed=seed)
    item = {
        "gpu": gpu,
        "model": model,
        "tp": tp,
        "workload": wl,
        "policy": policy,
        "concurrency": c,
        "seed": seed,
        "requests": r.requests,
        "tokens_per_s": round(r.tokens_per_s, 1),
        "ttft_ms": {k: round(1e3 * v, 1) for k, v in r.ttft_s.items()},
        "itl_ms": {k: round(1e3 * v, 2) for k, v in r.itl_s.items()},
        "goodput_rps": round(r.goodput_rps, 3),
        "mean_block": round(r.mean_block, 2),
        "tau": round(r.tau, 2),
        "steps": r.steps,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    if policy == "adaptive":
        item["policy_cpu_s_per_step"] = r.policy_cpu_s_per_step
        item["simulated_step_s"] = r.simulated_step_s
        item["policy_cpu_s_per_steady_step"] = r.policy_cpu_s_per_steady_step
        item["simulated_steady_step_s"] = r.simulated_steady_step_s
    return item


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def sweep(args) -> tuple[list[dict], list[dict], list[dict], dict | None, dict | None]:
    """Every cell, on `args.jobs` processes (the cells are independent; the Poisson sweep and the two
    calibrations, each one task, first, then the cells, the largest first, so that the pool ends together).
    Each process runs one simulation at a time on one core: the policy's CPU time per step is its own
    thread's; the cells where it is judged run last, alone. Returns the sweep's runs (seed 0), the
    headroom's (`headroom`), the Poisson runs and the CPU and GPU calibrations (None in a smoke run)."""
    import multiprocessing

    cells = [
        (gpu, model, tp, wl, c, policy, requests_for(c, args.scale), 0)
        for gpu, model, tp in args.setups
        for wl in args.workloads
        for c in args.concurrency
        for policy in args.policies
    ]
    n_sweep = len(cells)
    hc = args.headroom_c
    cells += [
        (gpu, model, tp, "mixed", hc, policy, requests_for(hc, args.scale), seed)
        for gpu, model, tp in args.setups
        for seed in range(1, args.headroom_seeds + 1)
        for policy in HEADROOM_POLICIES
    ]
    cells += [  # the oracle at seed 0, beside the sweep's cells of that seed
        (gpu, model, tp, "mixed", hc, "oracle", requests_for(hc, args.scale), 0) for gpu, model, tp in args.setups
    ]
    # The cells whose policy CPU time is judged (adaptive at 256 rows) run after the pool, one at a time: beside
    # another simulation on the second core, the policy's cold-cache numpy calls ran slower (shared cache and
    # memory), and a server's host thread does not share its CPU with a second simulation.
    judged = {i for i, cell in enumerate(cells) if cell[5] == "adaptive" and cell[4] == JUDGED_ROWS and cell[7] == 0}
    order = sorted((i for i in range(len(cells)) if i not in judged), key=lambda i: -cells[i][4])
    runs: list[dict | None] = [None] * len(cells)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, initializer=_one_thread) as pool:
        pois = pool.apply_async(poisson, (args,))
        cpu = pool.apply_async(calibrate_cpu, (args.load_results,)) if not args.smoke else None
        gpu = pool.apply_async(calibrate_gpu, (args,)) if not args.smoke else None
        for i, item in zip(order, pool.imap(run_cell, [cells[i] for i in order])):
            runs[i] = item
            print(json.dumps(item), flush=True)
        pois_runs, cpu_cal, gpu_cal = pois.get(), cpu and cpu.get(), gpu and gpu.get()
    alone = sorted(judged)
    with ctx.Pool(1, initializer=_one_thread) as pool:
        for i, item in zip(alone, pool.imap(run_cell, [cells[i] for i in alone])):
            runs[i] = item
            print(json.dumps(item), flush=True)
    done = [r for r in runs if r is not None]
    return done[:n_sweep], done[n_sweep:], pois_runs, cpu_cal, gpu_cal


def headroom(sweep_runs: list[dict], extra: list[dict], c: int) -> list[dict]:
    """Per setup, "mixed" at C = c: each policy's tokens/s over the seeds (the sweep's seed 0 and the extra
    seeds), the means' ratios to the best fixed block. The oracle measures what better acceptance estimates
    could add: where adaptive is level with it, they would not help."""
    out = []
    mine = sorted(
        [r for r in sweep_runs if r["workload"] == "mixed" and r["concurrency"] == c] + extra, key=lambda r: r["seed"]
    )
    for model, tp in sorted({(r["model"], r["tp"]) for r in mine}):
        gpu = next(r["gpu"] for r in mine if (r["model"], r["tp"]) == (model, tp))
        cost, past = ProfileCost(gpu, model, tp), [512] * c  # the price of 4 tokens a row against 1 (prompts' median)
        block4 = cost.target([4] * c, past, 4 * c) / cost.target([1] * c, past, c)
        by: dict[str, list[float]] = {}
        for r in mine:
            if (r["model"], r["tp"]) == (model, tp) and r["policy"] in HEADROOM_POLICIES:
                by.setdefault(r["policy"], []).append(r["tokens_per_s"])
        mean = {p: sum(v) / len(v) for p, v in by.items()}
        best = max(mean[p] for p in ("fixed-4", "fixed-8", "fixed-16") if p in mean)
        out.append(
            {
                "model": model,
                "tp": tp,
                "concurrency": c,
                "seeds": len(by.get("adaptive", [])),
                "verify_4_over_1": round(block4, 3),
                "tokens_per_s": {p: [round(x, 1) for x in v] for p, v in by.items()},
                "mean_tokens_per_s": {p: round(v, 1) for p, v in mean.items()},
                "vs_best_fixed": {p: round(v / best, 3) for p, v in mean.items()},
            }
        )
    return out


def poisson(args) -> list[dict]:
    out = []
    cost = ProfileCost("a100", "llama-3-8b", 1)
    work = workload("paper")
    for rate in args.rates:
        for policy in ("none", "fixed-8", "adaptive", "trtllm-schedule", "vllm-table"):
            r = simulate(cost, work, policy, rate=rate, requests=args.poisson_requests)
            out.append(
                {
                    "gpu": "a100",
                    "model": "llama-3-8b",
                    "tp": 1,
                    "workload": "paper",
                    "policy": policy,
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
    """(b): fixed block 16 over the target alone, MATH500-like (tau 7.87), concurrency 1 and 32."""
    cost = ProfileCost("a100", "llama-3-8b", 1)
    work = workload("math500", prompt_len="lognormal:150,0.4,32-1024", output_len=f"fixed:{args.gpu_osl}")
    out: dict = {"gpu": "a100", "model": "llama-3-8b", "tp": 1, "osl": args.gpu_osl, "published": SGLANG}
    for c in (1, 32):
        tps = {
            p: simulate(cost, work, p, concurrency=c, requests=requests_for(c, args.scale)).tokens_per_s
            for p in ("none", "fixed-16", "adaptive")
        }
        out[f"c{c}"] = {p: round(v, 1) for p, v in tps.items()}
        out[f"speedup_c{c}"] = round(tps["fixed-16"] / tps["none"], 2)
        out[f"adaptive_speedup_c{c}"] = round(tps["adaptive"] / tps["none"], 2)
    # what-if (labelled, not a profile): the A100 profile with its token axis stretched 1.8x and times 3.9x
    # shorter, B200-like (bf16 peak / HBM bandwidth: A100 312 TFLOP/s / 2.0 TB/s = 153 flop/B, B200
    # 2250 / 8 = 281 flop/B, so its matrices turn compute bound ~1.8x later; 8 / 2.04 TB/s = 3.9x faster)
    what_if = ProfileCost("a100", "llama-3-8b", 1, token_scale=1.8, time_scale=3.9)
    w = {}
    for c in (1, 32):
        tps = {
            p: simulate(what_if, work, p, concurrency=c, requests=requests_for(c, args.scale)).tokens_per_s
            for p in ("none", "fixed-16")
        }
        w[f"speedup_c{c}"] = round(tps["fixed-16"] / tps["none"], 2)
    w["decay"] = round(w["speedup_c32"] / w["speedup_c1"], 3)
    out["what_if_b200_like"] = w
    sim_decay = out["speedup_c32"] / out["speedup_c1"]
    pub_decay = SGLANG["c32"] / SGLANG["c1"]
    out["simulated_decay"] = round(sim_decay, 3)
    out["published_decay"] = round(pub_decay, 3)
    out["decay_error"] = round(sim_decay / pub_decay - 1, 3)
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def criteria(runs: list[dict], cpu: dict | None, room: list[dict] = ()) -> tuple[list[dict], dict]:
    checks, ratios = [], {}
    cells: dict = {}
    for r in runs:
        cells.setdefault((r["model"], r["tp"], r["workload"], r["concurrency"]), {})[r["policy"]] = r
    groups: dict = {}
    for (model, tp, wl, c), cell in sorted(cells.items()):
        if "adaptive" not in cell:
            continue
        a = cell["adaptive"]["tokens_per_s"]
        base = [cell[p]["tokens_per_s"] for p in ("none", "fixed-4", "fixed-8", "fixed-16") if p in cell]
        row = {"vs_best_base": a / max(base) if base else None}
        for peer in ("trtllm-schedule", "vllm-table"):
            if peer in cell:
                row[f"vs_{peer}"] = a / cell[peer]["tokens_per_s"]
        fixed = [cell[p]["tokens_per_s"] for p in ("fixed-4", "fixed-8", "fixed-16") if p in cell]
        row["vs_best_fixed"] = a / max(fixed) if fixed else None
        ratios[f"{model}/tp{tp}/{wl}/c{c}"] = {k: round(v, 3) for k, v in row.items() if v is not None}
        groups.setdefault((model, tp, wl), []).append((c, row, cell))
    for (model, tp, wl), items in groups.items():
        tag = f"{model} tp={tp} {wl}"
        low = min(items, key=lambda x: x[1]["vs_best_base"])
        checks.append(
            {
                "what": f"{tag}: adaptive >= 0.97x best of none/fixed at every concurrency",
                "passed": low[1]["vs_best_base"] >= 0.97,
                "figure": f"lowest {low[1]['vs_best_base']:.3f}x (c={low[0]})",
            }
        )
        for peer in ("trtllm-schedule", "vllm-table"):
            vals = [(c, row[f"vs_{peer}"]) for c, row, _ in items if f"vs_{peer}" in row]
            if not vals:
                continue
            lowp = min(vals, key=lambda x: x[1])
            g = geomean([v for _, v in vals])
            checks.append(
                {
                    "what": f"{tag}: adaptive >= 0.99x {peer} at every concurrency, geomean >= 1.05x",
                    "passed": lowp[1] >= 0.99 and g >= 1.05,
                    "figure": f"lowest {lowp[1]:.3f}x (c={lowp[0]}), geomean {g:.3f}x",
                }
            )
        for h in room:
            if wl == "mixed" and (h["model"], h["tp"]) == (model, tp) and "adaptive" in h["vs_best_fixed"]:
                v = h["vs_best_fixed"]
                checks.append(
                    {
                        "what": f"{tag} c={h['concurrency']}: adaptive >= 1.1x the best fixed block "
                        f"(mean of {h['seeds']} seeds)",
                        "passed": v["adaptive"] >= 1.1,
                        "figure": f"{v['adaptive']:.3f}x (oracle {v.get('oracle', float('nan')):.3f}x)",
                    }
                )
        for c, _, cell in items:
            if c == JUDGED_ROWS:
                a = cell["adaptive"]
                # judged on the steady window (256 requests in the batch all along); the whole run's means beside
                share = a["policy_cpu_s_per_steady_step"] / a["simulated_steady_step_s"]
                run_share = a["policy_cpu_s_per_step"] / a["simulated_step_s"]
                checks.append(
                    {
                        "what": f"{tag} c={JUDGED_ROWS}: policy CPU per step at {JUDGED_ROWS} rows (steady window, cell run alone) "
                        "<= 2 % of the simulated step",
                        "passed": share <= 0.02,
                        "figure": f"{1e3 * a['policy_cpu_s_per_steady_step']:.2f} ms of "
                        f"{1e3 * a['simulated_steady_step_s']:.1f} ms ({100 * share:.2f} %; whole run "
                        f"{1e3 * a['policy_cpu_s_per_step']:.2f} ms of {1e3 * a['simulated_step_s']:.1f} ms, "
                        f"{100 * run_share:.2f} %)",
                    }
                )
    if cpu:
        worst = max(abs(m["error"]) for m in cpu["modes"].values())
        checks.append(
            {
                "what": "calibration (a): simulated engines-alone tokens/s within 15 % of measured (CPU)",
                "passed": worst <= 0.15,
                "figure": ", ".join(
                    f"{k} {m['simulated_tokens_per_s']:.0f} vs {m['measured_tokens_per_s']:.0f} ({100 * m['error']:+.1f} %)"
                    for k, m in cpu["modes"].items()
                ),
            }
        )
    return checks, ratios


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["tp"], r["workload"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (model, tp, wl) in zip(axes[0], panels):
        for policy in POLICIES:
            pts = sorted(
                (r["concurrency"], r["tokens_per_s"])
                for r in runs
                if (r["model"], r["tp"], r["workload"], r["policy"]) == (model, tp, wl, policy)
            )
            if pts:
                style = {"lw": 2.5, "color": "black"} if policy == "adaptive" else {"lw": 1.2}
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=policy, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"A100 {model} tp={tp}, {wl}", fontsize=9)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s (simulated)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Simulated from measured profiles (Vidur A100 op profiles), not measured on a GPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


HOW_TO_READ = [
    "",
    "How to read it: one seed per cell and the policies' trajectories diverge, so a cell's ratio carries a",
    "few percent of luck; the C=32 `mixed` check is the mean of several seeds (the headroom below). The",
    "design choices behind the adaptive policy were measured over several seeds (docs/benchmarks.md,",
    '"Measurements behind design choices"). The adaptive server measures its token curve at start-up on a',
    "GPU (one-row passes every 8 tokens to 512, then coarser), as it does here: the profile is a staircase",
    "(GEMM tiles) and the best choices end a step at a tile's end.",
]
LEAVES_OUT = [
    "",
    "## What the simulation leaves out",
    "",
    "CUDA graphs and kernel launch gaps (a pass is its ops' profiled medians plus one named launch constant),",
    "paged-KV fragmentation and KV capacity limits (every row fits), network jitter and multi-node",
    "communication (one DGX node's profiled all-reduce), overlap of host work with the GPU, sampling at",
    "T > 0, chunked prefill (a joining batch's prompts are one pass), Vidur's measured attention kernels",
    "(absent from the snapshot: attention is a bandwidth/FLOP model), per-position acceptance shape (assumed",
    "decay 0.99 per position; tau per benchmark exact), and the B200 of the published SGLang curve (no",
    "profile: A100 is the nearest).",
    "",
    "## The attention model's check",
    "",
    "FlashAttention-2 (Dao 2023, fig. 4, A100, head dim 128) runs the causal forward pass at 150-200+ TFLOP/s",
    "for sequences of 1k-16k tokens, so a 2048-token causal prefill at 32 heads (34 GFLOP per layer:",
    "4 x 32 x 128 x 2048 x 1024.5) takes about 5.5-7.3 ms over 32 layers; the model gives 5.9 ms",
    "(tests/sim/test_sim.py holds it to that range).",
    "",
]


def intro(s: dict) -> list[str]:
    return [
        "# Serving simulated from measured profiles (A100)",
        "",
        "**Simulated, not measured on a GPU.** The real batched loop (`BatchDecoder`) and block-size policies run",
        "on fake engines whose passes advance a virtual clock by the time Vidur's measured A100 operator profiles",
        "give for their shape (`dflash_trt/sim`, data in `data/profiles/vidur/`). Acceptance: per-position rates",
        "fitted to the paper's Qwen3-8B T=0 block-16 table (tau 4.24 MT-Bench .. 7.87 MATH500).",
        f"Made by `make bench-sim` ({s['minutes']} min on {s['machine']}).",
        "",
        f"Closed loop, {s['requests_rule']}; prompts `{s['prompt_len']}`, outputs `{s['output_len']}` tokens; host",
        f"overhead {1e3 * s['host_step_s']:.2f} ms per step; greedy (T=0). Goodput: requests/s with TTFT <= "
        f"{SLO['ttft_s']} s and mean ITL <= {1e3 * SLO['tpot_s']:.0f} ms.",
        "",
        "![tokens/s vs concurrency](sim.png)",
        "",
    ]


def gpu_why(g: dict) -> list[str]:
    """Why the simulated A100 curve decays faster than the published B200 one, and the labelled what-if."""
    w = g["what_if_b200_like"]
    return [
        "",
        "Why they differ: on the A100 profile a 512-token pass (32 rows x block 16) costs 3.6x a 32-token one",
        "(Vidur: 1.11 vs 0.31 ms per layer), the verify block is compute bound at C=32; a B200 has 1.8x the",
        "A100's FLOPs per byte of bandwidth (281 vs 153), so its matrices stay weight bound ~1.8x further.",
        "A labelled what-if, the A100 profile with its token axis stretched 1.8x and times 3.9x shorter",
        f"(B200-like, not a profile): {w['speedup_c1']}x -> {w['speedup_c32']}x (decay {w['decay']}). What remains is not",
        "modelled: the published run's longer generations (attention, which a verify block shares, weighs more",
        "in the baseline), SGLang's own per-step costs in its target-alone baseline, and the B200 itself.",
    ]


def readme(res: dict) -> str:
    lines = intro(res["settings"]) + criteria_table(res["checks"], "Criteria (issue 28)") + HOW_TO_READ
    for h in res.get("headroom", []):
        lines += headroom_section(h, HEADROOM_POLICIES)
    lines += throughput_tables(res["runs"], POLICIES)
    if res.get("poisson"):
        lines += poisson_table(res["poisson"], "Open loop (Poisson), A100 Llama-3-8B tp=1, `paper`")
    cal = res.get("calibration", {})
    if cal.get("cpu"):
        lines += cpu_calibration(cal["cpu"])
    if cal.get("gpu"):
        g = cal["gpu"]
        lines += gpu_calibration(
            g, "MATH500-like requests (tau 7.87)", "SGLang's DFlash on one B200 (Qwen3-8B MATH500)"
        )
        lines += gpu_why(g)
    return "\n".join(lines + LEAVES_OUT)


def rewrite_readme(out: Path) -> None:
    """README.md again from results.json (after a change to its text only)."""
    (out / "README.md").write_text(readme(json.loads((out / "results.json").read_text())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "sim", help="output folder")
    ap.add_argument("--smoke", action="store_true", help="a few cells only (seconds): checks the pipeline")
    ap.add_argument("--reduced", action="store_true", help="concurrency 1/8/32/256, half the requests")
    ap.add_argument("--readme-only", action="store_true", help="rewrite README.md from the folder's results.json")
    ap.add_argument("--load-results", type=Path, default=ROOT / "results" / "load" / "results.json")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one per CPU)")
    ap.add_argument(
        "--headroom-seeds",
        type=int,
        default=2,
        help="seeds beyond the sweep's for the headroom cells (mixed, C=32; default 2: 3 seeds in all)",
    )
    args = ap.parse_args()
    if args.readme_only:
        return rewrite_readme(args.out)
    args.setups, args.workloads, args.policies = SETUPS, WORKLOADS, POLICIES
    args.concurrency, args.scale, args.rates, args.poisson_requests, args.gpu_osl = CONCURRENCY, 1.0, (4, 16), 96, 512
    args.headroom_c = 32
    if args.reduced:
        args.concurrency, args.scale, args.poisson_requests, args.gpu_osl = (1, 8, 32, 256), 0.5, 48, 256
    if args.smoke:
        args.setups, args.workloads = (SETUPS[0],), ("mixed",)
        args.concurrency, args.scale, args.rates, args.poisson_requests, args.gpu_osl = (2,), 0.25, (8,), 8, 32
        args.headroom_c, args.headroom_seeds = 2, 1
    t0 = time.perf_counter()
    runs, extra, pois, cpu, gpu = sweep(args)
    room = headroom(runs, extra, args.headroom_c)
    checks, ratios = criteria(runs, cpu, room)
    if gpu:
        checks.append(
            {
                "what": "calibration (b): simulated speedup decay C=1 -> 32 within +-25 % of SGLang's",
                "passed": abs(gpu["decay_error"]) <= 0.25,
                "figure": f"{gpu['speedup_c1']}x -> {gpu['speedup_c32']}x (decay {gpu['simulated_decay']}) vs "
                f"5.1x -> 2.8x ({gpu['published_decay']})",
            }
        )
    w = workload("paper")
    res = {
        "settings": {
            "setups": [list(s) for s in args.setups],
            "workloads": list(args.workloads),
            "policies": list(args.policies),
            "concurrency": list(args.concurrency),
            "requests_rule": f"max({round(32 * args.scale)}, {4 * args.scale:g} x C) requests per cell (at most "
            f"{round(512 * args.scale)}), steady window",
            "prompt_len": w.prompt_len,
            "output_len": w.output_len,
            "host_step_s": HOST_STEP_S,
            "slo": SLO,
            "machine": f"{os.cpu_count()} CPUs",
            "minutes": round((time.perf_counter() - t0) / 60, 1),
            "mode": "smoke" if args.smoke else "reduced" if args.reduced else "full",
        },
        "runs": runs,
        "headroom": room,
        "poisson": pois,
        "calibration": {"cpu": cpu, "gpu": gpu},
        "ratios": ratios,
        "checks": checks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(runs, args.out / "sim.png")
    (args.out / "README.md").write_text(readme(res))
    for c in checks:
        print(("PASS " if c["passed"] else "FAIL ") + c["what"] + ": " + c["figure"], flush=True)
    print(f"wrote {args.out} in {res['settings']['minutes']} min", flush=True)


if __name__ == "__main__":
    main()
