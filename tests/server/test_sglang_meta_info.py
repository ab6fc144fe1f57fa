"""SGLang's `meta_info` (`return_meta_info: true`) read by z-lab's own benchmark client: `dflash.benchmark
--backend openai` (the reference package, dflash 0.1.0) runs unchanged against a real server on a real loopback
port over the demo models (a trained drafter, so rounds accept drafts). Only its data set loader is replaced
(no network here); the demo target is a completion model, so it gets a plain chat template that joins the
messages (and writes one line more when the template variable `enable_thinking` is set)."""

import argparse
import re
import statistics

import httpx
import pytest
from server_harness import running_server, sse_events

from dflash_trt.loading import load_decoder
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

benchmark = pytest.importorskip("dflash.benchmark")

TEMPLATE = (
    "{% if enable_thinking == 'bad' %}{{ raise_exception('enable_thinking is a boolean') }}{% endif %}"
    "{% if enable_thinking %}# think first\n{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)
PROMPTS = [
    'def mean(values):\n    """Return the arithmetic mean of a list of numbers."""\n',
    'def read_lines(path):\n    """Return the lines of the file at path, without their line endings."""\n',
    'def is_even(n):\n    """Return True when n is even."""\n',
]


@pytest.fixture(scope="module")
def server():
    decoder = load_decoder(DEMO_TARGET, DEMO_DRAFTER)
    decoder.tokenizer.chat_template = TEMPLATE
    # the drafter's trained block for every request: the formulas need drafts, whatever an adaptive policy has
    # learnt from the earlier requests (it may stop drafting for a row)
    with running_server(decoder, adaptive=False) as (url, _):
        yield url


def chat(server, **extra):
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24, "temperature": 0, **extra}
    return httpx.post(server + "/v1/chat/completions", json=body, timeout=60)


def test_zlab_benchmark_client_reads_acceptance(server, monkeypatch, capsys):
    monkeypatch.setattr(benchmark, "load_and_process_dataset", lambda name: [{"turns": [p]} for p in PROMPTS])
    seen = []
    send = benchmark.send_openai

    def recording(*args, **kwargs):  # the client's own request and parsing; only the answers are kept
        seen.append(send(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(benchmark, "send_openai", recording)
    args = argparse.Namespace(
        backend="openai",
        dataset="humaneval",
        base_url=server,
        model=httpx.get(server + "/v1/models", timeout=10).json()["data"][0]["id"],
        num_prompts=4,
        concurrency=2,
        max_new_tokens=32,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        timeout_s=120,
        reasoning=None,
    )
    benchmark.run(args)
    out = capsys.readouterr().out
    measured = seen[args.concurrency :]  # the warm-up requests come first
    assert len(measured) == args.num_prompts
    lengths = [r["meta_info"]["spec_accept_length"] for r in measured]
    printed = re.search(r"Accept length:\s+([\d.]+)", out)
    assert printed is not None, out
    assert float(printed.group(1)) == pytest.approx(statistics.mean(lengths), abs=5e-4)
    assert statistics.mean(lengths) > 1.0  # the trained drafter's drafts are accepted
    verify = re.search(r"Spec verify ct:\s+(\d+)", out)
    assert verify is not None and int(verify.group(1)) == sum(r["spec"]["rounds"] for r in measured)


def test_meta_info_follows_sglangs_formulas(server):
    got = chat(server, return_meta_info=True).json()
    meta, spec, usage = got["meta_info"], got["spec"], got["usage"]
    assert got["choices"][0]["meta_info"] == meta  # SGLang's place, and the top level z-lab reads
    assert meta["id"] == got["id"] and meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert meta["prompt_tokens"] == usage["prompt_tokens"] and meta["completion_tokens"] == usage["completion_tokens"]
    assert meta["spec_verify_ct"] == spec["rounds"] > 0
    assert meta["spec_accept_length"] == pytest.approx(usage["completion_tokens"] / spec["rounds"])
    assert meta["spec_accept_token_num"] == spec["accepted_draft_tokens"] > 0
    assert meta["spec_draft_token_num"] == spec["drafted_tokens"]
    assert meta["spec_accept_rate"] == pytest.approx(spec["accepted_draft_tokens"] / spec["drafted_tokens"])
    plain = chat(server).json()
    assert "meta_info" not in plain and "meta_info" not in plain["choices"][0]
    assert plain["choices"][0]["message"] == got["choices"][0]["message"]  # greedy: asking changes no token


def test_completions_and_streams_carry_it_in_the_finishing_chunk(server):
    # DFlash named: under the hybrid the second request would draft from the first one's output (fewer rounds)
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "return_meta_info": True, "proposer": "dflash"}
    whole = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    assert whole["meta_info"]["completion_tokens"] == 12 and whole["choices"][0]["meta_info"] == whole["meta_info"]
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    carrying = [c for c in chunks if "meta_info" in c]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] == "length"
    assert carrying[0]["meta_info"]["spec_verify_ct"] == whole["meta_info"]["spec_verify_ct"]


def test_chat_template_kwargs_reach_the_template(server):
    plain = chat(server, return_meta_info=True).json()["meta_info"]["prompt_tokens"]
    thinking = chat(server, return_meta_info=True, chat_template_kwargs={"enable_thinking": True}).json()
    assert thinking["meta_info"]["prompt_tokens"] > plain
    bad = chat(server, chat_template_kwargs={"tokenize": True})
    assert bad.status_code == 400 and "tokenize" in bad.json()["error"]["message"]
    raised = chat(server, chat_template_kwargs={"enable_thinking": "bad"})  # the template's own error: the request's
    assert raised.status_code == 400 and raised.json()["error"]["param"] == "chat_template_kwargs"
    assert "is a boolean" in raised.json()["error"]["message"]


def test_openapi_documents_it(server):
    doc = httpx.get(server + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    assert {"spec_accept_length", "spec_verify_ct"} <= set(schemas["MetaInfo"]["properties"])
    for model in ("ChatCompletion", "Completion", "ChatChoice", "CompletionChoice"):
        assert "meta_info" in schemas[model]["properties"], model
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        assert "return_meta_info" in schemas[request]["properties"], request
    assert "chat_template_kwargs" in schemas["ChatCompletionRequest"]["properties"]
