"""The structured-output, tool and logprobs fields at the HTTP edge (issue 64), on the tiny text pair served by a real
server on a real port: the fields each endpoint takes (and the unknown ones it refuses by name, as OpenAI does),
and the 400s that say why and leave the server serving. Their decoding: test_structured_outputs.py."""

import json

import httpx
import pytest
from server_harness import server_fixtures

from dflash_trt.decoding.grammar import MAX_GRAMMAR_CHARS
from dflash_trt.decoding.request import MAX_TOP_LOGPROBS
from dflash_trt.server.structured import SmolLM2Tools, tool_format

models, decoder, server = server_fixtures("structured-api")
CHAT = [{"role": "user", "content": "def f(x):"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=120)


def ok(url, path, body):
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(url, path, body, param, code=None):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    return err


# ---- unknown fields -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,field",
    [
        ("/v1/completions", "guided_whitespace_pattern"),
        ("/v1/completions", "no_such_field"),
        ("/v1/chat/completions", "structural_tag"),
        ("/v1/chat/completions", "repetition_penaltyy"),
        ("/generate", "response_format"),
    ],
)
def test_unknown_fields_are_refused_by_name(server, path, field):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "x"}
    err = refused(server, path, {**base, "max_tokens": 2, field: {"x": 1}}, field, "extra_forbidden")
    assert err["message"] == f"{field}: Unrecognized request argument supplied"


def test_the_structured_outputs_object_refuses_members_it_does_not_take(server):
    body = {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}
    refused(server, "/v1/completions", body, "structured_outputs.structural_tag", "extra_forbidden")
    err = refused(server, "/v1/completions", {"prompt": "x", "structured_outputs": {}}, "structured_outputs")
    assert "exactly one" in err["message"]


def test_the_extensions_the_server_knows_are_still_taken(server):
    body = {"max_tokens": 3, "top_k": 5, "min_tokens": 1, "ignore_eos": True, "return_meta_info": True}
    ok(server, "/v1/completions", {"prompt": "x", **body, "spec_decode_metrics": "summary"})
    ok(server, "/v1/chat/completions", {"messages": CHAT, **body, "chat_template_kwargs": {"a": 1}})


# ---- bad grammars: a 400 that says why, and the server keeps serving -------------------------------------------
@pytest.mark.parametrize(
    "fields,param",
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json"),
        ({"guided_json": False}, "guided_json"),
        ({"guided_json": {"type": "object", "description": "x" * (MAX_GRAMMAR_CHARS + 1)}}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ],
    ids=["not-json", "no-string", "false", "too-large", "bad-regex", "bad-ebnf"],
)
def test_a_bad_grammar_is_a_400_that_harms_nothing(server, fields, param):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_grammar" and err["message"], err
    assert err["param"] in (param, None), err
    ok(server, "/v1/completions", {"prompt": "x", "max_tokens": 4})  # still serving


def test_two_constraints_at_once_are_refused(server):
    body = {"prompt": "x", "guided_json": SCHEMA, "guided_regex": "a+"}
    refused(server, "/v1/completions", body, "guided_regex", "conflicting_fields")
    tools = {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
    refused(server, "/v1/chat/completions", {"messages": CHAT, **tools}, "tools", "conflicting_fields")


# ---- logprobs -------------------------------------------------------------------------------------------------
def test_logprobs_bounds(server):
    refused(server, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs")
    refused(server, "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs")
    refused(server, "/v1/completions", {"prompt": "x", "logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs")
    refused(server, "/generate", {"prompt": "x", "logprobs": -1}, "logprobs")


# ---- tools ----------------------------------------------------------------------------------------------------
def test_tool_choices_the_tools_do_not_allow(server):
    named = {"type": "function", "function": {"name": "nope"}}
    refused(server, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": named}, "tool_choice")
    refused(server, "/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice")
    refused(server, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER, WEATHER]}, "tools")


def test_auto_needs_a_tool_format_the_server_knows(server):
    """The tiny model's chat template has no tool format the server parses: auto is refused, saying what works;
    none serves the reply as text."""
    err = refused(server, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER]}, "tool_choice")
    assert "required" in err["message"] and "smollm2" in err["message"]
    got = ok(server, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert "tool_calls" not in got["choices"][0]["message"] or not got["choices"][0]["message"]["tool_calls"]


def test_smollm2_tool_format_parses_calls_and_leaves_the_rest(decoder):
    fmt = SmolLM2Tools()
    names = {"get_weather", "get_time"}
    content, calls = fmt.parse(
        'Sure. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
        '"arguments": {}}]</tool_call>',
        names,
    )
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    text = '<tool_call>[{"name": "rm_rf", "arguments": {}}]</tool_call>'
    assert fmt.parse(text, names) == (text, [])  # not a listed function: the text, not an invented call
    assert fmt.parse("no call here", names) == ("no call here", [])
    assert tool_format(decoder.tokenizer) is None  # the tiny template is not ChatML
