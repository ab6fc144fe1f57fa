"""The OpenAI-compatible contract (issue 13): nulls, strict types, the model id, fields that change the
output (implemented losslessly or refused by name), and an /openapi.json that says what the server does.
A real server on a real port, driven by httpx and the official `openai` client.
"""

import httpx
import openai
import pytest
from helpers import generate_one
from server_harness import server_fixtures

from dflash_trt.decoding import GenerationConfig, LogitsAdjustment, SamplingParams
from dflash_trt.loading import load_decoder
from dflash_trt.server.routes.openai import chat_prompt_ids

MODEL = "dflash-trt"
CHAT = [{"role": "user", "content": "def f(x):"}]


models, decoder, server = server_fixtures("openai-contract")


@pytest.fixture(scope="module")
def target_alone(models):
    base = load_decoder(models[0], None)

    def run(ids, n, adjust=None, stops=None):
        return generate_one(
            base,
            ids,
            GenerationConfig(
                max_new_tokens=n, adjust=adjust, stop_token_ids=(base.default_stop_ids() if stops is None else stops)
            ),
        ).token_ids

    return run


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def test_explicit_nulls_are_the_defaults(server):
    nulls = {
        k: None
        for k in (
            "temperature",
            "top_p",
            "stream",
            "n",
            "seed",
            "stop",
            "user",
            "stream_options",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "logprobs",
        )
    }
    for path, body in [
        ("/v1/completions", {"prompt": "def f(x):", "echo": None, "best_of": None}),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "max_completion_tokens": None,
                "tools": None,
                "tool_choice": None,
                "response_format": None,
            },
        ),
    ]:
        r = post(server, path, {**body, **nulls, "max_tokens": 4, "seed": 5})
        assert r.status_code == 200, (path, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", "10"),
        ("max_tokens", True),
        ("max_tokens", 4.5),
        ("stream", "yes"),
        ("stream", 1),
        ("temperature", True),
        ("temperature", "0.5"),
        ("seed", "3"),
        ("n", "1"),
        ("n", True),
        ("top_p", False),
        ("prompt", [False]),
        ("prompt", [1.5, 2.0]),
        ("prompt", 5),
        ("logprobs", "1"),
        ("logprobs", True),
        ("logprobs", 1.5),
    ],
)
def test_completions_take_types_strictly(server, field, value):
    r = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", "10"), ("stream", "yes"), ("temperature", True), ("messages", [{"role": "user", "content": 5}])],
)
def test_chat_takes_types_strictly(server, field, value):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field, r.text


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.body if isinstance(exc.body, dict) else {}
    return body.get("error", body)


def test_model_is_checked_and_retrievable(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert error_of(e.value)["code"] == "model_not_found"
    for create in (
        lambda m: client.completions.create(model=m, prompt="x", max_tokens=2),
        lambda m: client.chat.completions.create(model=m, messages=CHAT, max_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            create("gpt-4o")
        assert e.value.status_code == 404 and error_of(e.value)["code"] == "model_not_found"
        assert error_of(e.value)["param"] == "model"
        create(MODEL)  # the served one works


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "function_call", {"name": "f"}),
        ("/v1/chat/completions", "n", 2),
        ("/v1/completions", "echo", True),
        ("/v1/completions", "suffix", "x"),
        ("/v1/completions", "best_of", 2),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(server, path, field, value):
    base = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "x"}
    r = post(server, path, {**base, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and err["message"].startswith(field), err


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 5.0),
        ("presence_penalty", -2.5),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"999999": 1}),
        ("min_tokens", -1),
        ("block_size", 0),
        ("block_size", 99),
        ("block_size", 2.5),
    ],
)
def test_output_fields_out_of_range(server, field, value):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_block_size_is_honoured_on_the_openai_endpoints(server, decoder, path):
    """`block_size` (our extension, like vLLM's extra sampling fields): a seeded sampled request at a fixed
    size returns what the decoder returns at that size; block 1 is the target alone; the size is read back
    from /metrics."""
    chat = path.endswith("chat/completions")
    base = {"messages": CHAT} if chat else {"prompt": "def f(x):"}
    ids = chat_prompt_ids(decoder, CHAT) if chat else decoder.encode("def f(x):")
    block = decoder.drafter.block_size - 1
    sampled = {**base, "max_tokens": 12, "temperature": 1.0, "seed": 5, "block_size": block}
    r = post(server, path, sampled)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message" if chat else "text"]
    text = text["content"] if chat else text
    want = generate_one(
        decoder,
        ids,
        GenerationConfig(
            max_new_tokens=12,
            block_size=block,
            sampling=SamplingParams(1.0, seed=5),
            stop_token_ids=decoder.default_stop_ids(),
        ),
    )
    assert text == want.text
    before = _block_histogram(server)
    assert post(server, path, {**base, "max_tokens": 6, "temperature": 0, "block_size": 1}).status_code == 200
    after = _block_histogram(server)
    assert after["count"] - before["count"] >= 5 and after["sum"] - before["sum"] == after["count"] - before["count"]


