"""What a serving engine's own metrics say about speculation over a window: tau, per-position acceptance, the
drafts per round and the running batch sizes, read from two or more scrapes of its metrics endpoint.

Counters are read as differences between the first and the last scrape (what happened in the window); gauges
are read at every scrape (what the batch looked like while it ran). Each engine's names, as its source
defines them:

* vLLM (`vllm/v1/spec_decode/metrics.py`, SpecDecodingProm, vllm-project/vllm at 016a8587; labels model_name
  and engine from `vllm/v1/metrics/loggers.py`, read at 005a810b): counters vllm:spec_decode_num_drafts,
  vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens and
  vllm:spec_decode_num_accepted_tokens_per_pos (label `position`, from 0; a round that accepted n drafts
  counts positions 0..n-1 once each); gauge vllm:num_requests_running; counter vllm:generation_tokens.
* SGLang (SchedulerMetricsCollector: `python/sglang/srt/metrics/collector.py` at 00ae9c15, moved to
  `python/sglang/srt/observability/metrics_collector.py`, read at sgl-project/sglang 016d8605; labels
  model_name, engine_type, tp_rank, pp_rank, moe_ep_rank and dp_rank where set, from the scheduler's
  init_metrics): gauges sglang:spec_accept_length (tokens committed per request per verify forward, the bonus
  included: tau), sglang:spec_accept_rate, sglang:num_running_reqs, set at each scheduler log interval
  (mostrecent), so they are averaged over the scrapes; counter sglang:generation_tokens. No per-position figure.
  spec_accept_rate has had two meanings: before sgl-project/sglang PR 23530 (merged 2026-04-23) accepted tokens
  with the bonus over verify forwards x speculative_num_draft_tokens, tau / block (log_decode_stats at
  78ac30c2, its HELP "`accepted tokens / total draft tokens`"); since, accepted drafts over proposed drafts,
  (tau - 1) / (block - 1) (HELP "`accepted drafts / proposed drafts`", collector at 016d8605). Since PR 25940
  (merged 2026-05-21) the gauge sglang:spec_num_draft_tokens gives the active speculative_num_draft_tokens (the
  block, the anchor included) and the drafts per round are read from it; without it the HELP text says which
  formula the rate is, and a HELP that names neither is read as the current one (`sglang_drafts`). With priority
  scheduling num_running_reqs carries a `priority` label: the total under priority="" and a breakdown per
  priority (`_log_gauge_queue_count`, 016d8605), so only the total is read.
* TensorRT-LLM (`trtllm-serve` GET /metrics, tensorrt_llm/serve/openai_server.py get_iteration_stats: a JSON
  list of the iteration statistics queued since the last call, drained by each call; fields as
  cpp/include/tensorrt_llm/executor/types.h IterationStats / SpecDecodingStats serialise them; needs
  enable_iter_perf_stats): per iteration numActiveRequests, inflightBatchingStats.numGenRequests and
  specDecodingStats {numDraftTokens, numAcceptedTokens, numRequestsWithDraftTokens}. The first scrape only
  drains the queue; the later ones hold the window's iterations. Records can be lost before a scrape reads them
  (`StatsLedger`): the executor's buffer is capped by max_stats_len (an LLM argument, 1000 by default; `plan check
  --max-stats-len`), and every read of /metrics is destructive, so another reader takes what it reads. Tokens per
  iteration are derived (each generation request commits one token plus its accepted drafts; context requests are
  not counted).
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

Each engine runs its own batch: vLLM's data-parallel engines (label `engine`, "0".."N-1") and SGLang's schedulers
(one label set each, dp_rank) publish their own running gauge, and the schedule is keyed on one engine's batch.
The running batch is therefore read per engine (one value per label set per scrape, as the PrometheusRule's
`max by` reads it), never summed across engines: eight engines at 24 requests are a batch of 24, not 192.

A metric the check needs that is absent from the scrape is an error naming it (`MissingMetric`): a running gauge
that is not there is not a batch of 0, and spec counters under another name are not "no traffic".
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
TRTLLM_STATS_KEPT = 1000  # the LLM args' max_stats_len default (llm_args.py)
# the executor's sign for "keep every record" (py_executor.py _UNBOUNDED_STATS_MAX_LEN, at 0004396 and c6fb6ac)
TRTLLM_STATS_UNBOUNDED = -1


def trtllm_cap(max_stats_len: int = TRTLLM_STATS_KEPT) -> int | None:
    """The most records one /metrics poll holds from an engine that does not number them, or None (no cap).

    The PyTorch executor pops its oldest record only once its buffer holds more than max_stats_len
    (tensorrt_llm/_torch/pyexecutor/py_executor.py _append_iter_stats at NVIDIA/TensorRT-LLM 0004396720:
    `len(self.stats) > self.max_stats_len` then `self.stats.pop(0)`, silently), so it holds max_stats_len + 1;
    llm_args.py turns 0 into 1, and -1 keeps every record. Where the executor's buffer is fetched at each /metrics
    call (the RPC-fetched stats of that era), a poll of that many or more (one response can carry several fetches)
    may have lost older records, and a shorter one lost none at the cap; where a worker thread drains it every 0.2 s
    into an unbounded queue (the older IPC design) a poll's length says little. Hence `StatsLedger.capped_polls`
    says "may". Not modelled: TLLM_METRICS_ALL_RANKS=1 with attention DP, where _flush_iter_stats_synced caps the
    buffer at max_stats_len x tp_size."""
    if max_stats_len == TRTLLM_STATS_UNBOUNDED:
        return None
    return max(max_stats_len, 1) + 1


@dataclass
class StatsLedger:
    """trtllm-serve's iteration records that a reader of /metrics never saw, as far as it can tell.

    One stored executor numbers its records (py_executor.py at c6fb6ac3 _append_stats_frame; executor/
    iteration_stats.py _materialize_frame; the pinned 0004396720 does not): `statsSequence`, +1 per buffered record
    from 1 in each process (attention-DP rows of one frame share it), and `statsDroppedFrames`, the evictions at the
    cap so far, stamped on each record as it is appended. Every read of /metrics drains the buffer, so a record a
    reader did not see was either evicted (`dropped`) or drained without reaching this reader (`unread`: another
    reader, such as a second scraper, an `LLM.get_stats` user or the return_perf_metrics collector, or a poll of
    this reader that failed after trtllm-serve had drained). Per poll: every record evicted since the last poll was
    appended before the poll's newest record, so that record's count less the last poll's is what was dropped, and
    the rest of the sequence numbers skipped were unread. That holds for whole drains; a drain split across two
    responses counts its first part's later numbers as skipping the rest, and an engine that restarted and evicted
    past the last number read before its first poll is not seen to have restarted. A poll whose sequence starts at
    or below the last one read is a restarted engine: counted from its start. The `iter` field cannot do this: the
    executor skips counter values (passes that scheduled nothing, the overlap loop's last pass) and stamps 0 twice
    after a start. An engine that numbers nothing: a poll of `trtllm_cap` records or more may have lost some."""

    dropped: int = 0  # records the engine evicted at its cap before any read
    unread: int = 0  # records drained that never reached this reader
    capped_polls: int = 0  # unnumbered records: polls at the cap or over (records may be lost)
    sequence: int | None = None  # the newest statsSequence read
    dropped_seen: int = 0  # the newest statsDroppedFrames read

    def add(self, records: Sequence[dict[str, Any]], cap: int | None) -> None:
        """One poll's records; `cap` None for the first poll of a window or of an exporter (it drains what came
        before, so only its numbers count, as the baseline). The first numbered records read are the baseline too:
        what was lost before them is not this reader's loss."""
        numbered = {r["statsSequence"]: r.get("statsDroppedFrames", 0) for r in records if "statsSequence" in r}
        if not numbered:
            if cap is not None and len(records) >= cap:
                self.capped_polls += 1
            return
        newest = max(numbered)
        if cap is not None and self.sequence is not None:  # else the first numbers read: the baseline
            since, dropped_since = self.sequence, self.dropped_seen
            if min(numbered) <= since:  # a new process: its numbers start after 0
                since, dropped_since = 0, 0
            evicted = max(0, numbered[newest] - dropped_since)
            self.dropped += evicted
            self.unread += max(0, newest - since - len(numbered) - evicted)
        self.sequence, self.dropped_seen = newest, numbered[newest]


