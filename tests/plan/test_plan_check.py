"""`dflash-trt plan check` against each engine's metrics, served by a local HTTP server, and `plan --from-metrics`.

The metrics text of each engine is written here with that engine's own metric names, label sets and format
(dflash_trt/plan/metrics.py cites the source of each): vLLM's and SGLang's Prometheus text, TensorRT-LLM's
trtllm-serve /metrics JSON list of iteration statistics (drained by each call). The counts in it are what an
engine serving the plan's acceptance (or a worse one) at a batch size would publish: expected per-position
counts of N rounds, so the scenarios are exact, not sampled. Three scenarios per engine, as the issue asks:
the plan's tau holds (exit 0), tau dropped by a third (exit 3), the batch ran above the planned range (exit 3).
Then each engine's current and previous metric shapes (each test names the source file and commit it is built
from): data-parallel engines judged per engine, SGLang's acceptance rate before and since its PR 23530, and a
missing or renamed metric, which must exit 1 naming what the check looked for.
"""

import functools
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_trt.cli.main import main
from dflash_trt.plan import check, metrics
from dflash_trt.sim.acceptance import AcceptanceProfile

SMALL = ["--concurrency", "1,8", "--min-requests", "8", "--prompt-len", "fixed:64", "--output-len", "fixed:48"]
VLLM_LABELS = 'engine="0",model_name="Qwen/Qwen3-8B"'  # vllm/v1/metrics/loggers.py: labelnames model_name, engine
SGLANG_LABELS = 'engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"'


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """A small plan of the demo acceptance (A100 Llama-3-8B profile): concurrencies 1 and 8."""
    out = tmp_path_factory.mktemp("plan")
    assert main(["plan", "--out", str(out), "--no-progress", *SMALL]) == 0
    doc = json.loads((out / "plan.json").read_text())
    assert doc["cells"][-1]["schedule_drafts"] > 0, "the plan drafts nothing at C=8: the scenarios would prove nothing"
    return out


def plan_doc(plan_dir):
    return json.loads((plan_dir / "plan.json").read_text())


def cumulative(profiles, k):
    """Per position j < k: the share of rounds that accepted positions 0..j (mean over request classes)."""
    out = []
    for j in range(k):
        total = 0.0
        for rates in profiles:
            p = 1.0
            for r in rates[: j + 1]:
                p *= r
            total += p
        out.append(total / len(profiles))
    return out


def engine_state(profiles, k, rounds):
    """Expected counters after `rounds` drafting rounds of k drafts each."""
    per_pos = [rounds * c for c in cumulative(profiles, k)]
    return {"drafts": rounds, "draft_tokens": rounds * k, "per_pos": per_pos, "accepted": sum(per_pos)}


# ---- each engine's exposition -------------------------------------------------------------------------------
def vllm_text(state, running, generated, engines=1):
    """vLLM's /metrics (vllm/v1/spec_decode/metrics.py SpecDecodingProm, vllm/v1/metrics/loggers.py), one label set
    per data-parallel engine (label `engine`, "0".."N-1", each counting its own rounds: the totals split evenly).
    `running` may be one per engine."""
    runs = list(running) if isinstance(running, (list, tuple)) else [running] * engines
    labels = [f'engine="{e}",model_name="Qwen/Qwen3-8B"' for e in range(engines)]
    lines = []

    def counter(name, doc, value, extra=""):
        lines.extend([f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"])
        lines.extend(f"{name}_total{{{ls}{extra}}} {float(value) / engines}" for ls in labels)

    lines += ["# HELP vllm:num_requests_running Number of requests in model execution batches."]
    lines += ["# TYPE vllm:num_requests_running gauge"]
    lines += [f"vllm:num_requests_running{{{ls}}} {r}" for ls, r in zip(labels, runs)]
    counter("vllm:generation_tokens", "Number of generation tokens processed.", generated)
    counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", state["drafts"])
    counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", state["draft_tokens"])
    counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", state["accepted"])
    lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position."]
    lines += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    for pos, value in enumerate(state["per_pos"]):
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{ls},position="{pos}"}} {value / engines}'
            for ls in labels
        ]
    return "\n".join(lines) + "\n"


def vllm_v0_text(state, running, generated):
    """The V0 engine's /metrics (vllm/engine/metrics.py Metrics at vllm-project/vllm f0afa0c2): running, generated,
    accepted and draft tokens, emitted tokens and the acceptance-rate gauges, but no count of drafting rounds
    (vllm:spec_decode_num_drafts came with the V1 engine's SpecDecodingProm)."""
    ls = 'model_name="Qwen/Qwen3-8B"'
    rows = [
        ("vllm:num_requests_running", "gauge", running),
        ("vllm:generation_tokens_total", "counter", generated),
        ("vllm:spec_decode_draft_acceptance_rate", "gauge", state["accepted"] / max(1, state["draft_tokens"])),
        ("vllm:spec_decode_num_accepted_tokens_total", "counter", state["accepted"]),
        ("vllm:spec_decode_num_draft_tokens_total", "counter", state["draft_tokens"]),
        ("vllm:spec_decode_num_emitted_tokens_total", "counter", state["accepted"] + state["drafts"]),
    ]
    lines = [x for name, kind, v in rows for x in (f"# TYPE {name} {kind}", f"{name}{{{ls}}} {float(v)}")]
    return "\n".join(lines) + "\n"


