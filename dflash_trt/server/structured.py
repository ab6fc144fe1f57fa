"""Structured outputs, tool calls and logprobs at the HTTP edge: from a request's fields to the grammar its output
must match (`decoding.grammar.GrammarSpec`), and from the generated tokens back to OpenAI's shapes.

The grammar itself is the decoder's business (decoding/grammar.py: compiled, cached, applied to the target's
logits at every verified position, so speculation stays lossless). Here: which fields ask for one (at most one
way per request, a 400 naming the second), the JSON schema of a forced tool call, the chat templates whose
tool format the server knows (for tool_choice "auto"), and the logprobs objects.

Tool calls follow vLLM (vllm/entrypoints/openai/protocol.py `_get_json_schema_from_tool`, and
tool_parsers/utils.py `_get_json_schema_from_tools`, v0.10-v0.12): a named function is generated as its
arguments under the function's parameters schema; "required" as a JSON array of {"name", "parameters"} objects,
at least one, under the union of the functions' schemas. Neither needs the model to know a tool format, so both
work with any chat model. "auto" lets the model decide, so its output is parsed in the tool format its chat
template was trained with: only the formats below (`TOOL_FORMATS`); any other template gets a 400 that says so.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..decoding.grammar import GrammarError, GrammarSpec
from .errors import ApiError
from .schemas import (
    ChatCompletionRequest,
    ChatMessage,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
    OutputFields,
    StructuredOutputs,
    Tool,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# error codes of the 400s no request schema can foresee (tests/schemathesis_hooks.py accepts them for valid data)
INVALID_GRAMMAR = "invalid_grammar"  # does not compile, admits no string, beyond a size or time bound
CONFLICT = "conflicting_fields"  # two ways to constrain the output, top_logprobs without logprobs
INVALID_TOOLS = "invalid_tools"  # a tool choice the tools do not allow, a tool format the server does not know
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


# ---- the grammar a request asks for ------------------------------------------------------------------------
def request_grammar(body: OutputFields, tools: ToolPlan | None = None) -> GrammarSpec | None:
    """The one grammar the request's fields ask for, or None (free text). Two ways at once (response_format and
    guided_json, say) are a 400 naming the second: which one wins is not the server's to guess. A grammar beyond
    the decoder's bounds (GrammarError) is a 400 naming its field."""
    asked: list[tuple[str, Callable[[], GrammarSpec]]] = []
    fmt = getattr(body, "response_format", None)
    if isinstance(fmt, JsonObjectFormat):
        asked.append(("response_format", lambda: GrammarSpec("json_object")))
    elif isinstance(fmt, JsonSchemaResponseFormat):
        f = fmt.json_schema
        asked.append(("response_format", lambda: GrammarSpec.json_schema(_schema(f.schema_), bool(f.strict))))
    so = body.structured_outputs
    if so is not None:
        asked.append(("structured_outputs", lambda: _structured(so)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        value = getattr(body, name)
        if value is not None:
            older = StructuredOutputs(**{kind: value})
            asked.append((name, lambda older=older: _structured(older)))  # type: ignore[misc]
    grammar = body.guided_grammar
    if grammar is not None:
        asked.append(("guided_grammar", lambda: GrammarSpec("ebnf", grammar)))
    if tools is not None and tools.schema is not None:
        schema = tools.schema
        asked.append(("tools", lambda: GrammarSpec.json_schema(schema)))
    if len(asked) > 1:
        raise ApiError(
            400,
            f"{asked[1][0]}: one constraint on the output per request; this one also sends {asked[0][0]}",
            param=asked[1][0],
            code=CONFLICT,
        )
    if not asked:
        return None
    param, make = asked[0]
    try:
        return make()
    except GrammarError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code=INVALID_GRAMMAR) from None


def _structured(so: StructuredOutputs) -> GrammarSpec:
    if so.json_ is not None:
        return GrammarSpec.json_schema(_schema(so.json_))
    if so.regex is not None:
        return GrammarSpec("regex", so.regex)
    if so.choice is not None:
        return GrammarSpec.choice(so.choice)
    if so.grammar is not None:
        return GrammarSpec("ebnf", so.grammar)
    return GrammarSpec("json_object")


def _schema(schema: dict[str, Any] | bool | str | None) -> dict[str, Any] | str:
    """A schema sent as an object or as JSON text (GrammarSpec.json_schema parses the text; a boolean schema goes
    as its text); none: any JSON object, as OpenAI reads a json_schema format without one."""
    if isinstance(schema, bool):
        return json.dumps(schema)
    return ANY_OBJECT if schema is None else schema


# ---- tools --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCallOut:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


class ToolFormat:
    """A chat template family's tool format: how the tools and earlier calls are written into the prompt, and
    how a reply's calls are found in the text. `fits` says whether a tokenizer's chat template is of the family."""

    name = ""

    def fits(self, template: str) -> bool:
        raise NotImplementedError

    def messages(self, messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, str]]:
        raise NotImplementedError

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCallOut]]:
        raise NotImplementedError


