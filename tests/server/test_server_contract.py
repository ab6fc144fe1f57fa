"""The server's contract at its edges, each case a bug found by outside tools (issue 13): arithmetic that
must not 500, input that is not text, a client that hangs up, HTTP the parser rejects, the moment the
server says it listens. The server runs the production way (serving.make_server: uvicorn with our HTTP
protocol) on a real port, in a thread.
"""

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import torch
from helpers import make_tiny_pair
from server_harness import HANG_S, metric, scrape, server_fixtures, sse_events

from dflash_trt.decoding import SamplingParams
from dflash_trt.decoding.sampling import probabilities
from dflash_trt.loading import load_decoder
from dflash_trt.server.app import ServerSettings, create_app
from dflash_trt.server.serving import LISTENING_EVENT, make_server


@contextlib.contextmanager
def serving(decoder, on_listening=None, **settings):
    """make_server() in a thread on 127.0.0.1, port 0; yields the base url once it says it listens.
    on_listening(port) runs inside the logging call of the listening line, before the server goes on."""
    got = {}

    class Listening(logging.Handler):
        def emit(self, record):
            event = json.loads(record.getMessage()) if record.getMessage().startswith("{") else {}
            if event.get("event") == LISTENING_EVENT:
                got["port"] = event["port"]
                if on_listening is not None:
                    got["probe"] = on_listening(event["port"])

    logger = logging.getLogger("dflash_trt.server")
    handler, level = Listening(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    server, sock = make_server(create_app(decoder, ServerSettings(**settings)), "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + HANG_S  # start-up measures the cost grid: minutes on a loaded machine
        while "port" not in got:
            assert thread.is_alive() and time.monotonic() < deadline, "the server never said it listens"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{got['port']}", got
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        logger.removeHandler(handler)
        logger.setLevel(level)
        if thread.is_alive():  # a test ends the servers it starts: none may outlive it
            raise RuntimeError("test server still running 15 s after it was told to exit")


models, decoder, server = server_fixtures("contract", serve=serving)


def post_raw(url, path, body: dict, **kw):
    """json.dumps escapes a lone surrogate as \\ud800 (httpx's own encoder cannot encode it at all)."""
    return httpx.post(
        url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}, timeout=60, **kw
    )


CHAT = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4}
BODIES = {
    "/generate": {"prompt": "def f(x):", "max_tokens": 4},
    "/v1/completions": {"prompt": "def f(x):", "max_tokens": 4},
    "/v1/chat/completions": CHAT,
}


def test_top_p_below_float32s_smallest_number_keeps_the_top_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-46))
    assert not p.isnan().any()
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_tiny_top_p_is_the_argmax_not_a_500(server, path, stream):
    body = {**BODIES[path], "temperature": 1.0, "top_p": 1e-46, "seed": 3, "stream": stream}
    greedy = post_raw(server, path, {**BODIES[path], "temperature": 0})
    assert greedy.status_code == 200, greedy.text
    r = post_raw(server, path, body)
    assert r.status_code == 200, r.text
    if not stream:
        got, want = r.json(), greedy.json()
        key = (
            (lambda j: j["token_ids"])
            if path == "/generate"
            else (lambda j: j["choices"][0].get("text", j["choices"][0].get("message", {}).get("content")))
        )
        assert key(got) == key(want)  # top_p that small leaves only the most likely token
    else:
        events = sse_events(r.text.splitlines())
        assert events and not any(isinstance(e, dict) and ("error" in e or e.get("type") == "error") for e in events)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", {"prompt": "\ud800", "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": "x\udfff", "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": ["\ud800"], "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content",
        ),
        ("/generate", {"prompt": "x", "stop": "\ud800"}, "stop"),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    r = post_raw(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and "unicode" in err["message"].lower(), err


def test_encode_refuses_a_lone_surrogate(decoder):
    from dflash_trt.decoding import InputError

    with pytest.raises(InputError, match="surrogate"):
        decoder.encode("a\ud800b")


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/generate", {"input_ids": [5] * 2048, "max_tokens": 1}, "input_ids"),
        ("/v1/completions", {"prompt": [5] * 2048}, "prompt"),
        ("/v1/completions", {"prompt": [5] * 2000, "max_tokens": 100}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x = 1\n" * 2048}]}, "messages"),
    ],
)
def test_context_overflow_names_the_field_to_change(server, path, body, param):
    r = post_raw(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err


def test_listening_line_comes_once_the_port_accepts(decoder):
    def probe(port):  # runs before the server goes on: a client that reacts at once must get in
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return "connected"
        except OSError as e:
            return repr(e)

    with serving(decoder, on_listening=probe) as (url, got):
        assert got["probe"] == "connected"
        assert httpx.get(url + "/health").status_code == 200


def test_malformed_http_is_a_json_400(server):
    host, port = server.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -1\r\n\r\n{}"
        )
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), reply
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("malformed HTTP request")


def test_non_streaming_client_hanging_up_stops_its_generation(tmp_path):
    """No end-of-text token in these models: without the cancel the request would run all its tokens."""
    make_tiny_pair(tmp_path, vocab_size=200, seed=1)
    decoder = load_decoder(tmp_path / "target", tmp_path / "drafter")
    long = {"input_ids": [3, 4, 5], "max_tokens": 2000, "block_size": 1}
    with serving(decoder) as (url, _):
        host, port = url.rsplit("//", 1)[1].split(":")
        payload = json.dumps(long).encode()
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        deadline = time.monotonic() + 60
        while metric(scrape(url), "dflash_generated_tokens_total") < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        s.close()  # the client goes away mid-generation
        while True:
            m = scrape(url)
            ended = {o: metric(m, "dflash_request_latency_seconds_count", outcome=o) for o in ("ok", "cancelled")}
            if any(ended.values()):
                break
            assert time.monotonic() < deadline, "the request never ended"
            time.sleep(0.01)
        assert ended == {"ok": 0, "cancelled": 1}
        assert metric(m, "dflash_generated_tokens_total") < long["max_tokens"]
        assert metric(m, "dflash_inflight_requests") == 0


def test_serve_freezes_its_start_up_heap_before_serving(monkeypatch):
    """`serve_app` (what `dflash-trt serve` runs) moves the start-up heap out of the collector's reach before the
    server runs, so a full collection during serving does not walk torch's and the engines' objects."""
    import gc

    from dflash_trt.server import serving as serving_module

    frozen = []

    class Recorder:  # uvicorn's Server.run, which would block: records what the collector holds back when it starts
        def run(self, sockets):
            frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(serving_module, "make_server", lambda app, host, port: (Recorder(), None))
    before = gc.get_freeze_count()
    try:
        serving_module.serve_app(None, "127.0.0.1", 0)
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] - before > 10_000  # torch and transformers alone hold far more than this
