"""What a serving engine's own metrics say about speculation over a window: tau, per-position acceptance, the
drafts per round and the running batch sizes, read from two or more scrapes of its metrics endpoint.

Counters are read as differences between the first and the last scrape (what happened in the window); gauges
are read at every scrape (what the batch looked like while it ran). Each engine's names, as its source
defines them:

* vLLM (`vllm/v1/spec_decode/metrics.py`, SpecDecodingProm, vllm-project/vllm at 016a8587; labels model_name
  and engine from `vllm/v1/metrics/loggers.py`): counters vllm:spec_decode_num_drafts,
  vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens and
  vllm:spec_decode_num_accepted_tokens_per_pos (label `position`, from 0; a round that accepted n drafts
  counts positions 0..n-1 once each); gauge vllm:num_requests_running; counter vllm:generation_tokens.
* SGLang (`python/sglang/srt/metrics/collector.py`, SchedulerMetricsCollector, sgl-project/sglang at
  00ae9c15; labels model_name, engine_type, tp_rank, pp_rank and dp_rank where set, from
  `python/sglang/srt/managers/scheduler_metrics_mixin.py` init_metrics at 01bb3c80): gauges
  sglang:spec_accept_length (tokens committed per request per verify forward, the bonus included: tau),
  sglang:spec_accept_rate (the same accepted tokens, bonus included, over forward count x
  speculative_num_draft_tokens: tau / block, log_decode_stats at 78ac30c2; update_spec_metrics adds the
  bonus), sglang:num_running_reqs, set at each scheduler log interval (mostrecent), so they are averaged over
  the scrapes; counter sglang:generation_tokens. No per-position figure. Each scheduler that records metrics
  (dp ranks; every rank with --enable-metrics-for-all-schedulers) publishes its own label set: the running
  batch is summed over them, tau and the rate (per-scheduler ratios) are averaged over those that drafted.
* TensorRT-LLM (`trtllm-serve` GET /metrics, tensorrt_llm/serve/openai_server.py get_iteration_stats: a JSON
  list of the iteration statistics queued since the last call, drained by each call; fields as
  cpp/include/tensorrt_llm/executor/types.h IterationStats / SpecDecodingStats serialise them; needs
  enable_iter_perf_stats): per iteration numActiveRequests, inflightBatchingStats.numGenRequests and
  specDecodingStats {numDraftTokens, numAcceptedTokens, numRequestsWithDraftTokens}. The first scrape only
  drains the queue; the later ones hold the window's iterations. The engine keeps only the last max_stats_len
  iterations (an LLM argument, 1000 by default): a scrape that returns that many may have lost older ones. Tokens per iteration are derived (each
  generation request commits one token plus its accepted drafts; context requests are not counted).
* dflash-trt (this project's server, dflash_trt/server/metrics.py): the vLLM names above (it exports them
  from the same verify rounds), plus dflash_generated_tokens, dflash_inflight_requests and the target pass's
  rows and tokens by part (dflash_batch_rows / dflash_batch_tokens {pass="verify"|"chunk"}): the verify rows'
  mean over the window is the batch the rounds actually ran, and with the tokens and the window's seconds they
  give the mean served step (`Observed.steps`), which `plan --from-metrics` prices against a cost model.

Per-position rates are conditional (position k accepted given k-1 was), as the simulator's profiles hold
them: rate_0 = accepted_per_pos[0] / drafts, rate_k = accepted_per_pos[k] / accepted_per_pos[k-1]. That is
exact when every round drafted at least k+1 tokens; only positions below the window's mean drafts per round
(rounded down) are kept for that reason (rounds clipped at an output's end, or a schedule that drafted fewer
at larger batches, bias the later ones).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

ENGINES = ("vllm", "sglang", "trtllm", "dflash-trt")
TRTLLM_STATS_KEPT = 1000  # the LLM args' max_stats_len default: iterations trtllm-serve queues between scrapes


class MetricsError(ValueError):
    """A scrape that cannot be read, or a window that says nothing about speculation (the message says why)."""


@dataclass
class Sample:
    """One scrape: its time, counters and gauges (summed over label sets), per-position accepted counts, and
    TensorRT-LLM's iteration statistics."""

    t: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)  # RATIO_GAUGES averaged over label sets
    per_pos: dict[int, float] = field(default_factory=dict)
    iterations: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Observed:
    """What a window of an engine's metrics says; None where the engine does not publish it."""

    engine: str
    url: str
    seconds: float
    drafts: float  # verify rounds that drafted (requests with drafts, per iteration, for TensorRT-LLM)
    tau: float  # tokens committed per drafting round, the bonus token included
    mean_drafts: float | None  # drafted tokens per drafting round (anchor excluded)
    position_rates: list[float] | None  # conditional per-position acceptance (module docstring)
    batch: list[float]  # running batch sizes seen (one per scrape, or per iteration for TensorRT-LLM)
    tokens_per_s: float | None  # generated tokens per second over the window
    idle_drafting: int | None = None  # TensorRT-LLM: iterations with generation requests and no draft
    source: str = ""
    full_scrapes: int | None = None  # TensorRT-LLM: window scrapes returning >= TRTLLM_STATS_KEPT iterations
    # dflash-trt: the mean served step (`step_shape`): its wall seconds, its verify rows and tokens, the prompt
    # chunks riding in its pass, its drafting rows and their drafted tokens; `steps` is how many it averages
    steps: dict[str, float] | None = None

    @property
    def mean_batch(self) -> float:
        busy = [b for b in self.batch if b > 0]
        return sum(busy) / len(busy) if busy else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"kind": "dflash-trt plan check scrape", **asdict(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Observed:
        fields = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc}
        try:
            return cls(**fields)
        except TypeError as e:
            raise MetricsError(f"not a `plan check --save` file: {e}") from None


