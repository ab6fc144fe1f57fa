"""`dflash-trt bench serve`: NVIDIA's aiperf against `dflash-trt serve`, a short run on the OpenAI completions
endpoint (and chat, for a target with a chat template: `--endpoints chat,completions`), streaming, as a new user would
benchmark the server with a client nobody here wrote.

Starts `dflash-trt serve --port 0` on the demo models (or --target/--drafter), runs `aiperf profile`
once per endpoint (synthetic prompts, fixed seed, greedy, ignore_eos so every request generates its
--osl tokens), and writes aiperf's own exports under --out/<endpoint>/ plus one summary JSON
(--out/summary.json: request throughput, output tokens/s, time to first token, inter-token latency,
errors). aiperf lives in its own venv (`make bench-serve` makes it): it pins prometheus-client and
huggingface-hub below what this project's venv has.

    make bench-serve
    dflash-trt bench serve --aiperf .venv-aiperf/bin/aiperf --requests 32 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from dflash_trt.bench.aiperf import AiperfFailed, AiperfRun, run_aiperf
from dflash_trt.server.process import start_serve
from dflash_trt.settings import REPO_ROOT


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--aiperf", default=str(REPO_ROOT / ".venv-aiperf/bin/aiperf"), help="the aiperf executable")
    ap.add_argument(
        "--endpoints",
        default="completions",
        help="aiperf endpoint types, comma-separated (default completions: the demo target has no chat template, "
        "so chat answers 400; chat,completions for a target with one)",
    )
    ap.add_argument("--requests", type=int, default=16, help="requests per endpoint (default 16)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent requests (default 4)")
    ap.add_argument("--isl", type=int, default=64, help="synthetic prompt tokens (default 64)")
    ap.add_argument("--osl", type=int, default=64, help="tokens to generate per request (default 64)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "results/bench-serve", help="output folder")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads of the server")


def run(args: argparse.Namespace) -> int:

    args.out.mkdir(parents=True, exist_ok=True)
    serve = ["--target", str(args.target), "--drafter", str(args.drafter)]
    if args.threads:
        serve += ["--threads", str(args.threads)]
    proc, url = start_serve(serve, args.out / "serve.log", timeout_s=300, env={"DFLASH_TRT_API_KEY": ""})
    summary = {
        "url": url,
        "target": str(args.target),
        "drafter": str(args.drafter),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "isl": args.isl,
        "osl": args.osl,
        "endpoints": {},
    }
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for endpoint in args.endpoints.split(","):
            run = AiperfRun(
                url,
                model,
                str(args.target),
                endpoint,
                args.concurrency,
                args.requests,
                isl=args.isl,
                osl=args.osl,
                extra_inputs={"temperature": 0},
            )
            try:
                summary["endpoints"][endpoint] = run_aiperf(args.aiperf, run, args.out / endpoint)
            except AiperfFailed as e:
                print(f"aiperf failed on {endpoint}: {e}", file=sys.stderr)
                return 1
    finally:
        proc.terminate()
        proc.wait(60)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for endpoint, m in summary["endpoints"].items():
        print(
            f"{endpoint}: "
            + ", ".join(f"{k} {v.get('avg', v) if isinstance(v, dict) else v}" for k, v in m.items() if k != "wall_s")
        )
    print(f"wrote {args.out / 'summary.json'}")
    return 0
