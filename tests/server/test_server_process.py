"""`dflash-trt serve` as a real process: startup on --port 0, SIGTERM drain (in-flight finishes, new work
gets 503), exit 0; flag checks.

The models have no tokenizer, so no end-of-text token can end a generation early: a request for
max_tokens near the context limit runs that long, whatever the speed of the machine.
"""

import signal
import time

import httpx
import pytest
from helpers import make_tiny_pair
from server_harness import HANG_S, metric, sse_events

from dflash_trt.cli import main
from dflash_trt.server.process import listening_port, start_serve

CONTEXT = 2048  # the tiny target's max_position_embeddings
LONG = {"input_ids": [3, 4, 5], "max_tokens": CONTEXT - 3, "block_size": 1, "stream": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-process")
    make_tiny_pair(root, vocab_size=200, seed=1)  # no tokenizer: a request for max_tokens runs exactly that many
    return root / "target", root / "drafter"


def start(models, log, *extra):
    return start_serve(
        ["--target", str(models[0]), "--drafter", str(models[1]), "--threads", "1", *extra],
        log,
        env={"DFLASH_TRT_API_KEY": ""},
        timeout_s=HANG_S,
    )


def wait_draining(url, headers=None):
    deadline = time.monotonic() + 30
    while httpx.get(url + "/ready", headers=headers, timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.02)


def test_sigterm_drains_in_flight_and_refuses_new_work(models, tmp_path):
    log = tmp_path / "serve.log"
    proc, url = start(models, log, "--drain-timeout", "120", "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    try:
        with httpx.stream("POST", url + "/generate", json=LONG, headers=auth, timeout=300) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            wait_draining(url, auth)
            metrics = httpx.get(url + "/metrics", headers=auth, timeout=10).text
            assert metric(metrics, "dflash_inflight_requests") == 1  # the stream is still open: a real drain
            refused = httpx.post(url + "/generate", json={"input_ids": [1], "max_tokens": 2}, headers=auth, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert httpx.get(url + "/health", timeout=10).status_code == 200  # alive while draining
            events = sse_events(lines)
        final = events[-1]
        assert final["type"] == "final" and final["finish_reason"] == "length"
        assert len(final["token_ids"]) == final["usage"]["completion_tokens"] == LONG["max_tokens"]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert '"event": "drain"' in err and '"status": 503' in err  # structured log lines
    assert "Traceback" not in err
    assert listening_port(err) == int(url.rsplit(":", 1)[1])  # --port 0: the port it bound, reported


def test_drain_limit_cuts_long_requests(models, tmp_path):
    proc, url = start(models, tmp_path / "serve.log", "--drain-timeout", "0.5")
    try:
        with httpx.stream("POST", url + "/generate", json=LONG, timeout=300) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            events = sse_events(lines)
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "shutting_down"
        assert sum(len(e.get("token_ids", ())) for e in events[:-1]) < LONG["max_tokens"]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--port", "-1", ">= 0"),
        ("--port", "65536", "<= 65535"),
        ("--port", "http", "integer"),
        ("--max-queue", "-1", ">= 0"),
        ("--request-timeout", "nan", "finite"),
        ("--request-timeout", "0", "> 0"),
        ("--drain-timeout", "inf", "finite"),
        ("--drain-timeout", "-1", ">= 0"),
        ("--block-size", "0", ">= 1"),
    ],
)
def test_bad_flags_are_usage_errors(flag, value, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and needle in err and "Traceback" not in err


def test_bad_model_path_is_one_line(tmp_path, capsys):
    assert main(["serve", "--target", str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dflash-trt serve: error: target directory not found: {tmp_path / 'missing'}"
    ]


def test_block_size_and_no_adaptive_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--block-size", "2", "--no-adaptive"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_block_size_beyond_the_drafter_is_one_line(models, capsys):
    assert main(["serve", "--target", str(models[0]), "--drafter", str(models[1]), "--block-size", "9"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "dflash-trt serve: error: --block-size must be in 1..4 for this drafter, got 9"
    ]


def test_block_size_flag_reaches_the_decoder(models, tmp_path):
    """--block-size 2: every verify row of every step has 2 tokens or fewer (read back from /metrics)."""
    proc, url = start(models, tmp_path / "serve.log", "--block-size", "2")
    try:
        r = httpx.post(url + "/generate", json={"input_ids": [3, 4, 5], "max_tokens": 20}, timeout=120).json()
        m = httpx.get(url + "/metrics", timeout=10).text
        rows = metric(m, "dflash_block_size_count")
        assert rows >= 10 and metric(m, "dflash_block_size_bucket", le="2.0") == rows
        assert metric(m, "dflash_block_size_bucket", le="1.0") < rows  # it drafts: 1 draft token per round
        assert r["spec"]["block_size"] == 2 and r["spec"]["drafted_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
