"""The HTTP server on a real port (uvicorn in a thread), driven by httpx and the `openai` client.

Greedy outputs over HTTP are compared with the target alone (a BatchDecoder without a
drafter); sampled outputs with a seed are compared with the same request run directly.
"""

import asyncio
import logging
import time

import httpx
import openai
import pytest
from clocks import TickingClock
from helpers import FaultyDrafter, generate_one, make_text_models
from server_harness import FaultyTarget, GatedTarget, metric, running_server, scrape, server_fixtures, sse_events

from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.loading import load_decoder
from dflash_trt.server.app import chat_prompt_ids

PROMPTS = ["def fibonacci(n):", "for i in range(10):", "class Point:", "import os", "print(", "x = 1\n"]


models, decoder, server = server_fixtures("server")


@pytest.fixture(scope="module")
def reference(models, decoder):
    """The target alone (no drafter): greedy outputs must equal its own."""
    base = load_decoder(models[0], None)

    def run(prompt, n, stops=(), sampling=None, spec=False):
        ids = base.encode(prompt) if isinstance(prompt, str) else prompt
        cfg = GenerationConfig(
            max_new_tokens=n,
            stop_token_ids=base.default_stop_ids(),
            stop_strings=tuple(stops),
            sampling=sampling or SamplingParams(),
        )
        return generate_one(decoder if spec else base, ids, cfg)

    return run