class MetricsError(ValueError):
    """A scrape that cannot be read, or a window that says nothing about speculation (the message says why)."""


def missing(engine: str, url: str, name: str, what: str, speculative: bool = False) -> MetricsError:
    """The error for a metric the check reads that the engine did not publish (module docstring);
    `speculative`: a figure the engine publishes only while speculation is configured."""
    off = ", speculation is off in it" if speculative else ""
    return MetricsError(
        f"{engine} at {url}: no {name} in its metrics, which the check reads for {what}: this {engine} version "
        f"names it otherwise{off}, or the URL is not its metrics endpoint"
    )


@dataclass
class Sample:
    """One scrape: its time, counters (summed over label sets), the running batch per engine (label set),
    per-scheduler ratios (averaged over the label sets that drafted), per-position accepted counts, the HELP text
    of the families read, and TensorRT-LLM's iteration statistics."""

    t: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)  # RATIO_GAUGES averaged over label sets
    running: dict[str, float] = field(default_factory=dict)  # engine (its label set) -> running requests
    per_pos: dict[int, float] = field(default_factory=dict)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    help: dict[str, str] = field(default_factory=dict)  # family name -> HELP text


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
    batch: list[float]  # running batch sizes seen: one per engine per scrape (per iteration for TensorRT-LLM)
    tokens_per_s: float | None  # generated tokens per second over the window
    idle_drafting: int | None = None  # TensorRT-LLM: iterations with generation requests and no draft
    source: str = ""
    stats_lost: StatsLedger | None = None  # TensorRT-LLM: records the window's scrapes never saw (StatsLedger)
    # dflash-trt: the mean served step (`step_shape`): its wall seconds, its verify rows and tokens, the prompt
    # chunks riding in its pass, its drafting rows and their drafted tokens; `steps` is how many it averages
    steps: dict[str, float] | None = None
    engines: int | None = None  # engines (label sets of the running gauge) seen in one scrape, at most

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
            if isinstance(fields.get("stats_lost"), dict):
                fields["stats_lost"] = StatsLedger(**fields["stats_lost"])
            return cls(**fields)
        except TypeError as e:
            raise MetricsError(f"not a `plan check --save` file: {e}") from None


