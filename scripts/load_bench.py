#!/usr/bin/env python3
"""Load benchmark of `dflash-trt serve`: throughput and p50/p99 latency at several concurrencies,
DFlash against target-only serving.

Starts `dflash-trt serve --port 0` as a subprocess, its log in --server-log (or uses --url), then at each
concurrency C runs a closed loop: C clients, each sending its next request when the last one
returned, greedy, --max-tokens each. Target-only serving is the same server and code path with
`block_size: 1` (exactly what `--no-draft` runs), so both modes produce identical tokens and the
speedup is a like-for-like ratio. Prints a table and writes JSON (default results/load_bench.json).

    .venv/bin/python scripts/load_bench.py                                # the demo models
    .venv/bin/python scripts/load_bench.py --target .cache/tiny/target --drafter .cache/tiny/drafter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "def fibonacci(n):",
    "Write a function that checks whether a string is a palindrome.",
    "import numpy as np\n\ndef softmax(x):",
    "The three laws of thermodynamics are",
    "class LinkedList:\n    def __init__(self):",
    "Explain speculative decoding in one paragraph.",
    "for i in range(10):",
    "SELECT name, COUNT(*) FROM users",
]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def start_server(args) -> tuple[subprocess.Popen, str]:
    from dflash_trt.server.process import ServerFailed, start_serve

    serve_args = ["--target", str(args.target), "--drafter", str(args.drafter),
                  "--max-active", str(max(args.concurrency)), "--max-queue", "1024"]
    if args.threads:
        serve_args += ["--threads", str(args.threads)]
    try:
        return start_serve(serve_args, args.server_log, timeout_s=600, env={"DFLASH_TRT_API_KEY": ""})
    except ServerFailed as e:
        sys.exit(f"load_bench: {e}")


def prompt_bodies(url: str, headers: dict, max_tokens: int) -> list[dict]:
    """Text prompts when the target has a tokenizer, else token-id prompts."""
    probe = httpx.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 1}, headers=headers, timeout=600)
    if probe.status_code == 200:
        return [{"prompt": p, "max_tokens": max_tokens} for p in PROMPTS]
    return [{"input_ids": [(7 * i + 13 * j) % 50 + 1 for j in range(6 + i)], "max_tokens": max_tokens}
            for i in range(len(PROMPTS))]


async def run_level(url: str, headers: dict, bodies: list[dict], concurrency: int, n_requests: int,
                    block_size: int | None) -> dict:
    queue = list(range(n_requests))
    records = []

    async def client(c: httpx.AsyncClient):
        while queue:
            i = queue.pop()
            body = dict(bodies[i % len(bodies)])
            if block_size is not None:
                body["block_size"] = block_size
            t0 = time.perf_counter()
            r = await c.post(url + "/generate", json=body, headers=headers)
            latency = time.perf_counter() - t0
            if r.status_code != 200:
                raise RuntimeError(f"request failed: {r.status_code} {r.text[:200]}")
            data = r.json()
            records.append((latency, len(data["token_ids"]), data["spec"]["mean_acceptance_length"], data["token_ids"]))

    async with httpx.AsyncClient(timeout=3600) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(c) for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    latencies = [r[0] for r in records]
    tokens = sum(r[1] for r in records)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 2),
        "requests_per_s": round(len(records) / wall, 3),
        "latency_p50_s": round(percentile(latencies, 0.5), 4),
        "latency_p99_s": round(percentile(latencies, 0.99), 4),
        "mean_tau": round(statistics.mean(r[2] for r in records), 3),
        "outputs": sorted(tuple(r[3]) for r in records),
    }


def _concurrency_list(text: str) -> list[int]:
    from dflash_trt.cli.options import positive_int as _positive_int

    parts = [t for t in text.replace(" ", "").split(",") if t]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated client counts, got {text!r}")
    return [_positive_int(t) for t in parts]


def main() -> None:
    from dflash_trt.cli.options import positive_int as _positive_int
    from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEMO_TARGET, help=f"target checkpoint (default {DEMO_TARGET})")
    p.add_argument("--drafter", type=Path, default=DEMO_DRAFTER, help=f"drafter checkpoint (default {DEMO_DRAFTER})")
    p.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("DFLASH_TRT_API_KEY"), help="bearer token for --url")
    p.add_argument("--concurrency", type=_concurrency_list, default=[1, 4, 16],
                   help="comma-separated client counts, each >= 1 (default 1,4,16)")
    p.add_argument("--requests", type=_positive_int, default=None,
                   help="requests per level and mode (default: max(8, 2 x concurrency))")
    p.add_argument("--max-tokens", type=_positive_int, default=64, help="tokens per request (default 64)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads of the started server")
    p.add_argument("--out", type=Path, default=REPO / "results" / "load_bench.json", help="JSON output")
    p.add_argument("--server-log", type=Path, default=REPO / "results" / "load_bench_server.log",
                   help="log of the started server: one JSON line per request (default results/load_bench_server.log)")
    args = p.parse_args()

    proc = None
    if args.url is None:
        for d in (args.target, args.drafter):
            if not d.is_dir():
                sys.exit(f"load_bench: {d} not found (train the demo models, or pass --target/--drafter)")
        proc, url = start_server(args)
    else:
        url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        bodies = prompt_bodies(url, headers, args.max_tokens)
        asyncio.run(run_level(url, headers, bodies, 2, 2, None))  # warm-up
        rows = []
        for c in args.concurrency:
            n = args.requests or max(8, 2 * c)
            level = {}
            for mode, block in (("target-only", 1), ("dflash", None)):
                level[mode] = asyncio.run(run_level(url, headers, bodies, c, n, block))
            same = level["dflash"].pop("outputs") == level["target-only"].pop("outputs")
            rows.append({"concurrency": c, **{m: r for m, r in level.items()},
                         "speedup_throughput": round(level["dflash"]["throughput_tok_s"]
                                                     / level["target-only"]["throughput_tok_s"], 3),
                         "speedup_p50_latency": round(level["target-only"]["latency_p50_s"]
                                                      / level["dflash"]["latency_p50_s"], 3),
                         "identical_outputs": same})
            print_row(rows[-1])
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    result = {
        "target": str(args.target) if args.url is None else None,
        "drafter": str(args.drafter) if args.url is None else None,
        "url": args.url,
        "max_tokens": args.max_tokens,
        "greedy": True,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "note": "one sequence per forward pass; concurrent requests are interleaved round-robin, not batched",
        "levels": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


HEADER_PRINTED = []


def print_row(row: dict) -> None:
    if not HEADER_PRINTED:
        HEADER_PRINTED.append(1)
        print(f"{'conc':>4} | {'mode':<11} | {'req':>4} | {'tok/s':>8} | {'req/s':>6} | {'p50 s':>7} | "
              f"{'p99 s':>7} | {'tau':>5} | speedup")
        print("-" * 82)
    for mode in ("target-only", "dflash"):
        r = row[mode]
        speed = f"{row['speedup_throughput']:.2f}x" if mode == "dflash" else ""
        print(f"{row['concurrency']:>4} | {mode:<11} | {r['requests']:>4} | {r['throughput_tok_s']:>8.1f} | "
              f"{r['requests_per_s']:>6.2f} | {r['latency_p50_s']:>7.3f} | {r['latency_p99_s']:>7.3f} | "
              f"{r['mean_tau']:>5.2f} | {speed}")
    if not row["identical_outputs"]:
        print("     WARNING: DFlash and target-only outputs differ (they must be identical under greedy)")


if __name__ == "__main__":
    main()
