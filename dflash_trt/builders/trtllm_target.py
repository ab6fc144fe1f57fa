"""Target -> tensor-parallel TensorRT-LLM engine (`dflash-trt build-target`), TensorRT-LLM 1.2 engine path.

Two steps, planned here as pure functions (testable without TensorRT-LLM) and executed as
subprocesses:
  1. convert: HF checkpoint -> TensorRT-LLM checkpoint, one `rank{r}.safetensors` per GPU and one
     config.json (`<Family>ForCausalLM.from_hugging_face(dir, dtype, mapping=Mapping(world_size=tp,
     rank=r, tp_size=tp))` + `save_checkpoint(out, save_config=(r == 0))`, see trtllm_convert.py);
     the config also records `dflash_feature_layer_ids`.
  2. build: `trtllm-build` with external draft tokens (`--speculative_decoding_mode
     draft_tokens_external --max_draft_len B-1`), paged context FMHA for KV reuse, context
     logits, and our model class (trtllm_features.py) that marks the outputs of the drafter's
     target layers as engine outputs `dflash_feature_{i}`.

Written against the real API, never run in this project (no TensorRT / TensorRT-LLM / GPU here); the
planning half is tested, the subprocesses it plans are not.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# model_type -> (TensorRT-LLM class, our feature-marking subclass in trtllm_features.py)
FAMILIES = {
    "llama": ("LLaMAForCausalLM", "DFlashLLaMAForCausalLM"),
    "mistral": ("LLaMAForCausalLM", "DFlashLLaMAForCausalLM"),
    "qwen2": ("QWenForCausalLM", "DFlashQWenForCausalLM"),
    "qwen3": ("QWenForCausalLM", "DFlashQWenForCausalLM"),
}
FEATURE_OUTPUT = "dflash_feature_{}"
FEATURES_MODEL_FILE = Path(__file__).with_name("trtllm_features.py")
TP_SIZES = (1, 2, 4, 8)


class TargetBuildError(ValueError):
    """A target the TensorRT-LLM engine path cannot build as asked (the message says why)."""


@dataclass(frozen=True)
class TargetBuildSpec:
    target_dir: Path
    out_dir: Path
    model_type: str
    tp: int
    block_size: int
    feature_layer_ids: tuple[int, ...]
    num_layers: int
    dtype: str = "float16"
    max_batch_size: int = 8
    max_input_len: int = 2048
    max_seq_len: int = 4096

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    @property
    def engine_dir(self) -> Path:
        return self.out_dir / "engine"


@dataclass
class TargetBuildPlan:
    spec: TargetBuildSpec
    checkpoint_files: list[str]
    engine_files: list[str]
    commands: list[list[str]] = field(default_factory=list)
    feature_outputs: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return "\n".join(shlex.join(c) for c in self.commands)


def family_classes(model_type: str) -> tuple[str, str]:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise TargetBuildError(
            f"target model_type {model_type!r}: the TensorRT-LLM engine path cannot expose its layer features "
            f"for DFlash (supported: {', '.join(sorted(FAMILIES))}); serve it with the PyTorch target instead"
        ) from None


def rank_files(tp: int, suffix: str = "safetensors") -> list[str]:
    """TensorRT-LLM names one weights file per rank (checkpoint) and one engine per rank."""
    return [f"rank{r}.{suffix}" for r in range(tp)]


def validate(spec: TargetBuildSpec) -> None:
    if spec.tp not in TP_SIZES:
        raise TargetBuildError(f"tp must be one of {TP_SIZES}, got {spec.tp}")
    if spec.block_size < 2:
        raise TargetBuildError(f"block_size must be >= 2 (max_draft_len = block_size - 1), got {spec.block_size}")
    if not spec.feature_layer_ids:
        raise TargetBuildError("no feature layers: the drafter needs the target's hidden states")
    bad = [i for i in spec.feature_layer_ids if not 0 <= i < spec.num_layers]
    if bad:
        raise TargetBuildError(f"feature layers {bad} outside the target's {spec.num_layers} layers")
    if spec.max_input_len >= spec.max_seq_len:
        raise TargetBuildError(f"max_input_len ({spec.max_input_len}) must be < max_seq_len ({spec.max_seq_len})")
    family_classes(spec.model_type)


def convert_command(spec: TargetBuildSpec, python: str = sys.executable) -> list[str]:
    base_cls, _ = family_classes(spec.model_type)
    return [
        python, "-m", "dflash_trt.builders.trtllm_convert",
        "--model_dir", str(spec.target_dir),
        "--output_dir", str(spec.checkpoint_dir),
        "--model_cls", base_cls,
        "--dtype", spec.dtype,
        "--tp_size", str(spec.tp),
        "--feature_layer_ids", ",".join(map(str, spec.feature_layer_ids)),
    ]


def build_command(spec: TargetBuildSpec) -> list[str]:
    _, features_cls = family_classes(spec.model_type)
    return [
        "trtllm-build",
        "--checkpoint_dir", str(spec.checkpoint_dir),
        "--output_dir", str(spec.engine_dir),
        # our subclass marks the feature layers' outputs; trtllm-build loads it from this file
        "--model_cls_file", str(FEATURES_MODEL_FILE),
        "--model_cls_name", features_cls,
        "--speculative_decoding_mode", "draft_tokens_external",
        "--max_draft_len", str(spec.block_size - 1),
        "--use_paged_context_fmha", "enable",  # KV block reuse across a request's rounds
        "--kv_cache_type", "paged",
        "--gather_context_logits",  # verification reads the logits of every block position
        "--gemm_plugin", "auto",
        "--max_batch_size", str(spec.max_batch_size),
        "--max_input_len", str(spec.max_input_len),
        "--max_seq_len", str(spec.max_seq_len),
        "--max_num_tokens", str(max(spec.max_input_len, spec.max_batch_size * spec.block_size)),
        "--workers", str(spec.tp),  # one build process per rank (one per GPU)
    ]


def plan_target_build(spec: TargetBuildSpec, python: str = sys.executable) -> TargetBuildPlan:
    validate(spec)
    return TargetBuildPlan(
        spec=spec,
        checkpoint_files=["config.json", *rank_files(spec.tp)],
        engine_files=["config.json", *rank_files(spec.tp, "engine")],
        commands=[convert_command(spec, python), build_command(spec)],
        feature_outputs=[FEATURE_OUTPUT.format(i) for i in spec.feature_layer_ids],
    )


def serve_command(engines_dir: str | Path, tp: int, argv: list[str]) -> list[str]:
    """Multi-GPU engines run one process per rank under MPI, as TensorRT-LLM does."""
    cmd = ["dflash-trt", *argv, "--engines", str(engines_dir)]
    return cmd if tp == 1 else ["mpirun", "-n", str(tp), "--allow-run-as-root", *cmd]


def spec_from_checkpoints(target_dir: str | Path, drafter_dir: str | Path, out_dir: str | Path, tp: int,
                          block_size: int | None = None, **kw) -> TargetBuildSpec:
    """Read model type, layer count and feature layers from the two config.json files (no weights loaded)."""
    from ..config import load_drafter_config

    raw = json.loads((Path(target_dir) / "config.json").read_text())
    text = raw.get("text_config") or raw
    _, spec = load_drafter_config(Path(drafter_dir))
    return TargetBuildSpec(
        target_dir=Path(target_dir), out_dir=Path(out_dir), model_type=str(raw.get("model_type")), tp=tp,
        block_size=block_size or spec.block_size, feature_layer_ids=tuple(spec.target_layer_ids),
        num_layers=int(text["num_hidden_layers"]), **kw,
    )


def run_plan(plan: TargetBuildPlan, log=print) -> None:
    """Execute the plan (needs TensorRT-LLM and GPUs); checks every planned rank file appeared."""
    from ..runtime.registry import require

    require("target", "tensorrt_llm")
    for cmd in plan.commands:
        log("+ " + shlex.join(cmd))
        subprocess.run(cmd, check=True)
    for folder, files in ((plan.spec.checkpoint_dir, plan.checkpoint_files), (plan.spec.engine_dir, plan.engine_files)):
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise RuntimeError(f"TensorRT-LLM did not write {missing} in {folder}")
    (plan.spec.out_dir / "dflash_target.json").write_text(json.dumps({
        "feature_layer_ids": list(plan.spec.feature_layer_ids),
        "feature_outputs": plan.feature_outputs,
        "block_size": plan.spec.block_size,
        "tp": plan.spec.tp,
        "engine_dir": "engine",
        "target_dir": str(plan.spec.target_dir.resolve()),
    }, indent=2) + "\n")
