"""The file formats the builders write and the runtimes, the loader and the Triton models read.

One home, torch-free (json and pathlib only), so a reader never imports a writer:
  drafter round graph   drafter.onnx / drafter_fp16.onnx + drafter.json (DrafterGraphMeta): tensor names
                        and shapes of the one-graph round (see builders/onnx_drafter.py)
  TensorRT plan         drafter.plan + drafter.plan.json (TensorRT version, GPU, optimization profile)
  engines folder        manifest.json: what `make engines` built and which backend serves each role
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# ---- the drafter round graph -------------------------------------------------------------------
# Inputs:  block_ids [1, B] int64, features [1, n, F] float32, past_k / past_v [L, 1, H, T, D] float32.
# Outputs: logits [1, B-1, V] float32, draft_tokens [1, B-1] int64, present_k / present_v [L, 1, H, T+n, D].
DRAFTER_INPUTS = ("block_ids", "features", "past_k", "past_v")
DRAFTER_OUTPUTS = ("logits", "draft_tokens", "present_k", "present_v")
GRAPH_FILE = "drafter.onnx"
FP16_GRAPH_FILE = "drafter_fp16.onnx"
GRAPH_FILES = {"fp32": GRAPH_FILE, "fp16": FP16_GRAPH_FILE}  # by precision
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16"}  # a graph's or plan's precision -> its dtype, torch's name
META_FILE = "drafter.json"

# ---- the batched drafter round graph (builders/onnx_drafter_batch.py) ----------------------------
# Ragged rows: per-row lengths as inputs, the cache [L, b, H, C, D] with C >= max(past_lengths) + n.
BATCH_DRAFTER_INPUTS = ("block_ids", "block_lengths", "features", "new_lengths", "past_k", "past_v", "past_lengths")
BATCH_DRAFTER_OUTPUTS = ("logits", "draft_tokens", "present_k", "present_v")
BATCH_GRAPH_FILES = {"fp32": "drafter_batch.onnx", "fp16": "drafter_batch_fp16.onnx"}  # by precision

# ---- DFlash 2 graphs (both kinds) add the candidate selector's inputs to its walk (models/selector.py) ----------
# candidates [b, B-1, k] int64, step_scores [b, B-1, k, k] float32; their draft_tokens are each position's best
# candidate, not the draft: the runtime walks the path beside the graph (greedy or sampled).
SELECTOR_OUTPUTS = ("candidates", "step_scores")


@dataclass(frozen=True)
class DrafterGraphMeta:
    """The contract between an exported graph and its runtimes (ONNX Runtime, TensorRT, Triton)."""

    block_size: int
    mask_token_id: int
    feature_layer_ids: tuple[int, ...]
    feature_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    selector_top_k: int = 0  # DFlash 2: the selector's candidates per position (SELECTOR_OUTPUTS); 0: DFlash 1

    def output_names(self, base: tuple[str, ...]) -> tuple[str, ...]:
        """The graph's outputs: `base` (DRAFTER_OUTPUTS / BATCH_DRAFTER_OUTPUTS), then DFlash 2's selector outputs."""
        return base + SELECTOR_OUTPUTS if self.selector_top_k else base

    def cache_shape(self, length: int) -> tuple[int, ...]:
        return (self.num_layers, 1, self.num_kv_heads, length, self.head_dim)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterGraphMeta:
        return cls(**{**raw, "feature_layer_ids": tuple(raw["feature_layer_ids"])})

    @classmethod
    def read(cls, folder: str | Path) -> DrafterGraphMeta:
        path = Path(folder) / META_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no {META_FILE} in {folder}: not an exported drafter (run `dflash-trt export-drafter`)"
            )
        return cls.from_dict(json.loads(path.read_text()))


# ---- the TensorRT drafter plan ------------------------------------------------------------------
PLAN_FILE = "drafter.plan"
PLAN_MANIFEST = "drafter.plan.json"


def read_plan_manifest(folder: str | Path) -> dict[str, Any]:
    """drafter.plan.json: {"plan", "tensorrt_version", "gpu", "profile": {input: {"min", "opt", "max"}}, ...}."""
    path = Path(folder) / PLAN_MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {PLAN_MANIFEST} in {folder}: build the plan with `dflash-trt build-drafter`")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def plan_max_context(manifest: dict[str, Any]) -> int:
    """The longest drafter context (cache length T) the plan's optimization profile admits."""
    return int(manifest["profile"]["past_k"]["max"][3])


