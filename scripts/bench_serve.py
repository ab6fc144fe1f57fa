#!/usr/bin/env python3
"""NVIDIA's aiperf against `dflash-trt serve`: a short run on the OpenAI chat and completions endpoints,
streaming, as a new user would benchmark the server with a client nobody here wrote.

Starts `dflash-trt serve --port 0` on the demo models (or --target/--drafter), runs `aiperf profile`
once per endpoint (synthetic prompts, fixed seed, greedy, ignore_eos so every request generates its
--osl tokens), and writes aiperf's own exports under --out/<endpoint>/ plus one summary JSON
(--out/summary.json: request throughput, output tokens/s, time to first token, inter-token latency,
errors). aiperf lives in its own venv (`make bench-serve` makes it): it pins prometheus-client and
huggingface-hub below what this project's venv has.

    make bench-serve
    .venv/bin/python scripts/bench_serve.py --aiperf .venv-aiperf/bin/aiperf --requests 32 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_trt.server.process import start_serve  # noqa: E402
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET  # noqa: E402

# aiperf's names for the numbers worth keeping (its JSON export: metric tag -> {unit, avg, p50, p99, ...})
METRICS = ("request_throughput", "output_token_throughput", "time_to_first_token", "inter_token_latency",
           "request_latency", "output_sequence_length", "request_count", "error_summary")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default=str(REPO / ".venv-aiperf/bin/aiperf"), help="the aiperf executable")
    ap.add_argument("--target", type=Path, default=DEMO_TARGET, help="target checkpoint (default: the demo's)")
    ap.add_argument("--drafter", type=Path, default=DEMO_DRAFTER, help="drafter checkpoint (default: the demo's)")
    ap.add_argument("--endpoints", default="chat,completions", help="aiperf endpoint types (default: both)")
    ap.add_argument("--requests", type=int, default=16, help="requests per endpoint (default 16)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent requests (default 4)")
    ap.add_argument("--isl", type=int, default=64, help="synthetic prompt tokens (default 64)")
    ap.add_argument("--osl", type=int, default=64, help="tokens to generate per request (default 64)")
    ap.add_argument("--out", type=Path, default=REPO / "results/bench-serve", help="output folder")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads of the server")
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    serve = ["--target", str(args.target), "--drafter", str(args.drafter)]
    if args.threads:
        serve += ["--threads", str(args.threads)]
    proc, url = start_serve(serve, args.out / "serve.log", timeout_s=300, env={"DFLASH_TRT_API_KEY": ""})
    summary = {"url": url, "target": str(args.target), "drafter": str(args.drafter), "requests": args.requests,
               "concurrency": args.concurrency, "isl": args.isl, "osl": args.osl, "endpoints": {}}
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for endpoint in args.endpoints.split(","):
            artifacts = args.out / endpoint
            cmd = [args.aiperf, "profile", "--url", url, "--endpoint-type", endpoint, "--streaming",
                   "--model", model, "--tokenizer", str(args.target), "--request-count", str(args.requests),
                   "--concurrency", str(args.concurrency), "--isl", str(args.isl), "--osl", str(args.osl),
                   "--random-seed", "0", "--artifact-dir", str(artifacts), "--num-warmup-requests", "1",
                   "--extra-inputs", json.dumps({"temperature": 0, "ignore_eos": True}),
                   "--no-server-metrics", "--no-gpu-telemetry", "--ui-type", "none"]
            started = time.monotonic()
            run = subprocess.run(cmd, capture_output=True, text=True)
            (artifacts / "aiperf.log").parent.mkdir(parents=True, exist_ok=True)
            (artifacts / "aiperf.log").write_text(run.stdout + run.stderr)
            if run.returncode != 0:
                print(f"aiperf failed on {endpoint} (exit {run.returncode}); its log: {artifacts / 'aiperf.log'}",
                      file=sys.stderr)
                print((run.stdout + run.stderr)[-3000:], file=sys.stderr)
                return 1
            summary["endpoints"][endpoint] = {"wall_s": round(time.monotonic() - started, 1),
                                              **_metrics(artifacts)}
    finally:
        proc.terminate()
        proc.wait(60)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for endpoint, m in summary["endpoints"].items():
        print(f"{endpoint}: " + ", ".join(f"{k} {v.get('avg', v) if isinstance(v, dict) else v}"
                                          for k, v in m.items() if k != "wall_s"))
    print(f"wrote {args.out / 'summary.json'}")
    return 0


def _metrics(artifacts: Path) -> dict:
    """The kept metrics from aiperf's JSON export of the profiling phase (warm-up excluded)."""
    export = artifacts / "profile_export_aiperf.json"
    if not export.is_file():
        raise SystemExit(f"aiperf wrote no {export.name} under {artifacts}")
    data = json.loads(export.read_text())
    found = {}
    for name in METRICS:
        value = data.get(name)
        if isinstance(value, dict):
            found[name] = {k: value[k] for k in ("unit", "avg", "p50", "p99") if k in value}
        elif value is not None:
            found[name] = value
    return found


if __name__ == "__main__":
    sys.exit(main())