# SGLang's HELP texts of its spec gauges: before PR 23530 (python/sglang/srt/metrics/collector.py, sglang
# 00ae9c15) and now (python/sglang/srt/observability/metrics_collector.py, sglang 016d8605)
SGLANG_HELP = {
    "before": {
        "sglang:spec_accept_length": "The average acceptance length of speculative decoding.",
        "sglang:spec_accept_rate": "The average acceptance rate of speculative decoding (`accepted tokens / total "
        "draft tokens` in batch).",
    },
    "current": {
        "sglang:spec_accept_length": "Mean acceptance length of speculative decoding (accepted drafts + bonus token "
        "per forward).",
        "sglang:spec_accept_rate": "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
    },
}


def sglang_text(tau, k, running, generated, label_sets=(SGLANG_LABELS,), shape="current", priorities=None):
    """SGLang's /metrics, one label set per scheduler, in one of its shapes:

    * "current" (sglang 016d8605: metrics_collector.py SchedulerMetricsCollector; the rate as the scheduler's
      report computes it since PR 23530, accepted drafts / proposed drafts = (tau - 1) / k; PR 25940's
      sglang:spec_num_draft_tokens, the block k + 1; sglang:generation_tokens_total with `is_streaming`);
    * "23530" (after PR 23530, before PR 25940): the same rate and HELP, no spec_num_draft_tokens;
    * "before" (collector.py at 00ae9c15, log_decode_stats at 78ac30c2): the rate tau / (k + 1), accepted tokens
      with the bonus over forwards x speculative_num_draft_tokens; its HELP.

    `tau`, `k` and `running` may be one per label set. `priorities`: a per-priority breakdown of each scheduler's
    running requests, published beside its total under priority="" (`_log_gauge_queue_count`, 016d8605)."""

    def each(v):
        return list(v) if isinstance(v, (list, tuple)) else [v] * len(label_sets)

    taus, ks, runs = each(tau), each(k), each(running)
    if shape == "before":
        rates = [t / (b + 1) for t, b in zip(taus, ks)]
    else:
        rates = [(t - 1) / b for t, b in zip(taus, ks)]
    helps = SGLANG_HELP["before" if shape == "before" else "current"]
    gauges = {
        "sglang:spec_accept_length": (helps["sglang:spec_accept_length"], taus),
        "sglang:spec_accept_rate": (helps["sglang:spec_accept_rate"], rates),
    }
    if shape == "current":
        gauges["sglang:spec_num_draft_tokens"] = ("Currently active speculative_num_draft_tokens.", [b + 1 for b in ks])
    lines = []
    for name, (doc, values) in gauges.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        lines += [f"{name}{{{labels}}} {value}" for labels, value in zip(label_sets, values)]
    lines += ["# HELP sglang:num_running_reqs The number of running requests.", "# TYPE sglang:num_running_reqs gauge"]
    for labels, r in zip(label_sets, runs):
        if priorities is None:
            lines.append(f"sglang:num_running_reqs{{{labels}}} {r}")
        else:
            lines.append(f'sglang:num_running_reqs{{{labels},priority=""}} {r}')
            lines += [f'sglang:num_running_reqs{{{labels},priority="{p}"}} {n}' for p, n in priorities.items()]
    lines += ["# HELP sglang:generation_tokens_total Number of generation tokens processed."]
    lines += ["# TYPE sglang:generation_tokens_total counter"]
    streaming = ',is_streaming="true"' if shape == "current" else ""
    lines += [
        f"sglang:generation_tokens_total{{{labels}{streaming}}} {generated / len(label_sets)}" for labels in label_sets
    ]
    return "\n".join(lines) + "\n"


def trtllm_iterations(tau, k, batch, n, first_iter=0):
    """trtllm-serve /metrics: n iterations of `batch` generation requests drafting k each, tau per request
    (cpp/include/tensorrt_llm/executor/types.h IterationStats / SpecDecodingStats field names)."""
    out, accepted_so_far = [], 0
    for i in range(n):
        due = round((i + 1) * batch * (tau - 1))
        accepted, accepted_so_far = due - accepted_so_far, due
        out.append(
            {
                "iter": first_iter + i,
                "iterLatencyMS": 20.0,
                "numActiveRequests": batch,
                "numQueuedRequests": 0,
                "inflightBatchingStats": {
                    "numScheduledRequests": batch,
                    "numContextRequests": 0,
                    "numGenRequests": batch,
                },
                "specDecodingStats": {
                    "numDraftTokens": batch * k,
                    "numAcceptedTokens": accepted,
                    "numRequestsWithDraftTokens": batch,
                    "acceptanceLength": 1 + accepted / batch,
                    "iterLatencyMS": 3.0,
                    "draftOverhead": 0.15,
                },
            }
        )
    return out