def _block_histogram(url):
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return {
        k: float(next(ln.split()[-1] for ln in lines if ln.startswith(f"dflash_block_size_{k} ")))
        for k in ("count", "sum")
    }


def test_penalties_and_bias_act_and_stay_the_targets_own(server, decoder, target_alone):
    """Greedy with penalties and logit_bias over HTTP (speculative) equals the target alone with the same
    adjustment; the adjustment changes the output, so a server that ignored it would fail here."""
    ids = decoder.encode("def fibonacci(n):")
    fields = {"frequency_penalty": 1.2, "presence_penalty": 0.8, "logit_bias": {"40": 3.0, "41": -100}}
    adjust = LogitsAdjustment.of(1.2, 0.8, {40: 3.0, 41: -100.0})
    want = target_alone(ids, 24, adjust)
    assert want != target_alone(ids, 24)
    for path, body in [
        ("/generate", {"input_ids": ids}),
        ("/v1/completions", {"prompt": ids}),
        ("/v1/chat/completions", None),
    ]:
        if body is None:
            chat_ids = chat_prompt_ids(decoder, CHAT)
            got = post(server, path, {"messages": CHAT, "max_tokens": 24, "temperature": 0, **fields}).json()
            assert got["choices"][0]["message"]["content"] == decoder.tokenizer.decode(
                target_alone(chat_ids, 24, adjust), skip_special_tokens=True
            )
            continue
        got = post(server, path, {**body, "max_tokens": 24, "temperature": 0, **fields}).json()
        text = got["text"] if path == "/generate" else got["choices"][0]["text"]
        assert text == decoder.tokenizer.decode(want, skip_special_tokens=True), path
        if path == "/generate":
            assert got["token_ids"] == want


def test_logit_bias_of_100_forces_the_token(server):
    got = post(server, "/generate", {"prompt": "x = ", "max_tokens": 8, "logit_bias": {"42": 100}}).json()
    assert got["token_ids"] == [42] * 8


def test_ignore_eos_and_min_tokens(server, decoder, target_alone):
    eos = decoder.tokenizer.eos_token_id
    ids = decoder.encode("import os")
    # Make end-of-text the likeliest token: without ignore_eos the answer ends at once.
    bias = {"logit_bias": {str(eos): 100}, "temperature": 0}
    short = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 6, **bias}).json()
    assert short["usage"]["completion_tokens"] == 0 or short["choices"][0]["finish_reason"] == "stop"
    full = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 6, "ignore_eos": True, **bias}).json()
    assert full["usage"]["completion_tokens"] == 6 and full["choices"][0]["finish_reason"] == "length"
    # min_tokens: end-of-text is held back for 5 tokens, then (biased) it ends the answer
    got = post(server, "/generate", {"input_ids": ids, "max_tokens": 12, "min_tokens": 5, **bias}).json()
    adjust = LogitsAdjustment.of(logit_bias={eos: 100.0}, min_tokens=5, min_tokens_suppress=(eos,))
    assert got["token_ids"] == target_alone(ids, 12, adjust)
    assert got["finish_reason"] == "stop" and len(got["token_ids"]) == 6 and got["token_ids"][-1] == eos
    assert eos not in got["token_ids"][:5]