class SmolLM2Tools(ToolFormat):
    """SmolLM2-Instruct (135M / 360M / 1.7B): its Hugging Face chat template is plain ChatML and writes no tools,
    so the server writes them as SmolLM2 was trained to read them, the format Ollama serves it with (ollama.com
    library `smollm2`, template blob dfebd0343bdd): a system prompt listing the functions inside <tools>...</tools>
    and asking for `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`; earlier calls written back
    the same way, tool results as user turns inside <tool_response>...</tool_response>.

    Fits a ChatML template (`<|im_start|>`) that renders no tools of its own (a template that does has a tool
    format of its own, which this server does not parse)."""

    name = "smollm2"
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    PROMPT = (
        "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
        "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
        "If none of the functions can be used, point it out and refuse to answer.\n"
        "If the given question lacks the parameters required by the function, also point it out.\n"
        "You have access to the following tools:\n<tools>{tools}</tools>\n"
        "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
        "The example format is as follows. Please make sure the parameter type is correct. If no function call "
        "is needed, please make the tool calls an empty list '[]'.\n"
        '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
        "(more tool calls as required)\n]</tool_call>"
    )

    def fits(self, template: str) -> bool:
        return "<|im_start|>" in template and "tools" not in template

    def messages(self, messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, str]]:
        listed = json.dumps([t.function.model_dump(exclude_none=True) for t in tools])
        system = self.PROMPT.format(tools=listed)
        out: list[dict[str, str]] = []
        for m in messages:
            if m["role"] in ("system", "developer") and not out:
                system += "\n" + m["content"]  # the client's instructions after the tool list
                continue
            if m["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            elif m.get("tool_calls"):
                calls = ",\n".join(
                    json.dumps({"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")})
                    for c in m["tool_calls"]
                )
                out.append({"role": "assistant", "content": f"<tool_call>[\n{calls}\n]</tool_call>"})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return [{"role": "system", "content": system}, *out]

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCallOut]]:
        """The calls in `<tool_call>` blocks (a list of calls or one call each); text outside them is content.
        A block that is not such JSON, or names no listed function, stays content: the client sees what the model
        wrote rather than a call the server invented."""
        calls: list[ToolCallOut] = []
        content = text
        for block in self.CALL.finditer(text):
            found = _calls_in(block.group(1).strip(), names)
            if found is None:
                continue
            calls += found
            content = content.replace(block.group(0), "")
        content = content.strip()
        return (content or None) if calls else text, calls


