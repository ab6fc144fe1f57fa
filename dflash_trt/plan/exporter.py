"""`plan check --serve-metrics`: trtllm-serve's JSON iteration statistics as Prometheus series under vLLM's names.

trtllm-serve publishes drafts and acceptance only as JSON (GET /metrics, a list of the iteration statistics queued
since the last call, drained by each call: tensorrt_llm/serve/openai_server.py get_iteration_stats,
NVIDIA/TensorRT-LLM 00057725; its /prometheus/metrics, mounted only with return_perf_metrics, and /perf_metrics,
per request, give no per-iteration drafts: docs/gpu.md). This sidecar polls
that list and keeps running totals, so the ServiceMonitor, the PrometheusRule's plan alerts, the KEDA triggers
and `plan check --engine vllm` read a trtllm-serve pod exactly as they read vLLM:

  vllm:spec_decode_num_drafts_total          sum of specDecodingStats.numRequestsWithDraftTokens (a request's
                                             drafting round, as vLLM counts a draft per request per step)
  vllm:spec_decode_num_draft_tokens_total    sum of specDecodingStats.numDraftTokens
  vllm:spec_decode_num_accepted_tokens_total sum of specDecodingStats.numAcceptedTokens (drafts kept, the bonus
                                             token excluded, as vLLM's)
  vllm:generation_tokens_total               sum of inflightBatchingStats.numGenRequests + numAcceptedTokens
                                             (each generation request commits one token plus its accepted drafts)
  vllm:num_requests_running                  numActiveRequests of the newest iteration polled
  vllm:num_requests_waiting                  numQueuedRequests of the newest iteration polled

(vLLM's names: vllm/v1/spec_decode/metrics.py at vllm-project/vllm 016a8587, vllm/v1/metrics/loggers.py at 005a810b; the
iteration fields: cpp/include/tensorrt_llm/executor/types.h IterationStats / SpecDecodingStats, read through
dflash_trt.plan.metrics, whose parser this reuses.) Per-position acceptance is not published by trtllm-serve,
so vllm:spec_decode_num_accepted_tokens_per_pos is absent, as on an engine without it.

Polling: every `poll_s` seconds in the background and once more at each scrape, so totals are current when read
and the engine's buffer (capped by max_stats_len, 1000 by default: --max-stats-len says the YAML's) is drained well
before it overflows. Records this exporter never saw (metrics.StatsLedger) are counted:
dflash_trtllm_stats_lost_total{cause="dropped"} (evicted at the cap) and {cause="unread"} (drained without reaching
this exporter: another reader of /metrics, or a poll that failed after the drain), where the engine numbers its
records; where it does not, dflash_trtllm_capped_polls_total counts polls that came back at the cap or over, when
records may have been lost.
An engine that ran no iteration for IDLE_S seconds runs nothing: its running and waiting gauges read 0 then, as
vLLM's do when idle (trtllm-serve publishes no iteration while idle, so the last one's counts would otherwise stay
and keep the autoscaler and the batch alert busy). A scrape whose poll fails (trtllm-serve down) answers 503, so Prometheus' `up` turns 0 rather than the series
going flat. The totals live in this process: a restarted sidecar starts from 0, which Prometheus' rate() reads
as a counter reset.
"""

from __future__ import annotations

import hmac
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import metrics

# vLLM's family names (vllm/v1/spec_decode/metrics.py at 016a8587, vllm/v1/metrics/loggers.py at 005a810b): the names
# dflash_trt.plan.metrics reads for engine "vllm", so one table serves both sides
VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "generated": "vllm:generation_tokens",
}
VLLM_RUNNING, VLLM_WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
STATS_LOST, CAPPED_POLLS = "dflash_trtllm_stats_lost", "dflash_trtllm_capped_polls"
IDLE_S = 5.0  # an iteration takes milliseconds to about a second: none for this long is an idle engine


