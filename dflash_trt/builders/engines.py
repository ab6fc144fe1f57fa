"""`make engines`: one config file in, every engine this machine can build out, plus engines/manifest.json.

    CPU (always):          drafter -> ONNX fp32 + fp16 (ONNX Runtime); target -> PyTorch from the checkpoint
    GPU + TensorRT:        drafter -> FP16 plan
    GPUs + TensorRT-LLM:   target -> tensor-parallel engine with the drafter's feature layers as outputs

Each step has a key: the sha256 of its inputs (checkpoint contents, settings, tool versions). A step
whose key equals the manifest's and whose files are all present is skipped, so re-running with
unchanged inputs does nothing. The manifest says which backend serves each role; the server,
`generate --engines` and the Triton repository read it through formats.serving_sources(). Checkpoint paths in it
are relative to its folder, so engines/ and the checkpoints can move together (a Docker mount).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib

from ..formats import (
    DRAFTER_ONNX_DIR,
    DRAFTER_TRT_DIR,
    MANIFEST,
    MANIFEST_VERSION,
    TARGET_TRTLLM_DIR,
    DrafterGraphMeta,
    read_manifest,
    read_plan_manifest,
)
from . import hashing
from .export_cache import EXPORT_CODE, EXPORT_TOOLS, cached_export, export_key
from .hashing import file_sha256, tree_sha256, tree_stamp, versions

if TYPE_CHECKING:
    from ..config import DFlashSpec

PRECISIONS = ("fp16", "fp32")


class EnginesConfigError(ValueError):
    pass


class EnginesDependencyError(RuntimeError):
    """A module the engines step needs is not installed in this Python (the message names the install)."""


# What the drafter's ONNX export imports (builders/onnx_drafter.py): onnx, onnxruntime's float16 converter, and
# onnxscript, which torch.onnx.export(dynamo=True) needs. A TensorRT-LLM container holds only the first:
# TensorRT-LLM's requirements.txt lists `onnx>=1.18.0,<1.20.0` and neither of the others (NVIDIA/TensorRT-LLM
# requirements.txt at 000867d9b1ad62f3de1e54e111c094da492a5626, the 1.2.0 line: tensorrt~=10.13.3,
# transformers==4.57.1). pyproject.toml lists all three; CONTAINER_INSTALL installs them into such a container.
EXPORT_MODULES = ("onnx", "onnxruntime", "onnxscript")
# The gpu image's Dockerfile runs this same script (tests/deploy/test_engines_build_script.py checks that).
CONTAINER_INSTALL = "scripts/container_install.sh"


def missing_export_modules() -> list[str]:
    """The EXPORT_MODULES this Python cannot import (imported, not only found: a broken install counts too)."""
    import importlib

    missing = []
    for name in EXPORT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def check_export_modules() -> None:
    """Refuse, before anything is built, where the drafter export could not run, naming the install."""
    missing = missing_export_modules()
    if missing:
        raise EnginesDependencyError(
            f"the engines step exports the drafter to ONNX, which needs {', '.join(missing)}, not installed in "
            f"this Python (a TensorRT-LLM container ships onnx only). Install this project into it, keeping the "
            f"container's torch and TensorRT-LLM, from the repository root: `{CONTAINER_INSTALL}` (what the gpu "
            f"image's Dockerfile runs)"
        )


# Pipeline parallelism splits the target's layers over stages (ranks); the drafter conditions every block on hidden
# states taken from several of those layers at once (the feature layers, spread over the depth), which no single
# stage holds, and layer ids become stage-local (builders/trtllm_features.py refuses pp_size != 1 for that reason).
# Across nodes, tensor parallelism spans the nodes instead (one tp group over every GPU of the job).
PIPELINE_KEYS = ("pp", "pp_size", "pipeline_parallel", "pipeline_parallel_size")
PIPELINE_REFUSAL = (
    "pipeline parallelism ({keys}) is not supported: the DFlash drafter needs the target's hidden states from "
    "feature layers that would live on different pipeline stages; use tensor parallelism (tp), which may span "
    "nodes (deploy/README.md)"
)


@dataclass
class EnginesConfig:
    target: Path
    drafter: Path
    output: Path = Path("engines")
    tp: int = 1
    # GPUs of one node (pod) the TensorRT-LLM ranks run on, recorded in the engine; 0: tp (one node holds every
    # rank). Two 4-GPU nodes serving tp 8 need 4: the Executor puts rank r on GPU r % gpus_per_node (trtllm_target)
    gpus_per_node: int = 0
    block_size: int = 0  # 0: the drafter's trained block size
    precision: str = "fp16"  # GPU engines; the CPU drafter ships both fp32 and fp16 graphs, serves fp32
    max_batch_size: int = 8
    max_input_len: int = 2048
    max_seq_len: int = 4096

    def settings(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def read_config(path: str | Path | None, base: Path, overrides: dict[str, Any] | None = None) -> EnginesConfig:
    """TOML or JSON; relative paths are relative to `base` (the repo root). Missing keys take defaults."""
    from ..settings import DEMO_DRAFTER, DEMO_TARGET

    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise EnginesConfigError(f"engines config not found: {path}")
        text = path.read_text()
        try:
            raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise EnginesConfigError(f"{path}: {e}") from None
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    pipeline = sorted(k for k in PIPELINE_KEYS if k in raw and raw[k] not in (None, 1))
    if pipeline:
        raise EnginesConfigError(PIPELINE_REFUSAL.format(keys=pipeline))
    raw = {k: v for k, v in raw.items() if k not in PIPELINE_KEYS}
    known = {f.name for f in fields(EnginesConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise EnginesConfigError(f"unknown engines config keys {unknown} (known: {sorted(known)})")
    raw.setdefault("target", DEMO_TARGET)
    raw.setdefault("drafter", DEMO_DRAFTER)
    for key in ("target", "drafter", "output"):
        if key in raw:
            p = Path(raw[key])
            raw[key] = p if p.is_absolute() else base / p
    cfg = EnginesConfig(**raw)
    if cfg.precision not in PRECISIONS:
        raise EnginesConfigError(f"precision must be one of {PRECISIONS}, got {cfg.precision!r}")
    for key in ("tp", "max_batch_size", "max_input_len", "max_seq_len"):
        if not isinstance(getattr(cfg, key), int) or getattr(cfg, key) < 1:
            raise EnginesConfigError(f"{key} must be a positive integer, got {getattr(cfg, key)!r}")
    if not isinstance(cfg.gpus_per_node, int) or cfg.gpus_per_node < 0:
        raise EnginesConfigError(f"gpus_per_node must be 0 (= tp, one node) or positive, got {cfg.gpus_per_node!r}")
    from .trtllm_target import nodes_split

    why = nodes_split(cfg.tp, cfg.gpus_per_node or cfg.tp)
    if why:
        raise EnginesConfigError(why)
    if not isinstance(cfg.block_size, int) or cfg.block_size < 0 or cfg.block_size == 1:
        raise EnginesConfigError(f"block_size must be 0 (trained size) or >= 2, got {cfg.block_size!r}")
    return cfg


def step_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _relative_to(folder: Path, path: Path) -> str:
    """`path` as the manifest stores it: relative to the manifest's folder, so engines/ and the checkpoints
    can move together (another checkout, a Docker mount)."""
    return os.path.relpath(path.resolve(), folder.resolve())


def _up_to_date(previous: dict[str, Any] | None, key: str, out: Path) -> bool:
    """Same key and every recorded file intact: by the folder's stamp when it matches the manifest's (no file is
    read: a 70B engine is about 140 GB), else by the files' hashes."""
    if not previous or previous.get("key") != key:
        return False
    folder = out / previous["dir"]
    files = previous.get("files", {})
    if not all((folder / name).is_file() for name in files):
        return False
    if previous.get("stamp") is not None and previous["stamp"] == tree_stamp(folder):
        return True
    return all(file_sha256(folder / name) == sha for name, sha in files.items())