@contextmanager
def serving(bodies, then=None, content_type="text/plain"):
    """A local HTTP server answering GET /metrics with bodies[0], bodies[1], ..., then `then` to every later GET
    (None: the last body again, as a Prometheus endpoint's counters stand still; a trtllm-serve, whose /metrics
    drains its iteration statistics, answers "[]"). Yields (its url, the paths asked for, in order)."""
    calls, lock = [], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            with lock:
                n = len(calls)
                calls.append(self.path)
            body = (bodies[n] if n < len(bodies) else bodies[-1] if then is None else then).encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


def bodies_for(engine, profiles, k, running, tau):
    """Two scrapes' bodies (three for SGLang, whose gauges are averaged) of an engine serving `profiles`."""
    if engine in ("vllm", "dflash-trt"):
        assert engine == "vllm"
        a, b = engine_state(profiles, k, 1000), engine_state(profiles, k, 5000)
        return [vllm_text(a, running, 1000 * tau), vllm_text(b, running, 5000 * tau)]
    if engine == "sglang":
        return [sglang_text(tau, k, running, g) for g in (1000, 2000, 3000)]
    warm = trtllm_iterations(tau * 2, k, running, 5)  # before the window: drained by the first scrape, not counted
    return [json.dumps(warm), json.dumps(trtllm_iterations(tau, k, running, 200, first_iter=5))]


SCENARIOS = {  # name: (batch, tau factor, exit status, the line that must say why)
    "tau holds": (8, 1.0, check.HOLDS, "held      tau"),
    "tau dropped by a third": (8, 2 / 3, check.FAILS, "NOT HELD  tau"),
    "batch above the planned range": (16, 1.0, check.FAILS, "NOT HELD  batch"),
}


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_plan_check_passes_and_fails_where_it_should(plan_dir, engine, scenario, capsys, tmp_path):
    batch, factor, status, why = SCENARIOS[scenario]
    doc = plan_doc(plan_dir)
    k = doc["cells"][-1]["schedule_drafts"]
    planned = doc["inputs"]["acceptance"]["position_rates"]
    tau = check.mean_tau(planned, k + 1) * factor
    profiles = planned if factor == 1.0 else [AcceptanceProfile.from_tau("low", tau, k + 1).rates]
    with serving(bodies_for(engine, profiles, k, batch, tau)) as (url, calls):
        samples = ["--samples", "3"] if engine == "sglang" else []
        args = ["plan", "check", "--engine", engine, "--url", url, "--plan", str(plan_dir), "--window", "0.1"]
        got = main([*args, *samples, "--save", str(tmp_path / "scrape.json")])
    out = capsys.readouterr().out
    assert got == status, out
    assert why in out and calls == ["/metrics"] * len(calls) and len(calls) >= 2
    saved = json.loads((tmp_path / "scrape.json").read_text())
    assert saved["tau"] == pytest.approx(tau, rel=0.01) and saved["mean_drafts"] == pytest.approx(k, rel=0.01)
    assert max(saved["batch"]) == batch and saved["check"]["holds"] == (status == check.HOLDS)
    assert set(saved["check"]["drafts_by_concurrency"]) == {"1", "8"}
    if factor != 1.0:
        assert "gain over the target alone" in out and out.count("NOT HELD") >= 2  # tau and the gain


def test_vllm_per_position_rates_are_read_back_exactly(plan_dir):
    doc = plan_doc(plan_dir)
    k = doc["cells"][-1]["schedule_drafts"]
    planned = doc["inputs"]["acceptance"]["position_rates"]
    a, b = engine_state(planned, k, 100), engine_state(planned, k, 700)
    samples = [metrics.read("vllm", vllm_text(s, 8, 0), t) for s, t in ((a, 0.0), (b, 2.0))]
    obs = metrics.window("vllm", "u", samples)
    cum = cumulative(planned, k)
    assert obs.position_rates == pytest.approx([cum[0]] + [cum[j] / cum[j - 1] for j in range(1, k)])
    assert obs.tau == pytest.approx(check.mean_tau(planned, k + 1)) and obs.seconds == 2.0


@pytest.mark.parametrize("shape", ["current", "23530", "before"])
def test_sglang_drafts_per_round_are_read_in_each_of_its_shapes(shape):
    """tau 4 at 7 drafts (block 8). Before PR 23530 the rate is tau / block = 0.5 (log_decode_stats, sglang
    78ac30c2): 7 drafts, not (tau - 1) / 0.5 = 6. Since, it is accepted / proposed drafts, (tau - 1) / 7 = 3/7:
    7 drafts, not tau / rate - 1 = 8.33 (which the check read before and made every round look longer than the
    plan's). Since PR 25940 the block gauge gives it directly (metrics_collector.py, sglang 016d8605)."""
    text = sglang_text(4.0, 7, 8, 0, shape=shape)
    rate = 0.5 if shape == "before" else 3 / 7
    assert f"sglang:spec_accept_rate{{{SGLANG_LABELS}}} {rate}" in text
    samples = [metrics.read("sglang", text, t) for t in (0.0, 1.0)]
    obs = metrics.window("sglang", "u", samples)
    assert obs.tau == 4.0 and obs.mean_drafts == pytest.approx(7.0)
    how = {"current": "spec_num_draft_tokens", "23530": "since PR 23530, its HELP", "before": "before PR 23530"}
    assert how[shape] in obs.source


