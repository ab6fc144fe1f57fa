"""Structured outputs and tool calls with a real chat model (issue 64): SmolLM2-135M-Instruct (`make models`) served
by `dflash-trt serve` as a real process, driven by the official OpenAI client: `chat.completions.parse` with a
pydantic model returns the parsed object; a tool call round-trips (the call, the tool's result sent back, the
answer), streaming and not; and `dflash-trt bench structured`'s requests all validate against their schemas."""

import argparse
import json

import openai
import pytest
from pydantic import BaseModel, Field

from dflash_trt.bench import structured as bench
from dflash_trt.models.pretrained import MODELS_DIR, SMOLLM2_135M
from dflash_trt.server.process import start_serve

SMOLLM2 = MODELS_DIR / SMOLLM2_135M.name
SERVE = ["--target", str(SMOLLM2), "--no-draft", "--threads", "1", "--model-name", "smollm2"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    if not (SMOLLM2 / "SHA256SUMS").is_file():
        pytest.skip("SmolLM2-135M-Instruct is not here: `make models`")
    proc, url = start_serve(SERVE, tmp_path_factory.mktemp("smollm2") / "serve.log", timeout_s=300)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        proc.terminate()
        proc.wait(60)


def test_parse_returns_the_pydantic_object(client):
    reply = client.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe Ada Lovelace as a person with a name and an age."}],
        response_format=Person,
        temperature=0,
        max_tokens=64,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Person), reply
    assert reply.choices[0].finish_reason == "stop"


def _accumulate(stream) -> tuple[dict, str | None]:
    """The tool call a stream's deltas spell (the client's own accumulation, as its users write it)."""
    call: dict = {"id": None, "name": None, "arguments": ""}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                assert tc.index == 0
                call["id"] = tc.id or call["id"]
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return call, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_tool_call_round_trips_through_the_client(client, stream, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    body = dict(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=80)
    if stream:
        call, finish = _accumulate(client.chat.completions.create(**body, stream=True))
    else:
        reply = client.chat.completions.create(**body)
        tc = reply.choices[0].message.tool_calls[0]
        call, finish = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}, None
        finish = reply.choices[0].finish_reason
    assert call["name"] == "get_weather" and call["id"]
    args = json.loads(call["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert finish == ("stop" if choice == "named" else "tool_calls")
    # the call and the tool's result go back; the model answers in text
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    answer = client.chat.completions.create(
        model="smollm2", messages=history, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_auto_parses_smollm2_tool_calls(client):
    """auto: SmolLM2's own tool format, parsed; whatever the model chose, the reply is text or calls of the listed
    function with arguments in JSON, never both missing."""
    reply = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=80
    )
    message = reply.choices[0].message
    assert message.content or message.tool_calls
    for tc in message.tool_calls or ():
        assert tc.function.name == "get_weather" and isinstance(json.loads(tc.function.arguments), dict)
    assert reply.choices[0].finish_reason == ("tool_calls" if message.tool_calls else "stop") or (
        reply.choices[0].finish_reason == "length"
    )


def test_structured_requests_all_validate(tmp_path):
    """A short run of `dflash-trt bench structured` (every way of asking, twice): every output matches its schema."""
    if not (SMOLLM2 / "SHA256SUMS").is_file():
        pytest.skip("SmolLM2-135M-Instruct is not here: `make models`")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)  # the command's own defaults: no drafter, the server's proposer
    args = parser.parse_args(
        ["--target", str(SMOLLM2), "--requests", str(2 * len(bench.CHAT_WAYS)), "--out", str(tmp_path)]
    )
    assert bench.run(args) == 0
    results = json.loads((tmp_path / f"http-{SMOLLM2.resolve().name}" / "results.json").read_text())
    assert results["valid"] == results["requests"] == 2 * len(bench.CHAT_WAYS)
    assert set(results["per_way"]) == set(bench.CHAT_WAYS)
