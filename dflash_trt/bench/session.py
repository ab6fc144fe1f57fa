"""`dflash-trt bench session`: a multi-turn session through the server; each turn's prompt carries the earlier turns'
prompts and answers, as an agentic or chat client resends what it received.

A session walks one installed package's file (`dflash_trt.bench.workloads.session_turns`: never the demo models'
training data): turn 1 is the file's first lines and its first function's head; turn k adds turn k-1's answer and
the next function's head. Each mode is one `dflash-trt serve` process (the demo models unless --serve-args say
otherwise) with its own arguments and request fields; the sessions alternate between the modes (A B A B), so that
the shared machine's drift hits them alike, and every mode's answers must be the first mode's token for token
(greedy, /v1/completions, ignore_eos). Per mode: tokens/s over all turns, by turn (later turns carry more of
what the server produced before), and the ratio to the first mode. Prints a table; writes JSON.

Modes (--modes, JSON: name -> {"serve": [serve args], "request": {extra request fields}}; modes with the same
serve arguments share one server); the default (below) compares the target alone, DFlash, the hybrid and the
hybrid without the shared structure of earlier outputs. Written out:

    --modes '{"target": {"serve": ["--block-size", "1"]},
              "dflash": {"serve": ["--proposer", "dflash"]},
              "hybrid": {"serve": ["--proposer", "hybrid", "--suffix-sharing", "all"]},
              "hybrid-per-request": {"serve": ["--proposer", "hybrid"]}}'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import httpx

from dflash_trt.bench.workloads import session_turns
from dflash_trt.server.process import start_serve

DEFAULT_MODES = {  # the target alone, then the shared structure's gain: hybrid with and without it
    "target": {"serve": ["--block-size", "1"]},
    "dflash": {"serve": ["--proposer", "dflash"]},
    # one client: its sessions may share (--suffix-sharing all); the per-request mode is the server's default
    "hybrid": {"serve": ["--proposer", "hybrid", "--suffix-sharing", "all"]},
    "hybrid-per-request": {"serve": ["--proposer", "hybrid"]},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", type=json.loads, default=DEFAULT_MODES, help="JSON, see above (first: the reference)")
    p.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    p.add_argument("--sessions", type=int, default=2, help="sessions per mode, alternating (default 2)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default 96)")
    p.add_argument("--serve-args", default="--threads 1", help="arguments every server gets (default --threads 1)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results/proposers/session.json"),
        help="the JSON written (default %(default)s)",
    )


def session(url: str, request: dict[str, Any], opening: str, heads: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """One session's turns against one server: each turn's prompt, answer, tokens and seconds."""
    turns, context = [], opening
    with httpx.Client(timeout=1800) as client:
        for head in heads:
            prompt = f"{context.rstrip()}\n\n\n{head}"
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **request}
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions", json=body)
            seconds = time.perf_counter() - t0
            r.raise_for_status()
            out = r.json()
            answer = out["choices"][0]["text"]
            turns.append(
                {
                    "prompt_chars": len(prompt),
                    "tokens": out["usage"]["completion_tokens"],
                    "seconds": seconds,
                    "answer": answer,
                }
            )
            context = prompt + answer
    return turns


def summary(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per mode: tokens/s over every turn, per turn index, and against the first mode."""
    out: dict[str, dict[str, Any]] = {}
    for mode, sessions in runs.items():
        turns = [t for s in sessions for t in s]
        by_turn = [
            round(sum(s[k]["tokens"] for s in sessions) / sum(s[k]["seconds"] for s in sessions), 2)
            for k in range(len(sessions[0]))
        ]
        out[mode] = {
            "tokens_per_s": round(sum(t["tokens"] for t in turns) / sum(t["seconds"] for t in turns), 2),
            "by_turn": by_turn,
        }
    first = next(iter(out.values()))["tokens_per_s"]
    for cell in out.values():
        cell["vs_first"] = round(cell["tokens_per_s"] / first, 3)
    return out


def run(args: argparse.Namespace) -> int:
    names = list(args.modes)
    servers: dict[tuple[str, ...], Any] = {}  # modes with the same serve arguments share a server
    urls = {}
    try:
        for name in names:
            serve = (*args.serve_args.split(), *args.modes[name].get("serve", []))
            if serve not in servers:
                log = args.out.parent / f"serve-{name}.log"
                servers[serve] = start_serve(list(serve), log, timeout_s=args.start_timeout)
            urls[name] = servers[serve][1]
        runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
        opening, heads, source = session_turns(args.turns)
        for k in range(args.sessions):
            for name in names if k % 2 == 0 else names[::-1]:
                request = args.modes[name].get("request", {})
                runs[name].append(session(urls[name], request, opening, heads, args.max_tokens))
                print(f"session {k} {name}: " + ", ".join(f"{t['seconds']:.1f}s" for t in runs[name][-1]))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    reference = [t["answer"] for t in runs[names[0]][0]]
    differ = [n for n in names for s in runs[n] if [t["answer"] for t in s] != reference]
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]},
        "source": source,
        "modes": args.modes,
        "summary": summary(runs),
        "identical": not differ,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("| mode | tokens/s | x first | tokens/s by turn |\n|---|---|---|---|")
    for name, cell in out["summary"].items():
        turns = " / ".join(f"{v:.1f}" for v in cell["by_turn"])
        print(f"| {name} | {cell['tokens_per_s']:.1f} | {cell['vs_first']:.2f}x | {turns} |")
    print(f"\nanswers equal to {names[0]}'s in every session: {'yes' if not differ else f'NO ({differ})'}")
    return 0 if not differ else 1
