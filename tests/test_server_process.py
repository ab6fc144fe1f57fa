"""`dflash-trt serve` as a real process: startup, SIGTERM drain (in-flight finishes, new work gets 503), exit 0."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import free_port, make_models, sse_events

from dflash_trt.cli import main

CLI = Path(sys.executable).parent / "dflash-trt"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("serve-process"))


def start(models, *extra):
    port = free_port()
    env = {**os.environ, "DFLASH_TRT_API_KEY": ""}
    proc = subprocess.Popen([str(CLI), "serve", "--target", str(models[0]), "--drafter", str(models[1]),
                             "--port", str(port), "--threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not come up")


def test_sigterm_drains_in_flight_and_refuses_new_work(models):
    proc, url = start(models, "--drain-timeout", "60", "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    try:
        body = {"input_ids": [3, 4, 5], "max_tokens": 600, "block_size": 1, "stream": True}  # seconds of work
        with httpx.stream("POST", url + "/generate", json=body, headers=auth, timeout=120) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            refused = httpx.post(url + "/generate", json={"prompt": "x", "max_tokens": 2}, headers=auth, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert httpx.get(url + "/ready", headers=auth, timeout=10).status_code == 503
            assert httpx.get(url + "/health", timeout=10).status_code == 200  # alive while draining
            events = sse_events(lines)
        final = events[-1]
        assert final["type"] == "final" and len(final["token_ids"]) == final["usage"]["completion_tokens"]
        assert final["finish_reason"] in ("length", "stop")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert '"event": "drain"' in err and '"status": 503' in err  # structured log lines
    assert "Traceback" not in err


def test_drain_limit_cuts_long_requests(models):
    proc, url = start(models, "--drain-timeout", "0.5")
    try:
        body = {"input_ids": [3, 4, 5], "max_tokens": 2000, "block_size": 1, "stream": True}
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            events = sse_events(lines)
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_model_path_is_one_line(tmp_path, capsys):
    assert main(["serve", "--target", str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dflash-trt serve: error: target directory not found: {tmp_path / 'missing'}"]
