"""`dflash-trt serve` under an API key, as the Kubernetes pods run it (deploy/k8s): a real process on a real port,
the key read from a file (the mounted Secret, $DFLASH_TRT_API_KEY_FILE).

- the probes: Kubernetes' httpGet probes send no credentials, so /health (liveness, startup) and /ready (readiness)
  answer without the key, and /ready turns 503 while draining (the Service stops routing here) instead of 401;
- the scrape: /metrics answers the ServiceMonitor's credentials (`authorization: {type: Bearer, credentials:
  <the key's Secret>}` sends `Authorization: Bearer <key>`) and 401 without them;
- every other route the app has (read from the app itself, so a route added later is covered) is 401 without the
  key and with a wrong one;
- a key file that was named but is empty (an empty Secret) stops the server: never a silent "no auth".
"""

import signal
import time

import httpx
import pytest
from helpers import make_tiny_pair
from server_harness import HANG_S

from dflash_trt.server.process import ServerFailed, start_serve

KEY = "k8s-s3cret"
PROBES = {"/health", "/ready"}
CONTEXT = 2048  # the tiny target's max_position_embeddings: a request this long runs until it is cut
LONG = {"input_ids": [3, 4, 5], "max_tokens": CONTEXT - 3, "block_size": 1, "stream": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-probes")
    make_tiny_pair(root, vocab_size=200, seed=1)  # no tokenizer: a request runs exactly max_tokens
    return root / "target", root / "drafter"


def start(models, tmp_path, key_text: str, *extra):
    key_file = tmp_path / "secret" / "key"
    key_file.parent.mkdir(exist_ok=True)
    key_file.write_text(key_text)
    return start_serve(
        ["--target", str(models[0]), "--drafter", str(models[1]), "--threads", "1", *extra],
        tmp_path / "serve.log",
        env={"DFLASH_TRT_API_KEY": "", "DFLASH_TRT_API_KEY_FILE": str(key_file)},
        timeout_s=HANG_S,
    )


def routes(url: str) -> set[tuple[str, str]]:
    """(method, path) of every route the running app serves: its OpenAPI document (read with the key) and the
    document's own routes, which the document does not list."""
    doc = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    found = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    return found | {("GET", "/openapi.json"), ("GET", "/docs")}


def call(url, method, path, headers=None):
    path = path.replace("{model}", "dflash-trt")
    body = {"prompt": [3, 4], "max_tokens": 1} if method == "POST" else None
    return httpx.request(method, url + path, json=body, headers=headers or {}, timeout=30)


def test_probes_open_metrics_with_the_monitors_credentials_every_other_route_401(models, tmp_path):
    proc, url = start(models, tmp_path, KEY + "\n", "--drain-timeout", "120")  # a trailing newline: stripped
    try:
        for path in sorted(PROBES):  # what the kubelet sends: no Authorization header at all
            r = httpx.get(url + path, timeout=30)
            assert r.status_code == 200, (path, r.text)
        assert httpx.get(url + "/metrics", timeout=30).status_code == 401
        scrape = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert scrape.status_code == 200 and "dflash_queue_depth" in scrape.text
        found = routes(url)
        assert {("GET", p) for p in PROBES} | {("GET", "/metrics"), ("POST", "/v1/completions")} <= found
        for method, path in sorted(found - {("GET", p) for p in PROBES}):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = call(url, method, path, headers)
                assert r.status_code == 401, (method, path, headers, r.status_code)
        ok = call(url, "POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        # drain: the readiness probe, still without the key, reads 503 (not 401) and /health stays 200
        with httpx.stream(
            "POST", url + "/generate", json=LONG, headers={"Authorization": f"Bearer {KEY}"}, timeout=300
        ) as stream:
            lines = stream.iter_lines()  # kept: a discarded iterator closes the stream, which cancels the request
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (ready := httpx.get(url + "/ready", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "the server never started draining"
                time.sleep(0.02)
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down"
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            assert sum(1 for line in lines if line.startswith("data: ")) > 1  # the request ran on, drained
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_an_empty_key_file_stops_the_server(models, tmp_path):
    with pytest.raises(ServerFailed, match=r"exited with code 1(.|\n)*--api-key-file .*key is empty"):
        start(models, tmp_path, "\n")
