"""Extract the keys TensorRT-LLM's LLM arguments accept, and their value constraints, from a copy of
tensorrt_llm/llmapi/llm_args.py, into data/upstream/trtllm-llm-args-<commit>.json.

    python scripts/trtllm_llm_args.py PATH/llm_args.py --commit SHA [--total-chars N] [--out FILE] [--note TEXT]

The file is parsed (`ast`), never imported (it imports torch, pydantic and TensorRT-LLM itself). For each class
named in CLASSES, and the classes they derive from within the file, it records every annotated field: its
annotation as written, its default (or "required"), the Field keywords that bound a value (ge, gt, le, lt, alias,
validation_alias) and a value rule the project's checks apply (`rule`: a type with its bounds, or the literal
values; "other" where the annotation names a class this script does not read), plus the validators' names and
the fields they name. StrEnum classes in the file give their values (a field typed by one accepts them). What a
validator's body enforces is not extracted: the project's checks state those rules with their source
(tests/builders/test_trtllm_serve_config.py check_like_decoding_base_config).

The classes are the ones `dflash-trt plan` writes keys of into trtllm-serve.yaml: the top level of the YAML is
TorchLlmArgs (BaseLlmArgs' subclass for the PyTorch backend, extra keys forbidden), its speculative_config a
DFlashDecodingConfig (DecodingBaseConfig's subclass). Keys TorchLlmArgs no longer declares but still takes on input
(REMOVED_ARGS: a "before" model validator pops them after a check) are recorded as `removed_args` with the check's
name. Bases the file imports rather than defines (StrictBaseModel, from tensorrt_llm/llmapi/utils.py) are listed in
`bases_not_in_file`: their model_config (extra, alias population, strictness) is not read here.

The record names its source so that anyone can check it: repository, path, commit, and the copy's length in
characters, its UTF-8 size and sha256. `--total-chars` is the length the upstream file has (what the search tool's
read_file reports as total_chars); a copy of another length is refused, so a partial copy cannot pass as the file.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

CLASSES = ("TorchLlmArgs", "DFlashDecodingConfig")
# the module-level table of arguments TorchLlmArgs dropped but still accepts (key -> the check run on its value)
REMOVED_ARGS = ("TorchLlmArgs", "_TORCH_LLMARGS_REMOVED_ARG_CHECKS")
# pydantic's constrained aliases and the bound each one is
CONSTRAINED = {
    "NonNegativeInt": ("int", {"ge": 0}),
    "PositiveInt": ("int", {"gt": 0}),
    "StrictInt": ("int", {}),
    "NonNegativeFloat": ("float", {"ge": 0}),
    "PositiveFloat": ("float", {"gt": 0}),
}
PLAIN = {"int": "int", "float": "float", "bool": "bool", "str": "str", "Path": "path", "object": "any", "Any": "any"}
BOUNDS = ("ge", "gt", "le", "lt")


def _name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _args(node: ast.expr) -> list[ast.expr]:
    return list(node.elts) if isinstance(node, ast.Tuple) else [node]


def rule(node: ast.expr, enums: dict[str, list[str]]) -> dict[str, Any]:
    """The value rule of an annotation: {"type": ..., bounds...}, "optional" for None allowed, "any_of" for a
    union, "values" for a Literal or a StrEnum, "items" / "keys" / "values_of" for containers."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | Y
        return _union([node.left, node.right], enums)
    if isinstance(node, ast.Constant) and node.value is None:
        return {"type": "none"}
    if isinstance(node, ast.Subscript):
        head, inner = _name(node.value), _args(node.slice)
        if head == "Optional":
            return {**rule(inner[0], enums), "optional": True}
        if head == "Union":
            return _union(inner, enums)
        if head == "Literal":
            return {"type": "literal", "values": [ast.literal_eval(v) for v in inner]}
        if head in ("List", "list", "Set", "set"):
            return {"type": "list", "items": rule(inner[0], enums)}
        if head in ("Dict", "dict"):
            return {"type": "dict", "keys": rule(inner[0], enums), "values_of": rule(inner[1], enums)}
        if head == "Annotated":
            return rule(inner[0], enums)
    name = _name(node)
    if name in CONSTRAINED:
        kind, bounds = CONSTRAINED[name]
        return {"type": kind, **bounds}
    if name in PLAIN:
        return {"type": PLAIN[name]}
    if name in enums:
        return {"type": "literal", "values": enums[name], "enum": name}
    return {"type": "other", "names": ast.unparse(node)}


def _union(parts: list[ast.expr], enums: dict[str, list[str]]) -> dict[str, Any]:
    rules = [rule(p, enums) for p in parts]
    optional = any(r["type"] == "none" for r in rules)
    rules = [r for r in rules if r["type"] != "none"]
    out = rules[0] if len(rules) == 1 else {"type": "union", "any_of": rules}
    return {**out, "optional": True} if optional else out


def _keywords(call: ast.Call) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg in BOUNDS or kw.arg == "alias":
            out[kw.arg] = ast.literal_eval(kw.value)
        elif kw.arg == "validation_alias" and isinstance(kw.value, ast.Call):
            out["validation_alias"] = [ast.literal_eval(a) for a in kw.value.args]
        elif kw.arg == "default":
            out["default"] = _default(kw.value)
        elif kw.arg == "default_factory":
            out["default"] = f"factory: {ast.unparse(kw.value)}"
    if "default" not in out:
        out["default"] = _default(call.args[0]) if call.args else "required"
    return out