# ---- the TensorRT-LLM target engine folder (written by builders/trtllm_target.py) -----------------
# <folder>/dflash_target.json (TARGET_META_FILE) + <folder>/engine/{config.json, rank<r>.engine}. The engine marks
# FEATURE_OUTPUT.format(i) for each feature layer i and FINAL_HIDDEN_OUTPUT (final-norm hidden state, all tokens).
# TensorRT-LLM 1.2 returns them prefixed (cpp/tensorrt_llm/batch_manager/llmRequest.cpp, LlmRequest::createResult).
TARGET_META_FILE = "dflash_target.json"
FEATURE_OUTPUT = "dflash_feature_{}"
FINAL_HIDDEN_OUTPUT = "dflash_final_hidden"
CONTEXT_PREFIX, GENERATION_PREFIX = "context_", "generation_"


def runtime_input_limit(max_seq_len: int, max_num_tokens: int | None, chunked_context: bool = False) -> int:
    """Longest request the TensorRT-LLM 1.2 runtime accepts (cpp/tensorrt_llm/batch_manager/trtGptModel.h,
    maxInputLen): max_seq_len - 1 with chunked context, else min(max_seq_len - 1, max_num_tokens)."""
    if chunked_context or max_num_tokens is None:
        return max_seq_len - 1
    return min(max_seq_len - 1, max_num_tokens)


def engine_max_context(engine_config: dict[str, Any]) -> int:
    """max_context of a built engine, from its config.json (build_config written by trtllm-build)."""
    build = engine_config.get("build_config", {})
    max_seq_len = int(build.get("max_seq_len") or engine_config.get("pretrained_config", {})["max_position_embeddings"])
    num_tokens = build.get("max_num_tokens")
    return runtime_input_limit(max_seq_len, int(num_tokens) if num_tokens else None)


# ---- the engines folder -------------------------------------------------------------------------
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
DRAFTER_ONNX_DIR = "drafter-onnx"
DRAFTER_TRT_DIR = "drafter-tensorrt"
TARGET_TRTLLM_DIR = "target-tensorrt-llm"


def resolve_manifest_path(engines_dir: Path, stored: str) -> Path:
    """A path read from a manifest: relative ones are relative to its folder; absolute ones (older manifests) stay."""
    return Path(os.path.normpath(Path(engines_dir) / stored))


def read_manifest(engines_dir: Path) -> dict[str, Any]:
    """The manifest as written, or {} when there is none or it is not JSON (a builder then rebuilds)."""
    path = Path(engines_dir) / MANIFEST
    if not path.is_file():
        return {}
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return manifest


@dataclass(frozen=True)
class ServingSources:
    """What to load to serve a built engines folder: the manifest's `serve` choice, with paths resolved."""

    drafter: dict[str, Any]  # the drafter's manifest entry ("backend", "dir", "serve_precision", ...)
    drafter_dir: Path  # its engine folder
    target: dict[str, Any]  # the target's manifest entry ("backend", ...)
    target_dir: Path  # the checkpoint for the "torch" backend, else the engine folder
    tokenizer_dir: Path  # the target checkpoint (engines carry no tokenizer)


def serving_sources(engines_dir: str | Path) -> ServingSources:
    """Read engines_dir/manifest.json's `serve` section (the one place that parses it for loading)."""
    engines_dir = Path(engines_dir)
    path = engines_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {engines_dir}: build the engines with `make engines`")
    try:
        manifest = json.loads(path.read_text())
        engines, serve = manifest["engines"], manifest["serve"]
        drafter, target = engines[serve["drafter"]], engines[serve["target"]]
        checkpoint = manifest["sources"]["target"]["path"]
        target_dir = (
            resolve_manifest_path(engines_dir, target["checkpoint"])
            if target["backend"] == "torch"
            else engines_dir / target["dir"]
        )
        drafter_dir = engines_dir / drafter["dir"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a manifest `make engines` wrote ({type(e).__name__}: {e}): rebuild it"
        ) from None
    return ServingSources(drafter, drafter_dir, target, target_dir, resolve_manifest_path(engines_dir, checkpoint))
