"""`plan check --serve-metrics`: the exporter sidecar on a real port, polling a real local HTTP server that serves
scripted trtllm-serve /metrics JSON (iteration statistics as cpp/include/tensorrt_llm/executor/types.h names them,
drained by each call as tensorrt_llm/serve/openai_server.py get_iteration_stats does). Its series must equal what
the JSON says over the run (counters monotone, sums exact, the gauges the newest iteration's), and `plan check
--engine vllm` against it must reach the verdict `plan check` reaches on the same engine read directly."""

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from plan.test_plan_check import (  # noqa: F401
    SCENARIOS,
    bodies_for,
    numbered,
    plan_dir,
    plan_doc,
    serving,
    trtllm_iterations,
)
from prometheus_client.parser import text_string_to_metric_families

from dflash_trt.cli.main import main
from dflash_trt.plan import check, exporter
from dflash_trt.sim.acceptance import AcceptanceProfile


def engine(bodies):
    """A trtllm-serve stand-in for /metrics only: each GET returns the next scripted body, then `[]` (drained)."""
    return serving(bodies, then="[]", content_type="application/json")


@contextmanager
def sidecar(url, api_key=None):
    """The exporter on a real port (polling only at scrapes: the test decides when iterations are read; its idle
    rule on a stopped clock, so no pause of a busy machine reads as an idle engine)."""
    stop, port = threading.Event(), []
    ready = threading.Event()
    thread = threading.Thread(
        target=exporter.serve,
        args=(url, "127.0.0.1", 0, 0.0, api_key),
        kwargs={"ready": lambda p: (port.append(p), ready.set()), "stop": stop, "clock": lambda: 0.0},
        daemon=True,
    )
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        stop.set()
        thread.join(10)


def series(text):
    """{sample name: value} of an exposition; a labelled sample is named as Prometheus writes it, name{k="v"}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


LOST = {cause: f'dflash_trtllm_stats_lost_total{{cause="{cause}"}}' for cause in ("dropped", "unread")}
CAPPED = "dflash_trtllm_capped_polls_total"


def expected(batches):
    """What the JSON says, summed independently of the exporter: totals after each poll, and the newest gauges."""
    tot = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "generated": 0}
    out = []
    for its in batches:
        for it in its:
            sd = it["specDecodingStats"]
            tot["drafts"] += sd["numRequestsWithDraftTokens"]
            tot["draft_tokens"] += sd["numDraftTokens"]
            tot["accepted"] += sd["numAcceptedTokens"]
            tot["generated"] += it["inflightBatchingStats"]["numGenRequests"] + sd["numAcceptedTokens"]
        out.append(dict(tot))
    return out


def test_series_equal_the_json_stats_over_a_scripted_run():
    # a run that changes its shape: warm-up, a batch of 4 drafting 7, a lull (no iterations), a batch of 12
    # drafting 3 with worse acceptance, queued requests at the end
    script = [
        trtllm_iterations(3.0, 7, 4, 30),
        [],
        trtllm_iterations(2.0, 3, 12, 250, first_iter=30),
        trtllm_iterations(5.0, 7, 2, 7, first_iter=280),
    ]
    script[-1][-1]["numQueuedRequests"] = 5
    sums = expected(script)
    with engine([json.dumps(b) for b in script]) as (url, calls), sidecar(url) as side:
        seen = []
        for _ in script:
            r = httpx.get(side + "/metrics", timeout=10)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            seen.append(series(r.text))
        assert calls == ["/metrics"] * len(script)  # one drain per scrape, nothing read twice
    names = {k: v + "_total" for k, v in exporter.VLLM_COUNTERS.items()}
    for got, want in zip(seen, sums):
        assert {k: got[n] for k, n in names.items()} == {k: float(v) for k, v in want.items()}
    for n in names.values():  # counters never go down, and moved exactly when iterations came
        values = [s[n] for s in seen]
        assert values == sorted(values) and values[0] == values[1] and values[2] > values[1]
    # the gauges: the newest iteration's (none polled yet before the first scrape's poll: never a batch of 0)
    assert [s["vllm:num_requests_running"] for s in seen] == [4, 4, 12, 2]
    assert [s["vllm:num_requests_waiting"] for s in seen] == [0, 0, 0, 5]
    assert all(s[CAPPED] == 0 and s[LOST["dropped"]] == 0 and s[LOST["unread"]] == 0 for s in seen)


def test_an_engine_idle_for_idle_s_reads_nothing_running():
    """trtllm-serve publishes no iteration while idle: empty polls keep the newest counts until IDLE_S has passed
    on the exporter's clock without an iteration, then the gauges read 0 (the counters keep their totals)."""
    bodies = iter([json.dumps(trtllm_iterations(3.0, 7, 4, 2)), "[]", "[]", "[]"])
    now = [0.0]
    totals = exporter.TrtllmTotals("http://engine:8000", get=lambda url: next(bodies), clock=lambda: now[0])
    totals.poll()
    running = totals.running
    assert running is not None and running > 0
    now[0] = exporter.IDLE_S / 2
    totals.poll()
    assert totals.running == running
    now[0] = exporter.IDLE_S
    totals.poll()
    assert totals.running == 0.0 and totals.waiting == 0.0 and totals.totals["drafts"] > 0


