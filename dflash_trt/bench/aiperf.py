"""NVIDIA's `aiperf` client against a running server: one `aiperf profile` run, and the numbers kept from it.

aiperf runs from its own virtualenv (`make aiperf-env`: its pins clash with this project's), so it is
called as a program, never imported. The kept numbers come from its JSON export of the profiling phase
(warm-up excluded): metric tag -> {unit, avg, p50, p99, ...}.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS = (
    "request_throughput",
    "output_token_throughput",
    "time_to_first_token",
    "inter_token_latency",
    "request_latency",
    "output_sequence_length",
    "request_count",
    "error_summary",
)


class AiperfFailed(RuntimeError):
    """aiperf exited non-zero or wrote no export; the message ends with its log's tail."""


@dataclass
class AiperfRun:
    url: str
    model: str
    tokenizer: str  # a Hugging Face tokenizer directory (aiperf counts tokens with it)
    endpoint: str = "completions"  # aiperf --endpoint-type: completions or chat
    concurrency: int = 1
    requests: int = 16
    warmup: int = 1
    input_file: Path | None = None  # single_turn JSONL ({"text", "output_length"}); None: synthetic prompts
    isl: int = 64  # synthetic prompt tokens (without input_file)
    osl: int = 64  # tokens per request (max_tokens; ignore_eos makes every request generate them all)
    extra_inputs: dict[str, Any] = field(default_factory=dict)  # merged into every request body (temperature, ...)
    seed: int = 0
    # aiperf is a multi-process client; on a small machine its default worker and record-processor counts
    # take CPU from the server it measures. One of each drives 32 concurrent streams (they are async).
    workers: int = 1
    record_processors: int = 1
    # niceness of the client: sharing the server's cores, aiperf's own CPU use (it parses every streamed
    # event) is taken from the server it measures; a lower priority lets it use idle CPU only, as a client
    # on another machine would (docs/design.md#benchmark-method-on-a-shared-2-core-cpu).
    nice: int = 0

    def command(self, aiperf: str, artifacts: Path) -> list[str]:
        cmd = ["nice", "-n", str(self.nice)] if self.nice else []
        cmd += [
            aiperf,
            "profile",
            "--url",
            self.url,
            "--endpoint-type",
            self.endpoint,
            "--streaming",
            "--model",
            self.model,
            "--tokenizer",
            self.tokenizer,
            "--request-count",
            str(self.requests),
            "--concurrency",
            str(self.concurrency),
            "--osl",
            str(self.osl),
            "--random-seed",
            str(self.seed),
            "--artifact-dir",
            str(artifacts),
            "--num-warmup-requests",
            str(self.warmup),
            "--extra-inputs",
            json.dumps({"ignore_eos": True, **self.extra_inputs}),
            "--workers-max",
            str(self.workers),
            "--record-processors",
            str(self.record_processors),
            "--no-server-metrics",
            "--no-gpu-telemetry",
            "--ui-type",
            "none",
        ]
        if self.input_file is not None:
            cmd += ["--input-file", str(self.input_file), "--custom-dataset-type", "single_turn"]
        else:
            cmd += ["--isl", str(self.isl)]
        return cmd


def run_aiperf(aiperf: str, run: AiperfRun, artifacts: Path) -> dict[str, Any]:
    """Run one profile into `artifacts`; returns the kept metrics plus the run's wall time."""
    artifacts.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = subprocess.run(run.command(aiperf, artifacts), capture_output=True, text=True)
    (artifacts / "aiperf.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AiperfFailed(
            f"aiperf exited {proc.returncode} (log: {artifacts / 'aiperf.log'}):\n"
            + (proc.stdout + proc.stderr)[-3000:]
        )
    return {"wall_s": round(time.monotonic() - started, 1), **export_metrics(artifacts)}


def export_metrics(artifacts: Path) -> dict[str, Any]:
    """The kept metrics from aiperf's JSON export under `artifacts` (searched: aiperf may nest it)."""
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not exports:
        raise AiperfFailed(f"aiperf wrote no profile_export_aiperf.json under {artifacts}")
    data = json.loads(exports[-1].read_text())
    found: dict[str, Any] = {}
    for name in METRICS:
        value = data.get(name)
        if isinstance(value, dict):
            found[name] = {k: value[k] for k in ("unit", "avg", "p50", "p99") if k in value}
        elif value is not None:
            found[name] = value
    return found


def value(metrics: dict[str, Any], name: str, stat: str = "avg") -> float | None:
    """One number out of `export_metrics`' result (None when aiperf did not report it)."""
    m = metrics.get(name)
    return float(m[stat]) if isinstance(m, dict) and m.get(stat) is not None else None
