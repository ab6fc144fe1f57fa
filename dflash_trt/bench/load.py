"""`dflash-trt bench load`: load benchmark of `dflash-trt serve` with NVIDIA's aiperf, against Hugging Face batched
generate().

Held-out code prompts (never trained on), OpenAI completions endpoint, streaming, every request exactly
--osl tokens (ignore_eos), at each concurrency C in --concurrency and temperature T in --temperatures:

    hf-generate    Hugging Face generate() on left-padded batches of C of the same prompts, in this
                   process, no speculation: the external reference (no HTTP, so it is flattered, not
                   handicapped). It takes its turn in the same rotation as the servers, so that its runs
                   and theirs fall in the same minutes of the machine's drift
    target         the server with --block-size 1: the batched target alone, same step loop
    dflash-b8      the server with --block-size 8: DFlash at a fixed block of 8
    adaptive       the server's adaptive policy with DFlash drafts (--proposer dflash): block size chosen per
                   step and per request
    hybrid         the same with --proposer hybrid: per row and round a DFlash block or a suffix run
                   (decoding/proposers.py), whichever is expected to earn more; the benchmark is one client, so
                   its requests share finished outputs (--suffix-sharing all)
    hybrid-own     the hybrid without the structure shared across requests (the server's default, sharing off):
                   each request matches its own tokens only. The cells repeat the same prompts, so the shared
                   hybrid's later runs draft from the earlier runs' answers; this mode shows the gain without that

Each cell is run --load-repeats times, every mode (HF generate included) back to back in a rotating order,
and reports its median run. aiperf measures output tokens/s, time to first token and inter-token latency
(avg, p50, p99) per cell. It
shares the machine with the server, so it runs at a lower priority (--client-nice) and uses idle CPU only.
In process, on the same models, it also measures per prompt (T = 0, 1 row, best of --repeats): the target alone, the
decoder at a fixed block of 8 and with adaptive blocks (each a batch of one), on the code
prompts (--osl tokens) and on --long-prompts longer ones (--long-osl tokens, where a weak drafter misses),
and the profile of one batched adaptive step at 16 rows (draft / verify / acceptance / policy / Python);
and, at C=16 T=0, the engines alone: HF generate() against the batched decoder's steady state (target
alone, adaptive) in this process, with no server and no client, which bounds what any server cell can reach.

Writes results/load/{results.json, README.md, load.png} and aiperf's exports under results/load/aiperf/.
Run it on a quiet machine: other processes' CPU time shows up as noise in every ratio.

    make bench-load
    dflash-trt bench load --concurrency 1,16 --temperatures 0 --modes target,adaptive
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_trt.bench.aiperf import AiperfFailed, AiperfRun, run_aiperf, value
from dflash_trt.bench.load_report import load_markdown
from dflash_trt.bench.methods import HFReference, hf_generate_batch
from dflash_trt.bench.prompts import held_out_code_prompts
from dflash_trt.settings import REPO_ROOT

if TYPE_CHECKING:
    from dflash_trt.decoding import BatchDecoder
    from dflash_trt.decoding.cost import CostModel
    from dflash_trt.runtime.base import DrafterEngine, TargetEngine

MODES = {  # server flags per mode
    "target": ["--block-size", "1"],
    "dflash-b8": ["--block-size", "8", "--proposer", "dflash"],
    "adaptive": ["--proposer", "dflash"],
    # the benchmark is one client: its requests may share finished outputs (--suffix-sharing all); it sends the
    # same prompts in every run, so the shared hybrid drafts a repeated greedy request from the earlier answer
    "hybrid": ["--proposer", "hybrid", "--suffix-sharing", "all"],
    "hybrid-own": ["--proposer", "hybrid"],  # the server's default: no sharing
}
STEP_KEYS = ("prefill_s", "policy_s", "draft_s", "verify_s", "accept_s", "overhead_s", "total_s")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--aiperf", default=str(REPO_ROOT / ".venv-aiperf/bin/aiperf"), help="the aiperf executable")
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated concurrencies (default 1,4,16,32)")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (default 0,1)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"server modes (default {','.join(MODES)})")
    ap.add_argument("--prompts", type=int, default=32, help="held-out code prompts (default 32)")
    ap.add_argument("--osl", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument(
        "--min-requests",
        type=int,
        default=16,
        help="requests per cell: max(this, 4 x concurrency) (default 16): several waves, so the server "
        "runs in its steady state (finished rows replaced by new ones), not one batch's straggler tail",
    )
    ap.add_argument("--long-prompts", type=int, default=8, help="longer held-out prompts, per-prompt check (default 8)")
    ap.add_argument("--long-osl", type=int, default=256, help="tokens per long prompt (default 256)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="per-prompt timings keep the best of this many runs (default 3; a 64-token run is so short "
        "that a burst of load elsewhere decides a single timing)",
    )
    ap.add_argument(
        "--drafter-dtype",
        default=None,
        help="the drafter's dtype, in the servers and in process (default: the target's, as every "
        "`dflash-trt` command; auto: bfloat16 on a CPU with AMX or AVX512-BF16)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads, here and in the servers")
    ap.add_argument(
        "--load-repeats",
        type=int,
        default=3,
        help="runs per cell, the modes and HF generate back to back in a rotating order (default 3; "
        "the cell reports its median run)",
    )
    ap.add_argument(
        "--client-nice",
        type=int,
        default=15,
        help="run aiperf at this niceness (default 15; 0 = as the server): on a machine it shares with "
        "the server, the client's own CPU use slows what it measures, which a client on another machine "
        "would not; the Hugging Face reference runs with no client at all",
    )
    ap.add_argument(
        "--skip-in-process",
        action="store_true",
        help="only the aiperf cells (no HF generate reference, no per-prompt runs, no step profile)",
    )
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "load", help="output folder")


def resolved_drafter_dtype(name: str | None) -> str:
    from dflash_trt.loading import drafter_dtype
    from dflash_trt.runtime.base import dtype_name

    return dtype_name(drafter_dtype(name, torch.float32, torch.device("cpu")))


def requests_for(c: int, args: argparse.Namespace) -> int:
    return max(int(args.min_requests), 4 * c)


# ---- in process: per-prompt ratios, the step profile ----------------------
def in_process(args: argparse.Namespace, code_texts: list[str], long_texts: list[str]) -> dict[str, Any]:
    from dflash_trt.config import validate_against_target
    from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder, GenerationConfig, SamplingParams
    from dflash_trt.decoding.cost import measure_costs
    from dflash_trt.decoding.request import GenerationResult
    from dflash_trt.loading import drafter_dtype
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.target import load_target, load_tokenizer
    from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

    model = load_target(args.target, torch.float32)
    tok = load_tokenizer(args.target)
    if tok is None:
        raise SystemExit(f"{args.target}: no tokenizer (the benchmark's prompts are text)")
    drafter = DFlashDrafter.from_pretrained(
        args.drafter, drafter_dtype(args.drafter_dtype, torch.float32, torch.device("cpu"))
    )
    validate_against_target(drafter.config, drafter.spec, model.config)
    layers = drafter.spec.target_layer_ids
    code = [tok.encode(t, add_special_tokens=False) for t in code_texts]
    long = [tok.encode(t, add_special_tokens=False) for t in long_texts]
    out: dict[str, Any] = {"per_prompt": [], "step_profile": {}, "repeats": args.repeats}

    # per prompt, one request at a time: target alone, DFlash at the trained block size, adaptive
    btarget = TorchTargetEngine(model, layers)
    bdrafter = TorchDrafterEngine.for_target(drafter, btarget)
    single = BatchDecoder(btarget, bdrafter)
    t0 = time.perf_counter()
    cost = measure_costs(btarget, bdrafter, rows=(1, 4, 16), blocks=(1, 4, 8), context=150, repeats=2)
    out["cost_model"] = {
        "target": vars(cost.target),
        "drafter": vars(cost.drafter),
        "measured_s": round(time.perf_counter() - t0, 2),
    }
    adaptive = BatchDecoder(btarget, bdrafter, policy=AdaptiveBlocks(cost))

    def timed(
        fn: Callable[[], GenerationResult],
    ) -> tuple[GenerationResult, float]:  # best of --repeats: load from elsewhere only ever adds time
        best, ids = float("inf"), None
        for _ in range(max(1, args.repeats)):
            t = time.perf_counter()
            ids = fn()
            best = min(best, time.perf_counter() - t)
        assert ids is not None
        return ids, best

    def run_adaptive(prompt: list[int], n: int) -> GenerationResult:
        row = adaptive.add(prompt, GenerationConfig(max_new_tokens=n))
        adaptive.run()
        return row.result()

    greedy = SamplingParams(0.0)
    for kind, prompts, n in (("code", code, args.osl), ("long", long, args.long_osl)):
        for i, p in enumerate(prompts):
            cfg = GenerationConfig(max_new_tokens=n, sampling=greedy, stop_token_ids=())
            alone, t_alone = timed(lambda: single.generate([p], GenerationConfig(max_new_tokens=n, block_size=1))[0])
            dflash, t_single = timed(lambda: single.generate([p], cfg)[0])
            adapt, t_adapt = timed(lambda: run_adaptive(p, n))
            row = {
                "set": kind,
                "prompt": i,
                "prompt_tokens": len(p),
                "new_tokens": len(alone.token_ids),
                "target_s": round(t_alone, 3),
                "single_dflash_s": round(t_single, 3),
                "adaptive_s": round(t_adapt, 3),
                "tau_single_b8": round(dflash.stats.mean_acceptance_length, 2),
                "tau_adaptive": round(adapt.stats.mean_acceptance_length, 2),
                "adaptive_vs_target": round(t_alone / t_adapt, 3),
                "single_vs_target": round(t_alone / t_single, 3),
                "equal": alone.token_ids == dflash.token_ids == adapt.token_ids,
            }
            out["per_prompt"].append(row)
            print("per-prompt", json.dumps(row), flush=True)

    # one batched adaptive step at 16 rows: where its time goes
    dec = BatchDecoder(btarget, bdrafter, policy=AdaptiveBlocks(cost))
    for p in code[:16]:
        dec.add(p, GenerationConfig(max_new_tokens=args.osl, stop_token_ids=()))
    steps = []
    while dec.active:
        steps.append(dec.step().profile)
    verify = [s for s in steps if s.verify_rows and not s.prefill_rows]
    out["step_profile"] = {
        "rows": 16,
        "steps": len(verify),
        "mean_rows": round(statistics.mean(s.verify_rows for s in verify), 2),
        "mean_verify_tokens": round(statistics.mean(s.verify_tokens for s in verify), 1),
        "mean_block": round(statistics.mean(b for s in verify for b in s.blocks), 2),
        "committed_per_step": round(statistics.mean(s.committed_tokens for s in verify), 2),
        **{
            k.removesuffix("_s") + "_ms": round(1e3 * statistics.mean(getattr(s, k) for s in verify), 2)
            for k in STEP_KEYS
        },
    }
    print("step profile", json.dumps(out["step_profile"]), flush=True)

    out["engines_alone"] = engines_alone(
        model, code, btarget, bdrafter, cost, args, pad=tok.pad_token_id if tok.pad_token_id is not None else 0
    )
    return out


def steady_state(decoder: BatchDecoder, stream: list[list[int]], c: int, n: int) -> int:
    """Run `stream` through `decoder` with `c` requests in flight, each finished row replaced at once (what a
    server with a client that never waits would do); returns the output tokens."""
    from dflash_trt.decoding import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=n, stop_token_ids=())
    rows = [decoder.add(p, cfg) for p in stream[:c]]
    nxt, tokens = len(rows), 0
    while rows:
        decoder.step()
        for r in [r for r in rows if r.done]:
            rows.remove(r)
            tokens += len(r.result().token_ids)
            if nxt < len(stream):
                rows.append(decoder.add(stream[nxt], cfg))
                nxt += 1
    return tokens


def engines_alone(
    model: Any,
    code: list[list[int]],
    btarget: TargetEngine,
    bdrafter: DrafterEngine,
    cost: CostModel,
    args: argparse.Namespace,
    pad: int = 0,
    c: int = 16,
) -> dict[str, Any]:
    """C=16, T=0 in this process, no HTTP server and no client: HF generate() (left-padded batches of C)
    against the batched decoder's steady state (target alone, adaptive) on the same request stream, in a
    rotating order, median of --load-repeats. What the engines can do here bounds what any server on the
    same machine can: the server cells add HTTP, streaming and a client on the same cores."""
    from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder

    stream = [code[i % len(code)] for i in range(requests_for(c, args))]
    members = {
        "hf-generate": lambda: sum(
            len(o)
            for s in range(0, len(stream), c)
            for o in hf_generate_batch(model, stream[s : s + c], args.osl, pad, 0.0)
        ),
        "target": lambda: steady_state(BatchDecoder(btarget, None), stream, c, args.osl),
        "adaptive": lambda: steady_state(
            BatchDecoder(btarget, bdrafter, policy=AdaptiveBlocks(cost)), stream, c, args.osl
        ),
    }
    members["hf-generate"]()  # warm-up at this shape
    runs: dict[str, list[float]] = {m: [] for m in members}
    for rnd in range(args.load_repeats):
        for name in rotation(list(members), rnd):
            t0 = time.perf_counter()
            tokens = members[name]()
            runs[name].append(round(tokens / (time.perf_counter() - t0), 1))
    med = {m: statistics.median(v) for m, v in runs.items()}
    out = {
        "concurrency": c,
        "temperature": 0.0,
        "requests": len(stream),
        "runs_tokens_per_s": runs,
        "tokens_per_s": med,
        "adaptive_vs_hf": round(med["adaptive"] / med["hf-generate"], 3),
        "target_vs_hf": round(med["target"] / med["hf-generate"], 3),
    }
    print("engines alone", json.dumps(out), flush=True)
    return out


# ---- the server cells --------------------------------------------------------------------------------
SERVER_SERIES = {  # /metrics series whose change over one aiperf run describes the server's batches
    "verify_rows": ("dflash_batch_rows", {"pass": "verify"}),
    "prefill_rows": ("dflash_batch_rows", {"pass": "prefill"}),
    "blocks": ("dflash_block_size", {}),
}


def metric_sums(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each SERVER_SERIES histogram in a /metrics page, and (busy seconds, steps) as "busy"."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {k: [0.0, 0.0] for k in (*SERVER_SERIES, "busy")}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, labels) in SERVER_SERIES.items():
                if sample.name in (name + "_sum", name + "_count") and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    found[key][0 if sample.name.endswith("_sum") else 1] += sample.value
            if sample.name == "dflash_step_seconds_sum":
                found["busy"][0] += sample.value
    return {k: (v[0], v[1]) for k, v in found.items()}


def server_side(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """What the server did during one run (aiperf's warm-up requests included): mean rows per verify pass
    (how full the batch was), mean block size, prefill passes and seconds of engine work."""
    d = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}

    def per(k: str) -> float | None:
        return round(d[k][0] / d[k][1], 2) if d[k][1] else None

    return {
        "mean_verify_rows": per("verify_rows"),
        "mean_block": per("blocks"),
        "prefill_passes": int(d["prefill_rows"][1]),
        "engine_s": round(d["busy"][0], 2),
    }


def rotation(members: list[str], rnd: int) -> list[str]:
    """The order of round `rnd`: each round starts one member later, so no member always runs first."""
    k = rnd % len(members)
    return members[k:] + members[:k]


def server_cells(
    args: argparse.Namespace,
    code_texts: list[str],
    levels: list[int],
    temps: list[float],
    modes: list[str],
    hf: HFReference | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every mode's server runs at once (idle ones cost nothing); each cell is measured --load-repeats times,
    the modes (and `hf`, the in-process reference, when given) back to back in a rotating order, so that the
    machine's drift (large over minutes, larger between spells: docs/benchmarks.md) falls on every mode and on the
    reference alike instead of on whichever ran during a slow spell. A cell reports the run with its median
    tokens/s and lists all runs. Returns the server cells and the reference's cells."""
    import httpx

    from dflash_trt.server.process import start_serve

    dataset = args.out / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"text": t, "output_length": args.osl}) + "\n" for t in code_texts))
    servers: dict[str, tuple[Any, ...]] = {}  # mode -> (process, url, model id)
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    try:
        for mode in modes:
            serve = [
                "--target",
                str(args.target),
                "--drafter",
                str(args.drafter),
                "--max-active",
                str(max(levels)),
                "--max-queue",
                str(4 * max(levels)),
                *(["--drafter-dtype", args.drafter_dtype] if args.drafter_dtype else []),
                *MODES[mode],
            ]
            if args.threads:
                serve += ["--threads", str(args.threads)]
            t0 = time.monotonic()
            proc, url = start_serve(
                serve, args.out / f"serve-{mode}.log", timeout_s=600, env={"DFLASH_TRT_API_KEY": ""}
            )
            servers[mode] = (proc, url)
            print(f"server {mode} up in {time.monotonic() - t0:.1f}s: {url}", flush=True)
            servers[mode] += (httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"],)
        for temp in temps:
            for c in levels:
                for rnd in range(args.load_repeats):
                    for mode in rotation(modes + ([hf.name] if hf is not None else []), rnd):
                        if hf is not None and mode == hf.name:
                            row = hf.run(c, temp)
                            runs.setdefault((mode, c, temp), []).append(row)
                            print(mode, json.dumps(row), flush=True)
                            continue
                        _, url, model = servers[mode]
                        run = AiperfRun(
                            url,
                            model,
                            str(args.target),
                            "completions",
                            c,
                            requests_for(c, args),
                            warmup=c,
                            input_file=dataset,
                            osl=args.osl,
                            extra_inputs={"temperature": temp},
                            nice=args.client_nice,
                        )
                        before = metric_sums(httpx.get(url + "/metrics", timeout=30).text)
                        m = run_aiperf(args.aiperf, run, args.out / "aiperf" / f"{mode}-t{temp:g}-c{c}-r{rnd}")
                        after = metric_sums(httpx.get(url + "/metrics", timeout=30).text)
                        cell = {
                            "mode": mode,
                            "concurrency": c,
                            "temperature": temp,
                            "requests": run.requests,
                            "tokens_per_s": value(m, "output_token_throughput"),
                            "ttft_ms": {s: value(m, "time_to_first_token", s) for s in ("avg", "p50", "p99")},
                            "itl_ms": {s: value(m, "inter_token_latency", s) for s in ("avg", "p50", "p99")},
                            "osl": value(m, "output_sequence_length"),
                            "errors": m.get("error_summary"),
                            "wall_s": m["wall_s"],
                            "server": server_side(before, after),
                        }
                        runs.setdefault((mode, c, temp), []).append(cell)
                        print("aiperf", json.dumps(cell), flush=True)
        for mode, (_, url, _) in servers.items():
            (args.out / f"metrics-{mode}.txt").write_text(httpx.get(url + "/metrics", timeout=30).text)
    finally:
        for proc, *_ in servers.values():
            proc.terminate()
            proc.wait(60)
    cells = [median_cell(rs) for rs in runs.values()]
    return [c for c in cells if c["mode"] in MODES], [c for c in cells if c["mode"] not in MODES]


def median_cell(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s (the lower middle one of an even count), with every run's figure."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"] or 0.0)
    return {**ranked[(len(ranked) - 1) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


# ---- the report --------------------------------------------------------------------------------------
def checks(cells: list[dict[str, Any]], proc: dict[str, Any] | None) -> list[tuple[str, bool | None, str]]:
    """The issue's done-figures, each (what, passed, figure)."""
    tps = {(c["mode"], c["concurrency"], c["temperature"]): c["tokens_per_s"] for c in cells}
    hf = {(r["concurrency"], r["temperature"]): r["tokens_per_s"] for r in (proc or {}).get("hf_generate", [])}
    found: list[tuple[str, bool | None, str]] = []

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    r = ratio(tps.get(("adaptive", 16, 0.0)), hf.get((16, 0.0)))
    found.append(
        (
            "c=16 T=0 adaptive >= 1.5x HF batched generate",
            None if r is None else r >= 1.5,
            "n/a" if r is None else f"{r:.2f}x",
        )
    )
    r = ratio(tps.get(("adaptive", 16, 0.0)), tps.get(("target", 16, 0.0)))
    found.append(
        (
            "c=16 T=0 adaptive >= 1.2x the server's batched target",
            None if r is None else r >= 1.2,
            "n/a" if r is None else f"{r:.2f}x",
        )
    )
    worst = [
        (x, c, t) for (m, c, t), v in tps.items() if m == "adaptive" and (x := ratio(v, tps.get(("target", c, t))))
    ]
    if worst:
        w = min(worst)
        found.append(
            ("every cell: adaptive >= 0.95x batched target", w[0] >= 0.95, f"lowest {w[0]:.2f}x (c={w[1]}, T={w[2]:g})")
        )
    for mode in ("hybrid", "hybrid-own"):
        low = [(x, c, t) for (m, c, t), v in tps.items() if m == mode and (x := ratio(v, tps.get(("adaptive", c, t))))]
        if low:
            w = min(low)
            found.append(
                (
                    f"every cell: {mode} >= 0.98x adaptive DFlash",
                    w[0] >= 0.98,
                    f"lowest {w[0]:.2f}x (c={w[1]}, T={w[2]:g})",
                )
            )
    if proc and proc.get("per_prompt"):
        rows: list[dict[str, Any]] = proc["per_prompt"]
        slowest = min(rows, key=lambda p: p["adaptive_vs_target"])
        found.append(
            (
                "every prompt: adaptive >= 0.9x the target alone",
                slowest["adaptive_vs_target"] >= 0.9,
                f"lowest {slowest['adaptive_vs_target']:.2f}x ({slowest['set']} prompt {slowest['prompt']}, "
                f"{slowest['prompt_tokens']} tokens, tau at B=8 {slowest['tau_single_b8']})",
            )
        )
        code = [p for p in rows if p["set"] == "code"]
        r = sum(p["single_dflash_s"] for p in code) / sum(p["adaptive_s"] for p in code)
        found.append(
            ("c=1 T=0: adaptive >= 0.97x a fixed block 8, one request alone (same prompts)", r >= 0.97, f"{r:.2f}x")
        )
        found.append(
            (
                "greedy outputs equal to the target alone (per prompt, all three)",
                all(p["equal"] for p in rows),
                f"{sum(p['equal'] for p in rows)}/{len(rows)}",
            )
        )
    return found


def markdown(
    cells: list[dict[str, Any]],
    proc: dict[str, Any] | None,
    found: list[tuple[str, bool | None, str]],
    settings: dict[str, Any],
) -> str:
    return load_markdown(cells, proc, found, settings, list(MODES))


def plot(cells: list[dict[str, Any]], proc: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({c["temperature"] for c in cells})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for mode in MODES:
            pts = sorted(
                (c["concurrency"], c["tokens_per_s"])
                for c in cells
                if c["mode"] == mode and c["temperature"] == t and c["tokens_per_s"]
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"server {mode}")
        hf = sorted(
            (r["concurrency"], r["tokens_per_s"]) for r in (proc or {}).get("hf_generate", []) if r["temperature"] == t
        )
        if hf:
            ax.plot(*zip(*hf), marker="s", linestyle="--", color="gray", label="HF generate (batched)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"T = {t:g}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)} (known: {', '.join(MODES)})")
    if not Path(args.aiperf).is_file():
        raise SystemExit(f"no aiperf at {args.aiperf}: run `make aiperf-env` (its own venv)")
    args.out.mkdir(parents=True, exist_ok=True)
    code_texts = held_out_code_prompts(args.prompts)
    long_texts = held_out_code_prompts(args.long_prompts, prefix_chars=1200) if args.long_prompts else []
    t0 = time.monotonic()
    proc = None if args.skip_in_process else in_process(args, code_texts, long_texts)
    hf = (
        None
        if args.skip_in_process
        else HFReference(args.target, code_texts, args.osl, lambda c: requests_for(c, args))
    )
    try:
        cells, reference = server_cells(args, code_texts, levels, temps, modes, hf)
    except AiperfFailed as e:
        print(f"aiperf failed: {e}", file=sys.stderr)
        return 1
    settings = {
        "target": str(args.target),
        "drafter": str(args.drafter),
        "osl": args.osl,
        "prompts": args.prompts,
        "long_prompts": args.long_prompts,
        "long_osl": args.long_osl,
        "concurrency": levels,
        "temperatures": temps,
        "modes": modes,
        "client_nice": args.client_nice,
        "drafter_dtype": f"{args.drafter_dtype or 'default'} ({resolved_drafter_dtype(args.drafter_dtype)})",
        "threads": args.threads or torch.get_num_threads(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "minutes": round((time.monotonic() - t0) / 60, 1),
    }
    if proc is not None:
        proc["hf_generate"] = reference
    found = checks(cells, proc)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "settings": settings,
                "cells": cells,
                "in_process": proc,
                "checks": [{"what": w, "passed": ok, "figure": f} for w, ok, f in found],
            },
            indent=2,
        )
        + "\n"
    )
    md = markdown(cells, proc, found, settings)
    (args.out / "README.md").write_text(md)
    plot(cells, proc, args.out / "load.png")
    print("\n" + md)
    print(
        f"wrote {args.out / 'results.json'}, {args.out / 'README.md'}, {args.out / 'load.png'} "
        f"in {settings['minutes']} min"
    )
    return 0