def _source(out: Path, path: Path, previous: dict[str, Any] | None) -> dict[str, str]:
    """A checkpoint as the manifest records it; its content hash is reused while its path and stamp are the
    manifest's (a start hashes nothing), else computed."""
    rel, stamp = _relative_to(out, path), tree_stamp(path)
    if previous and previous.get("path") == rel and previous.get("stamp") == stamp and previous.get("sha256"):
        return {"path": rel, "sha256": previous["sha256"], "stamp": stamp}
    return {"path": rel, "sha256": tree_sha256(path), "stamp": stamp}


def _record_files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class BuildReport:
    built: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        return (
            [f"built      {n}" for n in self.built]
            + [f"up to date {n}" for n in self.unchanged]
            + [f"skipped    {n}: {why}" for n, why in self.skipped.items()]
        )


@dataclass
class BuildContext:
    """What every step may read: the settings, the checkpoints' hashes and the engines built so far."""

    cfg: EnginesConfig
    out: Path
    sources: dict[str, dict[str, str]]  # role -> {"path", "sha256"} (paths relative to `out`)
    spec: DFlashSpec  # the drafter's (feature layers, trained block size)
    block_size: int
    engines: dict[str, dict[str, Any]]  # manifest entries of the steps already done (built or up to date)
    log: Callable[[str], Any]


