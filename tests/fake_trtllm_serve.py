"""A FAKE `trtllm-serve` (this workplace has no GPU and no TensorRT-LLM): the stand-in the pod runner starts in
place of the NGC image's trtllm-serve, with the same command line the overlays write:

    python tests/fake_trtllm_serve.py /checkpoints/target --backend pytorch --host 0.0.0.0 --port 8000 \
        --tp_size 1 --extra_llm_api_options /config/trtllm-serve.yaml

What it does as the real one does (each with its source; nothing here computes a model):
* the command line: tensorrt_llm/commands/serve.py (NVIDIA/TensorRT-LLM 00209af1, the `serve` click command):
  `--config` and `--extra_llm_api_options` name the same YAML, `--tp_size` aliases `--tensor_parallel_size`,
  `--host` defaults to localhost; an option it does not define is a usage error (click: exit 2);
* the YAML: read with yaml.safe_load and merged into the LLM arguments, which pydantic validates as TorchLlmArgs
  with speculative_config a DFlashDecodingConfig: any key or value llm_args.py at the pinned commit would refuse
  is refused here (dflash_trt.builders.trtllm_llm_args, the record data/upstream/trtllm-llm-args-00043967.json),
  and a speculative_model folder TensorRT-LLM's DFlash loader could not load (builders.trtllm_serve
  drafter_problems); the process then exits 1 before it listens, as the real one does before binding its port;
* GET /health: 200 with an empty body while the engine is healthy (tensorrt_llm/serve/openai_server.py at
  00057725, `health`: Response(status_code=200), else 503 with a message);
* GET /metrics: a JSON list of the iteration statistics queued since the last call, drained by the call
  (`get_iteration_stats` over get_stats_async), empty unless enable_iter_perf_stats is true; fields as
  cpp/include/tensorrt_llm/executor/types.h names them. The buffer keeps max_stats_len + 1 records (default 1000;
  0 is 1, as llm_args.py makes it; -1 all), dropping the oldest silently, as py_executor.py _append_iter_stats at
  0004396720 does; with FAKE_TRTLLM_NUMBERED=1 it keeps exactly max_stats_len and numbers its records as a stored
  later version does (py_executor.py at c6fb6ac3 _append_stats_frame: statsSequence +1 per record from 1,
  statsDroppedFrames the evictions so far). One rank, no attention DP, no startup snapshot record;
* GET /v1/models and POST /v1/completions (the OpenAI routes of `register_routes`), minimally: a completion of
  max_tokens FAKE tokens ("x"), decoded in rounds that each draft max_draft_len tokens (at most what the
  schedule gives at the batch size) and accept FAKE_TRTLLM_ACCEPT of them (default 0.5), each round queued as
  one iteration's statistics. FAKE_TRTLLM_LOAD_S delays the listening port (the engine's load), default 0;
* SIGTERM: drains, then re-raises the signal as uvicorn does (`main`), so a caller that leaves SIGTERM at its default
  sees the process end by it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_trt.builders.trtllm_llm_args import fields_of, record, yaml_problems  # noqa: E402
from dflash_trt.builders.trtllm_serve import drafter_problems  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-serve (FAKE)", allow_abbrev=False)
    p.add_argument("model")
    p.add_argument("--backend", choices=["pytorch", "tensorrt", "trt", "_autodeploy"], default="pytorch")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor_parallel_size", "--tp_size", type=int, default=1)
    p.add_argument("--pipeline_parallel_size", "--pp_size", type=int, default=1)
    p.add_argument("--gpus_per_node", type=int, default=None)
    p.add_argument("--max_batch_size", type=int, default=None)
    p.add_argument("--max_num_tokens", type=int, default=None)
    p.add_argument("--max_seq_len", type=int, default=None)
    p.add_argument("--free_gpu_memory_fraction", "--kv_cache_free_gpu_memory_fraction", type=float, default=0.9)
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--log_level", default="info")
    p.add_argument("--config", "--extra_llm_api_options", dest="extra_llm_api_options", default=None)
    return p


def load_args(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM arguments after the YAML (SystemExit(1) with the reasons, as pydantic's validation error ends it)."""
    import yaml

    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"trtllm-serve (FAKE): {args.model}: no Hugging Face checkpoint (config.json) there")
    extra: Any = {}
    if args.extra_llm_api_options is not None:
        with open(args.extra_llm_api_options) as f:
            extra = yaml.safe_load(f) or {}
    problems = yaml_problems(extra)
    spec = extra.get("speculative_config") if isinstance(extra, dict) else None
    if isinstance(spec, dict) and not problems:
        drafter = spec.get("speculative_model")
        if drafter is None or not Path(drafter).is_dir():
            problems.append(f"speculative_config.speculative_model: {drafter!r} is not a drafter folder")
        else:
            problems += [f"speculative_model {drafter}: {p}" for p in drafter_problems(drafter)]
    if problems:
        sys.exit("trtllm-serve (FAKE): the LLM arguments do not validate:\n  " + "\n  ".join(problems))
    if args.max_batch_size is not None:
        extra.setdefault("max_batch_size", args.max_batch_size)
    return dict(extra)