# ---- reading one scrape -------------------------------------------------------------------------------------
def prometheus_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of Prometheus exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [(s.name, s.labels, float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]
    except (ValueError, TypeError) as e:
        raise MetricsError(f"not Prometheus text ({e})") from None


# engine -> (counter names to sum, gauge names to sum, per-position counter, its label)
VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "generated": "vllm:generation_tokens_total",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
NAMES: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "vllm": (VLLM_COUNTERS, {"running": "vllm:num_requests_running"}),
    "sglang": (
        {"generated": "sglang:generation_tokens_total"},
        {
            "running": "sglang:num_running_reqs",
            "accept_length": "sglang:spec_accept_length",
            "accept_rate": "sglang:spec_accept_rate",
        },
    ),
    "dflash-trt": (
        {**VLLM_COUNTERS, "generated": "dflash_generated_tokens_total"},
        {"running": "dflash_inflight_requests"},
    ),
}
# dflash-trt's target pass by part, read per label: <part>_rows_sum, <part>_rows_count, <part>_tokens_sum
PASS_PARTS = ("verify", "chunk")
PASS_FAMILIES = {
    "dflash_batch_rows_sum": "rows_sum",
    "dflash_batch_rows_count": "rows_count",
    "dflash_batch_tokens_sum": "tokens_sum",
}


# Gauges that are each scheduler's own ratio (SGLang's tau and tau / block): a sum over label sets would add
# ratios, so they are averaged over the label sets that drafted (a scheduler that ran no verify forward in its
# log interval publishes 0). Every other gauge (the running batch) is summed: each scheduler runs its own.
RATIO_GAUGES = frozenset({"accept_length", "accept_rate"})


