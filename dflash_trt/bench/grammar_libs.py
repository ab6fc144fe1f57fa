"""`dflash-trt bench grammar-libs`: llguidance (the package's, decoding/grammar.py) and xgrammar side by side on the
same tokenizers and JSON schemas: the measurement that chose llguidance.

Per library and tokenizer: the seconds to read the tokenizer (once per tokenizer, kept by both); per schema, the
seconds from the schema's text to the first mask (a compile then, whatever each library does lazily: xgrammar
compiles a mask cache up front, llguidance builds its lexer as masks ask) with no cache; then the seconds of one
mask, walking a valid instance of the schema token by token (mean, median, max over the walk's positions), and
what an instance's walk forces (xgrammar's jump-forward string, llguidance's forced tokens). Install size: the
files of the library and of every distribution it requires that the package does not already require.

xgrammar is no dependency of the package: a run measures it where it is importable (e.g. `pip install --target
DIR xgrammar` and PYTHONPATH=DIR), and reports it absent otherwise.

    dflash-trt bench grammar-libs --tokenizers models/target .cache/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from ..settings import DEMO_TARGET

# The schemas measured, each with a valid instance to walk: a flat object, a tool call's arguments with an enum, an
# array of nested objects, and a wide record (40 properties: the size of a real extraction schema).
WIDE = {f"field_{i}": {"type": "integer" if i % 3 else "string"} for i in range(40)}
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    ),
    "tool-call": (
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    "required": ["city", "unit", "days"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
    ),
    "nested-array": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                        },
                        "required": ["id", "tags"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {"items": [{"id": 1, "tags": ["a", "bc"]}, {"id": 22, "tags": []}, {"id": 3, "tags": ["def"]}]},
    ),
    "wide-40": (
        {"type": "object", "properties": WIDE, "required": list(WIDE), "additionalProperties": False},
        {k: (i if i % 3 else f"v{i}") for i, k in enumerate(WIDE)},
    ),
}
LIBRARIES = ("llguidance", "xgrammar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizers",
        nargs="+",
        type=Path,
        default=[DEMO_TARGET, Path(".cache/models/smollm2-135m-instruct")],
        help="Hugging Face tokenizer folders (default: the demo target's 4,096 and SmolLM2's 49,152 tokens)",
    )
    p.add_argument("--repeats", type=int, default=3, help="compiles per schema; the median is reported (default 3)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results/structured/grammar-libs.json"),
        help="JSON written (default %(default)s)",
    )


def install_mb(library: str) -> float | None:
    """MB on disk of `library` and of the distributions it requires that dflash-trt does not (None: absent)."""
    try:
        metadata.distribution(library)
    except metadata.PackageNotFoundError:
        return None
    ours = _closure(["dflash-trt"]) if _installed("dflash-trt") else set()
    extra = _closure([library]) - ours
    total = 0
    for name in extra:
        dist = metadata.distribution(name)
        for f in dist.files or []:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                total += path.stat().st_size
    return total / 1e6


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _closure(names: Iterable[str]) -> set[str]:
    """The installed distributions `names` require, transitively (markers evaluated, no extras), with them."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [n.lower().replace("_", "-") for n in names]
    while todo:
        name = todo.pop()
        if name in seen or not _installed(name):
            continue
        seen.add(name)
        for line in metadata.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name.lower().replace("_", "-"))
    return seen


class _Lib:
    """One library's calls, timed by the caller: read a tokenizer, compile a schema to its first mask, and a
    matcher's mask / accept / forced text."""

    name = ""

    def tokenizer(self, tok: Any, vocab: int) -> Any:
        raise NotImplementedError

    def first_mask(self, info: Any, schema: str, vocab: int) -> Any:
        raise NotImplementedError

    def mask(self, m: Any) -> Any:
        raise NotImplementedError

    def allows(self, mask: Any, token: int) -> bool:
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    def accept(self, m: Any, token: int) -> bool:
        raise NotImplementedError

    def forced(self, m: Any, tok: Any) -> str:
        raise NotImplementedError


class _Matcher:
    def __init__(self, matcher: Any, bits: Any):
        self.matcher, self.bits = matcher, bits


class _Llguidance(_Lib):
    name = "llguidance"

    def __init__(self) -> None:
        import llguidance
        import llguidance.hf
        import torch

        self.llg, self.hf, self.torch = llguidance, llguidance.hf, torch

    def tokenizer(self, tok: Any, vocab: int) -> Any:
        return self.hf.from_tokenizer(tok, n_vocab=vocab)

    def first_mask(self, info: Any, schema: str, vocab: int) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = _Matcher(
            self.llg.LLMatcher(info, grammar, log_level=0),
            self.torch.empty((vocab + 31) // 32, dtype=self.torch.int32),
        )
        self.mask(m)
        if m.matcher.is_error():
            raise RuntimeError(m.matcher.get_error())
        return m

    def mask(self, m: Any) -> Any:
        m.matcher.unsafe_compute_mask_ptr(m.bits.data_ptr(), m.bits.numel() * 4)
        return m.bits

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.matcher.consume_token(token))

    def forced(self, m: Any, tok: Any) -> str:
        return str(tok.decode(m.matcher.compute_ff_tokens()))


