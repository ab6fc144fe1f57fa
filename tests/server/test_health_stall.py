"""GET /health fails while decoding is stuck: a request waits and no step has ended for --health-stall-seconds (a
hung engine or tensor-parallel collective), so a liveness probe restarts the server; idle or progressing, it is ok.

The server's request clock is a virtual one the test advances (`create_app(clock=)`): how long the engine "hangs"
is what the test says, not how long a loaded machine takes to answer /health."""

from __future__ import annotations

import threading

import httpx
from helpers import make_text_models
from server_harness import GatedTarget, running_server

from dflash_trt.decoding import BatchDecoder
from dflash_trt.loading import load_decoder
from dflash_trt.sim.engines import VirtualClock


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def _stuck_server(tmp_path, stall_s: float):
    base = load_decoder(*make_text_models(tmp_path))
    gated, clock = GatedTarget(base.target), VirtualClock()
    decoder = BatchDecoder(gated, base.drafter, base.tokenizer)
    return gated, clock, running_server(decoder, clock=clock, health_stall_s=stall_s)


def test_health_fails_while_a_step_hangs_and_recovers_after(tmp_path):
    gated, clock, server = _stuck_server(tmp_path, stall_s=1.0)
    with server as (url, _):
        clock.advance(1.5)
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
            assert _health(url).status_code == 200  # hung, but not yet for longer than the limit
            clock.advance(1.5)
            r = _health(url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "stalled", r.text
        finally:
            gated.hold.clear()
            gated.gate.set()
            request.join(60)
        assert answers and answers[0].status_code == 200
        assert _health(url).status_code == 200  # steps end again, nothing waits


def test_health_stall_zero_never_fails(tmp_path):
    gated, clock, server = _stuck_server(tmp_path, stall_s=0)
    with server as (url, _):
        gated.hold.set()
        request = threading.Thread(
            target=lambda: httpx.post(url + "/generate", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        )
        request.start()
        try:
            assert gated.entered.wait(30)
            clock.advance(1e6)
            assert _health(url).status_code == 200
        finally:
            gated.hold.clear()
            gated.gate.set()
            request.join(60)
