"""GET /health fails while decoding is stuck: a request waits and no step has ended for --health-stall-seconds (a
hung engine or tensor-parallel collective), so a liveness probe restarts the server; idle or progressing, it is ok."""

from __future__ import annotations

import threading
import time

import httpx
from helpers import make_text_models
from server_harness import GatedTarget, running_server

from dflash_trt.decoding import BatchDecoder
from dflash_trt.loading import load_decoder


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def _stuck_server(tmp_path, stall_s: float):
    base = load_decoder(*make_text_models(tmp_path))
    gated = GatedTarget(base.target)
    return gated, running_server(BatchDecoder(gated, base.drafter, base.tokenizer), health_stall_s=stall_s)


def test_health_fails_while_a_step_hangs_and_recovers_after(tmp_path):
    gated, server = _stuck_server(tmp_path, stall_s=1.0)
    with server as (url, _):
        time.sleep(1.5)
        assert _health(url).status_code == 200  # idle longer than the limit: nothing waits, nothing is stalled
        gated.hold.set()
        answers: list[httpx.Response] = []
        request = threading.Thread(
            target=lambda: answers.append(
                httpx.post(url + "/generate", json={"prompt": "import os", "max_tokens": 4}, timeout=60)
            )
        )
        request.start()
        try:
            assert gated.entered.wait(30), "the request never reached the engine"
            end = time.monotonic() + 15
            while (r := _health(url)).status_code == 200:
                assert time.monotonic() < end, "/health stayed ok while the engine hung"
                time.sleep(0.1)
            assert r.status_code == 503 and r.json()["error"]["code"] == "stalled", r.text
        finally:
            gated.hold.clear()
            gated.gate.set()
            request.join(60)
        assert answers and answers[0].status_code == 200
        assert _health(url).status_code == 200  # steps end again, nothing waits


def test_health_stall_zero_never_fails(tmp_path):
    gated, server = _stuck_server(tmp_path, stall_s=0)
    with server as (url, _):
        gated.hold.set()
        request = threading.Thread(
            target=lambda: httpx.post(url + "/generate", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        )
        request.start()
        try:
            assert gated.entered.wait(30)
            time.sleep(1.5)
            assert _health(url).status_code == 200
        finally:
            gated.hold.clear()
            gated.gate.set()
            request.join(60)