def test_default_temperature_is_openais_1(server, decoder):
    """Without a temperature the OpenAI endpoints sample (as OpenAI does); a seed makes it reproducible."""
    # a fixed block size: with the server's adaptive sizes a seed fixes the distribution, not the text
    body = {"prompt": "def f(x):", "max_tokens": 24, "ignore_eos": True, "block_size": decoder.drafter.block_size}
    sampled = {post(server, "/v1/completions", {**body, "seed": s}).json()["choices"][0]["text"] for s in range(4)}
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    assert len(sampled) > 1 or sampled != {greedy}
    same = post(server, "/v1/completions", {**body, "seed": 0, "temperature": 1.0}).json()["choices"][0]["text"]
    assert same == post(server, "/v1/completions", {**body, "seed": 0}).json()["choices"][0]["text"]


def test_openapi_tells_the_truth(server, decoder):
    doc = httpx.get(server + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "422" not in codes, (path, method)
            if method == "post":
                assert {"200", "400", "401", "413", "429", "500", "503", "504"} <= codes, (path, codes)
                assert "text/event-stream" in op["responses"]["200"]["content"]
                assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "404" in doc["paths"]["/v1/models/{model}"]["get"]["responses"]

    def bound(schema, field, key):
        prop = schemas[schema]["properties"][field]
        return next(s[key] for s in prop.get("anyOf", [prop]) if key in s)

    ctx = decoder.target.max_context
    assert bound("GenerateRequest", "block_size", "maximum") == decoder.drafter.block_size
    for schema in ("GenerateRequest", "CompletionRequest", "ChatCompletionRequest"):
        assert bound(schema, "max_tokens", "maximum") == ctx - 1
    assert bound("GenerateRequest", "prompt", "minLength") == 1
    # what the schema allows the server takes; one past it is a 400
    ok = post(server, "/generate", {"prompt": "x", "max_tokens": 1, "block_size": decoder.drafter.block_size})
    assert ok.status_code == 200
    assert post(server, "/generate", {"prompt": "x", "block_size": decoder.drafter.block_size + 1}).status_code == 400


def test_the_served_models_bounds_are_documented_and_enforced_alike(server, decoder):
    """The bounds of the loaded engines (limits.py) are read from /openapi.json here: one past each is
    pydantic's 400 naming the field, and what the document allows is served."""
    schemas = httpx.get(server + "/openapi.json").json()["components"]["schemas"]

    def member(schema, field, type_, items=None):
        prop = schemas[schema]["properties"][field]
        return next(
            s for s in prop.get("anyOf", [prop]) if s.get("type") == type_ and s.get("items", {}).get("type") == items
        )

    ctx, vocab = decoder.target.max_context, decoder.target.vocab_size
    for path, schema, field, body in (
        ("/generate", "GenerateRequest", "min_tokens", {"prompt": "x", "max_tokens": 2}),
        ("/v1/completions", "CompletionRequest", "max_tokens", {"prompt": "x"}),
        ("/v1/chat/completions", "ChatCompletionRequest", "max_completion_tokens", {"messages": CHAT}),
    ):
        most = member(schema, field, "integer")["maximum"]
        r = post(server, path, {**body, field: most + 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (field, "less_than_equal") and str(most) in err["message"], err
    ids = member("CompletionRequest", "prompt", "array", items="integer")
    assert (ids["maxItems"], ids["items"]["maximum"]) == (ctx, vocab - 1)
    r = post(server, "/v1/completions", {"prompt": [5, vocab], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1", r.text
    r = post(server, "/generate", {"input_ids": [5] * (ctx + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_long", r.text
    r = post(server, "/generate", {"prompt": "x", "logit_bias": {str(vocab): 1}})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"], r.text
    ok = post(server, "/generate", {"prompt": "x", "max_tokens": 2, "min_tokens": 1, "logit_bias": {str(vocab - 1): 1}})
    assert ok.status_code == 200, ok.text


def test_openapi_declares_the_bearer_scheme_exactly_when_the_server_has_a_key(server, decoder):
    from dflash_trt.server.app import ServerSettings, create_app

    assert "securitySchemes" not in httpx.get(server + "/openapi.json").json().get("components", {})
    doc = create_app(decoder, ServerSettings(api_key="k", adaptive=False)).openapi()  # built, never started
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    secured = {path for path, ops in doc["paths"].items() for op in ops.values() if op.get("security")}
    assert secured == set(doc["paths"]) - {"/health", "/ready"}  # the probes send no credentials
