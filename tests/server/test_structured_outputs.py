"""Structured outputs, tool calls and logprobs decoded through the server (issue 64), on the tiny text pair served by
a real server on a real port: the grammar each way of asking names is honoured in the output (greedy and
speculative), and the answers have OpenAI's shapes (logprobs objects, tool_calls, streaming deltas)."""

import json

import httpx
import jsonschema_rs
import pytest
from server_harness import server_fixtures, sse_events
from test_structured_api import CHAT, SCHEMA, WEATHER, ok, post  # the requests both files send

models, decoder, server = server_fixtures("structured-api", priced=True)  # same request, same passes: equal logprobs
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def refused(url, path, body, param, code=None):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    return err


# ---- the grammar is honoured ----------------------------------------------------------------------------------
def completion_text(url, body):
    return ok(url, "/v1/completions", {"prompt": "x = ", "max_tokens": 60, "temperature": 0, **body})["choices"][0]


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
        {"structured_outputs": {"json": SCHEMA}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
    ],
    ids=["guided_json", "guided_json-text", "structured_outputs", "response_format"],
)
def test_completions_follow_a_json_schema(server, fields):
    choice = completion_text(server, fields)
    assert choice["finish_reason"] == "stop", choice
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(choice["text"])), choice["text"]


def test_regex_choice_and_grammar(server):
    import re

    text = completion_text(server, {"guided_regex": r"[a-c]{2,4}-[0-9]"})["text"]
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]", text), text
    for fields in ({"guided_choice": ["yes", "no", "maybe"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        assert completion_text(server, fields)["text"] in fields.get("guided_choice", ["yes", "no"])
    text = completion_text(server, {"guided_grammar": 'root ::= "ab" [0-9]+'})["text"]
    assert re.fullmatch(r"ab[0-9]+", text), text
    # any JSON object: the tiny model may wander in a key past max_tokens (SmolLM2's run checks whole objects)
    choice = completion_text(server, {"response_format": {"type": "json_object"}})
    assert choice["text"].startswith("{")
    assert choice["finish_reason"] == "length" or isinstance(json.loads(choice["text"]), dict), choice


def test_generate_takes_the_structured_fields_and_streams(server):
    body = {"prompt": "x = ", "max_tokens": 60, "structured_outputs": {"json": SCHEMA}, "stream": True}
    with httpx.stream("POST", server + "/generate", json=body, timeout=120) as r:
        events = sse_events(r.iter_lines())
    final = events[-1]
    assert final["type"] == "final" and jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(final["text"]))
    assert "".join(e["text"] or "" for e in events if e["type"] == "round") == final["text"]


def test_chat_response_format_json_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    got = ok(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 60, "response_format": fmt})
    content = got["choices"][0]["message"]["content"]
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(content)), content


def test_completion_logprobs_have_openais_shape(server):
    got = ok(server, "/v1/completions", {"prompt": "x = ", "max_tokens": 8, "temperature": 0, "logprobs": 3})
    choice = got["choices"][0]
    lp = choice["logprobs"]
    n = got["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and all(a <= b for a, b in zip(lp["text_offset"], lp["text_offset"][1:]))
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and 1 <= len(top) <= 4 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy: the chosen token is the likeliest


def test_chat_logprobs_stream_and_not(server):
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    got = ok(server, "/v1/chat/completions", body)
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) == got["usage"]["completion_tokens"]
    for entry in content:
        assert bytes(entry["bytes"]).decode() == entry["token"] and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        chunks = [c for c in sse_events(r.iter_lines()) if c != "[DONE]"]
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content


def test_generate_logprobs(server):
    got = ok(server, "/generate", {"prompt": "x = ", "max_tokens": 6, "logprobs": 1})
    assert [e["token_id"] for e in got["logprobs"]] == got["token_ids"]
    assert all(e["top"][0]["token_id"] == e["token_id"] for e in got["logprobs"])  # greedy


def test_a_named_function_is_called_with_arguments_matching_its_schema(server):
    body = {
        "messages": CHAT,
        "max_tokens": 60,
        "temperature": 0,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    choice = ok(server, "/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["function"]["arguments"])
    assert jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).is_valid(args), args
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        chunks = [c for c in sse_events(r.iter_lines()) if c != "[DONE]"]
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    first = next(d for d in deltas if d.get("tool_calls"))
    assert first["tool_calls"][0]["function"]["name"] == "get_weather" and first["tool_calls"][0]["index"] == 0
    streamed = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d.get("tool_calls"))
    assert streamed == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("parallel", [False])
def test_required_calls_one_or_more_listed_functions(server, parallel):
    # bounded arguments and at most one call: the whole array fits max_tokens
    body = {"messages": CHAT, "max_tokens": 200, "temperature": 0, "tools": [WEATHER, TIME], "tool_choice": "required"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    choice = ok(server, "/v1/chat/completions", body)["choices"][0]
    calls = choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["finish_reason"] == "tool_calls" and calls and (parallel is None or len(calls) == 1)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        assert jsonschema_rs.validator_for(params[call["function"]["name"]]).is_valid(
            json.loads(call["function"]["arguments"])
        )