def test_an_sglang_rate_with_an_unknown_help_is_read_as_the_current_formula_and_says_so():
    text = sglang_text(4.0, 7, 8, 0, shape="23530").replace(SGLANG_HELP["current"]["sglang:spec_accept_rate"], "x")
    obs = metrics.window("sglang", "u", [metrics.read("sglang", text, t) for t in (0.0, 1.0)])
    assert obs.mean_drafts == pytest.approx(7.0) and "assumed: SGLang's current formula" in obs.source


def test_sglang_schedulers_are_each_their_own_batch_and_their_ratios_averaged():
    """Two schedulers (dp_rank 0 and 1: the scheduler's init_metrics labels, sglang 016d8605) each publish their
    own gauges: each runs its own batch (4 and 6, not 10), tau and the rate are each scheduler's own ratio."""
    sets = tuple(f'dp_rank="{d}",{SGLANG_LABELS}' for d in (0, 1))
    text = sglang_text([3.0, 5.0], 7, [4, 6], 200, label_sets=sets)
    sample = metrics.read("sglang", text, 0.0)
    assert sorted(sample.running.values()) == [4, 6] and sample.counters["generated"] == 200
    assert sample.gauges["accept_length"] == pytest.approx(4.0)
    obs = metrics.window("sglang", "u", [sample, metrics.read("sglang", text, 1.0)])
    assert obs.tau == pytest.approx(4.0) and obs.mean_drafts == pytest.approx(7.0)
    assert sorted(obs.batch) == [4, 4, 6, 6] and obs.engines == 2
    idle = sglang_text([4.0, 0.0], 7, [8, 0], 0, label_sets=sets)  # a scheduler that ran no verify forward
    assert metrics.read("sglang", idle, 0.0).gauges["accept_length"] == 4.0


def test_sglang_per_priority_running_requests_are_parts_of_the_total():
    """With priority scheduling num_running_reqs holds the scheduler's total under priority="" and a breakdown per
    priority (`_log_gauge_queue_count`, metrics_collector.py at sglang 016d8605): the batch is the total."""
    text = sglang_text(4.0, 7, 8, 0, priorities={"0": 5, "1": 3})
    assert 'priority="1"} 3' in text and 'priority=""} 8' in text
    assert list(metrics.read("sglang", text, 0.0).running.values()) == [8]


def test_trtllm_zero_draft_iterations_are_named(plan_dir, capsys):
    """PR 16888: a schedule that resolves to 0 drafts with generation requests in flight stops DFlash's context
    refresh; the check counts those iterations and says what to do."""
    its = trtllm_iterations(4.0, 7, 8, 50)
    for it in its[:10]:
        it["specDecodingStats"] = {**it["specDecodingStats"], "numDraftTokens": 0, "numAcceptedTokens": 0}
    with serving(["[]", json.dumps(its)]) as (url, _):
        args = ["plan", "check", "--engine", "trtllm", "--url", url, "--plan", str(plan_dir), "--window", "0.05"]
        main(args)
    assert "10 iterations ran generation requests without drafts" in capsys.readouterr().out


def numbered(records, first, dropped):
    """The records as a numbering executor serves them (py_executor.py at c6fb6ac3): statsSequence from `first`,
    statsDroppedFrames `dropped` on each."""
    return [r | {"statsSequence": first + i, "statsDroppedFrames": dropped} for i, r in enumerate(records)]


def test_a_trtllm_scrape_at_the_executors_cap_warns_that_records_may_be_lost(plan_dir):
    """An engine that does not number its records keeps max_stats_len + 1 of them (1001 by default; py_executor.py
    _append_iter_stats at 0004396720): a scrape of that many may have dropped older ones, and the check says so; one
    below it lost none at the cap, and one over it (several fetches in one response) is at the cap too. -1 keeps
    every record: no scrape is at a cap."""
    doc = plan_doc(plan_dir)
    first = metrics.read("trtllm", "[]", 0.0)
    for kept, n, warned in (
        (None, 1000, False),
        (None, 1001, True),
        (5000, 1001, False),
        (5000, 5001, True),
        (-1, 1, False),
    ):
        last = metrics.read("trtllm", json.dumps(trtllm_iterations(4.0, 7, 8, n)), 10.0)
        extra = {} if kept is None else {"max_stats_len": kept}
        obs = metrics.window("trtllm", "u", [first, last], **extra)
        assert obs.stats_lost is not None and obs.stats_lost.capped_polls == int(warned), (kept, n)
        assert ("may be lost" in check.check(doc, obs).text()) is warned


