"""`dflash-trt bench prefill`: chunked against separate prefill on the CPU server, side by side in one run: how long a long prompt arriving
makes the streaming requests wait, and what it costs in tokens/s.

Two servers (`dflash-trt serve`, the demo models, everything at its defaults but `--prefill chunked` /
`--prefill separate`), one process each, started one after the other; the trials alternate between them, so
that both see the same minutes of the machine's load.

  stall trial   --streams requests stream (/v1/completions, stream, ignore_eos, --osl tokens each, held-out
                code prompts); once every stream has run --warm-s seconds, a request with a --long-tokens-token
                prompt (held-out code files joined) arrives. Per streaming request: every gap between two
                events as the client receives them, their median and their largest. The largest over the median
                is how long the arriving prompt made the request wait, in units of its usual wait (the target:
                at most 3x); the same ratio over the gaps that do not overlap the prompt's prefill is the
                machine's own noise floor. Also the long request's time to first token.
  load trial    --load-clients clients, each sending --load-requests requests back to back (held-out code
                prompts, --load-osl tokens, ignore_eos): output tokens/s of the whole trial (closed loop, what
                `make bench-load` measures with aiperf at one concurrency, shorter).

Each figure is the median over --trials trials. Prints a table; writes results/load/prefill/results.json.
Measured on a shared machine the ratios are noisy: run it when the machine is quiet.

    dflash-trt bench prefill
    dflash-trt bench prefill --trials 1 --load-requests 2   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from dflash_trt.bench.prompts import held_out_code_prompts
from dflash_trt.server.process import start_serve
from dflash_trt.settings import DEMO_TARGET, REPO_ROOT

MODES = ("chunked", "separate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=8, help="requests streaming when the long prompt arrives")
    p.add_argument("--osl", type=int, default=256, help="tokens each streaming request generates")
    p.add_argument("--warm-s", type=float, default=1.0, help="seconds the streams run before the long prompt")
    p.add_argument("--long-tokens", type=int, default=1130, help="tokens of the arriving prompt")
    p.add_argument("--load-clients", type=int, default=16, help="clients of the load trial (0: no load trial)")
    p.add_argument("--load-requests", type=int, default=4, help="requests per client in a load trial")
    p.add_argument("--load-osl", type=int, default=64, help="tokens per request in a load trial")
    p.add_argument("--trials", type=int, default=3, help="trials per mode (the median is reported)")
    p.add_argument("--step-tokens", type=int, default=None, help="--step-tokens for the chunked server")
    p.add_argument("--threads", type=int, default=None, help="--threads for both servers (default: torch's)")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="--block-size for both servers (default: adaptive, whose start-up cost grid can differ between the "
        "two servers and with it every step's shape; a fixed size compares the prefill modes alone)",
    )
    p.add_argument(
        "--proposer",
        default=None,
        help="--proposer for every server (default: serve's default); name one when --base-tree's serve has another",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="prefill modes to run (default both; chunked alone with --base-tree for a before / after)",
    )
    p.add_argument(
        "--base-tree",
        type=Path,
        default=None,
        help="also a chunked server run from this source tree (PYTHONPATH; e.g. a git worktree of the commit "
        "before a change), mode 'chunked-base', alternating with the others",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results/load/prefill", help="folder for results.json")


def long_prompt(tokens: int) -> str:
    """Held-out code files joined until the prompt holds `tokens` tokens of the demo tokenizer, cut there."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    ids: list[int] = []
    for text in held_out_code_prompts(40, prefix_chars=2000):
        ids += tok.encode(text, add_special_tokens=False)
        if len(ids) >= tokens:
            break
    if len(ids) < tokens:
        raise SystemExit(f"the held-out prompts hold only {len(ids)} tokens, fewer than --long-tokens {tokens}")
    return str(tok.decode(ids[:tokens]))


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list[float]:
    """One streamed completion: the time each event (one verify round, or the first token) arrived."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times


async def stall_trial(url: str, prompts: list[str], long: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        runs = [asyncio.create_task(stream(client, url, p, args.osl)) for p in prompts[: args.streams]]
        await asyncio.sleep(args.warm_s)
        sent = time.perf_counter()
        arrival = await stream(client, url, long, 16)
        times = await asyncio.gather(*runs)
    window = (sent, arrival[0])  # from the long prompt's arrival to its first token
    return {"rows": [gap_figures(t, window) for t in times], "long_ttft_ms": 1e3 * (arrival[0] - sent)}


def gap_figures(times: list[float], window: tuple[float, float]) -> dict[str, float]:
    """One streaming row's gaps: the median, the largest, and the largest of those that overlap the long
    prompt's prefill window and of the others (the machine's own noise floor), in ms."""
    gaps = [(a, b) for a, b in zip(times, times[1:])]
    inside = [b - a for a, b in gaps if b > window[0] and a < window[1]]
    outside = [b - a for a, b in gaps if not (b > window[0] and a < window[1])]
    median = statistics.median(b - a for a, b in gaps)
    out = {
        "median_gap_ms": 1e3 * median,
        "largest_gap_ms": 1e3 * max(b - a for a, b in gaps),
        "largest_in_window_ms": 1e3 * max(inside, default=0.0),
        "largest_outside_ms": 1e3 * max(outside, default=0.0),
    }
    out["ratio"] = out["largest_gap_ms"] / out["median_gap_ms"]
    out["ratio_outside"] = out["largest_outside_ms"] / out["median_gap_ms"]
    return out


async def load_trial(url: str, prompts: list[str], args: argparse.Namespace) -> float:
    """Output tokens/s of --load-clients closed-loop clients."""

    async def client_loop(client: httpx.AsyncClient, k: int) -> int:
        done = 0
        for i in range(args.load_requests):
            body = {
                "prompt": prompts[(k * args.load_requests + i) % len(prompts)],
                "max_tokens": args.load_osl,
                "ignore_eos": True,
                "temperature": 0,
            }
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            done += int(r.json()["usage"]["completion_tokens"])
        return done

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*[client_loop(client, k) for k in range(args.load_clients)])
        return sum(tokens) / (time.perf_counter() - t0)


def summary(trials: list[dict[str, Any]], loads: list[float]) -> dict[str, Any]:
    """Medians over the trials of: the worst row's largest gap / its median gap (with and without the gaps that
    overlap the long prompt's prefill), the rows' median and largest gaps, the long prompt's TTFT, tokens/s."""
    med = statistics.median

    def worst(t: dict[str, Any], key: str) -> float:
        return float(max(r[key] for r in t["rows"]))

    return {
        "worst_ratio": round(med(worst(t, "ratio") for t in trials), 2),
        "worst_ratio_outside": round(med(worst(t, "ratio_outside") for t in trials), 2),
        "median_gap_ms": round(med(r["median_gap_ms"] for t in trials for r in t["rows"]), 1),
        "largest_gap_ms": round(med(worst(t, "largest_gap_ms") for t in trials), 1),
        "largest_in_window_ms": round(med(worst(t, "largest_in_window_ms") for t in trials), 1),
        "long_ttft_ms": round(med(t["long_ttft_ms"] for t in trials), 1),
        "load_tokens_per_s": round(med(loads), 1) if loads else None,
    }


