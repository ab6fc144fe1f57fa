"""What a measured cost grid was measured on (torch-free): the target's shape, dtype, engine, tensor-parallel size
and GPU. scripts/gpu_bare.py writes it into cost_grid.json as "identity"; `trtllm-serve-config --cost-table`
refuses a grid whose target shape or tp differ from the target it configures, because pass times scale with
layers, width, heads and vocabulary (a grid of another model picks draft lengths for the wrong costs), and a grid
measured on another engine or dtype than the one it configures: an eager PyTorch pass (engine "torch") launches
every kernel from Python, where TensorRT-LLM replays CUDA graphs over its own kernels, and a float32 pass moves
twice the bytes of a bfloat16 one, so their times are not the served engine's either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The fields of a Hugging Face config.json that set a pass's cost, under the names the identity records.
SHAPE_FIELDS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
}


TRTLLM_ENGINE = "tensorrt-llm"  # the engine name of a grid measured through TensorRT-LLM (what trtllm-serve runs)
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class CostGridMismatch(ValueError):
    """The grid was measured on another target, or says nothing about what it was measured on."""


def target_shape(config: Mapping[str, Any]) -> dict[str, int]:
    """The identity's shape of a Hugging Face config (a mapping as config.json holds it). An unset
    num_key_value_heads means one KV head per query head (the transformers default)."""
    missing = [hf for name, hf in SHAPE_FIELDS.items() if name != "kv_heads" and config.get(hf) is None]
    if missing:
        raise CostGridMismatch(f"the target config has no {', '.join(missing)}")
    shape = {name: int(config.get(hf) or 0) for name, hf in SHAPE_FIELDS.items()}
    shape["kv_heads"] = shape["kv_heads"] or shape["heads"]
    return shape


def grid_identity(config: Mapping[str, Any], *, dtype: str, engine: str, tp: int, gpu: str) -> dict[str, Any]:
    """The record a grid carries: {"target": shape, "dtype", "engine", "tp", "gpu"}."""
    return {"target": target_shape(config), "dtype": dtype, "engine": engine, "tp": int(tp), "gpu": gpu}


def dtype_name(name: str | None) -> str | None:
    """One spelling per dtype ("bf16", "torch.bfloat16" -> "bfloat16"); None stays None."""
    if name is None:
        return None
    bare = str(name).removeprefix("torch.").lower()
    return DTYPE_NAMES.get(bare, bare)


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The checkpoint's dtype (transformers 5 writes `dtype`, 4.x `torch_dtype`): what trtllm-serve loads the
    target in when its dtype is left at "auto"."""
    return dtype_name(config.get("dtype") or config.get("torch_dtype"))


def read_target_config(target_dir: str | Path) -> dict[str, Any]:
    path = Path(target_dir) / "config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CostGridMismatch(f"cannot read the target's config {path}: {e}") from None
    return raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw


def check_grid_matches(
    grid: Mapping[str, Any],
    config: Mapping[str, Any],
    tp: int,
    source: str = "the grid",
    *,
    engine: str | None = None,
    dtype: str | None = None,
) -> None:
    """Raise CostGridMismatch with every difference between what `grid` was measured on and this target at `tp`,
    served by `engine` in `dtype` (each None: not checked)."""
    ident = grid.get("identity")
    if not isinstance(ident, Mapping) or not isinstance(ident.get("target"), Mapping):
        raise CostGridMismatch(
            f"{source} records no identity (target shape, dtype, engine, tp, GPU), so nothing says it was measured "
            "on this target: measure one with `python3 scripts/gpu_bare.py --grid-target TARGET_DIR`"
        )
    want = target_shape(config)
    got = {k: ident["target"].get(k) for k in SHAPE_FIELDS}
    diffs = [f"{k} {got[k]} (grid) != {want[k]} (target)" for k in SHAPE_FIELDS if got[k] != want[k]]
    if ident.get("tp") != tp:
        diffs.append(f"tp {ident.get('tp')} (grid) != {tp} (serving)")
    if diffs:
        raise CostGridMismatch(
            f"{source} was measured on another target ({'; '.join(diffs)}; {ident.get('engine')} engine, "
            f"{ident.get('dtype')}, {ident.get('gpu')}): its pass times do not apply. Measure this target's "
            "grid with `python3 scripts/gpu_bare.py --grid-target TARGET_DIR`"
        )
    if engine is not None and ident.get("engine") != engine:
        diffs.append(f"engine {ident.get('engine')} (grid) != {engine} (serving)")
    if dtype is not None and dtype_name(ident.get("dtype")) != dtype_name(dtype):
        diffs.append(f"dtype {ident.get('dtype')} (grid) != {dtype_name(dtype)} (serving)")
    if diffs:
        raise CostGridMismatch(
            f"{source} was measured on this target but on another engine or dtype ({'; '.join(diffs)}; "
            f"{ident.get('gpu')}): an eager PyTorch pass is not a TensorRT-LLM pass (CUDA graphs, its own kernels), "
            f"nor a float32 pass a bfloat16 one, so its pass times do not apply. Measure the grid on the engine and "
            "dtype that serve"
        )
