"""TensorRT FP16 plan from the exported drafter graph (`dflash-trt build-drafter`).

Precision per TensorRT major version:
  10.x  strongly typed on the fp16 graph (default), or weak typing: the fp32 graph + BuilderFlag.FP16
  11.x  strongly typed only (BuilderFlag.FP16 is gone): the fp16 graph, whose casts fix every type
Strong typing is the default because the fp16 graph keeps the RMS norms' arithmetic in fp32
(builders/onnx_drafter.to_fp16) and a strongly typed build follows its casts; under weak typing TensorRT may pick
fp16 kernels for the norms' squares, which overflow above 256 (target hidden states reach thousands).
Every dynamic input gets a profile (block length, new-context length, cache length). A plan only
loads on the TensorRT version and GPU it was built for, so the manifest beside it records both.
Written against the real API, never run in this project (no TensorRT / TensorRT-LLM / GPU here); tests
drive it with a fake `tensorrt` module (tests/fake_tensorrt.py). `tensorrt` is imported only inside these functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats import FP16_GRAPH_FILE, GRAPH_FILE, META_FILE, PLAN_FILE, PLAN_MANIFEST, DrafterGraphMeta
from ..runtime.base import EngineUnavailable
from ..runtime.trt_backend import import_tensorrt
from .hashing import files_sha256


@dataclass(frozen=True)
class ProfileShapes:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def trt_major(trt: Any) -> int:  # the tensorrt module (untyped)
    return int(str(trt.__version__).split(".")[0])


def profile_shapes(
    meta: DrafterGraphMeta, max_context: int | None = None, max_new_tokens: int | None = None
) -> dict[str, ProfileShapes]:
    """min / opt / max for every dynamic input. opt = a steady-state round (B new tokens, half-full cache)."""
    B = meta.block_size
    ctx = min(max_context or meta.max_context, meta.max_context)
    new = min(max_new_tokens or ctx, ctx)  # the prefill hands the whole prompt's features at once

    def cache(t: int) -> tuple[int, ...]:
        return (meta.num_layers, 1, meta.num_kv_heads, t, meta.head_dim)

    return {
        "block_ids": ProfileShapes((1, 2), (1, B), (1, B)),
        "features": ProfileShapes((1, 1, meta.feature_size), (1, B, meta.feature_size), (1, new, meta.feature_size)),
        "past_k": ProfileShapes(cache(0), cache(ctx // 2), cache(ctx)),
        "past_v": ProfileShapes(cache(0), cache(ctx // 2), cache(ctx)),
    }


def choose_typing(major: int, requested: str | None) -> str:
    if major >= 11:
        if requested == "weak":
            raise ValueError("TensorRT 11 builds strongly typed networks only: use --typing strong (the fp16 graph)")
        return "strong"
    if major == 10:
        return requested or "strong"
    raise EngineUnavailable(f"TensorRT {major}.x is not supported: install TensorRT 10.x or 11.x")


def build_drafter_plan(
    graph_dir: str | Path,
    out_dir: str | Path,
    *,
    typing: str | None = None,
    max_context: int | None = None,
    max_new_tokens: int | None = None,
    workspace_gib: float = 4.0,
) -> Path:
    """Parse the exported graph, add one optimization profile, build an FP16 plan, write plan + manifest."""
    import_tensorrt()  # a missing TensorRT is the first thing to say
    meta = DrafterGraphMeta.read(graph_dir)
    return build_plan(
        graph_dir,
        out_dir,
        (GRAPH_FILE, FP16_GRAPH_FILE),
        profile_shapes(meta, max_context, max_new_tokens),
        PLAN_FILE,
        PLAN_MANIFEST,
        typing=typing,
        workspace_gib=workspace_gib,
    )


def build_plan(
    graph_dir: str | Path,
    out_dir: str | Path,
    graphs: tuple[str, str],
    shapes: dict[str, ProfileShapes],
    plan_file: str,
    manifest_file: str,
    *,
    typing: str | None = None,
    workspace_gib: float = 4.0,
) -> Path:
    """Build one graph (graphs = (fp32 file, fp16 file)) with one profile `shapes`."""
    trt = import_tensorrt()
    graph_dir, out_dir = Path(graph_dir), Path(out_dir)
    meta = DrafterGraphMeta.read(graph_dir)
    major = trt_major(trt)
    typing = choose_typing(major, typing)
    onnx_path = graph_dir / (graphs[1] if typing == "strong" else graphs[0])
    if not onnx_path.is_file():
        raise FileNotFoundError(f"{onnx_path} not found (run `dflash-trt export-drafter` first)")

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if typing == "strong":
        # In 11.x the flag is the only mode (kept for clarity; 10.x needs it to opt in).
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # parse_from_file, not parse(bytes): it resolves the external weights file beside the graph.
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: " + "; ".join(errors))

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if typing == "weak":
        config.set_flag(trt.BuilderFlag.FP16)  # 10.x only: fp16 kernels where TensorRT judges it safe
    inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    missing = set(inputs) ^ set(shapes)
    if missing:
        raise RuntimeError(f"graph inputs {sorted(inputs)} do not match the profile's {sorted(shapes)}")
    profile = builder.create_optimization_profile()
    for name in inputs:
        s = shapes[name]
        profile.set_shape(name, s.min, s.opt, s.max)
    config.add_optimization_profile(profile)

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build the drafter plan (see the TensorRT log above)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / plan_file).write_bytes(bytes(plan))
    # What each execution context allocates on the device beside the plan's weights: ICudaEngine.device_memory_size_v2
    # (TensorRT 10.1+ and 11 Python API; the activation memory a context created with the default STATIC strategy
    # takes, sized for the largest profile). The executor's memory plan counts it per row (runtime/trtllm_memory.py).
    engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(plan))
    if engine is None:
        raise RuntimeError("TensorRT could not load the plan it just built (see the TensorRT log above)")
    sources = [onnx_path, onnx_path.with_name(onnx_path.name + ".data"), graph_dir / META_FILE]
    manifest = {
        "backend": "tensorrt",
        "plan": plan_file,
        "tensorrt_version": str(trt.__version__),
        "typing": typing,
        "precision": "fp16",
        "context_device_memory": int(engine.device_memory_size_v2),
        "gpu": gpu_name(),
        "profile": {k: {"min": v.min, "opt": v.opt, "max": v.max} for k, v in shapes.items()},
        "source_graph": onnx_path.name,
        "input_sha256": files_sha256([p for p in sources if p.is_file()]),
        "meta": json.loads(meta.to_json()),
    }
    (out_dir / manifest_file).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (out_dir / META_FILE).write_text(meta.to_json())  # the runtime contract travels with the plan
    return out_dir / plan_file


def gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a name for the manifest, never a reason to fail a build
        return None