def table(out: dict[str, Any]) -> str:
    s = out["summary"]
    lines = [
        "| prefill | median gap | largest gap (while the prompt entered) | worst row: largest / median "
        f"(other gaps only) | long prompt's TTFT | tokens/s, {out['args']['load_clients']} clients |",
        "|---|---|---|---|---|---|",
    ]
    for mode, m in s.items():
        lines.append(
            f"| {mode} | {m['median_gap_ms']} ms | {m['largest_gap_ms']} ms ({m['largest_in_window_ms']} ms) | "
            f"{m['worst_ratio']}x ({m['worst_ratio_outside']}x) | {m['long_ttft_ms']} ms | {m['load_tokens_per_s']} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    prompts = held_out_code_prompts(40)
    long = long_prompt(args.long_tokens)
    extra = {"chunked": [] if args.step_tokens is None else ["--step-tokens", str(args.step_tokens)], "separate": []}
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    threads += [] if args.block_size is None else ["--block-size", str(args.block_size)]
    threads += [] if args.proposer is None else ["--proposer", args.proposer]
    threads += ["--max-active", str(args.streams + 1)]  # the long prompt joins the streams, never waits for one to end
    load_before = os.getloadavg()
    modes = list(args.modes) + (["chunked-base"] if args.base_tree else [])
    envs = {"chunked-base": {"PYTHONPATH": str(args.base_tree.resolve())}} if args.base_tree else {}
    extra["chunked-base"] = extra["chunked"]
    servers = {
        m: start_serve(
            ["--prefill", m.removesuffix("-base"), *extra[m], *threads],
            args.out / f"serve-{m}.log",
            timeout_s=600,
            env=envs.get(m),
        )
        for m in modes
    }
    trials: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    loads: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for _, url in servers.values():  # warm-up: each server's first requests
            asyncio.run(stall_trial(url, prompts, long, argparse.Namespace(**{**vars(args), "osl": 16})))
        for k in range(args.trials):
            for mode in modes if k % 2 == 0 else modes[::-1]:
                url = servers[mode][1]
                trials[mode].append(asyncio.run(stall_trial(url, prompts, long, args)))
                if args.load_clients:
                    loads[mode].append(asyncio.run(load_trial(url, prompts, args)))
                w = max(trials[mode][-1]["rows"], key=lambda r: r["ratio"])
                load = f", {loads[mode][-1]:.0f} tokens/s" if loads[mode] else ""
                print(f"trial {k} {mode}: worst row {w['largest_gap_ms']:.0f} / {w['median_gap_ms']:.0f} ms{load}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    out = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "summary": {m: summary(trials[m], loads[m]) for m in modes},
        "trials": trials,
        "load_tokens_per_s": loads,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0