def test_health_ready_models(server):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    ready = httpx.get(server + "/ready")
    assert ready.status_code == 200 and ready.json()["drafter"] is True
    models = httpx.get(server + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "dflash-trt"


@pytest.mark.parametrize("block_size", [None, 2])
def test_generate_greedy_equals_target_alone(server, reference, block_size):
    for i, prompt in enumerate(PROMPTS[:4]):
        n = 6 + 7 * i
        body = {"prompt": prompt, "max_tokens": n}
        if block_size:
            body["block_size"] = block_size
        got = httpx.post(server + "/generate", json=body, timeout=60).json()
        want = reference(prompt, n)
        assert got["token_ids"] == want.token_ids
        assert got["text"] == want.text
        assert got["finish_reason"] == want.finish_reason
        assert got["usage"]["completion_tokens"] == len(want.token_ids)
        assert got["spec"]["rounds"] >= 1 and got["spec"]["mean_acceptance_length"] >= 1
    ids = [5, 9, 13, 2]
    got = httpx.post(server + "/generate", json={"input_ids": ids, "max_tokens": 9}, timeout=60).json()
    assert got["token_ids"] == reference(ids, 9).token_ids


def _stream_generate(url, body):
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


@pytest.mark.parametrize("sampling", [None, {"temperature": 1.0, "seed": 7, "top_k": 50}])
def test_generate_stream_reassembles(server, reference, decoder, sampling):
    # a fixed block size: with the server's adaptive sizes a seed fixes the distribution, not the text
    fixed = {"block_size": decoder.drafter.block_size} if sampling else {}
    body = {"prompt": "def fibonacci(n):", "max_tokens": 40, **(sampling or {}), **fixed}
    events = _stream_generate(server, body)
    rounds, final = events[:-1], events[-1]
    assert final["type"] == "final" and all(e["type"] == "round" for e in rounds)
    assert rounds[0]["prefill"] and len(rounds[0]["token_ids"]) == 1
    assert sum((e["token_ids"] for e in rounds), []) == final["token_ids"]
    assert "".join(e["text"] for e in rounds) == final["text"]
    assert len(rounds) - 1 == final["spec"]["rounds"]  # one event per verified round (+ the prefill's)
    direct = httpx.post(server + "/generate", json=body, timeout=60).json()
    assert direct["token_ids"] == final["token_ids"] and direct["text"] == final["text"]
    if sampling is None:
        assert final["token_ids"] == reference(body["prompt"], 40).token_ids
    else:  # same seed, same distribution code path, run directly: identical tokens
        want = reference(body["prompt"], 40, sampling=SamplingParams(1.0, top_k=50, seed=7), spec=True)
        assert final["token_ids"] == want.token_ids
        assert max(len(e["token_ids"]) for e in rounds) > 1  # rounds that committed several tokens


def test_stop_string_never_leaks_into_stream(server, reference):
    free = reference("class Point:", 40)
    stop = free.text[len(free.text) // 2 :][:3]  # text the model really produces, likely spanning tokens
    want = reference("class Point:", 40, stops=[stop])
    assert want.finish_reason == "stop"
    events = _stream_generate(server, {"prompt": "class Point:", "max_tokens": 40, "stop": stop})
    assert "".join(e["text"] for e in events[:-1]) == want.text == events[-1]["text"]
    assert events[-1]["finish_reason"] == "stop"


def test_openai_client_completions_and_chat(server, reference, decoder):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    want = reference("def fibonacci(n):", 12)
    c = client.completions.create(model="dflash-trt", prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    assert c.choices[0].text == want.text and c.choices[0].finish_reason == want.finish_reason
    assert c.usage.completion_tokens == len(want.token_ids)
    # the configuration a seed's text depends on, in OpenAI's field: the drafter's dtype
    assert c.system_fingerprint == f"drafter-{decoder.drafter.dtype}" == "drafter-float32"
    chunks = list(
        client.completions.create(
            model="dflash-trt", prompt="def fibonacci(n):", max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == want.text
    assert {ch.system_fingerprint for ch in chunks} == {c.system_fingerprint}
    assert chunks[-1].choices[0].finish_reason == want.finish_reason

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "print("}]
    want = reference(chat_prompt_ids(decoder, messages), 10)
    r = client.chat.completions.create(model="dflash-trt", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.system_fingerprint == c.system_fingerprint and r.model_extra["spec"]["drafter_dtype"] == "float32"
    assert r.usage.prompt_tokens == len(chat_prompt_ids(decoder, messages))
    stream = client.chat.completions.create(
        model="dflash-trt",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert [m.id for m in client.models.list()] == ["dflash-trt"]


def test_raw_sse_ends_with_done(server):
    # greedy: /v1/completions samples at OpenAI's temperature 1 by default, and a sampled run may end on end-of-text
    with httpx.stream(
        "POST",
        server + "/v1/completions",
        json={"prompt": "import os", "max_tokens": 5, "temperature": 0, "stream": True},
        timeout=60,
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_metrics_move(server):
    before = scrape(server)
    n = 11
    got = httpx.post(server + "/generate", json={"prompt": "import os", "max_tokens": n}, timeout=60).json()
    httpx.post(server + "/generate", json={"prompt": ""}, timeout=60)  # a 400
    after = scrape(server)
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert delta("dflash_requests_total", endpoint="/generate", status="200") == 1
    assert delta("dflash_requests_total", endpoint="/generate", status="400") == 1
    assert delta("dflash_generated_tokens_total") == len(got["token_ids"]) == n
    assert delta("dflash_time_to_first_token_seconds_count") == 1
    assert delta("dflash_request_latency_seconds_count", outcome="ok") == 1
    assert delta("dflash_acceptance_length_count") == got["spec"]["rounds"]
    assert delta("dflash_acceptance_length_sum") == n - 1  # every token but the prefill's came from a round
    assert delta("dflash_verify_time_seconds_count") == got["spec"]["rounds"]
    assert delta("dflash_inter_token_latency_seconds_count") == n - 1
    assert metric(after, "dflash_inflight_requests") == 0 and metric(after, "dflash_queue_depth") == 0


def test_concurrent_requests_are_independent(server, reference, decoder):
    """24 requests at once (greedy and seeded sampling at a fixed block size, mixed lengths): each equals
    its own serial run."""
    cases = []
    for i in range(24):
        prompt = PROMPTS[i % len(PROMPTS)]
        n = 4 + (i * 5) % 23
        sampling = {"temperature": 0.8, "seed": i, "block_size": decoder.drafter.block_size} if i % 3 == 0 else {}
        cases.append((prompt, n, sampling))

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *[client.post(server + "/generate", json={"prompt": p, "max_tokens": n, **s}) for p, n, s in cases]
            )

    responses = asyncio.run(main())
    for (prompt, n, sampling), r in zip(cases, responses):
        assert r.status_code == 200, r.text
        if sampling:
            want = reference(prompt, n, sampling=SamplingParams(0.8, seed=sampling["seed"]), spec=True)
        else:
            want = reference(prompt, n)
        assert r.json()["token_ids"] == want.token_ids, (prompt, n, sampling)


def test_drafter_failure_falls_back_to_target(models, reference):
    decoder = load_decoder(*models)
    faulty = FaultyDrafter(decoder.drafter)
    decoder = BatchDecoder(decoder.target, faulty, decoder.tokenizer)
    with running_server(decoder) as (url, _):
        faulty.failing = True
        # a fixed block size, so the drafter surely runs: the adaptive policy may price the tiny random drafter
        # out of a 15-token request altogether (its costs are timed at start-up, on a busy machine)
        body = {"prompt": "for i in range(10):", "max_tokens": 15, "block_size": faulty.block_size}
        got = httpx.post(url + "/generate", json=body, timeout=60)
        assert got.status_code == 200
        assert got.json()["token_ids"] == reference("for i in range(10):", 15).token_ids
        assert got.json()["spec"]["drafter_fallback"] is True
        assert metric(scrape(url), "dflash_drafter_fallbacks_total") == 1
        faulty.failing = False
        got = httpx.post(url + "/generate", json={"prompt": "import os", "max_tokens": 5}, timeout=60).json()
        assert got["spec"]["drafter_fallback"] is False


def test_engine_failure_is_a_500_and_the_server_goes_on(models, reference, caplog):
    decoder = load_decoder(*models)
    faulty = FaultyTarget(decoder.target)
    decoder = BatchDecoder(faulty, decoder.drafter, decoder.tokenizer)
    with running_server(decoder) as (url, _), caplog.at_level(logging.INFO, logger="dflash_trt.server"):
        faulty.failing = True
        r = httpx.post(url + "/generate", json={"prompt": "import os", "max_tokens": 5}, timeout=60)
        assert r.status_code == 500
        err = r.json()["error"]
        rid = r.headers["x-request-id"]
        assert err["type"] == "server_error" and rid in err["message"]
        assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)  # traceback, with the id
        faulty.failing = False
        ok = httpx.post(url + "/generate", json={"prompt": "import os", "max_tokens": 5}, timeout=60)
        assert ok.status_code == 200 and ok.json()["token_ids"] == reference("import os", 5).token_ids
        assert metric(scrape(url), "dflash_engine_errors_total") == 1
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("{")]
    assert any(f'"request_id": "{rid}"' in line and '"status": 500' in line for line in lines)


LONG = {"input_ids": [3, 4, 5], "max_tokens": 2000, "block_size": 1}  # seconds of work for the tiny target


def test_queue_full_gives_429_and_a_disconnect_frees_the_slot(decoder):
    with running_server(decoder, max_active=1, max_queue=1) as (url, _):
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url + "/generate", json={**LONG, "stream": True}) as stream:
                lines = stream.iter_lines()  # kept referenced: closing this generator closes the connection
                assert next(lines).startswith("data: ")  # the long job is active

                async def burst():
                    async with httpx.AsyncClient(timeout=60) as c:
                        tasks = [
                            asyncio.create_task(c.post(url + "/generate", json={"prompt": "x", "max_tokens": 3}))
                            for _ in range(4)
                        ]
                        # Three get 429 while the long job runs; one waits in the queue (no wall-clock guess:
                        # wait for the three, however loaded the machine is).
                        deadline = time.monotonic() + 60
                        while sum(t.done() for t in tasks) < 3 and time.monotonic() < deadline:
                            await asyncio.sleep(0.05)
                        early = [t.result() for t in tasks if t.done()]
                        metrics = (await c.get(url + "/metrics")).text
                        stream.close()  # the client of the long job goes away ...
                        return early, metric(metrics, "dflash_queue_depth"), await asyncio.gather(*tasks)

                early, queued, responses = asyncio.run(burst())
        assert [r.status_code for r in early] == [429] * 3 and queued == 1
        busy = [r for r in responses if r.status_code == 429]
        assert len(busy) == 3
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in busy)
        served = [r for r in responses if r.status_code == 200]
        assert len(served) == 1  # ... and the queued request ran once the long job was dropped
        metrics = scrape(url)
        assert metric(metrics, "dflash_request_latency_seconds_count", outcome="cancelled") == 1
        assert metric(metrics, "dflash_inflight_requests") == 0
        assert metric(metrics, "dflash_generated_tokens_total") < LONG["max_tokens"]


def test_new_requests_do_not_wait_for_the_engines(models):
    """While the worker is stuck inside an engine call, a new request is still tokenized and queued, and
    one over the limit gets its 429 at once (the engines and the tokenizer share no lock)."""
    base = load_decoder(*models)
    gated = GatedTarget(base.target)
    decoder = BatchDecoder(gated, base.drafter, base.tokenizer)
    with running_server(decoder, max_active=1, max_queue=1) as (url, _):
        gated.hold.set()

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as c:
                first = asyncio.create_task(c.post(url + "/generate", json={"prompt": "import os", "max_tokens": 4}))
                while not gated.entered.is_set():
                    assert not first.done(), first.result().text
                    await asyncio.sleep(0.02)
                queued = asyncio.create_task(
                    c.post(
                        url + "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "print("}], "max_tokens": 3},
                    )
                )
                while metric((await c.get(url + "/metrics")).text, "dflash_queue_depth") < 1:
                    assert not queued.done(), queued.result().text  # tokenized and queued, not answered
                    await asyncio.sleep(0.02)
                refused = await c.post(url + "/generate", json={"prompt": "x", "max_tokens": 3})  # timeout: 30 s
                assert gated.entered.is_set() and not gated.gate.is_set()  # the worker is still stuck
                gated.hold.clear()
                gated.gate.set()
                return refused, await first, await queued

        refused, first, queued = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert first.status_code == 200 and queued.status_code == 200


def test_client_hanging_up_during_upload_is_499(server):
    """A body cut short by its client is the client's doing: 499 in the metrics, not a 500."""
    import socket
    from urllib.parse import urlparse

    before = scrape(server)
    u = urlparse(server)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )
        time.sleep(0.2)  # let the server start reading the body
    deadline = time.monotonic() + 30
    while metric(scrape(server), "dflash_requests_total", endpoint="/generate", status="499") == metric(
        before, "dflash_requests_total", endpoint="/generate", status="499"
    ):
        assert time.monotonic() < deadline, "the cut upload was never counted as 499"
        time.sleep(0.05)
    after = scrape(server)
    assert metric(after, "dflash_requests_total", endpoint="/generate", status="500") == metric(
        before, "dflash_requests_total", endpoint="/generate", status="500"
    )


def test_completions_default_max_tokens_is_openais_16_clipped_to_the_context(server, decoder):
    r = httpx.post(server + "/v1/completions", json={"prompt": [5, 9, 13], "temperature": 0}, timeout=60).json()
    assert r["usage"]["completion_tokens"] <= 16
    assert r["usage"]["completion_tokens"] == 16 or r["choices"][0]["finish_reason"] == "stop"
    null = httpx.post(
        server + "/v1/completions", json={"prompt": [5, 9, 13], "max_tokens": None, "temperature": 0}, timeout=60
    )
    assert null.json()["usage"] == r["usage"]  # an explicit null is the same default
    room = 3
    long_prompt = [5 + i % 50 for i in range(decoder.target.max_context - room)]
    clipped = httpx.post(server + "/v1/completions", json={"prompt": long_prompt}, timeout=60)
    assert clipped.status_code == 200 and clipped.json()["usage"]["completion_tokens"] <= room
    explicit = httpx.post(server + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 16}, timeout=60)
    assert explicit.status_code == 400 and explicit.json()["error"]["code"] == "context_length_exceeded"