def read_prometheus(engine: str, text: str, t: float) -> Sample:
    """One Prometheus scrape of `engine`, by the names above (label sets summed, RATIO_GAUGES averaged;
    dflash_batch_rows: the verify pass only)."""
    counters, gauges = NAMES[engine]
    by_name = {v: k for k, v in counters.items()}
    by_gauge = {v: k for k, v in gauges.items()}
    s = Sample(t)
    ratios: dict[str, list[float]] = {}
    for name, labels, value in prometheus_samples(text):
        if engine == "dflash-trt" and name in PASS_FAMILIES:
            if labels.get("pass") in PASS_PARTS:
                key = f"{labels['pass']}_{PASS_FAMILIES[name]}"
                s.counters[key] = s.counters.get(key, 0.0) + value
            continue
        if name in by_name:
            s.counters[by_name[name]] = s.counters.get(by_name[name], 0.0) + value
        elif by_gauge.get(name) in RATIO_GAUGES:
            ratios.setdefault(by_gauge[name], []).append(value)
        elif name in by_gauge:
            s.gauges[by_gauge[name]] = s.gauges.get(by_gauge[name], 0.0) + value
        elif name == VLLM_PER_POS and engine in ("vllm", "dflash-trt"):
            pos = int(labels.get("position", -1))
            s.per_pos[pos] = s.per_pos.get(pos, 0.0) + value
    for key, values in ratios.items():
        drafted = [v for v in values if v > 0]
        s.gauges[key] = sum(drafted) / len(drafted) if drafted else 0.0
    return s


def read_trtllm(text: str, t: float) -> Sample:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise MetricsError(f"trtllm-serve /metrics is a JSON list of iteration statistics: {e.msg}") from None
    if not isinstance(doc, list) or not all(isinstance(i, dict) for i in doc):
        raise MetricsError("trtllm-serve /metrics is a JSON list of iteration statistics (objects)")
    return Sample(t, iterations=doc)


def read(engine: str, text: str, t: float) -> Sample:
    if engine not in ENGINES:
        raise MetricsError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    return read_trtllm(text, t) if engine == "trtllm" else read_prometheus(engine, text, t)


# ---- a window -----------------------------------------------------------------------------------------------
def _delta(first: Sample, last: Sample, key: str) -> float | None:
    if key not in last.counters:
        return None
    return last.counters[key] - first.counters.get(key, 0.0)


def _rates(per_pos: dict[int, float], drafts: float, positions: int) -> list[float] | None:
    if not per_pos or drafts <= 0 or positions < 1:
        return None
    rates, before = [], drafts
    for k in range(positions):
        now = per_pos.get(k, 0.0)
        rates.append(min(1.0, now / before) if before > 0 else 0.0)
        before = now
    return rates


def _no_drafts(engine: str, url: str) -> MetricsError:
    return MetricsError(
        f"{engine} at {url}: no speculative round in the window (no traffic, or speculation off): send traffic "
        "or widen --window"
    )


def window_prometheus(engine: str, url: str, samples: Sequence[Sample]) -> Observed:
    first, last = samples[0], samples[-1]
    seconds = last.t - first.t
    batch = [s.gauges.get("running", 0.0) for s in samples]
    generated = _delta(first, last, "generated")
    tps = generated / seconds if generated is not None and seconds > 0 else None
    if engine == "sglang":
        lengths = [s.gauges["accept_length"] for s in samples if s.gauges.get("accept_length", 0.0) > 0]
        accept_rates = [s.gauges["accept_rate"] for s in samples if s.gauges.get("accept_rate", 0.0) > 0]
        if not lengths:
            raise _no_drafts(engine, url)
        tau = sum(lengths) / len(lengths)
        rate = sum(accept_rates) / len(accept_rates) if accept_rates else 0.0
        k = tau / rate - 1 if rate > 0 else None  # rate = tau / block, and a block is the anchor + its drafts
        src = f"sglang:spec_accept_length / spec_accept_rate averaged over {len(lengths)} scrapes"
        return Observed(engine, url, seconds, float(len(lengths)), tau, k, None, batch, tps, source=src)
    drafts = _delta(first, last, "drafts") or 0.0
    if drafts <= 0:
        raise _no_drafts(engine, url)
    accepted = _delta(first, last, "accepted") or 0.0
    draft_tokens = _delta(first, last, "draft_tokens")
    k = draft_tokens / drafts if draft_tokens is not None else None
    per_pos = {p: last.per_pos.get(p, 0.0) - first.per_pos.get(p, 0.0) for p in last.per_pos}
    rates = _rates(per_pos, drafts, int(k) if k is not None else len(per_pos))
    steps = step_shape(first, last, seconds) if engine == "dflash-trt" else None
    if steps is not None:
        batch = batch + [steps["rows"]]  # the verify passes' mean rows: the batch the rounds ran at
    src = f"{int(drafts)} drafting rounds, counter differences over {seconds:.1f} s"
    return Observed(engine, url, seconds, drafts, 1 + accepted / drafts, k, rates, batch, tps, source=src, steps=steps)