def test_numbered_trtllm_records_name_what_was_dropped_and_what_another_reader_took(plan_dir):
    """A numbering executor (statsSequence, statsDroppedFrames; py_executor.py at c6fb6ac3): the window's gaps are
    split exactly into records evicted at the cap and records another reader drained, each with its own advice;
    the first scrape's records are the baseline (what came before the window is not the window's loss)."""
    doc = plan_doc(plan_dir)
    its = trtllm_iterations(4.0, 7, 8, 30)
    first = metrics.read("trtllm", json.dumps(numbered(its[:5], 100, 40)), 0.0)  # 40 dropped before the window
    mid = metrics.read("trtllm", json.dumps(numbered(its[5:15], 110, 43)), 5.0)  # 105-109: 3 evicted, 2 unread
    last = metrics.read("trtllm", json.dumps(numbered(its[15:], 120, 43)), 10.0)
    obs = metrics.window("trtllm", "u", [first, mid, last])
    assert (obs.stats_lost.dropped, obs.stats_lost.unread, obs.stats_lost.capped_polls) == (3, 2, 0)
    text = check.check(doc, obs).text()
    assert "dropped 3 iteration records" in text and "2 iteration records were drained from" in text
    again = metrics.Observed.from_json(json.loads(json.dumps(obs.to_json())))  # --save, then --from a file
    assert again.stats_lost == obs.stats_lost


def test_plan_check_refuses_a_max_stats_len_trtllm_serve_would_refuse(plan_dir, capsys):
    args = ["plan", "check", "--engine", "trtllm", "--url", "http://x", "--plan", str(plan_dir)]
    assert main([*args, "--max-stats-len", "-2"]) != 0
    assert "--max-stats-len" in capsys.readouterr().err


def test_no_traffic_and_no_server_are_clear_errors(plan_dir, capsys):
    state = engine_state([[0.5] * 7], 7, 0)
    with serving([vllm_text(state, 0, 0)]) as (url, _):
        args = ["plan", "check", "--engine", "vllm", "--url", url, "--plan", str(plan_dir), "--window", "0.05"]
        assert main(args) == 1
    assert "no speculative round in the window" in capsys.readouterr().err
    args = ["plan", "check", "--engine", "vllm", "--url", "http://127.0.0.1:9", "--plan", str(plan_dir)]
    assert main([*args, "--window", "0"]) == 1
    assert "cannot scrape http://127.0.0.1:9/metrics" in capsys.readouterr().err


def check_against(plan_dir, engine, bodies, capsys, samples=2):
    """`plan check` of `engine` served `bodies` by a local HTTP server: (exit status, stdout, stderr)."""
    with serving(bodies) as (url, _):
        args = ["plan", "check", "--engine", engine, "--url", url, "--plan", str(plan_dir), "--window", "0.05"]
        status = main([*args, "--samples", str(samples)])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_data_parallel_engines_are_judged_per_engine(plan_dir, engine, capsys):
    """vLLM's data-parallel engines (label engine="0".."7", vllm/v1/metrics/loggers.py at 016a8587) and SGLang's
    schedulers (dp_rank label sets, scheduler init_metrics at sglang 016d8605) each run their own batch: eight at
    8 requests are batches of 8, inside a plan up to 8 (summed, 64, read as a false exit 3); one of them at 16 is
    above it."""
    doc = plan_doc(plan_dir)
    k = doc["cells"][-1]["schedule_drafts"]
    planned = doc["inputs"]["acceptance"]["position_rates"]
    tau = check.mean_tau(planned, k + 1)
    sets = tuple(f'dp_rank="{d}",{SGLANG_LABELS}' for d in range(8))

    def bodies(running):
        if engine == "vllm":
            a, b = engine_state(planned, k, 1000), engine_state(planned, k, 5000)
            return [vllm_text(a, running, 1000 * tau, engines=8), vllm_text(b, running, 5000 * tau, engines=8)]
        return [sglang_text(tau, k, running, g, label_sets=sets) for g in (1000, 2000, 3000)]

    status, out, _ = check_against(plan_dir, engine, bodies([8] * 8), capsys, samples=3)
    assert status == check.HOLDS, out
    assert "held      batch: mean 8.0, largest 8 running requests per engine (8 engines" in out
    status, out, _ = check_against(plan_dir, engine, bodies([8] * 7 + [16]), capsys, samples=3)
    assert status == check.FAILS and "NOT HELD  batch: mean 9.0, largest 16 running requests per engine" in out


def _trtllm_without(field):
    its = trtllm_iterations(4.0, 3, 8, 20)
    for it in its:
        it.pop(field)
    return ["[]", json.dumps(its)]