# ---- reading one scrape -------------------------------------------------------------------------------------
def prometheus_families(text: str) -> tuple[list[tuple[str, dict[str, str], float]], dict[str, str]]:
    """(sample name, labels, value) of Prometheus exposition text, and each family's HELP text."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(text))
        samples = [(s.name, s.labels, float(s.value)) for f in families for s in f.samples]
    except (ValueError, TypeError) as e:
        raise MetricsError(f"not Prometheus text ({e})") from None
    return samples, {f.name: f.documentation for f in families}


def prometheus_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of Prometheus exposition text."""
    return prometheus_families(text)[0]


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
            "block": "sglang:spec_num_draft_tokens",
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


# Gauges that are each scheduler's own figure (SGLang's tau, its acceptance rate, its block): a sum over label
# sets would add them, so they are averaged over the label sets that drafted (a scheduler that ran no verify
# forward in its log interval publishes 0). The running gauge is kept per label set: each engine runs its own.
RATIO_GAUGES = frozenset({"accept_length", "accept_rate", "block"})
# Labels that split one engine's running gauge into parts rather than name another engine: SGLang's per-priority
# breakdown (the engine's total sits under priority="", `_log_gauge_queue_count`).
PART_LABELS = ("priority",)


def engine_key(labels: dict[str, str]) -> str | None:
    """The engine a running-gauge sample belongs to (its label set), or None for a part of an engine's total."""
    if any(labels.get(name) for name in PART_LABELS):
        return None
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in PART_LABELS)