class _Xgrammar(_Lib):
    name = "xgrammar"

    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar

    def tokenizer(self, tok: Any, vocab: int) -> Any:
        return self.xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)

    def first_mask(self, info: Any, schema: str, vocab: int) -> Any:
        compiler = self.xgr.GrammarCompiler(info, cache_enabled=False)
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"), strict_mode=True)
        m = _Matcher(self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, vocab))
        self.mask(m)
        return m

    def mask(self, m: Any) -> Any:
        m.matcher.fill_next_token_bitmask(m.bits)
        return m.bits[0]

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.matcher.accept_token(token))

    def forced(self, m: Any, tok: Any) -> str:
        return str(m.matcher.find_jump_forward_string())


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out


def measure(lib: _Lib, tok: Any, vocab: int, repeats: int) -> dict[str, Any]:
    """One library on one tokenizer: its tokenizer's seconds, and per schema the compile and the walk."""
    tok_s, info = _timed(lambda: lib.tokenizer(tok, vocab))
    out: dict[str, Any] = {"tokenizer_s": round(tok_s, 4), "schemas": {}}
    for name, (schema, instance) in SCHEMAS.items():
        text = json.dumps(schema)
        compiles = [_timed(lambda: lib.first_mask(info, text, vocab)) for _ in range(repeats)]
        m = compiles[-1][1]
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        masks, forced_chars = [], 0
        for t in ids:
            s, mask = _timed(lambda: lib.mask(m))
            masks.append(s)
            if not lib.allows(mask, t):
                raise RuntimeError(f"{lib.name} refuses token {t} ({tok.decode([t])!r}) of a valid {name} instance")
            forced_chars += len(lib.forced(m, tok))
            if not lib.accept(m, t):
                raise RuntimeError(f"{lib.name} could not accept token {t} of a valid {name} instance")
        out["schemas"][name] = {
            "compile_ms": round(1e3 * statistics.median(s for s, _ in compiles), 3),
            "mask_us_mean": round(1e6 * statistics.fmean(masks), 1),
            "mask_us_median": round(1e6 * statistics.median(masks), 1),
            "mask_us_max": round(1e6 * max(masks), 1),
            "instance_tokens": len(ids),
            "forced_chars_per_position": round(forced_chars / len(ids), 2),
        }
    return out


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    libs: list[_Lib] = []
    report: dict[str, Any] = {
        "source": "dflash-trt bench grammar-libs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "libraries": {},
    }
    for name, make in (("llguidance", _Llguidance), ("xgrammar", _Xgrammar)):
        entry: dict[str, Any] = {"install_mb": install_mb(name)}
        try:
            import_s, lib = _timed(make)
        except ImportError as e:
            entry["absent"] = str(e)
            print(f"{name}: not importable ({e}); install it to measure it")
        else:
            libs.append(lib)
            entry["version"] = metadata.version(name)
            entry["import_s"] = round(import_s, 2)
            entry["tokenizers"] = {}
        report["libraries"][name] = entry
    for folder in args.tokenizers:
        tok = AutoTokenizer.from_pretrained(folder)
        vocab = len(tok)
        for lib in libs:
            result = measure(lib, tok, vocab, args.repeats)
            result["vocab"] = vocab
            report["libraries"][lib.name]["tokenizers"][str(folder)] = result
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def table(report: dict[str, Any]) -> str:
    """The report as Markdown: one line per library, tokenizer and schema."""
    lines = [
        "| library | install MB | vocab | tokenizer s | schema | compile ms | mask us mean / median / max | forced chars/pos |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in report["libraries"].items():
        mb = f"{entry['install_mb']:.1f}" if entry.get("install_mb") is not None else "absent"
        for _folder, t in entry.get("tokenizers", {}).items():
            for schema, s in t["schemas"].items():
                lines.append(
                    f"| {name} {entry.get('version', '')} | {mb} | {t['vocab']} | {t['tokenizer_s']} | {schema} | "
                    f"{s['compile_ms']} | {s['mask_us_mean']} / {s['mask_us_median']} / {s['mask_us_max']} | "
                    f"{s['forced_chars_per_position']} |"
                )
    return "\n".join(lines)