def test_request_timeout(decoder):
    # the server's request clock ticks a quarter of the limit at every read: LONG (thousands of steps, each reading
    # it) passes its deadline within a few steps, on a fast machine as on a loaded one
    with running_server(decoder, clock=TickingClock(0.25), request_timeout_s=1.0) as (url, _):
        r = httpx.post(url + "/generate", json=LONG, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        events = _stream_generate(url, LONG)
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "timeout"
        assert httpx.get(url + "/health").status_code == 200


def test_auth(decoder):
    with running_server(decoder, api_key="s3cret") as (url, _):
        assert httpx.get(url + "/health").status_code == 200  # the probes stay open
        assert httpx.get(url + "/ready").status_code == 200
        body = {"prompt": "import os", "max_tokens": 3}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = httpx.post(url + "/generate", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/v1/models").status_code == 401
        for path in ("/openapi.json", "/docs"):  # the contract too: every route but the probes
            assert httpx.get(url + path).status_code == 401, path
            assert httpx.get(url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200, path
        assert httpx.get(url + "/redoc").status_code in (401, 404)
        ok = httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert (
            client.completions.create(
                model="dflash-trt", prompt="import os", max_tokens=2, temperature=0
            ).usage.completion_tokens
            == 2
        )


BAD_GENERATE = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),  # beyond the context: the schema says so
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "path": "/etc/passwd"}, "path"),
    ({"prompt": "x", "input_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"input_ids": [1, 10_000_000]}, "input_ids.1"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"prompt": "x", "block_size": 9}, "block_size"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ([1, 2], "dictionary"),
]


@pytest.mark.parametrize("body,needle", BAD_GENERATE)
def test_bad_generate_requests_are_400(server, body, needle):
    r = httpx.post(server + "/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle.lower() in err["message"].lower(), err


def test_other_bad_requests(server):
    raw = [
        ("/generate", b'{"prompt": "x",'),
        ("/generate", b"\xff\xfe"),
        ("/generate", b"NaN"),
        ("/generate", b'{"prompt": "x", "temperature": NaN}'),
        ("/v1/completions", b"[" * 10000),
    ]
    for path, content in raw:
        r = httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "error" in r.json(), (path, content[:20], r.text)
    big = httpx.post(server + "/generate", json={"prompt": "x" * (2 << 20)}, timeout=30)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server + "/nowhere").status_code == 404
    assert httpx.get(server + "/generate").status_code == 405
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert chat.status_code == 400
    n2 = httpx.post(server + "/v1/completions", json={"prompt": "x", "n": 2}, timeout=30)
    assert n2.status_code == 400 and n2.json()["error"]["param"] == "n"
    assert httpx.get(server + "/health").status_code == 200


def test_tiny_temperature_is_greedy_not_nan(server, reference):
    """Found by the fuzz test: logits / 1e-308 overflow to inf and sampling produced NaN (a 500)."""
    r = httpx.post(
        server + "/generate", json={"prompt": "import os", "max_tokens": 6, "temperature": 1e-308}, timeout=30
    )
    assert r.status_code == 200 and r.json()["token_ids"] == reference("import os", 6).token_ids


def test_chat_prompt_uses_the_template(decoder):
    assert (
        decoder.tokenizer.decode(chat_prompt_ids(decoder, [{"role": "user", "content": "hi"}])) == "<user>hi<assistant>"
    )


def test_chat_without_a_template_is_refused_and_points_to_completions(tmp_path):
    """A completion model (no chat template) answers chat with a 400 naming /v1/completions, as vLLM
    does, rather than inventing a `role: content` format it never saw; completions still serve."""
    decoder = load_decoder(*make_text_models(tmp_path, chat=False))
    with running_server(decoder) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "no chat template" in err["message"] and "/v1/completions" in err["message"]
        assert err["param"] == "messages" and err["type"] == "invalid_request_error"
        ok = httpx.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200


@pytest.mark.parametrize(
    "sampling",
    [
        {},  # greedy: the CLI at the drafter's trained size, the server at its own (adaptive) sizes
        {"temperature": 1.0, "seed": 7, "block_size": 4},  # seeded sampling at one fixed block size
    ],
    ids=["greedy", "seeded-sampled"],
)
def test_cli_generate_and_the_server_return_the_same_tokens(models, server, reference, sampling):
    """Issue 25: `dflash-trt generate` (the console script, a process of its own) and POST /generate run the
    same loop, so the same request gives the same tokens, greedy and seeded sampled alike."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    target, drafter = models
    prompt, n = "def fibonacci(n):", 24
    args = [str(Path(sys.executable).parent / "dflash-trt"), "generate", "--target", str(target)]
    args += ["--drafter", str(drafter), "--prompt", prompt, "--max-new-tokens", str(n), "--json"]
    for key in ("temperature", "seed", "block_size"):
        if key in sampling:
            args += [f"--{key.replace('_', '-')}", str(sampling[key])]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cli = json.loads(proc.stdout)
    http = httpx.post(server + "/generate", json={"prompt": prompt, "max_tokens": n, **sampling}, timeout=60).json()
    assert cli["token_ids"] == http["token_ids"] and cli["text"] == http["text"]
    assert cli["drafter_dtype"] == http["spec"]["drafter_dtype"] == "float32"  # what made the text, said alike
    assert cli["finish_reason"] == http["finish_reason"]
    if not sampling:
        assert cli["token_ids"] == reference(prompt, n).token_ids  # both equal the target alone
    else:
        assert cli["token_ids"] != reference(prompt, n).token_ids  # it did sample
        assert cli["stats"]["block_size"] == http["spec"]["block_size"] == 4