def read_prometheus(engine: str, text: str, t: float) -> Sample:
    """One Prometheus scrape of `engine`, by the names above (counters summed over label sets, the running gauge
    per engine, RATIO_GAUGES averaged; dflash_batch_rows: the verify pass only)."""
    counters, gauges = NAMES[engine]
    by_name = {v: k for k, v in counters.items()}
    by_gauge = {v: k for k, v in gauges.items()}
    samples, docs = prometheus_families(text)
    s = Sample(t, help={n: d for n, d in docs.items() if n in by_gauge})
    ratios: dict[str, list[float]] = {}
    for name, labels, value in samples:
        if engine == "dflash-trt" and name in PASS_FAMILIES:
            if labels.get("pass") in PASS_PARTS:
                key = f"{labels['pass']}_{PASS_FAMILIES[name]}"
                s.counters[key] = s.counters.get(key, 0.0) + value
            continue
        if name in by_name:
            s.counters[by_name[name]] = s.counters.get(by_name[name], 0.0) + value
        elif by_gauge.get(name) in RATIO_GAUGES:
            ratios.setdefault(by_gauge[name], []).append(value)
        elif by_gauge.get(name) == "running":
            part_of = engine_key(labels)
            if part_of is not None:
                s.running[part_of] = s.running.get(part_of, 0.0) + value
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


def running_batches(engine: str, url: str, samples: Sequence[Sample]) -> tuple[list[float], int]:
    """Every engine's running requests at every scrape, and the most engines one scrape showed (module
    docstring: per engine, never summed); an error naming the gauge when no scrape has it."""
    if not any(s.running for s in samples):
        raise missing(engine, url, NAMES[engine][1]["running"], "the running batch")
    return [b for s in samples for b in s.running.values()], max(len(s.running) for s in samples)


# SGLang's spec_accept_rate HELP text before and since PR 23530 (module docstring), lower case
SGLANG_RATE_BEFORE = "accepted tokens / total draft tokens"
SGLANG_RATE_SINCE = "accepted drafts / proposed drafts"


def sglang_drafts(tau: float, rate: float, blocks: list[float], help_text: str) -> tuple[float | None, str]:
    """Drafts per round from SGLang's gauges, and how they were read: the block gauge where published (the
    block less its anchor), else the acceptance rate by the formula its HELP text names (module docstring)."""
    if blocks:
        return sum(blocks) / len(blocks) - 1, "sglang:spec_num_draft_tokens - 1"
    if rate <= 0:
        return None, "unknown (no spec_num_draft_tokens, no acceptance rate)"
    if SGLANG_RATE_BEFORE in help_text.lower():
        return tau / rate - 1, "tau / spec_accept_rate - 1 (the rate is tau / block: SGLang before PR 23530, its HELP)"
    why = "its HELP" if SGLANG_RATE_SINCE in help_text.lower() else "assumed: SGLang's current formula, HELP unknown"
    if tau <= 1:
        return None, "unknown (nothing accepted: the rate gives no block)"
    return (tau - 1) / rate, f"(tau - 1) / spec_accept_rate (accepted / proposed drafts since PR 23530, {why})"


def window_sglang(url: str, samples: Sequence[Sample], batch: list[float], engines: int, tps: float | None) -> Observed:
    names = NAMES["sglang"][1]
    if not any("accept_length" in s.gauges for s in samples):
        raise missing("sglang", url, names["accept_length"], "tau", speculative=True)
    lengths = [s.gauges["accept_length"] for s in samples if s.gauges.get("accept_length", 0.0) > 0]
    if not lengths:
        raise _no_drafts("sglang", url)
    drafting = [s for s in samples if s.gauges.get("accept_length", 0.0) > 0]
    rates = [s.gauges["accept_rate"] for s in drafting if s.gauges.get("accept_rate", 0.0) > 0]
    blocks = [s.gauges["block"] for s in drafting if s.gauges.get("block", 0.0) > 0]
    tau = sum(lengths) / len(lengths)
    rate = sum(rates) / len(rates) if rates else 0.0
    help_text = next((s.help[names["accept_rate"]] for s in samples if names["accept_rate"] in s.help), "")
    k, how = sglang_drafts(tau, rate, blocks, help_text)
    seconds = samples[-1].t - samples[0].t
    src = f"sglang:spec_accept_length averaged over {len(lengths)} scrapes; drafts per round: {how}"
    return Observed("sglang", url, seconds, float(len(lengths)), tau, k, None, batch, tps, source=src, engines=engines)


