"""`dflash-trt bench forced`: structured outputs with and without drafting the tokens their grammar forces
(`GenerationConfig.forced_drafts`, decoding/guided.py), on JSON-schema and tool-call workloads.

Per model and proposer, each prompt under each schema runs greedy twice, forced drafting on and off, interleaved,
one request at a time (the shared suffix structure emptied before each run); the outputs must be equal (exit 1
otherwise: forced drafts are verified like any other) and valid JSON of the schema where they finished. Reports
tau (tokens per round, bonus included) and tokens/s per setting, over all its requests. The demo target completes
raw text (`/v1/completions`); a model with a chat template (SmolLM2-135M-Instruct, `make models`) is asked in a
chat message.

    dflash-trt bench forced                                     # the demo pair: dflash and suffix
    dflash-trt bench forced --target .cache/models/smollm2-135m-instruct --drafter none --proposers suffix ngram
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from ..settings import DEMO_DRAFTER, DEMO_TARGET, NO_DRAFTER, drafter_path

SCHEMAS: dict[str, dict[str, Any]] = {
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "kind": {"enum": ["function", "class", "module", "constant"]},
            "line_count": {"type": "integer", "minimum": 0},
            "public": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        },
        "required": ["name", "kind", "line_count", "public", "tags"],
        "additionalProperties": False,
    },
    # a tool call as "required" / a named function would constrain it: the name and the arguments' keys forced
    "tool-call": {
        "type": "object",
        "properties": {
            "name": {"const": "search_files"},
            "arguments": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "maxLength": 32},
                    "directory": {"type": "string", "maxLength": 32},
                    "case_sensitive": {"type": "boolean"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 100},
                },
                "required": ["pattern", "directory", "case_sensitive", "max_results"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}
PROMPTS = [
    'def load_config(path):\n    """Read the configuration file at path and return it as a dict."""\n',
    'class LRUCache:\n    """A dictionary that forgets its least recently used keys."""\n',
    "import os\n\n\ndef walk_sources(root):\n    for dirpath, _, files in os.walk(root):\n",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=DEMO_TARGET, help="target checkpoint (default %(default)s)")
    p.add_argument(
        "--drafter",
        type=drafter_path,
        default=DEMO_DRAFTER,
        metavar="{DIR,none}",
        help="DFlash drafter (default %(default)s); none: no drafter, for --proposers that need none",
    )
    p.add_argument("--proposers", nargs="+", default=["dflash", "suffix"], help="(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="(default %(default)s)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="prompts per schema (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument(
        "--out", type=Path, default=Path("results/structured/forced.json"), help="JSON written (default %(default)s)"
    )


def prompt_ids(decoder: Any, text: str, schema: dict[str, Any]) -> list[int]:
    """Raw text for a completion model; a chat message asking for the JSON where the tokenizer has a template."""
    from ..decoding.prompting import chat_prompt_ids, has_chat_template

    if not has_chat_template(decoder.tokenizer):
        return list(decoder.encode(text))
    ask = f"Describe this Python code as JSON following this schema: {json.dumps(schema)}\n\n{text}"
    return chat_prompt_ids(decoder.tokenizer, [{"role": "user", "content": ask}])


def run(args: argparse.Namespace) -> int:
    import torch

    from ..decoding import GenerationConfig, GrammarSpec
    from ..decoding.proposers import PROPOSERS, proposer_for
    from ..loading import load_decoder

    drafter = None if args.drafter == NO_DRAFTER else args.drafter
    if drafter is None and any(proposer_for(name).uses_drafter for name in args.proposers):
        free = [name for name in PROPOSERS if not proposer_for(name).uses_drafter]
        raise SystemExit(f"--drafter none: name only --proposers that need no drafter ({', '.join(free)})")
    torch.set_num_threads(args.threads)
    decoder = load_decoder(args.target, drafter)
    report: dict[str, Any] = {
        "source": "dflash-trt bench forced",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "target": str(args.target),
        "drafter": None if drafter is None else str(drafter),
        "max_new_tokens": args.max_new_tokens,
        "rows": [],
    }
    mismatches = 0
    for proposer in args.proposers:
        for schema_name, schema in SCHEMAS.items():
            totals = {
                on: {"tokens": 0, "round_tokens": 0, "rounds": 0, "seconds": 0.0, "valid": 0, "finished": 0}
                for on in (1, 0)
            }
            for text in PROMPTS[: args.prompts]:
                ids = prompt_ids(decoder, text, schema)
                outputs = {}
                for on in (1, 0):
                    decoder.forget_finished_outputs()
                    config = GenerationConfig(
                        max_new_tokens=args.max_new_tokens,
                        grammar=GrammarSpec.json_schema(schema),
                        proposer=proposer,
                        forced_drafts=bool(on),
                        stop_token_ids=decoder.default_stop_ids(),
                    )
                    start = time.perf_counter()
                    [r] = decoder.generate([ids], config)
                    seconds = time.perf_counter() - start
                    outputs[on] = r.token_ids
                    t = totals[on]
                    t["tokens"] += r.stats.new_tokens
                    t["round_tokens"] += sum(r.stats.acceptance_lengths)  # tau: the verify rounds' (no prefill)
                    t["rounds"] += len(r.stats.acceptance_lengths)
                    t["seconds"] += seconds
                    if r.finish_reason == "stop":
                        t["finished"] += 1
                        t["valid"] += _valid(r.text or "", decoder.tokenizer)
                if outputs[1] != outputs[0]:
                    mismatches += 1
                    print(f"MISMATCH: {proposer} {schema_name}: forced drafting changed the output")
            for on in (1, 0):
                t = totals[on]
                row = {
                    "proposer": proposer,
                    "schema": schema_name,
                    "forced_drafts": bool(on),
                    "requests": len(PROMPTS[: args.prompts]),
                    "tokens": t["tokens"],
                    "tau": round(t["round_tokens"] / max(1, t["rounds"]), 3),
                    "tokens_per_s": round(t["tokens"] / t["seconds"], 1),
                    "finished": t["finished"],
                    "valid_json": t["valid"],
                }
                report["rows"].append(row)
    report["mismatches"] = mismatches
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 1 if mismatches else 0


def _valid(text: str, tokenizer: Any) -> int:
    """1 if the finished text (its end-of-text token's text removed) is a JSON value."""
    eos = getattr(tokenizer, "eos_token", None) or ""
    try:
        json.loads(text.replace(eos, "") if eos else text)
    except json.JSONDecodeError:
        return 0
    return 1


def table(report: dict[str, Any]) -> str:
    lines = [
        f"target {report['target']}, drafter {report['drafter']}, greedy, {report['max_new_tokens']} new tokens at "
        f"most, load average {report['load_average_1m']}",
        "",
        "| proposer | schema | forced drafts | tau | tokens/s | finished (valid JSON) / requests |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['proposer']} | {r['schema']} | {'on' if r['forced_drafts'] else 'off'} | {r['tau']} | "
            f"{r['tokens_per_s']} | {r['finished']} ({r['valid_json']}) / {r['requests']} |"
        )
    return "\n".join(lines)