class StepSkipped(Exception):
    """A step that cannot build these checkpoints (e.g. a target family its engine path refuses): reported as
    skipped with the message, which names what serves them instead; the other steps go on."""


@dataclass(frozen=True)
class BuildStep:
    """One engine `make engines` may build. Its key hashes everything the output depends on; a key equal
    to the manifest's, with every recorded file intact, means nothing to do."""

    name: str  # the manifest entry
    backend: str
    role: str  # "drafter" or "target"
    folder: str  # below the engines folder
    needs: bool  # whether the registry must find `backend` usable here (a package, a GPU); else skipped
    versions: Callable[[], dict[str, Any]]  # tool versions that change the output
    key: Callable[[BuildContext, dict[str, Any]], tuple[Any, ...]]  # (context, versions) -> what the key hashes
    build: Callable[[BuildContext, Path], dict[str, Any]]  # writes the folder; returns the entry's step-specific fields


def _onnx_key(ctx: BuildContext, vers: dict[str, Any]) -> tuple[Any, ...]:
    return (
        "drafter-onnx",
        ctx.sources["target"]["sha256"],
        ctx.sources["drafter"]["sha256"],
        vers,
        hashing.code_sha256(*EXPORT_CODE),
    )


def _build_onnx(ctx: BuildContext, folder: Path) -> dict[str, Any]:
    from .onnx_drafter import export_from_checkpoints
    from .onnx_drafter_batch import export_batched_from_checkpoints

    def export(out: Path) -> None:
        shutil.rmtree(out, ignore_errors=True)
        ctx.log(f"exporting the drafter to ONNX in {out} ...")
        export_from_checkpoints(ctx.cfg.drafter, ctx.cfg.target, out, fp16=True)
        # the batched round next to it: the server drafts every row of a step in one pass of this graph
        ctx.log(f"exporting the batched drafter round (drafter_batch.onnx) in {out} ...")
        export_batched_from_checkpoints(ctx.cfg.drafter, ctx.cfg.target, out, fp16=True)

    key = export_key(ctx.sources["target"]["sha256"], ctx.sources["drafter"]["sha256"], fp16=True)
    cached_export(key, folder, export, ctx.log)
    meta = DrafterGraphMeta.read(folder)
    return {
        "precisions": ["fp32", "fp16"],
        "serve_precision": "fp32",
        "shapes": {
            "block_ids": [1, "B (2.." + str(meta.block_size) + ")"],
            "features": [1, "n", meta.feature_size],
            "past_k": list(meta.cache_shape(0)[:3]) + ["T", meta.head_dim],
            "logits": [1, "B-1", meta.vocab_size],
        },
    }