def _default(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def field(stmt: ast.AnnAssign, enums: dict[str, list[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"annotation": ast.unparse(stmt.annotation)}
    value = stmt.value
    if isinstance(value, ast.Call) and _name(value.func) in ("Field", "PydanticField"):
        out.update(_keywords(value))
    else:
        out["default"] = "required" if value is None else _default(value)
    found = rule(stmt.annotation, enums)
    out["rule"] = {**found, **{k: out[k] for k in BOUNDS if k in out}}
    return out


def validators(cls: ast.ClassDef) -> list[dict[str, Any]]:
    out = []
    for item in cls.body:
        if not isinstance(item, ast.FunctionDef):
            continue
        for dec in item.decorator_list:
            if isinstance(dec, ast.Call) and _name(dec.func) in ("field_validator", "model_validator"):
                named = [ast.literal_eval(a) for a in dec.args if isinstance(a, ast.Constant)]
                mode = next((ast.literal_eval(k.value) for k in dec.keywords if k.arg == "mode"), None)
                out.append({"name": item.name, "kind": _name(dec.func), "fields": named, "mode": mode})
    return out


def removed_args(tree: ast.Module) -> dict[str, str]:
    """The REMOVED_ARGS table: each key the class still takes on input, and the name of the check on its value."""
    for node in tree.body:
        targets: list[ast.expr]
        if isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        if not any(_name(t) == REMOVED_ARGS[1] for t in targets):
            continue
        if not isinstance(value, ast.Dict):
            raise SystemExit(f"{REMOVED_ARGS[1]} is not a dict literal: this script does not read it")
        return {ast.literal_eval(k): ast.unparse(v) for k, v in zip(value.keys, value.values) if k is not None}
    return {}


def extract(source: str) -> dict[str, Any]:
    """Every class of CLASSES and its bases within the file: fields, validators, bases; and the StrEnums."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    enums = {
        name: [ast.literal_eval(s.value) for s in node.body if isinstance(s, ast.Assign)]
        for name, node in classes.items()
        if any(_name(b) == "StrEnum" for b in node.bases)
    }
    wanted: list[str] = []
    todo = list(CLASSES)
    while todo:
        name = todo.pop()
        if name in wanted or name not in classes:
            continue
        wanted.append(name)
        todo += [_name(b) for b in classes[name].bases]
    out: dict[str, Any] = {}
    for name in wanted:
        node = classes[name]
        fields = {
            s.target.id: field(s, enums)
            for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")
        }
        forbid = any(
            isinstance(s, ast.Assign)
            and any(_name(t) == "model_config" for t in s.targets)
            and "extra='forbid'" in ast.unparse(s.value).replace('"', "'")
            for s in node.body
        )
        out[name] = {
            "bases": [_name(b) for b in node.bases],
            "extra_forbidden": forbid or None,
            "fields": fields,
            "validators": validators(node),
        }
    missing = [c for c in CLASSES if c not in out]
    if missing:
        raise SystemExit(f"no class {', '.join(missing)} in the file: not llm_args.py?")
    out[REMOVED_ARGS[0]]["removed_args"] = removed_args(tree)
    outside = sorted({b for c in out.values() for b in c["bases"] if b not in classes})
    return {"classes": out, "bases_not_in_file": outside, "enums": enums}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("source", type=Path, help="a copy of tensorrt_llm/llmapi/llm_args.py (or of its field declarations)")
    p.add_argument("--commit", required=True, help="the NVIDIA/TensorRT-LLM commit the copy is of (40 hex digits)")
    p.add_argument("--out", type=Path, default=None, help="default: data/upstream/trtllm-llm-args-<commit[:8]>.json")
    p.add_argument(
        "--total-chars",
        type=int,
        default=None,
        help="the upstream file's length in characters; a copy of another length is refused",
    )
    p.add_argument("--note", default="", help="what the copy is, recorded in the file")
    args = p.parse_args(argv)
    if len(args.commit) != 40 or any(c not in "0123456789abcdef" for c in args.commit):
        p.error("--commit: 40 lower-case hex digits")
    data = args.source.read_bytes()
    text = data.decode("utf-8")
    if args.total_chars is not None and len(text) != args.total_chars:
        p.error(f"--total-chars: the copy has {len(text)} characters, the file {args.total_chars}: not the whole file")
    record = {
        "source": {
            "repository": "NVIDIA/TensorRT-LLM",
            "path": "tensorrt_llm/llmapi/llm_args.py",
            "commit": args.commit,
            "chars": len(text),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        },
        "extracted_by": "scripts/trtllm_llm_args.py",
        "note": args.note,
        "yaml": {"top_level": "TorchLlmArgs", "speculative_config": "DFlashDecodingConfig"},
        **extract(text),
    }
    out = (
        args.out
        or Path(__file__).resolve().parents[1] / "data" / "upstream" / f"trtllm-llm-args-{args.commit[:8]}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    counts = ", ".join(f"{name} {len(c['fields'])} fields" for name, c in record["classes"].items())
    print(f"wrote {out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