def _calls_in(block: str, names: set[str]) -> list[ToolCallOut] | None:
    try:
        data = json.loads(block)
    except ValueError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCallOut(item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


TOOL_FORMATS: tuple[ToolFormat, ...] = (SmolLM2Tools(),)


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The tool format of the tokenizer's chat template, or None when the server knows none for it."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str):
        return None
    return next((f for f in TOOL_FORMATS if f.fits(template)), None)


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: `mode` none / auto / required / named; `schema` the JSON schema the
    output is generated under (required and named), `format` the template's tool format (writes the tools into
    the prompt where known; parses auto's replies)."""

    mode: str
    tools: tuple[Tool, ...]
    name: str | None
    parallel: bool
    format: ToolFormat | None
    schema: dict[str, Any] | None

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation for the chat template: with the tools written in where the format is known."""
        if self.format is None or self.mode == "none":
            return [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.format.messages(messages, self.tools)

    def parse(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        """(content, calls) of a finished reply. A forced call that does not parse (the reply ran out of tokens)
        stays content, with finish_reason "length" saying why."""
        if self.mode == "named":
            assert self.name is not None
            return (None, [ToolCallOut(self.name, text)]) if _is_json(text) else (text, [])
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ToolCallOut(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        if self.mode == "auto" and self.format is not None:
            return self.format.parse(text, self.names)
        return text, []


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tool_plan(body: ChatCompletionRequest, tokenizer: Any) -> ToolPlan | None:
    """The request's ToolPlan (None without tools), or a 400: a choice naming no listed function, "required"
    without tools, "auto" on a chat template whose tool format the server does not know."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if not tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise ApiError(
                400,
                "tool_choice: a tool is required but the request sends no tools",
                param="tool_choice",
                code=INVALID_TOOLS,
            )
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two functions have the same name", param="tools", code=INVALID_TOOLS)
    fmt = tool_format(tokenizer)
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            message = f"tool_choice: '{choice.function.name}' is not one of the tools ({', '.join(names)})"
            raise ApiError(400, message, param="tool_choice", code=INVALID_TOOLS)
        return ToolPlan("named", tools, tool.function.name, parallel, fmt, _parameters(tool))
    if choice == "required":
        return ToolPlan("required", tools, None, parallel, fmt, _required_schema(tools, parallel))
    if choice == "none":
        return ToolPlan("none", tools, None, parallel, fmt, None)
    if fmt is None:
        supported = ", ".join(f.name for f in TOOL_FORMATS)
        raise ApiError(
            400,
            "tool_choice: 'auto' needs the chat template's tool format, and this model's is not one the server "
            f"parses ({supported}); send tool_choice 'required' or a named function (generated under a JSON "
            "schema, with any model), or 'none'",
            param="tool_choice",
            code=INVALID_TOOLS,
        )
    return ToolPlan("auto", tools, None, parallel, fmt, None)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def _required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of at least one {"name", "parameters"} object (and no
    other key, which vLLM's allows), each one of the functions; the functions' `$defs` lifted to the top, where their `$ref`s point (two functions
    defining one name differently is a 400). parallel_tool_calls false: at most one call."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = dict(_parameters(tool))
        for name, d in params.pop("$defs", {}).items():
            if defs.setdefault(name, d) != d:
                raise ApiError(
                    400, f"tools: two functions define '$defs/{name}' differently", param="tools", code=INVALID_TOOLS
                )
        variants.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,  # vLLM's leaves it open: a model could wander off in an extra key
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the chat template and the tool formats read them (content as text)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": str(m.content or "")}
        if m.tool_calls:
            d["tool_calls"] = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        out.append(d)
    return out


# ---- logprobs -------------------------------------------------------------------------------------------------
def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as text: its decoding alone (a piece of a multi-byte character decodes to U+FFFD; `bytes` in
    chat logprobs is then of that text), or vLLM's `token_id:<id>` for a target without a tokenizer."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _top(entry: Any) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for t, lp in entry.top]


def chat_logprobs(tokenizer: Any, entries: Sequence[Any]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in _top(e)]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, entries: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (text -> logprob, the chosen
    token included, as vLLM sends it; keyed by text, so tokens that decode alike share one entry) and text_offset
    (each token's start in the text, from `offset`)."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for tok, e in zip(tokens, entries):
        top = {token_text(tokenizer, t): lp for t, lp in _top(e)}
        top[tok] = e.logprob  # the chosen token's own, where another token has the same text (a partial character)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def native_logprobs(entries: Sequence[Any]) -> list[dict[str, Any]]:
    """/generate's logprobs: [{token_id, logprob, top: [{token_id, logprob}]}]."""
    return [
        {
            "token_id": e.token_id,
            "logprob": e.logprob,
            "top": [{"token_id": t, "logprob": lp} for t, lp in _top(e)],
        }
        for e in entries
    ]