def _trt_versions() -> dict[str, Any]:
    from .trt_drafter import gpu_name

    return versions("tensorrt") | {"gpu": gpu_name()}


def _trt_key(ctx: BuildContext, vers: dict[str, Any]) -> tuple[Any, ...]:
    cfg = ctx.cfg
    return ("drafter-trt", ctx.engines["drafter_onnx"]["key"], vers, cfg.precision, cfg.max_seq_len, cfg.max_input_len)


def _build_trt(ctx: BuildContext, folder: Path) -> dict[str, Any]:
    from .trt_drafter import build_drafter_plan

    ctx.log(f"building the TensorRT drafter plan in {folder} ...")
    build_drafter_plan(
        ctx.out / DRAFTER_ONNX_DIR, folder, max_context=ctx.cfg.max_seq_len, max_new_tokens=ctx.cfg.max_input_len
    )
    return {"shapes": read_plan_manifest(folder)["profile"]}


def gpu_arch() -> str | None:
    """The GPUs' compute capabilities ("sm_90"): a TensorRT-LLM engine runs only on the architecture it was built
    for, so the target's key holds it (an engines volume shared by nodes of two GPU generations rebuilds)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ",".join(f"sm_{major}{minor}" for major, minor in caps)
    except Exception:  # noqa: BLE001 - no usable CUDA: the step is skipped before its key matters
        return None


def _trtllm_versions() -> dict[str, Any]:
    return versions("tensorrt_llm", "tensorrt") | {"gpu_arch": gpu_arch()}


def _trtllm_key(ctx: BuildContext, vers: dict[str, Any]) -> tuple[Any, ...]:
    cfg = ctx.cfg
    return (
        "target-trtllm",
        ctx.sources["target"]["sha256"],
        ctx.spec.target_layer_ids,
        ctx.block_size,
        cfg.tp,
        cfg.gpus_per_node or cfg.tp,
        cfg.precision,
        cfg.max_batch_size,
        cfg.max_seq_len,
        "no-context-logits",
        "paged-context-fmha-in-half-precision-only",  # fp32 engines built before this rule reused KV blocks wrongly
        vers,
    )


def _build_trtllm(ctx: BuildContext, folder: Path) -> dict[str, Any]:
    from .trtllm_target import TargetBuildError, plan_target_build, run_plan, spec_from_checkpoints

    cfg = ctx.cfg
    dtype = "float16" if cfg.precision == "fp16" else "float32"
    try:  # spec_from_checkpoints refuses only a family the 1.2 engine path cannot build
        spec = spec_from_checkpoints(
            cfg.target,
            cfg.drafter,
            folder,
            cfg.tp,
            ctx.block_size,
            dtype=dtype,
            max_batch_size=cfg.max_batch_size,
            max_seq_len=cfg.max_seq_len,
            gpus_per_node=cfg.gpus_per_node or None,
        )
    except TargetBuildError as e:
        raise StepSkipped(str(e)) from None
    plan = plan_target_build(spec)  # max_num_tokens = max_seq_len: max_input_len is the drafter plan's only
    run_plan(plan, ctx.log)
    return {
        "tp": cfg.tp,
        "gpus_per_node": plan.spec.node_gpus,
        "feature_outputs": plan.feature_outputs,
        "outputs": plan.outputs,
        "shapes": {
            "max_batch_size": cfg.max_batch_size,
            "max_seq_len": cfg.max_seq_len,
            "max_context": plan.spec.max_context,
            "block_size": ctx.block_size,
        },
    }


# In order: the TensorRT plan is built from the ONNX export.
STEPS = (
    BuildStep(
        "drafter_onnx",
        "onnxruntime",
        "drafter",
        DRAFTER_ONNX_DIR,
        False,
        lambda: versions(*EXPORT_TOOLS),
        _onnx_key,
        _build_onnx,
    ),
    BuildStep("drafter_tensorrt", "tensorrt", "drafter", DRAFTER_TRT_DIR, True, _trt_versions, _trt_key, _build_trt),
    BuildStep(
        "target_tensorrt_llm",
        "tensorrt_llm",
        "target",
        TARGET_TRTLLM_DIR,
        True,
        _trtllm_versions,
        _trtllm_key,
        _build_trtllm,
    ),
)


def _check_checkpoints(cfg: EnginesConfig) -> None:
    from ..settings import DEMO_MODELS_HINT

    for role, path in (("target", cfg.target), ("drafter", cfg.drafter)):
        if not (path / "config.json").is_file():
            raise EnginesConfigError(
                f"{role} checkpoint not found: {path} (the demo models come from `{DEMO_MODELS_HINT}`; "
                f"point engines.toml's `{role}` at another checkpoint, e.g. .cache/tiny/{role} from `make demo`)"
            )


def _run_step(step: BuildStep, ctx: BuildContext, previous: dict[str, Any], report: BuildReport) -> None:
    from ..runtime.registry import unavailable_reason

    reason = unavailable_reason(step.role, step.backend) if step.needs else None
    if reason:
        report.skipped[step.name] = reason
        return
    vers = step.versions()
    key = step_key(*step.key(ctx, vers))
    if _up_to_date(previous.get(step.name), key, ctx.out):
        ctx.engines[step.name] = previous[step.name] | {"stamp": tree_stamp(ctx.out / step.folder)}
        report.unchanged.append(step.name)
        return
    folder = ctx.out / step.folder
    try:
        fields = step.build(ctx, folder)
    except StepSkipped as e:
        report.skipped[step.name] = str(e)
        return
    ctx.engines[step.name] = {
        "backend": step.backend,
        "role": step.role,
        "dir": step.folder,
        "key": key,
        "files": _record_files(folder),
        "stamp": tree_stamp(folder),
        "versions": vers,
        **fields,
    }
    report.built.append(step.name)


def build_engines(cfg: EnginesConfig, log: Callable[[str], Any] = print) -> tuple[dict[str, Any], BuildReport]:
    from ..config import load_drafter_config

    check_export_modules()  # first: a missing module must stop the step before any engine is built
    _check_checkpoints(cfg)
    out = cfg.output
    out.mkdir(parents=True, exist_ok=True)
    before = read_manifest(out)
    previous, known = before.get("engines", {}), before.get("sources", {})
    report = BuildReport()
    log(f"checking checkpoints {cfg.target} and {cfg.drafter} ...")
    sources = {  # paths relative to `out` (formats.resolve_manifest_path reads them back)
        "target": _source(out, cfg.target, known.get("target")),
        "drafter": _source(out, cfg.drafter, known.get("drafter")),
    }
    _, spec = load_drafter_config(cfg.drafter)
    ctx = BuildContext(cfg, out, sources, spec, cfg.block_size or spec.block_size, {}, log)
    for step in STEPS:
        _run_step(step, ctx, previous, report)
    engines = ctx.engines
    # The PyTorch target needs no build: it serves from the checkpoint (recorded by hash).
    engines["target_torch"] = {
        "backend": "torch",
        "role": "target",
        "checkpoint": sources["target"]["path"],
        "sha256": sources["target"]["sha256"],
        "versions": versions("torch", "transformers"),
    }
    manifest = {
        "version": MANIFEST_VERSION,
        "config": cfg.settings() | {"block_size": ctx.block_size},
        "sources": sources,
        "engines": engines,
        "skipped": report.skipped,
        "serve": {
            "drafter": "drafter_tensorrt" if "drafter_tensorrt" in engines else "drafter_onnx",
            "target": "target_tensorrt_llm" if "target_tensorrt_llm" in engines else "target_torch",
        },
    }
    path = out / MANIFEST
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    if not path.is_file() or path.read_text() != text:  # unchanged inputs: not even the manifest is rewritten
        path.write_text(text)
    return manifest, report
