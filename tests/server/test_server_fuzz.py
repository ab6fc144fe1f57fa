"""Schema-driven fuzzing: hundreds of malformed (and some valid) requests, never a 5xx, never a hang.

Requests are built from each endpoint's schema: a valid request, then up to three fields (or
unknown keys) replaced by arbitrary JSON (wrong types, out-of-range numbers, NaN, nesting), or a
field dropped; plus JSON that is not an object and raw bodies that are not JSON at all. Hypothesis runs derandomized so CI sees the same cases.
"""

import json

import httpx
import pytest
from helpers import generate_one, make_text_models
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_harness import running_server

from dflash_trt.decoding import GenerationConfig
from dflash_trt.loading import load_decoder

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


TEXT = st.text(max_size=30)
IDS = st.lists(st.integers(0, 150), min_size=1, max_size=6)
SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 300),
    "seed": st.integers(0, 2**53 - 1),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stream": st.booleans(),
}
MAX_TOKENS = st.integers(1, 6)  # valid requests must stay cheap
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
    min_size=1,
    max_size=3,
)

# endpoint -> (fields always sent, fields sometimes sent); every strategy here draws VALID values
SCHEMAS = {
    "/generate": ({"max_tokens": MAX_TOKENS}, {"block_size": st.integers(1, 4), **SAMPLING}),
    "/v1/completions": (
        {"max_tokens": MAX_TOKENS, "prompt": TEXT | IDS},
        {"n": st.just(1), "model": TEXT, "echo": st.just(False), **SAMPLING},
    ),
    "/v1/chat/completions": ({"messages": MESSAGES}, {"max_tokens": MAX_TOKENS, "n": st.just(1), **SAMPLING}),
}
FIELDS = {path: sorted({*req, *opt, "prompt", "input_ids", "junk"}) for path, (req, opt) in SCHEMAS.items()}


@st.composite
def json_body(draw, path):
    """A valid request for `path`, then 0-3 of its fields (or unknown ones) replaced by arbitrary JSON."""
    required, optional = SCHEMAS[path]
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if path == "/generate":
        body.update(draw(st.sampled_from([{"prompt": TEXT}, {"input_ids": IDS}]).flatmap(st.fixed_dictionaries)))
    for name in draw(st.lists(st.sampled_from(FIELDS[path]), max_size=3, unique=True)):
        body[name] = draw(anything)
    if draw(st.booleans()) and draw(st.booleans()) and body:  # sometimes drop a field
        body.pop(draw(st.sampled_from(sorted(body))))
    return json.dumps(body).encode()


requests = st.sampled_from(sorted(SCHEMAS)).flatmap(
    lambda path: st.tuples(
        st.just(path), json_body(path) | anything.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)
    )
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    decoder = load_decoder(*make_text_models(tmp_path_factory.mktemp("fuzz")))
    with running_server(decoder, default_max_tokens=4, max_body_bytes=4096) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:  # a hang fails the test through the timeout
            yield client, decoder


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests)
def test_fuzzed_requests_never_5xx(fuzz_server, request):
    client, _ = fuzz_server
    path, body = request
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    event(f"{path} -> {r.status_code}")  # --hypothesis-show-statistics shows the mix of outcomes
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    else:
        assert r.status_code == 200 and r.content


def test_server_still_healthy_and_correct_after_fuzzing(fuzz_server):
    client, decoder = fuzz_server
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    got = client.post("/generate", json={"prompt": "import os", "max_tokens": 8}).json()
    cfg = GenerationConfig(max_new_tokens=8, block_size=1, stop_token_ids=decoder.default_stop_ids())
    assert got["token_ids"] == generate_one(decoder, decoder.encode("import os"), cfg).token_ids
    metrics = client.get("/metrics").text
    assert 'status="500"' not in metrics and "dflash_inflight_requests 0.0" in metrics