def test_no_gauge_before_any_iteration_and_a_poll_at_the_cap_is_counted():
    """An engine that does not number its records keeps max_stats_len + 1 of them (1001 by default): a poll of that
    many may have lost older ones; a poll of 1000 lost none at the cap."""
    polls = ["[]", json.dumps(trtllm_iterations(3.0, 7, 4, 1000)), json.dumps(trtllm_iterations(3.0, 7, 4, 1001))]
    with engine(polls) as (url, _), sidecar(url) as side:
        first = series(httpx.get(side + "/metrics", timeout=10).text)
        assert "vllm:num_requests_running" not in first and first["vllm:spec_decode_num_drafts_total"] == 0
        second = series(httpx.get(side + "/metrics", timeout=10).text)
        assert second[CAPPED] == 0 and second["vllm:spec_decode_num_drafts_total"] == 4000
        third = series(httpx.get(side + "/metrics", timeout=10).text)
        assert third[CAPPED] == 1 and third[LOST["dropped"]] == 0


def test_the_cap_follows_max_stats_len_and_minus_one_has_none():
    """--max-stats-len says the YAML's: 5000 makes a poll of 1001 no sign of loss; -1 keeps every record; 0 is 1
    (llm_args.py's normalize_max_stats_len), a buffer of 2."""
    assert [exporter.metrics.trtllm_cap(n) for n in (1000, 0, 1, -1)] == [1001, 2, 2, None]
    for kept, capped in ((None, 1), (5000, 0), (-1, 0), (1000, 1), (0, 1)):
        bodies = iter(["[]", json.dumps(trtllm_iterations(3.0, 7, 4, 1001))])
        extra = {} if kept is None else {"max_stats_len": kept}
        totals = exporter.TrtllmTotals("http://engine:8000", get=lambda url: next(bodies), **extra)
        totals.poll(), totals.poll()
        assert totals.lost.capped_polls == capped, kept


def test_numbered_records_say_exactly_what_was_dropped_and_what_another_reader_took():
    """statsSequence 1-10 read; 11-15 never seen, of which 3 the engine evicted (statsDroppedFrames 0 -> 3) and 2
    another reader drained; 16-20 read; then a restart (the sequence starts again): a new baseline, no loss."""
    its = trtllm_iterations(3.0, 7, 4, 10)
    polls = [
        numbered(its, 1, 0),
        numbered(its[:5], 16, 3),
        numbered(its[:3], 1, 0),
        numbered(its[:2], 4, 0),
    ]
    with engine([json.dumps(p) for p in polls]) as (url, _), sidecar(url) as side:
        seen = [series(httpx.get(side + "/metrics", timeout=10).text) for _ in polls]
    assert [(s[LOST["dropped"]], s[LOST["unread"]]) for s in seen] == [(0, 0), (3, 2), (3, 2), (3, 2)]
    assert all(s[CAPPED] == 0 for s in seen)  # numbered records: what was lost is known, never guessed


def test_attention_dp_rows_of_one_frame_share_a_sequence_and_lose_nothing():
    """Under attention DP one frame is a row per rank, all with the frame's statsSequence (c6fb6ac3)."""
    its = trtllm_iterations(3.0, 7, 4, 3)
    rows = [r | {"statsSequence": seq, "statsDroppedFrames": 0} for seq, r in ((1, its[0]), (1, its[1]), (2, its[2]))]
    ledger = exporter.metrics.StatsLedger()
    ledger.add(rows, None)
    ledger.add([its[0] | {"statsSequence": 3, "statsDroppedFrames": 0}], 1001)
    assert (ledger.dropped, ledger.unread, ledger.capped_polls) == (0, 0, 0)


