"""What every python-backend model here shares: its parameters, its version folder, input access."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def load_config(args: dict) -> tuple[dict, dict, Path]:
    """(model config, string parameters, version folder) from the dict Triton passes to initialize()."""
    config = json.loads(args["model_config"])
    params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
    folder = Path(args["model_repository"]) / args["model_version"]
    return config, params, folder


def resolve(folder: Path, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else folder / p


def load_text_model(args: dict):
    """(string parameters, the tokenizer) of a text model (pre/postprocessing): `tokenizer_dir` in its folder."""
    from ...models.target import load_tokenizer

    _, params, folder = load_config(args)
    tokenizer = load_tokenizer(resolve(folder, params.get("tokenizer_dir", "tokenizer")))
    if tokenizer is None:
        raise RuntimeError(f"no tokenizer in {folder}: the repository was written without one")
    return params, tokenizer


def get(request, name: str, default=None) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy()


def scalar(request, name: str, default, rows: int) -> list:
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


def error_response(message: str, cancelled: bool = False):
    if cancelled:  # Triton's CANCELLED status (python backend >= 23.10), so clients see a cancellation
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
            message, pb_utils.TritonError.CANCELLED))
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


def strings(values: list[str], rows: int | None = None) -> np.ndarray:
    arr = np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    return arr.reshape(-1, 1) if rows is not None else arr