MISSING = {  # case: (engine, bodies, the metric the error must name)
    # vLLM with its running gauge renamed: the batch is unknown, not 0 (loggers.py at 016a8587 names it)
    "vllm running gauge renamed": (
        "vllm",
        [
            vllm_text(engine_state([[0.6] * 3], 3, n), 8, n).replace("num_requests_running", "num_requests_active")
            for n in (100, 900)
        ],
        "vllm:num_requests_running",
    ),
    # vLLM's V0 engine (vllm/engine/metrics.py at f0afa0c2): no count of drafting rounds
    "vllm V0 spec counters": (
        "vllm",
        [vllm_v0_text(engine_state([[0.6] * 3], 3, n), 8, n) for n in (100, 900)],
        "vllm:spec_decode_num_drafts_total",
    ),
    # SGLang with the running gauge under another name (metrics_collector.py at 016d8605 names it)
    "sglang running gauge renamed": (
        "sglang",
        [sglang_text(3.0, 3, 8, g).replace("sglang:num_running_reqs", "sglang:num_running") for g in (10, 20)],
        "sglang:num_running_reqs",
    ),
    "sglang spec gauges renamed": (
        "sglang",
        [sglang_text(3.0, 3, 8, g).replace("spec_accept_length", "spec_accept_len") for g in (10, 20)],
        "sglang:spec_accept_length",
    ),
    # trtllm-serve iteration statistics (cpp/include/tensorrt_llm/executor/types.h IterationStats) without their
    # speculative part, or without the active-request count
    "trtllm without specDecodingStats": ("trtllm", _trtllm_without("specDecodingStats"), "specDecodingStats"),
    "trtllm without numActiveRequests": ("trtllm", _trtllm_without("numActiveRequests"), "numActiveRequests"),
    # enable_iter_perf_stats off (TorchLlmArgs, llm_args.py at 00043967): /metrics answers an empty list
    "trtllm stats off": ("trtllm", ["[]", "[]"], "enable_iter_perf_stats"),
}


@pytest.mark.parametrize("case", list(MISSING))
def test_a_missing_or_renamed_metric_exits_1_naming_it(plan_dir, case, capsys):
    """A running gauge that is not there is no batch of 0 (a pass at C=1), and spec counters under another name
    are no "no traffic": both exit 1 and name the metric the check looked for."""
    engine, bodies, name = MISSING[case]
    status, out, err = check_against(plan_dir, engine, bodies, capsys)
    assert status == 1, out
    assert name in err and "held" not in out, err


def test_from_metrics_plans_on_what_the_engine_saw(plan_dir, tmp_path):
    doc = plan_doc(plan_dir)
    k = doc["cells"][-1]["schedule_drafts"]
    low = AcceptanceProfile.from_tau("low", 2.5, k + 1).rates
    with serving(bodies_for("vllm", [low], k, 8, 2.5)) as (url, _):
        args = ["plan", "check", "--engine", "vllm", "--url", url, "--plan", str(plan_dir), "--window", "0.05"]
        assert main([*args, "--save", str(tmp_path / "seen.json")]) == check.FAILS
    out = tmp_path / "replan"
    assert (
        main(["plan", "--out", str(out), "--from-metrics", str(tmp_path / "seen.json"), "--no-progress", *SMALL]) == 0
    )
    acc = json.loads((out / "plan.json").read_text())["inputs"]["acceptance"]
    assert acc["measured"] and "vllm /metrics" in acc["source"] and "per-position" in acc["source"]
    assert acc["tau_by_drafts"][str(k)] == pytest.approx(2.5, rel=0.01)
    with serving(bodies_for("vllm", [low], k, 8, 2.5)) as (url, _):  # the new plan holds on the same traffic
        args = ["plan", "check", "--engine", "vllm", "--url", url, "--plan", str(out), "--window", "0.05"]
        assert main(args) == check.HOLDS