def step_shape(first: Sample, last: Sample, seconds: float) -> dict[str, float] | None:
    """The window's mean served step of a dflash-trt server: wall seconds per verify pass (everything the server
    did between them: the loop's own work, HTTP and streaming, the client on a shared machine), rows and tokens of
    that pass, prompt-chunk rows and tokens riding in it, drafting rows and their drafted tokens (None without
    verify passes or the pass metrics)."""
    n = _delta(first, last, "verify_rows_count")
    if not n or seconds <= 0:
        return None

    def per_step(key: str) -> float:
        return (_delta(first, last, key) or 0.0) / n

    return {
        "steps": n,
        "wall_s": seconds / n,
        "rows": per_step("verify_rows_sum"),
        "tokens": per_step("verify_tokens_sum"),
        "chunk_rows": per_step("chunk_rows_sum"),
        "chunk_tokens": per_step("chunk_tokens_sum"),
        "drafting_rows": per_step("drafts"),
        "drafted_tokens": per_step("draft_tokens"),
    }


def window_trtllm(url: str, samples: Sequence[Sample]) -> Observed:
    iters = [i for s in samples[1:] for i in s.iterations]  # the first scrape drained what came before
    spec = [i.get("specDecodingStats") or {} for i in iters]
    with_drafts = [s for s in spec if s.get("numDraftTokens", 0) > 0]
    requests = sum(s.get("numRequestsWithDraftTokens", 0) for s in with_drafts)
    if not requests:
        raise _no_drafts("trtllm", url)
    accepted = sum(s.get("numAcceptedTokens", 0) for s in with_drafts)
    drafted = sum(s.get("numDraftTokens", 0) for s in with_drafts)
    gen = [(i.get("inflightBatchingStats") or {}).get("numGenRequests", 0) for i in iters]
    idle = sum(1 for g, s in zip(gen, spec) if g > 0 and s.get("numDraftTokens", 0) == 0)
    seconds = samples[-1].t - samples[0].t
    tokens = sum(gen) + sum(s.get("numAcceptedTokens", 0) for s in spec)
    batch = [float(i.get("numActiveRequests", 0)) for i in iters]
    src = f"{len(iters)} iterations ({len(with_drafts)} drafting) of trtllm-serve /metrics over {seconds:.1f} s"
    tps = tokens / seconds if seconds > 0 else None
    full = sum(1 for s in samples[1:] if len(s.iterations) >= TRTLLM_STATS_KEPT)
    return Observed(
        "trtllm",
        url,
        seconds,
        float(requests),
        1 + accepted / requests,
        drafted / requests,
        None,
        batch,
        tps,
        idle,
        src,
        full,
    )


def window(engine: str, url: str, samples: Sequence[Sample]) -> Observed:
    if len(samples) < 2:
        raise MetricsError("a window needs two scrapes at least")
    return window_trtllm(url, samples) if engine == "trtllm" else window_prometheus(engine, url, samples)


# ---- scraping -----------------------------------------------------------------------------------------------
def metrics_url(url: str) -> str:
    """`url` with /metrics appended when it names no path (every engine here serves its metrics there)."""
    from urllib.parse import urlsplit

    return url if urlsplit(url).path not in ("", "/") else url.rstrip("/") + "/metrics"


def fetch(url: str, timeout: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode())
    except (urllib.error.URLError, OSError) as e:
        raise MetricsError(f"cannot scrape {url}: {getattr(e, 'reason', e)}") from None


def scrape(
    engine: str,
    url: str,
    seconds: float,
    samples: int = 2,
    get: Callable[[str], str] = fetch,
    sleep: Callable[[float], None] = time.sleep,
) -> Observed:
    """`samples` scrapes evenly over `seconds` (the first at once), read as one window."""
    target = metrics_url(url)
    got = []
    for i in range(samples):
        if i:
            sleep(seconds / (samples - 1))
        got.append(read(engine, get(target), time.monotonic()))
    return window(engine, target, got)