class TrtllmTotals(Collector):
    """Running totals of trtllm-serve's iteration statistics, exposed as the vLLM series above."""

    def __init__(
        self,
        url: str,
        get: Callable[[str], str] = metrics.fetch,
        clock: Callable[[], float] = time.monotonic,
        max_stats_len: int = metrics.TRTLLM_STATS_KEPT,
    ):
        self.url = metrics.metrics_url(url)
        self.get, self.clock = get, clock
        self.cap = metrics.trtllm_cap(max_stats_len)  # an unnumbered poll this long may have lost older records
        self.last_iteration_at = clock()
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(VLLM_COUNTERS, 0.0)
        self.running: float | None = None
        self.waiting: float | None = None
        self.iterations = self.polls = 0
        self.lost = metrics.StatsLedger()

    def poll(self) -> int:
        """Drain trtllm-serve's queue once and add what it held; returns the iterations read (MetricsError on an
        unreachable engine or a body that is not the JSON list)."""
        with self.lock:
            now = self.clock()
            sample = metrics.read_trtllm(self.get(self.url), now)
            for it in sample.iterations:
                spec = it.get(metrics.TRTLLM_SPEC) or {}
                gen = (it.get("inflightBatchingStats") or {}).get("numGenRequests", 0)
                self.totals["drafts"] += spec.get("numRequestsWithDraftTokens", 0)
                self.totals["draft_tokens"] += spec.get("numDraftTokens", 0)
                self.totals["accepted"] += spec.get("numAcceptedTokens", 0)
                self.totals["generated"] += gen + spec.get("numAcceptedTokens", 0)
            if sample.iterations:
                newest = max(sample.iterations, key=lambda i: i.get("iter", 0))
                self.running = float(newest.get(metrics.TRTLLM_ACTIVE, 0))
                self.waiting = float(newest.get("numQueuedRequests", 0))
                self.last_iteration_at = now
            elif self.running is not None and now - self.last_iteration_at >= IDLE_S:
                self.running = self.waiting = 0.0
            # the first poll drains what came before this exporter: its numbers are the baseline, its length no loss
            self.lost.add(sample.iterations, self.cap if self.polls else None)
            self.iterations += len(sample.iterations)
            self.polls += 1
            return len(sample.iterations)

    def collect(self) -> Iterable[Metric]:
        self.poll()  # a failed poll fails the scrape: `up` 0, never stale totals read as no traffic
        return self.families()

    def families(self) -> Iterator[Metric]:
        with self.lock:
            for key, name in VLLM_COUNTERS.items():
                c = CounterMetricFamily(name, f"trtllm-serve iteration statistics: {key} (plan/exporter.py)")
                c.add_metric([], self.totals[key])
                yield c
            # no gauge before the first iteration: an absent batch is an error to the check, never a batch of 0
            for name, value in ((VLLM_RUNNING, self.running), (VLLM_WAITING, self.waiting)):
                if value is not None:
                    g = GaugeMetricFamily(name, "trtllm-serve's newest iteration statistics (plan/exporter.py)")
                    g.add_metric([], value)
                    yield g
            lost = CounterMetricFamily(
                STATS_LOST,
                "trtllm-serve iteration records never read: dropped at its cap, or drained and unread here",
                labels=["cause"],
            )
            lost.add_metric(["dropped"], float(self.lost.dropped))
            lost.add_metric(["unread"], float(self.lost.unread))
            yield lost
            capped = CounterMetricFamily(
                CAPPED_POLLS, "polls of unnumbered records at max_stats_len + 1 or more (loss possible)"
            )
            capped.add_metric([], float(self.lost.capped_polls))
            yield capped


def app(totals: TrtllmTotals, api_key: str | None) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: /metrics (Bearer key when one is set, as the ServiceMonitor sends it), /health open."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(totals)
    prom = make_wsgi_app(registry)

    def serve(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/health":
            start("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path != "/metrics":
            start("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        if api_key is not None:
            sent = environ.get("HTTP_AUTHORIZATION", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
                start("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
                return [b"unauthorized\n"]
        try:
            return list(prom(environ, start))
        except metrics.MetricsError as e:
            print(f"serve-metrics: scrape failed: {e}", file=sys.stderr, flush=True)
            start("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"{e}\n".encode()]

    return serve


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # a scrape every 15 s would fill the log
        pass


class _Threading(WSGIServer):
    daemon_threads = True


def read_key(path: Path | None) -> str | None:
    """The API key from its file (as `serve --api-key-file`): None without a file; an empty file is an error."""
    if path is None:
        return None
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"{path} is empty: an empty key would let every scraper in")
    return key


def serve(
    url: str,
    host: str,
    port: int,
    poll_s: float,
    api_key: str | None,
    ready: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    max_stats_len: int = metrics.TRTLLM_STATS_KEPT,
) -> None:
    """Serve until `stop` is set (or forever): polls every poll_s seconds in the background (0: at scrapes only);
    `clock` times the idle rule (IDLE_S); `max_stats_len` is trtllm-serve's (its cap)."""
    from socketserver import ThreadingMixIn

    class Server(ThreadingMixIn, _Threading):
        pass

    totals = TrtllmTotals(url, clock=clock, max_stats_len=max_stats_len)
    stop = stop or threading.Event()
    httpd = make_server(host, port, app(totals, api_key), server_class=Server, handler_class=_Quiet)

    def poller() -> None:
        while not stop.wait(poll_s):
            try:
                totals.poll()
            except metrics.MetricsError as e:  # the engine still loading, or restarting: the next poll retries
                print(f"serve-metrics: poll failed: {e}", file=sys.stderr, flush=True)

    if poll_s > 0:
        threading.Thread(target=poller, daemon=True).start()

    def stopper() -> None:
        stop.wait()
        httpd.shutdown()

    threading.Thread(target=stopper, daemon=True).start()
    bound = httpd.server_address[1]
    print(f'{{"event": "serve_metrics", "port": {bound}, "engine": "{totals.url}"}}', flush=True)
    if ready is not None:
        ready(int(bound))
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()