# ---- this project's server under load -----------------------------------------------------------------------
@contextmanager
def load(url, concurrency, block=8, max_tokens=48):
    """`concurrency` clients posting completions back to back (held-out code prompts, a fixed block) until the
    block ends; yields the list of their answers so far."""
    import httpx

    from dflash_trt.bench.prompts import held_out_code_prompts

    prompts, stop, answers = held_out_code_prompts(8, prefix_chars=200), threading.Event(), []

    def client(i):
        with httpx.Client(timeout=120) as http:
            n = i
            while not stop.is_set():
                body = {"prompt": prompts[n % len(prompts)], "max_tokens": max_tokens, "temperature": 0}
                answers.append(http.post(url + "/v1/completions", json={**body, "block_size": block}).status_code)
                n += concurrency

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    try:
        yield answers
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def test_this_projects_server_under_load(tmp_path, capsys, monkeypatch):
    """The real server (demo pair, 4 clients): the check reads its vLLM-named counters and its own batch rows;
    a plan made --from-metrics from that scrape holds on the next window of the same traffic. Each window is
    3 x 12 served steps (verify passes: the steps the check reads), whatever seconds they take."""
    from server_harness import after_served, running_server

    from dflash_trt.loading import load_decoder
    from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

    first, second = tmp_path / "first.json", tmp_path / "second.json"
    plan, any_plan = tmp_path / "plan", plan_dir_for(tmp_path)
    with running_server(load_decoder(DEMO_TARGET, DEMO_DRAFTER)) as (url, _), load(url, 4) as answers:
        served = after_served(url, "dflash_batch_rows_count", 12, **{"pass": "verify"})
        monkeypatch.setattr(metrics, "scrape", functools.partial(metrics.scrape, sleep=served))
        while len(answers) < 4:  # every client has had an answer: the batch is full
            threading.Event().wait(0.2)
        args = ["plan", "check", "--engine", "dflash-trt", "--url", url, "--window", "6", "--samples", "4"]
        main([*args, "--plan", str(any_plan), "--save", str(first)])
        flags = ["--concurrency", "1,4", "--min-requests", "8", "--prompt-len", "fixed:64", "--output-len", "fixed:48"]
        assert main(["plan", "--out", str(plan), "--from-metrics", str(first), "--no-progress", *flags]) == 0
        status = main([*args, "--plan", str(plan), "--save", str(second), "--tolerance", "0.25"])
    out = capsys.readouterr().out
    assert set(answers) == {200}
    seen = json.loads(first.read_text())
    assert seen["engine"] == "dflash-trt" and 0 < max(seen["batch"]) <= 4 and seen["tokens_per_s"] > 0
    assert 5 < seen["mean_drafts"] <= 7  # block 8: 7 drafts a round, fewer in the rounds an output's end clips
    assert 1 < seen["tau"] <= 8 and len(seen["position_rates"]) == int(seen["mean_drafts"])
    assert all(0 <= r <= 1 for r in seen["position_rates"])
    steps = seen["steps"]  # the mean served step, which --from-metrics prices against a --cost-model
    assert steps["steps"] >= 3 * 12 and 0 < steps["rows"] <= 4 and steps["tokens"] >= steps["rows"]
    assert 0 < steps["drafting_rows"] <= steps["rows"] and steps["drafted_tokens"] <= 7 * steps["drafting_rows"]
    assert steps["wall_s"] == pytest.approx(seen["seconds"] / steps["steps"])
    # two windows of 36 steps on different prompts: tau moves between them, within the tolerance given
    assert status == check.HOLDS, out


def plan_dir_for(tmp_path):
    """Any plan for the first window's check (its verdict is not what this test reads): a tiny one."""
    out = tmp_path / "any"
    assert main(["plan", "--out", str(out), "--no-progress", *SMALL]) == 0
    return out


def test_the_cluster_rule_reads_what_the_check_reads(plan_dir):
    """deploy/k8s/base/prometheusrule.yaml's plan alerts: tau from the same vLLM counters as `plan check`, the
    running batch from the same gauge, and the plan gives the two thresholds (plan.json "alerts")."""
    import yaml

    from dflash_trt.settings import REPO_ROOT

    doc = yaml.safe_load((REPO_ROOT / "deploy" / "k8s" / "base" / "prometheusrule.yaml").read_text())
    rules = {r.get("alert") or r["record"]: r["expr"] for g in doc["spec"]["groups"] for r in g["rules"]}
    tau = rules["dflash:spec_decode_tau:rate10m"]
    assert metrics.VLLM_COUNTERS["accepted"] in tau and metrics.VLLM_COUNTERS["drafts"] in tau
    assert "dflash:spec_decode_tau:rate10m <" in rules["DFlashPlanTauBelowPlan"]
    assert metrics.NAMES["vllm"][1]["running"] in rules["DFlashBatchAbovePlan"]
    plan = plan_doc(plan_dir)
    k = plan["cells"][-1]["schedule_drafts"]
    assert plan["alerts"]["batch_above"] == 8
    assert plan["alerts"]["tau_floor"] <= round(0.9 * plan["inputs"]["acceptance"]["tau_by_drafts"][str(k)], 2)


def test_an_engine_drafting_longer_than_the_plan_is_compared_at_the_plans_longest(plan_dir):
    doc = plan_doc(plan_dir)
    top = max(int(k) for k in doc["cells"][-1]["tokens_per_s_by_drafts"])
    planned = doc["inputs"]["acceptance"]["position_rates"]
    tau = check.mean_tau(planned, top + 1)
    obs = metrics.Observed("sglang", "u", 10.0, 3.0, tau, top + 2.0, None, [8.0], None)
    report = check.check(doc, obs)
    assert report.holds, report.text()  # the same tau at a longer draft is no loss against the plan
    assert f"more than the plan's longest {top}" in report.text()


def test_a_plan_written_before_plan_check_is_refused_clearly(plan_dir, tmp_path, capsys):
    doc = plan_doc(plan_dir)
    del doc["inputs"]["acceptance"]["position_rates"]
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    k = doc["cells"][-1]["schedule_drafts"]
    with serving(bodies_for("vllm", [[0.5] * k], k, 8, 2.0)) as (url, _):
        args = ["plan", "check", "--engine", "vllm", "--url", url, "--plan", str(tmp_path), "--window", "0.05"]
        assert main(args) == 1
    assert "write the plan again" in capsys.readouterr().err


