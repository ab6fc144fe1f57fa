"""Structured outputs through `dflash-trt serve`: a few hundred requests, each constrained by a JSON schema, every
output validated against its schema with a JSON Schema validator (jsonschema_rs, which schemathesis brings).

The requests cycle through bounded schemas (strings with a maxLength, arrays with maxItems, objects closed with
additionalProperties false: every output fits the token budget, so an invalid one is the server's fault, not
truncation's; an open object lets a model add keys until max_tokens, as the demo model did), every way the API asks for a schema
(`response_format` json_schema strict and not, `structured_outputs.json`, `guided_json`; on chat also tool calls,
named and "required", whose arguments object is closed the same way, one call each) and temperatures 0 and 1 (seeded). Not
json_object: "any JSON object" bounds nothing, so a small model's object may run to max_tokens (tests/server
test that it is decoded under its grammar). /v1/completions where the target has no
chat template (the demo target), /v1/chat/completions where it has one (SmolLM2-135M-Instruct).

Writes OUT/results.json (default results/structured/http-<target>/; the server's log beside it): per way of asking, requests, valid, finish reasons, and the first invalid outputs;
tokens/s and tau (tokens per verify round) over the run. Exits 1 when any output fails its schema.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..server.process import start_serve
from ..settings import NO_DRAFTER, drafter_path

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": NAME,
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "done": {"type": "boolean"},
        },
        "required": ["title", "tags", "done"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                # a number bounded in digits too (multipleOf): a bare number's fraction may run to max_tokens
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "number", "multipleOf": 0.25, "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"anyOf": [NAME, {"type": "null"}]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no", "unknown"]}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["id"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "What is the weather in Paris? Answer in JSON.",
    "Make a short task list item.",
    "Give a point on a plane.",
    "Is the sky blue?",
    "List some record ids.",
    "def parse(line):",
    "The result is",
]
COMPLETION_WAYS = ("response_format", "response_format_strict", "structured_outputs", "guided_json")
CHAT_WAYS = (*COMPLETION_WAYS, "tool_named", "tool_required")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, required=True, help="the target checkpoint directory")
    p.add_argument(
        "--drafter",
        type=drafter_path,
        default=NO_DRAFTER,
        metavar="{DIR,none}",
        help="its DFlash drafter (default none: the server drafts with its drafterless proposer and the grammar's "
        "forced tokens)",
    )
    p.add_argument("--proposer", default=None, help="the server's --proposer (default: its own)")
    p.add_argument("--requests", type=int, default=300, help="requests to send (default 300)")
    p.add_argument("--max-tokens", type=int, default=160, help="max_tokens of each (default 160)")
    p.add_argument("--threads", type=int, default=1, help="the server's --threads (default 1)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results/structured"),
        help="the run's folder http-<target folder's name> (results.json, the server's log) goes here "
        "(default %(default)s)",
    )


def _case(i: int, chat: bool) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Request i: (its way of asking, the fields that ask, the schema each output must match)."""
    ways = CHAT_WAYS if chat else COMPLETION_WAYS
    way, schema = ways[i % len(ways)], SCHEMAS[(i // len(ways)) % len(SCHEMAS)]
    if way.startswith("response_format"):
        fmt = {"name": "out", "schema": schema, "strict": way.endswith("strict")}
        return way, {"response_format": {"type": "json_schema", "json_schema": fmt}}, schema
    if way == "structured_outputs":
        return way, {"structured_outputs": {"json": schema}}, schema
    if way == "guided_json":
        return way, {"guided_json": schema}, schema
    params = schema
    if schema.get("type") != "object":  # a tool's parameters are an object: the array becomes its one member
        params = {
            "type": "object",
            "properties": {"items": schema},
            "required": ["items"],
            "additionalProperties": False,
        }
    tool = {
        "type": "function",
        "function": {"name": "record", "description": "record the answer", "parameters": params},
    }
    choice = {"type": "function", "function": {"name": "record"}} if way == "tool_named" else "required"
    # one call: parallel calls are an array of calls with no bound on its length (OpenAI's), which a small model
    # may fill until max_tokens (tests/server test parallel calls)
    return way, {"tools": [tool], "tool_choice": choice, "parallel_tool_calls": False}, params


def _outputs(way: str, body: dict[str, Any], chat: bool) -> list[str] | None:
    """The JSON texts the response holds (the text; a tool call's arguments each); None: no call was made."""
    choice = body["choices"][0]
    if not chat:
        return [choice["text"]]
    message = choice["message"]
    if way.startswith("tool"):
        calls = message.get("tool_calls") or []
        return [c["function"]["arguments"] for c in calls] or None
    return [message["content"]]


def run(args: argparse.Namespace) -> int:
    import httpx
    import jsonschema_rs
    from transformers import AutoTokenizer

    chat = bool(getattr(AutoTokenizer.from_pretrained(args.target), "chat_template", None))
    serve = ["--target", str(args.target), "--threads", str(args.threads), "--model-name", "m"]
    serve += ["--drafter", str(args.drafter)]
    if args.proposer:
        serve += ["--proposer", args.proposer]
    out = args.out / f"http-{args.target.resolve().name}"
    out.mkdir(parents=True, exist_ok=True)
    proc, url = start_serve(serve, out / "serve.log", timeout_s=300)
    per_way: dict[str, dict[str, Any]] = {}
    tokens = rounds = 0
    started = time.monotonic()
    try:
        client = httpx.Client(base_url=url, timeout=600)
        for i in range(args.requests):
            way, fields, schema = _case(i, chat)
            prompt = PROMPTS[i % len(PROMPTS)]
            body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": float(i % 2), "seed": i, **fields}
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            row = per_way.setdefault(way, {"requests": 0, "valid": 0, "finish_reasons": Counter(), "invalid": []})
            row["requests"] += 1
            if r.status_code != 200:
                row["invalid"].append({"request": i, "status": r.status_code, "body": r.text[:300]})
                continue
            got = r.json()
            row["finish_reasons"][got["choices"][0]["finish_reason"]] += 1
            tokens += got["usage"]["completion_tokens"]
            rounds += got["spec"]["rounds"]
            texts = _outputs(way, got, chat)
            validator = jsonschema_rs.validator_for(schema)
            try:
                good = texts is not None and all(validator.is_valid(json.loads(t)) for t in texts)
            except ValueError:
                good = False
            if good:
                row["valid"] += 1
            elif len(row["invalid"]) < 5:
                row["invalid"].append({"request": i, "outputs": texts, "schema": schema})
    finally:
        proc.terminate()
        proc.wait(60)
    seconds = time.monotonic() - started
    total = sum(r["requests"] for r in per_way.values())
    valid = sum(r["valid"] for r in per_way.values())
    results = {
        "target": str(args.target),
        "drafter": None if args.drafter == NO_DRAFTER else str(args.drafter),
        "proposer": args.proposer,
        "endpoint": "/v1/chat/completions" if chat else "/v1/completions",
        "requests": total,
        "valid": valid,
        "valid_fraction": valid / total if total else 0.0,
        "completion_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "tokens_per_round": tokens / rounds if rounds else 0.0,
        "per_way": {k: {**v, "finish_reasons": dict(v["finish_reasons"])} for k, v in per_way.items()},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"{valid}/{total} outputs valid; {results['tokens_per_second']:.1f} tokens/s, "
        f"{results['tokens_per_round']:.2f} tokens per round -> {out / 'results.json'}"
    )
    return 0 if valid == total else 1
