"""The server's batched steps, through a real server on a real port: many requests share each step and
each still returns exactly what it returns alone; seeded sampling at a fixed block size is reproducible
under load; a client that leaves frees its row while the others finish; the block-size settings reach
the decoder (read back from /metrics and the responses)."""

import asyncio

import httpx
import pytest
from helpers import generate_one, make_text_models
from server_harness import metric, running_server, scrape

from dflash_trt.decoding import AdaptiveBlocks, GenerationConfig, SamplingParams
from dflash_trt.loading import load_decoder

WORDS = [
    "def fibonacci(n):",
    "for i in range(10):",
    "class Point:",
    "import os",
    "print(",
    "x = 1\n",
    "while True:",
    "return a + b",
    "if x > 0:",
    "# comment",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_text_models(tmp_path_factory.mktemp("batching"))


@pytest.fixture(scope="module")
def decoder(models):
    return load_decoder(*models)


def cases(count):
    """(prompt, max_tokens): different prompts and lengths, so rows join and leave at different steps."""
    return [(WORDS[i % len(WORDS)] + " " * (i // len(WORDS)), 5 + (i * 7) % 29) for i in range(count)]


def post_all(url, bodies):
    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[client.post(url + "/generate", json=b) for b in bodies])

    return asyncio.run(main())


def test_32_concurrent_greedy_requests_equal_each_alone(decoder):
    todo = cases(32)
    bodies = [{"prompt": p, "max_tokens": n} for p, n in todo]
    with running_server(decoder, max_active=32) as (url, _):
        together = post_all(url, bodies)
        m = scrape(url)
        alone = [httpx.post(url + "/generate", json=b, timeout=120) for b in bodies]
    rows, passes = (
        metric(m, "dflash_batch_rows_sum", **{"pass": "verify"}),
        metric(m, "dflash_batch_rows_count", **{"pass": "verify"}),
    )
    assert passes and rows / passes > 2, "the requests did not share verify passes"
    assert metric(m, "dflash_batch_tokens_sum", **{"pass": "verify"}) >= rows  # >= 1 token per verify row
    # every prompt token entered exactly once: in a prefill pass of its own (no row running yet) or as a chunk in a
    # verify pass (chunked prefill, the default: a step's token budget may split a prompt over two steps)
    kinds = ("prefill", "chunk")
    prompts_in = sum(metric(m, "dflash_batch_rows_sum", **{"pass": kind}) for kind in kinds)
    tokens_in = sum(metric(m, "dflash_batch_tokens_sum", **{"pass": kind}) for kind in kinds)
    assert prompts_in >= len(todo)
    assert tokens_in == sum(len(decoder.encode(p)) for p, _ in todo)
    for part in ("prefill", "policy", "draft", "verify", "accept", "overhead"):  # one sample per step and part
        assert metric(m, "dflash_step_seconds_count", part=part) == metric(
            m, "dflash_step_seconds_count", part="verify"
        )
    assert metric(m, "dflash_step_seconds_sum", part="verify") > 0
    for (prompt, n), got, ref in zip(todo, together, alone):
        assert got.status_code == ref.status_code == 200, got.text
        want = generate_one(
            decoder,
            decoder.encode(prompt),
            GenerationConfig(max_new_tokens=n, stop_token_ids=decoder.default_stop_ids()),
        )
        assert got.json()["token_ids"] == ref.json()["token_ids"] == want.token_ids, prompt
        assert got.json()["text"] == want.text


def test_seeded_sampling_with_a_fixed_block_size_is_the_same_under_load(decoder):
    body = {"prompt": "def fibonacci(n):", "max_tokens": 30, "temperature": 1.0, "seed": 3, "block_size": 3}
    load = [
        {"prompt": p, "max_tokens": n, **({"temperature": 0.9, "seed": i} if i % 2 else {})}
        for i, (p, n) in enumerate(cases(11))
    ]
    with running_server(decoder, max_active=16) as (url, _):
        alone = httpx.post(url + "/generate", json=body, timeout=120).json()
        loaded = post_all(url, load[:5] + [body] + load[5:])[5].json()
    want = generate_one(
        decoder,
        decoder.encode(body["prompt"]),
        GenerationConfig(
            max_new_tokens=30,
            block_size=3,
            sampling=SamplingParams(1.0, seed=3),
            stop_token_ids=decoder.default_stop_ids(),
        ),
    )
    assert alone["token_ids"] == loaded["token_ids"] == want.token_ids
    assert alone["text"] == loaded["text"]
    assert alone["spec"]["drafted_tokens"] > 0 and alone["spec"]["block_size"] == 3


def test_a_client_leaving_frees_its_row_while_the_others_finish(decoder):
    long = {"input_ids": [3, 4, 5], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    todo = cases(6)
    with running_server(decoder, max_active=8) as (url, _):
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", url + "/generate", json=long) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")  # the long row is in the batch

                async def others():
                    async with httpx.AsyncClient(timeout=300) as c:
                        tasks = [
                            asyncio.create_task(c.post(url + "/generate", json={"prompt": p, "max_tokens": n}))
                            for p, n in todo
                        ]
                        while metric((await c.get(url + "/metrics")).text, "dflash_inflight_requests") < 2:
                            await asyncio.sleep(0.01)  # the others joined the long row's batch
                        stream.close()  # ... and its client goes away
                        return await asyncio.gather(*tasks)

                responses = asyncio.run(others())
        m = scrape(url)
    for (prompt, n), r in zip(todo, responses):
        assert r.status_code == 200, r.text
        want = generate_one(
            decoder,
            decoder.encode(prompt),
            GenerationConfig(max_new_tokens=n, stop_token_ids=decoder.default_stop_ids()),
        )
        assert r.json()["token_ids"] == want.token_ids
    assert metric(m, "dflash_request_latency_seconds_count", outcome="cancelled") == 1
    assert metric(m, "dflash_request_latency_seconds_count", outcome="ok") == len(todo)
    assert metric(m, "dflash_generated_tokens_total") < long["max_tokens"]
    assert metric(m, "dflash_inflight_requests") == 0


def block_counts(m):
    """(samples, samples of size <= b for b = 1..16) from the dflash_block_size histogram."""
    return metric(m, "dflash_block_size_count"), {
        b: metric(m, "dflash_block_size_bucket", le=f"{b}.0") for b in range(1, 17)
    }


def test_block_size_settings_reach_the_decoder(decoder):
    trained = decoder.drafter.block_size
    bodies = [{"prompt": p, "max_tokens": 24} for p in WORDS[:3]]
    with running_server(decoder, block_size=1) as (url, _):
        fixed = post_all(url, bodies)
        total, le = block_counts(scrape(url))
        assert total > 0 and le[1] == total  # every verify row at size 1: the target alone
        assert all(r.json()["spec"]["drafted_tokens"] == 0 for r in fixed)
        own = httpx.post(url + "/generate", json={**bodies[0], "block_size": 3}, timeout=60).json()
        assert own["spec"]["drafted_tokens"] > 0 and own["spec"]["block_size"] == 3  # the request's size wins
        assert own["token_ids"] == fixed[0].json()["token_ids"]
    with running_server(decoder, adaptive=False, proposer="dflash") as (url, _):  # suffix runs may run longer
        trained_runs = post_all(url, bodies)
        total, le = block_counts(scrape(url))
        assert le[trained] == total and total - le[trained - 1] >= len(bodies)  # the trained size (the last
        assert all(r.json()["spec"]["block_size"] == trained for r in trained_runs)  # rounds may be shorter)
    with running_server(decoder) as (url, app):  # the default: adaptive, with a cost model measured at start-up
        adaptive = post_all(url, bodies)
        m = scrape(url)
        total, _ = block_counts(m)
        assert (
            isinstance(app.state.server.decoder.policy, AdaptiveBlocks)
            and app.state.server.decoder.policy.cost.target(4, 8) > 0
        )
        assert total > 0
        # the running correction of the start-up costs is exported, and it has moved (real passes were timed)
        scale = app.state.server.decoder.policy.cost.corrections()
        assert {e: metric(m, "dflash_cost_correction", engine=e) for e in scale} == pytest.approx(scale)
        assert scale["target"] != 1.0
    for a, b, c in zip(fixed, trained_runs, adaptive):  # lossless whatever the sizes
        assert a.json()["token_ids"] == b.json()["token_ids"] == c.json()["token_ids"]
