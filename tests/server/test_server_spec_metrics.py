"""vLLM-named speculative-decoding metrics on /metrics and vLLM's per-request stats in the OpenAI responses,
on a real server (uvicorn on a free loopback port) over the demo models (a trained drafter: drafts are accepted,
so the per-position counters move)."""

import httpx
import pytest
from server_harness import metric, running_server, scrape, sse_events

from dflash_trt.loading import load_decoder
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET


@pytest.fixture(scope="module")
def decoder():
    return load_decoder(DEMO_TARGET, DEMO_DRAFTER)


@pytest.fixture(scope="module")
def server(decoder):
    with running_server(decoder) as (url, _):
        yield url


VLLM = {"model_name": "dflash-trt", "engine": "0"}


def per_position(text: str) -> dict[int, float]:
    """vllm:spec_decode_num_accepted_tokens_per_pos_total by position."""
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{"):
            key, _, value = line.rpartition(" ")
            labels = dict(p.split("=", 1) for p in key[key.index("{") + 1 : -1].split(","))
            assert labels["model_name"] == '"dflash-trt"' and labels["engine"] == '"0"'
            out[int(labels["position"].strip('"'))] = float(value)
    return out


def test_vllm_counters_agree_with_ours_after_one_request(server, decoder):
    before = scrape(server)
    n, block = 24, 4
    body = {"prompt": "def fibonacci(n):", "max_tokens": n, "temperature": 0, "block_size": block}
    got = httpx.post(server + "/v1/completions", json={**body, "spec_decode_metrics": "detailed"}, timeout=60).json()
    after = scrape(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    sd = got["metrics"]["speculative_decoding"]
    drafts, draft_tokens, accepted = (
        delta("dflash_draft_rounds_total"),
        delta("dflash_draft_tokens_total"),
        delta("dflash_accepted_draft_tokens_total"),
    )
    # a fixed block of 4 drafts 3 tokens in every verify round but the last ones, which the tokens left clip
    rounds = delta("dflash_acceptance_length_count")
    assert rounds == got["spec"]["rounds"] and rounds - 3 <= drafts == sd["num_spec_steps"] > 0
    assert (block - 1) * (drafts - 2) <= draft_tokens <= (block - 1) * drafts and draft_tokens == sd["num_draft_tokens"]
    assert accepted == sd["num_accepted_draft_tokens"]
    # every committed token but the prefill's is an accepted draft token or a round's bonus token (no stop here)
    assert got["choices"][0]["finish_reason"] == "length"
    assert accepted + rounds == delta("dflash_acceptance_length_sum") == n - 1
    assert delta("vllm:spec_decode_num_drafts_total", **VLLM) == drafts
    assert delta("vllm:spec_decode_num_draft_tokens_total", **VLLM) == draft_tokens
    assert delta("vllm:spec_decode_num_accepted_tokens_total", **VLLM) == accepted
    pos_before, pos_after = per_position(before), per_position(after)
    trained = decoder.drafter.block_size
    assert sorted(pos_after) == list(range(trained - 1))  # every position exported from the start
    pos_delta = [pos_after[p] - pos_before.get(p, 0.0) for p in sorted(pos_after)]
    assert sum(pos_delta) == accepted
    assert pos_delta[0] > 0  # the demo drafter's first guesses are often right
    assert all(a >= b for a, b in zip(pos_delta, pos_delta[1:]))  # position p is reached only through p - 1
    # the per-request stats, vLLM's shape, agree with the per-step lists and with the counters
    assert sd["per_step_accepted"] and len(sd["per_step_accepted"]) == len(sd["per_step_drafted"]) == drafts
    assert sum(sd["per_step_accepted"]) == accepted and sum(sd["per_step_drafted"]) == draft_tokens
    assert sd["per_step_drafted"][0] == block - 1 and max(sd["per_step_drafted"]) == block - 1
    assert sd["num_spec_tokens"] == trained - 1 and len(sd["acceptance_histogram"]) == trained
    assert sum(sd["acceptance_histogram"]) == drafts
    assert sum(j * c for j, c in enumerate(sd["acceptance_histogram"])) == accepted
    assert abs(sd["mean_acceptance_length"] - (1 + accepted / drafts)) < 1e-9
    assert abs(sd["draft_acceptance_rate"] - accepted / draft_tokens) < 1e-9
    assert metric(after, "vllm:num_requests_running", **VLLM) == 0
    assert metric(after, "vllm:num_requests_waiting", **VLLM) == 0


def test_per_request_stats_only_when_asked(server):
    # completions: the demo target is a completion model (chat is refused without a chat template)
    body = {"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "block_size": 2}
    plain = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    assert "metrics" not in plain
    summary = httpx.post(server + "/v1/completions", json={**body, "spec_decode_metrics": "summary"}, timeout=60)
    sd = summary.json()["metrics"]["speculative_decoding"]
    assert "per_step_accepted" not in sd and 0 < sd["num_spec_steps"] <= summary.json()["spec"]["rounds"]
    bad = httpx.post(server + "/v1/completions", json={**body, "spec_decode_metrics": "all"}, timeout=60)
    assert bad.status_code == 400
    target_alone = httpx.post(
        server + "/v1/completions", json={**body, "block_size": 1, "spec_decode_metrics": "summary"}, timeout=60
    ).json()["metrics"]["speculative_decoding"]
    assert target_alone["num_spec_steps"] == 0 and target_alone["draft_acceptance_rate"] is None
    assert target_alone["mean_acceptance_length"] == 1.0


def test_stream_carries_stats_in_the_finishing_chunk(server):
    body = {"prompt": "import os", "max_tokens": 8, "temperature": 0, "block_size": 3, "stream": True}
    with httpx.stream(
        "POST", server + "/v1/completions", json={**body, "spec_decode_metrics": "summary"}, timeout=60
    ) as r:
        events = sse_events(r.iter_lines())
    chunks = [e for e in events if e != "[DONE]"]
    with_metrics = [c for c in chunks if "metrics" in c]
    assert len(with_metrics) == 1 and with_metrics[0]["choices"][0]["finish_reason"] == "length"
    assert with_metrics[0]["metrics"]["speculative_decoding"]["num_spec_steps"] >= 1