class Engine:
    """The decoding loop's observable side: active requests and the iteration statistics it queues."""

    def __init__(self, llm_args: dict[str, Any]):
        top = fields_of(record(), "TorchLlmArgs")
        self.stats_on = bool(llm_args.get("enable_iter_perf_stats", top["enable_iter_perf_stats"]["default"]))
        keep = int(llm_args.get("max_stats_len", top["max_stats_len"]["default"]))
        keep = keep if keep == -1 else max(keep, 1)  # llm_args.py: 0 becomes 1
        self.numbered = os.environ.get("FAKE_TRTLLM_NUMBERED") == "1"
        self.cap = None if keep == -1 else keep if self.numbered else keep + 1
        self.stats: deque[dict[str, Any]] = deque()
        self.sequence = self.dropped = 0
        self.spec = llm_args.get("speculative_config") or {}
        self.accept = float(os.environ.get("FAKE_TRTLLM_ACCEPT", "0.5"))
        self.lock = threading.Lock()
        self.active = 0
        self.iteration = 0

    def drafts_at(self, batch: int) -> int:
        """max_draft_len, or the schedule's length for this batch (the smallest key at or above it; none above)."""
        k = int(self.spec.get("max_draft_len") or 0)
        schedule = self.spec.get("draft_len_schedule")
        if schedule:
            keys = sorted(int(b) for b in schedule)
            at = [b for b in keys if b >= batch]
            k = int(schedule[at[0]] if at[0] in schedule else schedule[str(at[0])]) if at else 0
        cap = self.spec.get("max_concurrency")
        return 0 if cap is not None and batch > int(cap) else k

    def complete(self, max_tokens: int) -> int:
        with self.lock:
            self.active += 1
        made = 0
        try:
            while made < max_tokens:
                with self.lock:
                    k = self.drafts_at(self.active)
                    accepted = min(math.floor(self.accept * k), max_tokens - made - 1)
                    made += 1 + accepted
                    if self.stats_on:
                        self.record(self.iteration_stats(k, accepted))
                    self.iteration += 1
                time.sleep(0.001)
        finally:
            with self.lock:
                self.active -= 1
        return made

    def iteration_stats(self, k: int, accepted: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "iter": self.iteration,
            "iterLatencyMS": 1.0,
            "numActiveRequests": self.active,
            "numQueuedRequests": 0,
            "inflightBatchingStats": {"numScheduledRequests": 1, "numContextRequests": 0, "numGenRequests": 1},
        }
        if self.spec:
            out["specDecodingStats"] = {
                "numDraftTokens": k,
                "numAcceptedTokens": accepted if k else 0,
                "numRequestsWithDraftTokens": 1 if k else 0,
                "acceptanceLength": 1 + (accepted if k else 0),
                "iterLatencyMS": 1.0,
                "draftOverhead": 0.0,
            }
        return out

    def record(self, stats: dict[str, Any]) -> None:
        """Into the capped buffer, the oldest evicted first (module docstring: the two executors' rules)."""
        if self.cap is not None:
            while self.stats and len(self.stats) >= self.cap:
                self.stats.popleft()
                self.dropped += 1
        if self.numbered:
            self.sequence += 1
            stats |= {"statsSequence": self.sequence, "statsDroppedFrames": self.dropped}
        self.stats.append(stats)

    def drain(self) -> list[dict[str, Any]]:
        with self.lock:
            out = list(self.stats)
            self.stats.clear()
            return out


def handler(engine: Engine, model: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: int, body: Any = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            if body is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200)
            elif self.path == "/metrics":
                self.reply(200, engine.drain())
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "fake"}]})
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.reply(404, {"detail": "Not Found"})
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                n = int(req.get("max_tokens", 16))
            except (ValueError, TypeError):
                self.reply(400, {"error": "a JSON body with an integer max_tokens"})
                return
            made = engine.complete(n)
            text = "x" * made  # FAKE tokens: no model runs here
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            usage = {"prompt_tokens": 1, "completion_tokens": made, "total_tokens": 1 + made}
            self.reply(200, {"object": "text_completion", "model": model, "choices": [choice], "usage": usage})

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    llm_args = load_args(args)
    time.sleep(float(os.environ.get("FAKE_TRTLLM_LOAD_S", "0")))
    server = ThreadingHTTPServer((args.host, args.port), handler(Engine(llm_args), args.model))
    server.daemon_threads = True
    # uvicorn's Server.capture_signals (uvicorn >= 0.29, PR 1600; read in 0.55.0 uvicorn/server.py): its own SIGTERM
    # handler while serving, then the process's earlier handler back and the captured signal raised again. With
    # SIGTERM at its default that ends the process by the signal (exit 143) after a complete drain; where the
    # process inherited SIGTERM ignored, raising it again does nothing and it exits 0.
    caught: list[int] = []

    def drain(signum: int, _frame: Any) -> None:
        caught.append(signum)
        threading.Thread(target=server.shutdown).start()

    earlier = signal.signal(signal.SIGTERM, drain)
    print(f"trtllm-serve (FAKE) listening on {args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        signal.signal(signal.SIGTERM, earlier)
    for signum in caught[:1]:
        signal.raise_signal(signum)
    return 0


if __name__ == "__main__":
    sys.exit(main())
