"""What TensorRT-LLM's LLM arguments accept, from the record scripts/trtllm_llm_args.py extracted from
tensorrt_llm/llmapi/llm_args.py at the pinned commit (data/upstream/trtllm-llm-args-<commit>.json).

trtllm-serve reads its `--extra_llm_api_options` YAML (alias `--config`) with yaml.safe_load and merges it into the
LLM arguments (tensorrt_llm/commands/serve.py, update_llm_args_with_extra_dict), which pydantic then validates as
TorchLlmArgs (extra keys forbidden, BaseLlmArgs' model_config) with `speculative_config` a DFlashDecodingConfig.
`yaml_problems` says what that validation would refuse, by the record's field list and value rules, so a YAML
is refused here (`dflash-trt plan overlay`, the stand-in trtllm-serve of the tests) before a GPU sees it. The
validators' bodies are not in the record: the schedule's rules (DecodingBaseConfig's
validate_draft_len_schedule_and_sort and the max_concurrency exclusion) are restated in `schedule_problems`.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from ..settings import REPO_ROOT

COMMIT = "0004396720054fd8e205cbf616f21f0b57c6b412"
RECORD = REPO_ROOT / "data" / "upstream" / f"trtllm-llm-args-{COMMIT[:8]}.json"


@cache
def record(path: Path = RECORD) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def accepts(rule: dict[str, Any], value: Any) -> bool:
    """Whether a value passes a field's rule as the record states it (type, bounds, literal values)."""
    if value is None:
        return bool(rule.get("optional"))
    kind = rule["type"]
    if kind == "union":
        return any(accepts(r, value) for r in rule["any_of"])
    if kind == "literal":
        return value in rule["values"]
    if kind == "bool":
        return isinstance(value, bool)
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind == "float" else int):
            return False
        bounds = {"ge": value >= rule.get("ge", value), "gt": "gt" not in rule or value > rule["gt"]}
        bounds |= {"le": value <= rule.get("le", value), "lt": "lt" not in rule or value < rule["lt"]}
        return all(bounds.values())
    if kind in ("str", "path"):
        return isinstance(value, str)
    if kind == "list":
        return isinstance(value, list) and all(accepts(rule["items"], v) for v in value)
    if kind == "dict":
        return isinstance(value, dict) and all(
            accepts(rule["keys"], k) and accepts(rule["values_of"], v) for k, v in value.items()
        )
    return False  # "other": a class the record does not describe; refused rather than guessed


def fields_of(rec: dict[str, Any], name: str) -> dict[str, Any]:
    """A class's fields with those of its bases in the record (a subclass's own declaration wins)."""
    cls = rec["classes"][name]
    out: dict[str, Any] = {}
    for base in cls["bases"]:
        if base in rec["classes"]:
            out |= fields_of(rec, base)
    return out | dict(cls["fields"])


def schedule_problems(spec: dict[str, Any]) -> list[str]:
    """DecodingBaseConfig's validators on the schedule (llm_args.py at COMMIT): keys >= 1, lengths 0..max_draft_len,
    the smallest key's length max_draft_len; max_concurrency and draft_len_schedule mutually exclusive."""
    out = []
    schedule = spec.get("draft_len_schedule")
    if schedule is not None and "max_concurrency" in spec:
        out.append("speculative_config: max_concurrency and draft_len_schedule are mutually exclusive")
    if isinstance(schedule, dict) and schedule and isinstance(spec.get("max_draft_len"), int):
        top = spec["max_draft_len"]
        if not all(b >= 1 and 0 <= k <= top for b, k in schedule.items()):
            out.append(f"speculative_config.draft_len_schedule: keys >= 1 and lengths 0..max_draft_len ({top})")
        elif schedule[min(schedule)] != top:
            out.append("speculative_config.draft_len_schedule: the smallest key must map to max_draft_len")
    return out


def yaml_problems(loaded: Any, rec: dict[str, Any] | None = None) -> list[str]:
    """What TorchLlmArgs / DFlashDecodingConfig at COMMIT would refuse in a loaded trtllm-serve YAML (empty: none)."""
    rec = rec if rec is not None else record()
    if not isinstance(loaded, dict):
        return ["the YAML is not a mapping of LLM arguments"]
    top, spec_fields = fields_of(rec, rec["yaml"]["top_level"]), fields_of(rec, rec["yaml"]["speculative_config"])
    at = f"at NVIDIA/TensorRT-LLM {COMMIT[:8]}"
    out = []
    for key, value in loaded.items():
        if key not in top:
            out.append(f"{key}: not a {rec['yaml']['top_level']} field {at} (extra keys are forbidden)")
        elif key != "speculative_config" and not accepts(top[key]["rule"], value):
            out.append(f"{key}: {value!r} refused by {top[key]['annotation']} {at}")
    spec = loaded.get("speculative_config")
    if isinstance(spec, dict):
        for key, value in spec.items():
            if key not in spec_fields:
                out.append(f"speculative_config.{key}: not a {rec['yaml']['speculative_config']} field {at}")
            elif not accepts(spec_fields[key]["rule"], value):
                out.append(f"speculative_config.{key}: {value!r} refused by {spec_fields[key]['annotation']} {at}")
        out += schedule_problems(spec)
    elif spec is not None:
        out.append("speculative_config: not a mapping")
    return out
