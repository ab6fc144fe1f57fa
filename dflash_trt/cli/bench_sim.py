"""`dflash-trt bench sim` (`make bench-sim`): the command line and the run that writes results.json, README.md
and sim.png. The package dflash_trt.bench.sim (grid, calibrations, checks, report) says in its docstring what it
simulates; the simulator itself is dflash_trt.sim."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from ..bench import sim as sim_bench
from ..bench.sim.calibrate import calibrate_cpu, calibrate_gpu
from ..bench.sim.checks import criteria
from ..bench.sim.grid import (
    CONCURRENCY,
    PHASE1,
    PREFILL_AT,
    REDUCED_CONCURRENCY,
    REDUCED_GROUPS,
    REDUCED_SEEDS,
    SEEDS,
    SETUPS,
    SHOWN,
    SLO,
    WORKLOADS,
    _cells,
    _one_thread,
    poisson,
    reduced_requests,
    requests_for,
    run_cell,
    tuned_tables,
)
from ..bench.sim.report import plot, readme
from ..decoding.chunking import BACKLOG_STEPS, STALL
from ..decoding.proposers import DEFAULT_PROPOSER, PROPOSERS, proposer_for, proposers_help
from ..settings import REPO_ROOT
from ..sim.measured import DEMO_LOAD
from ..sim.policies import FIXED, STEP_TOKENS_OF, TUNED
from ..sim.serving import host_step_s, workload
from ..sim.suffix import Proposing, SuffixTrace, recorded_workloads
from .options import non_negative_int, stall_factor

ABOUT = sim_bench.__doc__ or ""  # the package's docstring: what the run is


def sweep(
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
    """Phase 1, the tables it tunes, phase 2, on `args.jobs` processes (the largest cells first); the Poisson
    sweep and the calibrations beside phase 1."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    runs: list[dict[str, Any]] = []
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
        pois_runs = pois.get()
        cpu_cal = cpu.get() if cpu is not None else None
        gpu_cal = gpu.get() if gpu is not None else None
    return runs, tables, pois_runs, cpu_cal, gpu_cal


def _prefill_options(ap: argparse.ArgumentParser) -> None:
    """The grid's prefill mode and chunk pacing (the server's options of the same names)."""
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


def _proposer_options(ap: argparse.ArgumentParser) -> None:
    """The proposer every simulated request names, and the recorded trace its suffix matches replay."""
    ap.add_argument(
        "--proposer",
        choices=PROPOSERS,
        default=DEFAULT_PROPOSER,
        help=f"what every request drafts with (the server's --proposer): {proposers_help()};\n"
        f"a proposer's suffix matches are replayed from --suffix-trace (default: {DEFAULT_PROPOSER})",
    )
    ap.add_argument(
        "--suffix-trace",
        default="rewrite",
        help=f"the recorded workload whose suffix rounds are replayed (data/measured/suffix-trace.json, recorded\n"
        f"on the demo pair by `dflash-trt bench suffix-trace`: {', '.join(recorded_workloads()) or 'missing'};\n"
        f"default: rewrite), or a file of `dflash-trt generate --json --trace --proposer suffix` outputs, one a line",
    )
    ap.add_argument(
        "--suffix-prior-from",
        default=None,
        help="a trace recorded on other prompts (as --suffix-trace names one) whose pooled acceptance sets the\n"
        "replayed matches' prior: the proposers' table out of sample (default: --suffix-trace's own)",
    )


def _proposing(args: argparse.Namespace, ap: argparse.ArgumentParser) -> dict[str, str]:
    """Set `args.proposing` (what `grid._pacing` hands every cell) from --proposer and --suffix-trace; the
    settings that record them."""
    try:
        trace = SuffixTrace.resolve(args.suffix_trace) if proposer_for(args.proposer).keeps_suffix else None
        if trace is not None and args.suffix_prior_from:
            trace = trace.prior_from(SuffixTrace.resolve(args.suffix_prior_from))
    except (ValueError, FileNotFoundError) as e:
        ap.error(f"--suffix-trace / --suffix-prior-from: {e}")
    args.proposing = Proposing(args.proposer, trace)
    recorded = {"suffix_trace": args.suffix_trace, "suffix_prior_from": args.suffix_prior_from}
    return {"proposer": args.proposer, **(recorded if trace is not None else {})}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "sim", help="output folder")
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
    ap.add_argument(
        "--load-results",
        type=Path,
        default=DEMO_LOAD,
        help="the demo pair's measured figures for calibration (a): a results.json of make bench-load\n"
        "(default data/measured/demo-load.json, the copy the package reads)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one per CPU)")
    _prefill_options(ap)
    _proposer_options(ap)
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


def _grid(
    args: argparse.Namespace, ap: argparse.ArgumentParser
) -> tuple[list[tuple[Any, ...]], tuple[int, ...], int, str]:
    """The mode's groups, concurrencies, seeds and requests rule (setting `args.requests`), then what
    --setups, --workloads or --groups replace."""
    conc: tuple[int, ...]
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


def _set_by_hand(args: argparse.Namespace) -> list[str]:
    """The options that moved the run off its mode's grid (the settings' "mode" names them)."""
    custom = [f for f in ("setups", "workloads", "groups", "concurrency", "seeds") if getattr(args, f) is not None]
    custom += ["policies"] if set(args.policies) != set(SHOWN) else []
    custom += ["prefill-stall"] if args.prefill_stall != STALL else []
    custom += ["prefill-backlog-steps"] if args.prefill_backlog_steps != BACKLOG_STEPS else []
    return custom + ([f"proposer {args.proposer}"] if args.proposer != DEFAULT_PROPOSER else [])


def cmd_sim(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The run; `ap` (the `sim` parser) reports a usage error as argparse does (exit 2)."""
    if set(TUNED) & set(args.policies) and not set(FIXED) <= set(args.policies):
        ap.error(f"--policies: {' and '.join(TUNED)} are tuned from the fixed runs; add {' '.join(FIXED)}")
    if args.readme_only:
        (args.out / "README.md").write_text(readme(json.loads((args.out / "results.json").read_text())))
        return 0
    proposer_settings = _proposing(args, ap)
    rates = (4, 16) if args.rates is None else tuple(args.rates)
    args.rates, args.poisson_requests, args.gpu_osl, args.gpu_requests = rates, 256, 2048, 4
    args.mode = "smoke" if args.smoke else "full" if args.full else "reduced"
    custom = _set_by_hand(args)
    groups, conc, seeds, rule = _grid(args, ap)
    args.groups = groups
    args.concurrency = args.concurrency or conc
    args.seeds = args.seeds or seeds
    t0 = time.perf_counter()
    runs, tuned, pois, cpu, gpu = sweep(args)
    checks = criteria(runs, gpu)
    w = workload("paper")
    res: dict[str, Any] = {
        "settings": {
            "groups": [list(g) for g in args.groups],  # (gpu, model, tp, workload) pairs the grid ran
            "policies": [p for p in SHOWN if p in args.policies],
            "concurrency": list(args.concurrency),
            "seeds": args.seeds,
            "prefill": args.prefill,
            "step_tokens": STEP_TOKENS_OF,
            "prefill_stall": args.prefill_stall,
            "prefill_backlog_steps": args.prefill_backlog_steps,
            **proposer_settings,
            "requests_rule": rule,
            "prompt_len": w.prompt_len,
            "output_len": w.output_len,
            "host_step_s": host_step_s(1),
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
    return 0
