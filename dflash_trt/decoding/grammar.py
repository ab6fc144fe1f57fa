"""Grammars a request's output must follow (structured outputs): what a request asks for (`GrammarSpec`), its
compilation against a tokenizer (`compile_grammar`, cached) and the matcher that walks one sequence through it
(`GrammarMatcher`: the tokens allowed next, the tokens it forces, rollback).

The library is llguidance (Microsoft's, the engine behind vLLM's "guidance" backend and llama.cpp's): an Earley
parser over a lazily built lexer, so a schema compiles in about a millisecond and a mask costs tens of
microseconds; chosen over xgrammar by measurement (`dflash-trt bench grammar-libs`, docs/benchmarks.md), and it
installs as one 8 MB wheel with no dependency where xgrammar pulls in OpenAI's Triton (about 1 GB).

Bounds, so that a request cannot hold the engine thread: a grammar's source is at most `MAX_GRAMMAR_CHARS`
characters; its compilation (and its first mask) runs under llguidance's parser limits (`PARSER_LIMITS`: work
counted in items and lexer fuel, the same on every machine) and at most `COMPILE_TIMEOUT_S` seconds of the clock;
past either, `GrammarError`. A compilation that overran the clock finishes in its worker thread (llguidance cannot
be interrupted; its limits bound that work) and its result is dropped.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .errors import InputError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
MAX_GRAMMAR_CHARS = 65_536  # a grammar's source (a schema's JSON text, a regex, the choices together, an EBNF)
COMPILE_TIMEOUT_S = 5.0  # the clock's bound on one compilation and its first mask
GRAMMAR_CACHE_SIZE = 128  # compiled grammars kept per tokenizer (least recently used first out)


class GrammarError(InputError):
    """A grammar the server cannot serve: it does not compile, admits no string, or is beyond a bound."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must follow.

    kind      "json_schema" (source: the schema as JSON text), "json_object" (any JSON object; no source),
              "regex" (source: the pattern, matched whole), "choice" (source: a tuple of the strings allowed) or
              "ebnf" (source: a Lark grammar with a `start` rule, or a GBNF one with `root ::= ...` as vLLM's
              guided_grammar takes it)
    strict    for a JSON schema: every keyword must be enforced (a schema using one the library cannot enforce is
              refused); not strict, such keywords are ignored and the rest enforced
    """

    kind: str
    source: str | tuple[str, ...] = ""
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if self.kind == "choice":
            if not isinstance(self.source, tuple) or not self.source:
                raise GrammarError("a choice grammar needs a non-empty tuple of strings")
            if not all(isinstance(c, str) for c in self.source):
                raise GrammarError("a choice grammar's choices must be strings")
            size = sum(len(c) for c in self.source)
        else:
            if not isinstance(self.source, str):
                raise GrammarError(f"a {self.kind} grammar's source must be a string")
            if self.kind != "json_object" and not self.source:
                raise GrammarError(f"a {self.kind} grammar needs a source")
            size = len(self.source)
        if size > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"the {self.kind} grammar has {size} characters, more than the {MAX_GRAMMAR_CHARS} allowed"
            )

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, strict: bool = False) -> GrammarSpec:
        """A JSON schema given as an object or as JSON text (kept as the compact text: the cache's key)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping) and not isinstance(schema, bool):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), strict)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", tuple(choices))


# llguidance's defaults (a million lexer fuel, 50,000 Earley items a step: milliseconds of work) bound one mask;
# the grammar's size is bounded lower than its 500,000 symbols, in line with MAX_GRAMMAR_CHARS.
_LIMITS: dict[str, int] = {"max_grammar_size": 200_000}


def _llguidance() -> Any:
    import llguidance

    return llguidance


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (its JSON form of one top-level grammar)."""
    m = _llguidance().LLMatcher
    # compact JSON (no optional whitespace): a model cannot wander into whitespace, and more bytes are forced
    options = {"whitespace_flexible": False, "lenient": False}
    if spec.kind == "json_schema":
        options["lenient"] = not spec.strict
        schema = json.loads(str(spec.source))
        try:
            return str(m.grammar_from_json_schema(schema, defaults=options))
        except ValueError as e:
            raise GrammarError(f"the JSON schema does not compile: {e}") from None
    if spec.kind == "json_object":
        return str(m.grammar_from_json_schema({"type": "object"}, defaults=options))
    if spec.kind == "regex":
        return str(m.grammar_from_regex(str(spec.source)))
    if spec.kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.source)
        return str(m.grammar_from_lark(f"start: {alternatives}"))
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # GBNF (llama.cpp's, as vLLM's guided_grammar takes it) becomes Lark; Lark stays as it is
        source = any_to_lark(str(spec.source))
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad input
        raise GrammarError(f"the ebnf grammar does not compile: {e}") from None
    return str(m.grammar_from_lark(source))


class CompiledGrammar:
    """A grammar compiled against one tokenizer; `matcher()` starts a sequence through it (cheap)."""

    def __init__(self, spec: GrammarSpec, text: str, tokenizer: Any, vocab_size: int):
        self.spec, self.text, self.tokenizer, self.vocab_size = spec, text, tokenizer, vocab_size
        # the end-of-text tokens the grammar admits once its string is whole (the tokenizer's end of text)
        self.end_ids: tuple[int, ...] = tuple(int(t) for t in tokenizer.eos_tokens)

    def matcher(self) -> GrammarMatcher:
        llg = _llguidance()
        return GrammarMatcher(llg.LLMatcher(self.tokenizer, self.text, log_level=0), self.vocab_size)


class GrammarMatcher:
    """One sequence's place in a grammar: the tokens it admits next (`allowed`), those it forces (`forced`),
    advancing by tokens (`accept`) and going back (`rollback`: a rejected draft's tokens)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = torch.empty(self._words, dtype=torch.int32)

    @cached_property
    def _shifts(self) -> torch.Tensor:
        return torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar admits next, as a bool mask [vocab_size] (all False once it is in error)."""
        self._m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._words * 4)
        bits = (self._bits.unsqueeze(-1) >> self._shifts) & 1
        return bits.reshape(-1)[: self.vocab_size].bool()

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (the bytes it admits are one string, and these tokens spell
        it); empty where it admits more than one continuation."""
        return list(self._m.compute_ff_tokens())

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and the matcher unchanged) where the grammar forbids it."""
        if self._m.validate_tokens([token]) != 1:
            return False
        return bool(self._m.consume_token(token))

    def rollback(self, count: int) -> None:
        if count:
            self._m.rollback(count)

    @property
    def accepting(self) -> bool:
        """Whether what it has taken is a whole string of the grammar (an end of text may come now)."""
        return bool(self._m.is_accepting())

    @property
    def finished(self) -> bool:
        """Whether it admits nothing more but the end of text."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error())


# ---- compilation and its cache ---------------------------------------------------------------------------------
_lock = threading.Lock()
_workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
# per tokenizer object (dropped with it): its llguidance tokenizer per vocabulary size, and its compiled grammars
_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_compiled: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[GrammarSpec, int], CompiledGrammar]] = (
    weakref.WeakKeyDictionary()
)


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer (about a second for a large vocabulary: kept)."""
    with _lock:
        known = _tokenizers.setdefault(tokenizer, {})
        if vocab_size in known:
            return known[vocab_size]
    import llguidance.hf

    try:
        made = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except ValueError as e:  # a slow tokenizer, or a decoder llguidance cannot read bytes through
        raise GrammarError(f"grammars are not available for this model's tokenizer: {e}") from None
    with _lock:
        return known.setdefault(vocab_size, made)


def _compile(spec: GrammarSpec, lltok: Any, vocab_size: int) -> CompiledGrammar:
    llg = _llguidance()
    text = _grammar_text(spec)
    limits = llg.LLParserLimits(**_LIMITS)
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, lltok, limits=limits)
    if failed:
        raise GrammarError(_why(spec, messages[0] if messages else "unknown error"))
    compiled = CompiledGrammar(spec, text, lltok, vocab_size)
    matcher = compiled.matcher()  # the lexer is built here: part of what the time bound covers
    if matcher.error:
        raise GrammarError(_why(spec, matcher.error))
    allowed = matcher.allowed()
    allowed[list(compiled.end_ids)] = False
    if not bool(allowed.any()) and not matcher.accepting:
        raise GrammarError(f"the {spec.kind} grammar admits no string")
    return compiled


def _why(spec: GrammarSpec, message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else message
    if "nsatisfiable" in first:
        return f"the {spec.kind} grammar admits no string: {first}"
    return f"the {spec.kind} grammar does not compile: {first}"


def compile_grammar(
    spec: GrammarSpec, tokenizer: Any, vocab_size: int | None = None, timeout_s: float = COMPILE_TIMEOUT_S
) -> CompiledGrammar:
    """`spec` compiled against a Hugging Face fast `tokenizer` with masks of `vocab_size` tokens (default: the
    tokenizer's length; a model's vocabulary may be larger). Cached per tokenizer and spec (`GRAMMAR_CACHE_SIZE`
    per tokenizer). GrammarError when it does not compile, admits no string, or takes longer than `timeout_s` (the
    tokenizer's first reading, once per tokenizer and vocabulary size, is not counted)."""
    if tokenizer is None:
        raise GrammarError("a grammar needs the model's tokenizer; this model has none (token ids only)")
    size = int(vocab_size if vocab_size is not None else len(tokenizer))
    key = (spec, size)
    with _lock:
        cache = _compiled.setdefault(tokenizer, OrderedDict())
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    # the tokenizer's side (seconds for a large vocabulary, once per tokenizer) is outside the bound: no request's
    # grammar makes it longer
    lltok = _ll_tokenizer(tokenizer, size)
    future = _workers.submit(_compile, spec, lltok, size)
    try:
        compiled = future.result(timeout=timeout_s)
    except FutureTimeout:
        raise GrammarError(f"the {spec.kind} grammar took longer than {timeout_s:g} s to compile") from None
    with _lock:
        cache[key] = compiled
        while len(cache) > GRAMMAR_CACHE_SIZE:
            cache.popitem(last=False)
    return compiled
