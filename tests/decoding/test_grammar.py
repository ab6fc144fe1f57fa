"""Grammars (decoding/grammar.py): what a spec accepts, the errors a bad one gets, the matcher's masks, forced
tokens and rollback, and the compile cache. On the demo target's tokenizer (4,096 tokens)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from dflash_trt.decoding import GenerationConfig, GrammarError, GrammarSpec, InputError, compile_grammar
from dflash_trt.decoding import grammar as grammar_module
from dflash_trt.decoding.grammar import MAX_GRAMMAR_CHARS
from dflash_trt.decoding.request import MAX_TOP_LOGPROBS, validate_request

DEMO = Path(__file__).resolve().parents[2] / "models" / "target"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def walk(matcher, text: str, tok) -> list[int]:
    """Feed `text` through the matcher token by token as the tokenizer spells it; the ids fed."""
    ids = tok.encode(text)
    for t in ids:
        assert matcher.accept(t), f"{tok.decode([t])!r} refused after {ids[: ids.index(t)]}"
    return ids


def test_spec_rejects_bad_shapes():
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("xml", "x")
    with pytest.raises(GrammarError, match="choice"):
        GrammarSpec("choice", ())
    with pytest.raises(GrammarError, match="needs a source"):
        GrammarSpec("regex", "")
    with pytest.raises(GrammarError, match="more than"):
        GrammarSpec("regex", "a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema("{nope")
    assert issubclass(GrammarError, InputError)  # a server answers it with a 400
    # one key per schema however it was written: the cache's key is the compact text
    assert GrammarSpec.json_schema(PERSON) == GrammarSpec.json_schema(json.dumps(PERSON, indent=2))


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (GrammarSpec.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "admits no string"),
        (GrammarSpec("regex", "[^\x00-\U0010ffff]"), "admits no string"),
        (GrammarSpec("regex", "(a"), "does not compile"),
        (GrammarSpec.json_schema({"type": "strin"}), "does not compile"),
        (GrammarSpec.json_schema({"not": {}}, strict=True), "does not compile"),  # not enforceable: refused
        (GrammarSpec("ebnf", "start: undefined_rule"), "does not compile"),
    ],
)
def test_bad_grammars_say_why(tok, spec, why):
    with pytest.raises(GrammarError, match=why):
        compile_grammar(spec, tok, 4096)


def test_no_tokenizer_no_grammar():
    with pytest.raises(GrammarError, match="tokenizer"):
        compile_grammar(GrammarSpec("regex", "a"), None)


def test_compile_time_bound(tok, monkeypatch):
    """A compilation still running at the bound is a GrammarError (a compile that waits on an event: no timing)."""
    release = threading.Event()
    real = grammar_module._compile
    monkeypatch.setattr(grammar_module, "_compile", lambda *a: (release.wait(), real(*a))[1])
    spec = GrammarSpec("regex", "x{1,3}y{2}z[0-9]{4}")
    try:
        with pytest.raises(GrammarError, match="longer than 0.01 s"):
            compile_grammar(spec, tok, 4096, timeout_s=0.01)
    finally:
        release.set()
    monkeypatch.undo()
    assert compile_grammar(spec, tok, 4096).matcher().accept(tok.encode("x")[0])  # nothing cached by the overrun


def test_json_schema_masks_forced_tokens_and_rollback(tok):
    m = compile_grammar(GrammarSpec.json_schema(PERSON), tok, 4096).matcher()
    forced = m.forced()
    # keys and punctuation are forced (llguidance stops before a last token that could merge with what follows)
    assert tok.decode(forced) in ('{"name":', '{"name":"')
    allowed = m.allowed()
    assert allowed.shape == (4096,) and allowed.dtype == torch.bool
    assert all(allowed[t] for t in forced[:1])
    ids = walk(m, '{"name":"Ann","age":3,"kind":"', tok)
    assert not m.accepting
    # both enum values start differently: nothing forced; after "c" the rest of "cat" is
    assert m.forced() == []
    walk(m, "c", tok)
    assert tok.decode(m.forced()) in ("at", 'at"', 'at"}')
    bad = tok.encode("x")[0]
    assert not m.accept(bad) and not m.allowed()[bad]  # refused, and the matcher is unchanged
    m.rollback(1)  # back before "c": both values possible again
    assert m.forced() == []
    m.rollback(len(ids))
    assert m.forced() == forced
    walk(m, '{"name":"A","age":1,"kind":"dog"}', tok)
    assert m.accepting and m.finished


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GrammarSpec("regex", "[0-9]{3}-[a-z]+"), "123-abc", "12a"),
        (GrammarSpec.choice(["yes", 'no "way"']), 'no "way"', "maybe"),
        (GrammarSpec("ebnf", 'root ::= "ab" [0-9]+'), "ab42", "ba"),
        (GrammarSpec("ebnf", 'start: "ab" /[0-9]+/'), "ab7", "abc"),
        (GrammarSpec("json_object"), '{"a":[1,2]}', "[1]"),
    ],
)
def test_kinds(tok, spec, good, bad):
    m = compile_grammar(spec, tok, 4096).matcher()
    walk(m, good, tok)
    assert m.accepting
    m.rollback(len(tok.encode(good)))
    ids = tok.encode(bad)
    assert not all(m.accept(t) for t in ids)


def test_cache_keyed_by_spec_and_vocab(tok):
    spec = GrammarSpec.json_schema(PERSON)
    first = compile_grammar(spec, tok, 4096)
    assert compile_grammar(GrammarSpec.json_schema(json.dumps(PERSON)), tok, 4096) is first
    assert compile_grammar(spec, tok, 4160) is not first  # a model's padded vocabulary: masks of its size
    assert compile_grammar(spec, tok, 4160).matcher().allowed().shape == (4160,)
    assert compile_grammar(GrammarSpec.json_schema(PERSON, strict=True), tok, 4096) is not first


def test_logprobs_bound():
    class Target:
        vocab_size, max_context = 4096, 1024

    validate_request([1, 2], GenerationConfig(logprobs=MAX_TOP_LOGPROBS), Target(), None)
    with pytest.raises(InputError, match="logprobs"):
        validate_request([1, 2], GenerationConfig(logprobs=MAX_TOP_LOGPROBS + 1), Target(), None)
