"""What every python-backend model here shares: its parameters, its version folder, input access."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

# Triton's python backend (triton_python_backend_utils) is untyped: its requests and responses are Any here.


def load_config(args: dict[str, str]) -> tuple[dict[str, Any], dict[str, str], Path]:
    """(model config, string parameters, version folder) from the dict Triton passes to initialize()."""
    config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    folder = Path(args["model_repository"]) / args["model_version"]
    return config, params, folder


def resolve(folder: Path, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else folder / p


def load_text_model(args: dict[str, str]) -> tuple[dict[str, str], Any]:
    """(string parameters, the tokenizer) of a text model (pre/postprocessing): `tokenizer_dir` in its folder.
    The tokenizer is Any as in dflash_trt.decoding: transformers types its decode() looser than the
    detokenizer's protocol."""
    from ...models.target import load_tokenizer

    _, params, folder = load_config(args)
    tokenizer = load_tokenizer(resolve(folder, params.get("tokenizer_dir", "tokenizer")))
    if tokenizer is None:
        raise RuntimeError(f"no tokenizer in {folder}: the repository was written without one")
    return params, tokenizer


def get(request: Any, name: str, default: np.ndarray | None = None) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    value: np.ndarray = t.as_numpy()
    return value


def need(request: Any, name: str) -> np.ndarray:
    """A required input (the model config declares it, so Triton refuses a request without it)."""
    a = get(request, name)
    if a is None:
        raise ValueError(f"input {name!r} is missing")
    return a


def scalar(request: Any, name: str, default: Any, rows: int) -> list[Any]:
    """An optional per-row scalar input ([N, 1] with batching, [1] without) as a list of N values."""
    a = get(request, name)
    if a is None:
        return [default] * rows
    flat = a.reshape(-1)
    if flat.size == 1 and rows > 1:
        return [flat[0].item()] * rows
    if flat.size != rows:
        raise ValueError(f"input {name!r} has {flat.size} values for {rows} rows")
    return [v.item() for v in flat]


def texts(request: Any, name: str, default: str, rows: int) -> list[str]:
    """An optional per-row string input (TYPE_STRING, [N, 1] with batching) as a list of N strings."""
    a = get(request, name)
    if a is None:
        return [default] * rows
    flat = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in a.reshape(-1)]
    if len(flat) == 1 and rows > 1:
        return flat * rows
    if len(flat) != rows:
        raise ValueError(f"input {name!r} has {len(flat)} values for {rows} rows")
    return flat


def error_response(message: str, cancelled: bool = False) -> Any:  # a pb_utils.InferenceResponse
    if cancelled:  # Triton's CANCELLED status (python backend >= 23.10), so clients see a cancellation
        return pb_utils.InferenceResponse(
            output_tensors=[], error=pb_utils.TritonError(message, pb_utils.TritonError.CANCELLED)
        )
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


def strings(values: list[str], rows: int | None = None) -> np.ndarray:
    arr = np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    return arr.reshape(-1, 1) if rows is not None else arr
