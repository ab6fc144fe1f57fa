"""Server test harness: a real uvicorn server on a real socket, SSE / metrics parsing, target fault injection."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from clocks import priced_decoder
from helpers import make_text_models

from dflash_trt.loading import load_decoder
from dflash_trt.server.app import ServerSettings, create_app

HANG_S = 600.0  # how long a wait on a server's own progress may last before it counts as hung (a busy machine's)


@contextlib.contextmanager
def running_server(decoder, clock=time.monotonic, **settings):
    """uvicorn.Server in a thread, listening on a free port of 127.0.0.1; yields (base url, app). `clock`: the
    server's request clock (create_app)."""
    app = create_app(decoder, ServerSettings(**settings), clock)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    # Start-up measures the adaptive policy's cost grid (CPU-seconds of passes, the first server of each shape in a
    # session): on a loaded machine that is minutes of wall clock. A thread that dies is a failed start at once; the
    # deadline only bounds a start that hangs, and so does the one on the exit.
    deadline = time.monotonic() + HANG_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(HANG_S)
        sock.close()
        if thread.is_alive():  # a test ends the servers it starts: none may outlive it
            raise RuntimeError(f"test server still running {HANG_S} s after it was told to exit")


def after_served(url: str, name: str, more: float, headers: dict | None = None, **labels):
    """A `sleep` for `plan.metrics.scrape` (its `sleep=`) that waits for served work instead of seconds: it returns
    once the counter `name` (with `labels`) on url's /metrics has grown by `more` since it was called. A window of
    scrapes then holds the same work on a busy machine as on a quiet one, so a test of what the window saw cannot
    depend on the machine's speed. Only a server that stopped serving (HANG_S) fails it."""

    def served(_seconds: float) -> None:
        def now() -> float:
            return metric(scrape(url, **(headers or {})), name, **labels)

        until, deadline, pause = now() + more, time.monotonic() + HANG_S, threading.Event()
        while now() < until:
            assert time.monotonic() < deadline, f"{name} grew by less than {more} in {HANG_S} s"
            pause.wait(0.05)

    return served


def server_fixtures(name: str, serve=None, priced: bool = False):
    """A server test file's module-scoped fixtures: `models` (the tiny text pair, saved in a temp folder
    named after `name`), `decoder` (loaded from them; with `priced`, its engines priced on a virtual clock,
    `clocks.priced_decoder`, for tests whose outcome depends on the server's priced choices) and `server` (the
    base url of serve(decoder), a context manager yielding (url, _); running_server by default). Bind them at
    module level: `models, decoder, server = server_fixtures("server")`."""

    @pytest.fixture(scope="module")
    def models(tmp_path_factory):
        return make_text_models(tmp_path_factory.mktemp(name))

    @pytest.fixture(scope="module")
    def decoder(models):
        loaded = load_decoder(*models)
        return priced_decoder(loaded) if priced else loaded

    @pytest.fixture(scope="module")
    def server(decoder):
        with (serve or running_server)(decoder) as (url, _):
            yield url

    return models, decoder, server


def sse_events(lines) -> list:
    """Parse `data: ...` lines of a server-sent-event stream (JSON, or the literal [DONE])."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric_name, _, label_part = key.partition("{")
        if metric_name != name:
            continue
        got = ",".join(sorted(p for p in label_part.rstrip("}").split(",") if p))
        if got == want:
            return float(value)
    return 0.0


def scrape(url: str, **headers) -> str:
    return httpx.get(url + "/metrics", headers=headers, timeout=10).text


class FaultyTarget:
    """Wraps a real target engine; while `failing` is set, its sessions' forward() raises (fault injection)."""

    def __init__(self, engine):
        self.engine, self.failing = engine, False
        for attr in ("name", "vocab_size", "max_context", "feature_layer_ids"):
            setattr(self, attr, getattr(engine, attr))

    def before_forward(self):
        if self.failing:
            raise RuntimeError("injected target failure")

    def new_session(self):
        return _FaultyTargetSession(self, self.engine.new_session())


class _FaultyTargetSession:
    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner

    def __getattr__(self, name):  # add_row, remove_row, length, rollback: the real session's
        return getattr(self.inner, name)

    def forward(self, rows, tokens, **kw):
        self.owner.before_forward()
        return self.inner.forward(rows, tokens, **kw)


class GatedTarget(FaultyTarget):
    """Wraps a real target engine; while `hold` is set, forward() parks until `gate` is set, and
    `entered` tells the test that the orchestrator's worker is inside an engine call."""

    def __init__(self, engine):
        super().__init__(engine)
        self.hold, self.gate, self.entered = threading.Event(), threading.Event(), threading.Event()

    def before_forward(self):
        if self.hold.is_set():
            self.entered.set()
            if not self.gate.wait(60):
                raise RuntimeError("gate never opened")
        super().before_forward()