@pytest.mark.parametrize("numbers", [False, True], ids=["unnumbered", "numbered"])
def test_the_ledger_matches_what_the_stand_in_engine_dropped_and_what_a_second_reader_took(numbers, monkeypatch):
    """The FAKE trtllm-serve's engine (tests/fake_trtllm_serve.py, each executor's buffer rule) with max_stats_len 4:
    a burst of 9 iterations between two polls overflows it; then a second reader drains 2 records the exporter never
    sees. Numbered, the exporter counts 9 - 4 = 5 dropped and 2 unread; unnumbered (a buffer of 5), it sees a poll at
    the cap and can say no more."""
    import fake_trtllm_serve

    monkeypatch.setenv("FAKE_TRTLLM_NUMBERED", "1" if numbers else "0")
    eng = fake_trtllm_serve.Engine({"enable_iter_perf_stats": True, "max_stats_len": 4})
    totals = exporter.TrtllmTotals("http://engine:8000", get=lambda url: json.dumps(eng.drain()), max_stats_len=4)
    its = trtllm_iterations(3.0, 7, 4, 12)
    eng.record(dict(its[0]))
    totals.poll()
    for it in its[1:10]:
        eng.record(dict(it))
    totals.poll()
    for it in its[10:12]:
        eng.record(dict(it))
    eng.drain()  # another reader of /metrics
    eng.record(dict(its[0]))
    totals.poll()
    lost = totals.lost
    assert (lost.dropped, lost.unread, lost.capped_polls) == ((5, 2, 0) if numbers else (0, 0, 1))
    assert totals.iterations == (1 + 4 + 1 if numbers else 1 + 5 + 1)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_plan_check_against_the_exporter_judges_as_against_the_engine(plan_dir, scenario, capsys, tmp_path):  # noqa: F811
    """The same scripted trtllm-serve read two ways: `plan check --engine trtllm` on its JSON, and `plan check
    --engine vllm` on the exporter in front of it. Same exit status, same tau, same drafts per round."""
    batch, factor, status, why = SCENARIOS[scenario]
    doc = plan_doc(plan_dir)
    k = doc["cells"][-1]["schedule_drafts"]
    planned = doc["inputs"]["acceptance"]["position_rates"]
    tau = check.mean_tau(planned, k + 1) * factor
    profiles = planned if factor == 1.0 else [AcceptanceProfile.from_tau("low", tau, k + 1).rates]
    bodies = bodies_for("trtllm", profiles, k, batch, tau)
    saved = {}
    for how in ("trtllm", "vllm"):
        with engine(bodies) as (url, _), sidecar(url) as side:
            target = url if how == "trtllm" else side
            args = ["plan", "check", "--engine", how, "--url", target, "--plan", str(plan_dir), "--window", "0.05"]
            got = main([*args, "--save", str(tmp_path / f"{how}.json")])
        out = capsys.readouterr().out
        assert got == status and why in out, (how, out)
        saved[how] = json.loads((tmp_path / f"{how}.json").read_text())
    assert saved["vllm"]["tau"] == pytest.approx(saved["trtllm"]["tau"], rel=1e-9)
    assert saved["vllm"]["mean_drafts"] == pytest.approx(saved["trtllm"]["mean_drafts"], rel=1e-9)
    assert max(saved["vllm"]["batch"]) == max(saved["trtllm"]["batch"]) == batch


def test_the_key_guards_metrics_not_health_and_a_down_engine_fails_the_scrape():
    with engine([json.dumps(trtllm_iterations(3.0, 7, 4, 10))]) as (url, _), sidecar(url, api_key="s3cret") as side:
        assert httpx.get(side + "/health", timeout=10).status_code == 200
        assert httpx.get(side + "/metrics", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.get(side + "/metrics", headers=wrong, timeout=10).status_code == 401
        ok = httpx.get(side + "/metrics", headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert ok.status_code == 200 and series(ok.text)["vllm:spec_decode_num_drafts_total"] == 40
    with socket.socket() as s:  # a port nobody listens on: trtllm-serve down
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with sidecar(dead) as side:
        r = httpx.get(side + "/metrics", timeout=10)
        assert r.status_code == 503 and "cannot scrape" in r.text


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_sidecar_command_serves_and_refuses_what_it_cannot_do(tmp_path, capsys):
    assert main(["plan", "check", "--engine", "vllm", "--url", "http://x", "--serve-metrics", "9"]) == 1
    assert "--engine trtllm" in capsys.readouterr().err
    empty = tmp_path / "key"
    empty.write_text("\n")
    args = ["plan", "check", "--engine", "trtllm", "--url", "http://x", "--serve-metrics", "9"]
    assert main([*args, "--api-key-file", str(empty)]) == 1 and "empty" in capsys.readouterr().err
    assert main(["plan", "check", "--engine", "trtllm", "--url", "http://x"]) == 1
    assert "--plan is required" in capsys.readouterr().err
    key = tmp_path / "k"
    key.write_text("abc\n")
    with engine([json.dumps(trtllm_iterations(3.0, 7, 4, 10))]) as (url, _):
        port = _free_port()
        cmd = [sys.executable, "-m", "dflash_trt.cli", "plan", "check", "--engine", "trtllm", "--url", url]
        proc = subprocess.Popen(
            [*cmd, "--serve-metrics", str(port), "--host", "127.0.0.1", "--poll", "0.05", "--api-key-file", str(key)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and '"event": "serve_metrics"' in proc.stdout.readline()
            deadline = time.monotonic() + 30  # the background poll drains the scripted body on its own
            got = {}
            while time.monotonic() < deadline and got.get("vllm:spec_decode_num_drafts_total") != 40:
                r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer abc"}, timeout=10)
                got = series(r.text)
                time.sleep(0.05)
            assert got["vllm:spec_decode_num_drafts_total"] == 40
        finally:
            proc.terminate()
            proc.wait(10)
    # SIGTERM (the kubelet's stop) ends it with 0: its own handler, since as a container's PID 1 the default action
    # would ignore the signal and hold the pod for its whole grace period (tests/deploy/test_pods.py runs it so)
    assert proc.returncode == 0