def window_prometheus(engine: str, url: str, samples: Sequence[Sample]) -> Observed:
    first, last = samples[0], samples[-1]
    seconds = last.t - first.t
    batch, engines = running_batches(engine, url, samples)
    generated = _delta(first, last, "generated")
    tps = generated / seconds if generated is not None and seconds > 0 else None
    if engine == "sglang":
        return window_sglang(url, samples, batch, engines, tps)
    counters = NAMES[engine][0]
    for key, what in (("drafts", "the drafting rounds"), ("accepted", "tau")):
        if key not in last.counters:
            raise missing(engine, url, counters[key], what, speculative=True)
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
    return Observed(
        engine,
        url,
        seconds,
        drafts,
        1 + accepted / drafts,
        k,
        rates,
        batch,
        tps,
        source=src,
        steps=steps,
        engines=engines,
    )


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


# trtllm-serve's iteration fields the check reads (IterationStats' JSON names, module docstring)
TRTLLM_SPEC, TRTLLM_ACTIVE = "specDecodingStats", "numActiveRequests"


def window_trtllm(url: str, samples: Sequence[Sample], max_stats_len: int = TRTLLM_STATS_KEPT) -> Observed:
    iters = [i for s in samples[1:] for i in s.iterations]  # the first scrape drained what came before
    if not iters:
        raise MetricsError(
            f"trtllm at {url}: /metrics returned no iteration statistics in the window: trtllm-serve publishes them "
            "only with enable_iter_perf_stats: true in its YAML (the plan's has it) and only while it serves: send "
            "traffic or widen --window"
        )
    for name, what in ((TRTLLM_SPEC, "the drafting rounds"), (TRTLLM_ACTIVE, "the running batch")):
        if not any(name in i for i in iters):
            raise missing("trtllm", url, f"{name} (an iteration statistic)", what, speculative=name == TRTLLM_SPEC)
    spec = [i.get(TRTLLM_SPEC) or {} for i in iters]
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
    batch = [float(i.get(TRTLLM_ACTIVE, 0)) for i in iters]
    src = f"{len(iters)} iterations ({len(with_drafts)} drafting) of trtllm-serve /metrics over {seconds:.1f} s"
    tps = tokens / seconds if seconds > 0 else None
    lost = StatsLedger()
    for n, sample in enumerate(samples):
        lost.add(sample.iterations, None if n == 0 else trtllm_cap(max_stats_len))
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
        lost,
        engines=1,
    )


def window(engine: str, url: str, samples: Sequence[Sample], max_stats_len: int = TRTLLM_STATS_KEPT) -> Observed:
    """The scrapes read as one window; `max_stats_len` is trtllm-serve's (the YAML's LLM argument)."""
    if len(samples) < 2:
        raise MetricsError("a window needs two scrapes at least")
    if engine == "trtllm":
        return window_trtllm(url, samples, max_stats_len)
    return window_prometheus(engine, url, samples)


# ---- scraping -----------------------------------------------------------------------------------------------
def metrics_url(url: str) -> str:
    """`url` with /metrics appended when it names no path (every engine here serves its metrics there)."""
    from urllib.parse import urlsplit

    return url if urlsplit(url).path not in ("", "/") else url.rstrip("/") + "/metrics"


def fetch(url: str, timeout: float = 10.0, key: str | None = None) -> str:
    """GET url's body; with `key`, as `Authorization: Bearer KEY` (this project's server and the exporter)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
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
    max_stats_len: int = TRTLLM_STATS_KEPT,
) -> Observed:
    """`samples` scrapes evenly over `seconds` (the first at once), read as one window."""
    target = metrics_url(url)
    got = []
    for i in range(samples):
        if i:
            sleep(seconds / (samples - 1))
        got.append(read(engine, get(target), time.monotonic()))
    return window(engine, target, got, max_stats_len)