def as_block_keyed(doc):
    """plan.json as the version before drafted tokens became its one unit wrote it: cells and tau keyed by block
    (drafts + 1) beside the *_drafts copies, the acceptance's block_size."""
    old = json.loads(json.dumps(doc))
    for c in old["cells"]:
        c["tokens_per_s_by_block"] = {str(int(k) + 1): v for k, v in c.pop("tokens_per_s_by_drafts").items()}
        c["tuned_block"], c["schedule_block"] = c["tuned_drafts"] + 1, c["schedule_drafts"] + 1
    acc = old["inputs"]["acceptance"]
    acc["tau_by_block"] = {str(int(k) + 1): v for k, v in acc.pop("tau_by_drafts").items()}
    acc["block_size"] = acc.pop("max_drafts") + 1
    return old


@pytest.mark.parametrize("factor", [1.0, 2 / 3])
def test_a_plan_keyed_by_block_is_checked_as_its_drafts_form_with_a_notice(plan_dir, factor, capsys, tmp_path):
    """Operators hold plan.json files of the previous version: `plan check` reads them in drafts, says so in
    one line, and reaches the same verdict, line for line, as on the same plan keyed by drafts."""
    doc = plan_doc(plan_dir)
    (tmp_path / "plan.json").write_text(json.dumps(as_block_keyed(doc)))
    k = doc["cells"][-1]["schedule_drafts"]
    tau = check.mean_tau(doc["inputs"]["acceptance"]["position_rates"], k + 1) * factor
    outs = []
    for where in (plan_dir, tmp_path):
        with serving(bodies_for("sglang", [], k, 8, tau)) as (url, _):
            args = ["plan", "check", "--engine", "sglang", "--url", url, "--plan", str(where), "--window", "0.1"]
            outs.append((main([*args, "--samples", "3"]), capsys.readouterr()))
    (new_status, new), (old_status, old) = outs
    assert old_status == new_status == (check.HOLDS if factor == 1.0 else check.FAILS), old.out

    def verdict(out):  # every line but the engine's own and the tokens/s seen (wall-clock over the window)
        return [line for line in out.splitlines()[1:] if "tokens/s seen" not in line]

    assert verdict(old.out) == verdict(new.out) and len(verdict(new.out)) >= 4
    assert new.err == "" and old.err.count("\n") == 1 and check.OLD_UNITS in old.err


def test_upgrade_rewrites_every_block_key_and_leaves_a_drafts_plan_alone(plan_dir):
    doc = plan_doc(plan_dir)
    assert check.upgrade(json.loads(json.dumps(doc))) is None
    old = as_block_keyed(doc)
    assert check.upgrade(old) == check.OLD_UNITS
    assert (
        old["cells"] == doc["cells"]
        and old["inputs"]["acceptance"]["tau_by_drafts"] == (doc["inputs"]["acceptance"]["tau_by_drafts"])
    )
    with pytest.raises(check.PlanDocError, match="not a plan"):
        check.upgrade({"cells": [{"schedule_block": "x"}]})


def test_a_servers_scrape_scales_its_cost_model_to_the_steps_it_served(tmp_path):
    """`plan --from-metrics S --cost-model C`: the passes' costs times the served step's wall seconds over the
    cost model's seconds for that step (what the start-up grid does not see: the loop, HTTP, the client)."""
    from dflash_trt.plan import inputs
    from dflash_trt.plan.metrics import Observed

    model = {
        "target": {"fixed": 0.01, "per_row": 0.001, "per_token": 0.0002},
        "drafter": {"fixed": 0.004, "per_row": 0.0, "per_token": 0.0001},
    }
    (tmp_path / "cost.json").write_text(json.dumps(model))
    cost = inputs.cost_model(tmp_path / "cost.json", 128)
    steps = {"steps": 100, "rows": 8, "tokens": 40, "chunk_rows": 1, "chunk_tokens": 20, "drafting_rows": 6}
    steps["drafted_tokens"] = 30
    passes = 0.01 + 0.001 * 9 + 0.0002 * 60 + 0.004 + 0.0001 * (30 + 12)
    steps["wall_s"] = 1.5 * passes
    seen = Observed("dflash-trt", "http://x", 10.0, 600, 3.0, 5.0, [0.8] * 5, [8.0], 400.0, steps=steps)
    (tmp_path / "seen.json").write_text(json.dumps(seen.to_json()))
    served = inputs.served_step_cost(cost, tmp_path / "seen.json")
    assert served.cost.target([5] * 8, [100] * 8, 8) == pytest.approx(1.5 * cost.cost.target([5] * 8, [100] * 8, 8))
    assert served.cost.drafter([6] * 4, [2] * 4, [0] * 4) == pytest.approx(
        1.5 * cost.cost.drafter([6] * 4, [2] * 4, [0] * 4)
    )
    assert "scaled x1.50" in served.source and served.parts["served"].startswith("measured")
    other = Observed("vllm", "http://x", 10.0, 600, 3.0, 5.0, [0.8] * 5, [8.0], 400.0)  # no served steps: unscaled
    (tmp_path / "vllm.json").write_text(json.dumps(other.to_json()))
    assert inputs.served_step_cost(cost, tmp_path / "vllm.json") is cost
    with pytest.raises(inputs.PlanInputError, match="--cost-model"):
        inputs.served_step_cost(inputs.vidur_cost("a100", None, 1), tmp_path / "seen.json")
