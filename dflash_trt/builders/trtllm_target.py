"""Target -> tensor-parallel TensorRT-LLM engine (`dflash-trt build-target`), TensorRT-LLM 1.2 engine path.

Two steps, planned here as pure functions (testable without TensorRT-LLM) and executed as subprocesses:
  1. convert: HF checkpoint -> TensorRT-LLM checkpoint, one `rank{r}.safetensors` per GPU and one config.json
     (trtllm_convert.py); the config also records `dflash_feature_layer_ids`.
  2. build: `trtllm-build` with our model class (trtllm_features.py), which marks as engine outputs the
     drafter's feature layers (`dflash_feature_{i}`) and the final-norm hidden state (`dflash_final_hidden`,
     from which the orchestrator computes the verification logits with the target's lm_head).

Why this design (each point read in the TensorRT-LLM 1.2 sources; see also docs/deployment.md):
  * no `--gather_context_logits`: an engine built with it gets KV block reuse switched off at executor start
    (`cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp`, fixExecutorConfig), so every round
    would re-run the whole sequence. Verification reads the marked final hidden state instead.
  * no `--speculative_decoding_mode draft_tokens_external --max_draft_len`: `tensorrt_llm/commands/build.py`
    refuses them together with context logits, and additional outputs cannot be combined with external
    draft tokens (`cpp/tensorrt_llm/batch_manager/utils/inflightBatchingUtils.cpp`, copyAdditionalOutputs).
    A round is a plain context-phase request over the session's tokens; KV block reuse skips the prefix.
  * KV block reuse only where the context phase runs fused attention, that is in half precision: TensorRT-LLM
    falls back to unfused MHA for any other data type ("Fall back to unfused MHA because of unsupported data
    type", cpp/tensorrt_llm/common/attentionOp.cpp AttentionOp::initialize at eea41b73a7bdddb1032ee255d8feb695e4811651),
    and the unfused context path attends over the new tokens only (enqueueContext: `attention_seq_len_2 =
    params.input_seq_length`, same file), so a request whose prefix blocks were reused would compute every new
    row without its prefix. An fp32 engine is therefore built with `--use_paged_context_fmha disable`, and the
    Executor then switches reuse off itself (cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp
    fixExecutorConfig at b35ac1b64368513d215c57d2ed01d62d910df8da: "KV cache reuse disabled because model was not
    built with paged context FMHA support"); every round then re-runs the whole sequence, exact but slower.
    trtllm-build keeps the flag as given for fp32 (tensorrt_llm/builder.py build() adjusts it only for FP8 and
    int8 KV caches, and forces it on for EAGLE), so the builder must choose.
  * `--max_num_tokens >= --max_seq_len`: without chunked context the runtime accepts prompts of at most
    min(max_seq_len - 1, max_num_tokens) tokens (`cpp/tensorrt_llm/batch_manager/trtGptModel.h`); the engine
    advertises exactly that as its `max_context`.
  * `--workers 1`: with more workers build.py spawns processes and pickles the class loaded from
    `--model_cls_file`, which the workers cannot import; one worker builds every rank in turn.
  * tp > 1 is served under `mpirun -n tp` (`launch_command`): every rank creates the Executor (leader
    mode), only the leader may enqueue requests (`cpp/tensorrt_llm/executor/executorImpl.cpp`,
    canEnqueueRequests), so only it runs the orchestrator and HTTP.
  * the conversion's `--gpus_per_node` = the GPUs of one node (one pod): its Mapping(gpus_per_node=) is saved in
    the checkpoint's config.json (tensorrt_llm/mapping.py, to_dict) and trtllm-build keeps the checkpoint's
    mapping; trtllm-build itself has no --gpus_per_node at 1.2 (tensorrt_llm/commands/build.py at 65f1d153: it
    went with auto_parallel, NVIDIA/TensorRT-LLM PR 8329), so passing one would stop every build. The Executor
    builds its world from the engine's `pretrained_config.mapping.gpus_per_node` (executorImpl.cpp, loadModel:
    WorldConfig::mpi(gpusPerNode, tp, pp, cp, deviceIds)) and runs rank r on GPU r % gpus_per_node
    (worldConfig.cpp / worldConfig.h getDevice); a recorded value above the node's GPUs is lowered to them with a
    warning, one below its ranks puts two ranks on one GPU (rank_device in runtime/trtllm_backend.py refuses it).

NOT RUN on real hardware in this project (no TensorRT / TensorRT-LLM / GPU here): the planning half is
tested, the subprocesses it plans are not.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats import (  # noqa: F401 - re-exported: the engine folder's names live in formats.py
    CONTEXT_PREFIX,
    FEATURE_OUTPUT,
    FINAL_HIDDEN_OUTPUT,
    GENERATION_PREFIX,
    TARGET_META_FILE,
    engine_max_context,
    runtime_input_limit,
)

# model_type -> (TensorRT-LLM class, our output-marking subclass in trtllm_features.py): only families the 1.2
# engine path builds with the two classes trtllm_features.py subclasses. Read in the TensorRT-LLM sources
# (NVIDIA/TensorRT-LLM, the TensorRT engine path that 1.2 is the last line of): tensorrt_llm/models/__init__.py
# MODEL_MAP maps LlamaForCausalLM / MistralForCausalLM to LLaMAForCausalLM and Qwen2ForCausalLM /
# Qwen3ForCausalLM to QWenForCausalLM (read at commit 02267d3d4fd886c3ad036f6580beb0847eac6e4b), and
# tensorrt_llm/models/qwen/config.py QWenConfig.from_hugging_face accepts model_type qwen3_moe beside qwen2 and
# qwen3 (read at commit 0428c18828880e7c60c13cc5cc0794bbbc05c0a3), whose MoE decoder layers end in the same
# hidden state trtllm_features.py marks. Llama 3.x checkpoints are model_type llama.
FAMILIES = {
    "llama": ("LLaMAForCausalLM", "DFlashLLaMAForCausalLM"),
    "mistral": ("LLaMAForCausalLM", "DFlashLLaMAForCausalLM"),
    "qwen2": ("QWenForCausalLM", "DFlashQWenForCausalLM"),
    "qwen3": ("QWenForCausalLM", "DFlashQWenForCausalLM"),
    "qwen3_moe": ("QWenForCausalLM", "DFlashQWenForCausalLM"),
}
# Families TensorRT-LLM serves only in its PyTorch backend, after 1.2: MODEL_MAP (above) has no TensorRT model
# class for them (hybrid Gated DeltaNet layers, attention sinks, Gemma 4's layers), so no engine can be built.
PYTORCH_BACKEND_ONLY = {
    "qwen3_5": "Qwen3.5 (hybrid Gated DeltaNet + full attention)",
    "qwen3_5_text": "Qwen3.5 (hybrid Gated DeltaNet + full attention)",
    "qwen3_5_moe": "Qwen3.5 MoE (hybrid Gated DeltaNet + full attention)",
    "qwen3_5_moe_text": "Qwen3.5 MoE (hybrid Gated DeltaNet + full attention)",
    "qwen3_next": "Qwen3-Next (hybrid Gated DeltaNet + full attention)",
    "gpt_oss": "gpt-oss (MoE, sliding-window layers, attention sinks)",
    "gemma4": "Gemma 4",
    "gemma4_text": "Gemma 4",
}
WORKING_ROUTES = (
    "Serve it with TensorRT-LLM's native DFlash on a release after 1.2 (PyTorch backend, no engine build: "
    "`dflash-trt trtllm-serve-config --target T --drafter D --out cfg.yaml`, then `trtllm-serve T --backend "
    "pytorch --config cfg.yaml`) or with this project's PyTorch engines (`dflash-trt serve --target T --drafter D`)"
)
FEATURES_MODEL_FILE = Path(__file__).with_name("trtllm_features.py")
TIMING_CACHE_FILE = "model.cache"  # trtllm-build's timing cache, written into the converted checkpoint's folder
TP_SIZES = (1, 2, 4, 8)
# Engine dtypes whose context phase runs TensorRT-LLM's fused (paged) context FMHA, the only path on which KV
# block reuse is correct (module docstring): attentionOp.cpp accepts kHALF and kBF16.
FUSED_CONTEXT_DTYPES = ("float16", "bfloat16")
# Flags this design must never pass (see the module docstring for the source of each refusal).
FATAL_BUILD_FLAGS = ("--gather_context_logits", "--speculative_decoding_mode", "--max_draft_len")


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
    max_seq_len: int = 4096
    max_num_tokens: int | None = None  # None: max_seq_len, so the whole context fits one pass
    # Attention head counts (None: unknown, not checked; spec_from_checkpoints always reads them).
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    # GPUs of one node (one pod) the ranks run on; None: tp (every rank on one node). See the module docstring.
    gpus_per_node: int | None = None

    @property
    def node_gpus(self) -> int:
        return self.gpus_per_node if self.gpus_per_node is not None else self.tp

    @property
    def block_reuse(self) -> bool:
        """Whether this engine may reuse KV blocks: only where its context attention is fused (half precision)."""
        return self.dtype in FUSED_CONTEXT_DTYPES

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    @property
    def engine_dir(self) -> Path:
        return self.out_dir / "engine"

    @property
    def num_tokens(self) -> int:
        return self.max_num_tokens if self.max_num_tokens is not None else self.max_seq_len

    @property
    def max_context(self) -> int:
        return runtime_input_limit(self.max_seq_len, self.num_tokens)


@dataclass
class TargetBuildPlan:
    spec: TargetBuildSpec
    checkpoint_files: list[str]
    engine_files: list[str]
    commands: list[list[str]] = field(default_factory=list)
    feature_outputs: list[str] = field(default_factory=list)

    @property
    def outputs(self) -> list[str]:
        """Every output the engine marks: the feature layers, then the final hidden state."""
        return [*self.feature_outputs, FINAL_HIDDEN_OUTPUT]

    def describe(self) -> str:
        return "\n".join(shlex.join(c) for c in self.commands)


def family_classes(model_type: str) -> tuple[str, str]:
    """The TensorRT-LLM class and our output-marking subclass for this model_type; a refusal naming the family
    and the routes that serve it otherwise."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = ", ".join(sorted(FAMILIES))
    if model_type in PYTORCH_BACKEND_ONLY:
        raise TargetBuildError(
            f"target model_type {model_type!r} ({PYTORCH_BACKEND_ONLY[model_type]}): TensorRT-LLM 1.2's engine "
            f"path (trtllm-build) has no model class for it, so build-target cannot build it (it builds: "
            f"{supported}). {WORKING_ROUTES}"
        )
    raise TargetBuildError(
        f"target model_type {model_type!r}: the TensorRT-LLM engine path cannot expose its layer features "
        f"for DFlash (supported: {supported}). {WORKING_ROUTES}"
    )


def rank_files(tp: int, suffix: str = "safetensors") -> list[str]:
    """TensorRT-LLM names one weights file per rank (checkpoint) and one engine per rank."""
    return [f"rank{r}.{suffix}" for r in range(tp)]


def heads_split(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why `tp` ranks cannot split these attention heads, or None when they can.

    The rule of TensorRT-LLM 1.2's LLaMA / QWen converters (tensorrt_llm/models/llama/convert.py,
    models/qwen/convert.py) and attention layer (tensorrt_llm/layers/attention.py): each rank holds
    num_heads / tp query heads, so the query weight splits into tp equal row blocks only when tp divides
    num_heads (otherwise the halves do not match what each rank's attention expects and loading fails);
    KV heads are split the same way when num_kv_heads >= tp, and replicated (`dup_kv_weight`, which asserts
    tp % num_kv_heads == 0) when there are fewer KV heads than ranks.
    """
    if num_heads % tp:
        return f"{num_heads} query heads do not divide by tp {tp}"
    if num_kv_heads >= tp and num_kv_heads % tp:
        return f"{num_kv_heads} KV heads do not divide by tp {tp}"
    if num_kv_heads < tp and tp % num_kv_heads:
        return f"tp {tp} is not a multiple of the {num_kv_heads} KV heads (each rank would need a fraction of one)"
    return None


def working_tp(num_heads: int, num_kv_heads: int) -> list[int]:
    """The tp sizes this engine path offers that split these heads."""
    return [t for t in TP_SIZES if heads_split(num_heads, num_kv_heads, t) is None]


def nodes_split(tp: int, gpus_per_node: int) -> str | None:
    """Why `tp` ranks cannot run on nodes of `gpus_per_node` GPUs each, or None when they can: one node holds
    them all (tp <= gpus_per_node), or they fill whole nodes (mpirun --map-by ppr:gpus_per_node:node)."""
    if gpus_per_node < 1:
        return f"gpus_per_node must be >= 1, got {gpus_per_node}"
    if tp > gpus_per_node and tp % gpus_per_node:
        return f"tp {tp} does not fill whole nodes of {gpus_per_node} GPUs (tp must be a multiple of gpus_per_node)"
    return None


def validate(spec: TargetBuildSpec) -> None:
    family_classes(spec.model_type)  # first: a family this path cannot build is refused before its shapes
    if spec.tp not in TP_SIZES:
        raise TargetBuildError(f"tp must be one of {TP_SIZES}, got {spec.tp}")
    if spec.num_attention_heads is not None:
        kv = spec.num_kv_heads if spec.num_kv_heads is not None else spec.num_attention_heads
        why = heads_split(spec.num_attention_heads, kv, spec.tp)
        if why:
            raise TargetBuildError(
                f"target has {spec.num_attention_heads} attention heads and {kv} KV heads: {why}, so the "
                f"tensor-parallel weight split fails; tp values that work: {working_tp(spec.num_attention_heads, kv)}"
            )
    why = nodes_split(spec.tp, spec.node_gpus)
    if why:
        raise TargetBuildError(why)
    if spec.block_size < 2:
        raise TargetBuildError(f"block_size must be >= 2 (a round verifies the block), got {spec.block_size}")
    if not spec.feature_layer_ids:
        raise TargetBuildError("no feature layers: the drafter needs the target's hidden states")
    bad = [i for i in spec.feature_layer_ids if not 0 <= i < spec.num_layers]
    if bad:
        raise TargetBuildError(f"feature layers {bad} outside the target's {spec.num_layers} layers")
    if spec.max_seq_len < 2:
        raise TargetBuildError(f"max_seq_len must be >= 2, got {spec.max_seq_len}")
    if spec.num_tokens < spec.block_size:
        raise TargetBuildError(f"max_num_tokens ({spec.num_tokens}) must be >= block_size ({spec.block_size})")


def convert_command(spec: TargetBuildSpec, python: str = sys.executable) -> list[str]:
    base_cls, _ = family_classes(spec.model_type)
    return [
        python,
        "-m",
        "dflash_trt.builders.trtllm_convert",
        "--model_dir",
        str(spec.target_dir),
        "--output_dir",
        str(spec.checkpoint_dir),
        "--model_cls",
        base_cls,
        "--dtype",
        spec.dtype,
        "--tp_size",
        str(spec.tp),
        "--gpus_per_node",
        str(spec.node_gpus),
        "--feature_layer_ids",
        ",".join(map(str, spec.feature_layer_ids)),
    ]


def build_command(spec: TargetBuildSpec) -> list[str]:
    """trtllm-build flags as tensorrt_llm/commands/build.py (1.2) parses them."""
    _, features_cls = family_classes(spec.model_type)
    return [
        "trtllm-build",
        "--checkpoint_dir",
        str(spec.checkpoint_dir),
        "--output_dir",
        str(spec.engine_dir),
        # the timing cache into the build's own scratch folder (removed with the converted checkpoint): by default
        # trtllm-build writes `model.cache` into the working directory (tensorrt_llm/commands/build.py
        # --output_timing_cache, BuildConfig.output_timing_cache in builder.py at 008b2b8d), which a pod's image
        # WORKDIR or a read-only container root does not let it write, after the whole build
        "--output_timing_cache",
        str(spec.checkpoint_dir / TIMING_CACHE_FILE),
        # our subclass marks the feature layers and the final hidden state as outputs
        "--model_cls_file",
        str(FEATURES_MODEL_FILE),
        "--model_cls_name",
        features_cls,
        # KV block reuse needs paged context FMHA; an fp32 engine runs unfused attention, where reuse is wrong, so
        # it is built without, and the Executor switches reuse off for it (module docstring)
        "--use_paged_context_fmha",
        "enable" if spec.block_reuse else "disable",
        "--kv_cache_type",
        "paged",
        "--gemm_plugin",
        "auto",
        "--max_batch_size",
        str(spec.max_batch_size),
        "--max_seq_len",
        str(spec.max_seq_len),
        "--max_input_len",
        str(spec.max_context),
        "--max_num_tokens",
        str(spec.num_tokens),
        "--workers",
        "1",  # >1 pickles the --model_cls_file class into workers that cannot import it
        # no --gpus_per_node: 1.2's trtllm-build has none; the engine keeps the checkpoint's (module docstring)
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


def launch_command(engines_dir: str | Path, tp: int, argv: list[str]) -> list[str]:
    """How to run `dflash-trt <argv> --engines DIR` on a tp-rank engine: one process per GPU under MPI.

    Every rank loads the engine; only the leader (rank 0) runs the loop and the HTTP server, the others
    keep the Executor's tensor-parallel work going until the leader shuts down.
    """
    cmd = ["dflash-trt", *argv, "--engines", str(engines_dir)]
    return cmd if tp == 1 else ["mpirun", "-n", str(tp), "--allow-run-as-root", *cmd]


def spec_from_checkpoints(
    target_dir: str | Path,
    drafter_dir: str | Path,
    out_dir: str | Path,
    tp: int,
    block_size: int | None = None,
    **kw: Any,
) -> TargetBuildSpec:
    """Read model type, layer count and feature layers from the two config.json files (no weights loaded)."""
    from ..config import load_drafter_config

    raw = json.loads((Path(target_dir) / "config.json").read_text())
    text = raw.get("text_config") or raw
    family_classes(str(raw.get("model_type")))  # refused by name before the drafter's config is read
    _, spec = load_drafter_config(Path(drafter_dir))
    return TargetBuildSpec(
        target_dir=Path(target_dir),
        out_dir=Path(out_dir),
        model_type=str(raw.get("model_type")),
        tp=tp,
        block_size=block_size or spec.block_size,
        feature_layer_ids=tuple(spec.target_layer_ids),
        num_layers=int(text["num_hidden_layers"]),
        num_attention_heads=int(text["num_attention_heads"]),
        num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
        **kw,
    )


def target_meta(plan: TargetBuildPlan) -> dict[str, Any]:
    """What the runtime reads next to the engine (dflash_target.json)."""
    return {
        "feature_layer_ids": list(plan.spec.feature_layer_ids),
        "feature_outputs": plan.feature_outputs,
        "final_hidden_output": FINAL_HIDDEN_OUTPUT,
        "block_size": plan.spec.block_size,
        "tp": plan.spec.tp,
        "gpus_per_node": plan.spec.node_gpus,
        "max_context": plan.spec.max_context,
        "kv_block_reuse": plan.spec.block_reuse,
        "engine_dir": "engine",
        "target_dir": str(plan.spec.target_dir.resolve()),  # the lm_head and the tokenizer come from here
    }


def run_plan(plan: TargetBuildPlan, log: Callable[[str], None] = print) -> None:
    """Execute the plan (needs TensorRT-LLM and GPUs); checks every planned rank file appeared. NOT RUN here."""
    from ..runtime.registry import require

    require("target", "tensorrt_llm")
    for cmd in plan.commands:
        log("+ " + shlex.join(cmd))
        subprocess.run(cmd, check=True)
    for folder, files in ((plan.spec.checkpoint_dir, plan.checkpoint_files), (plan.spec.engine_dir, plan.engine_files)):
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise RuntimeError(f"TensorRT-LLM did not write {missing} in {folder}")
    # The converted checkpoint is as large as the engine (a 70B fp16 target: about 140 GB each) and nothing reads
    # it after the build: the engines folder keeps only the engine.
    log(f"removing the converted checkpoint {plan.spec.checkpoint_dir}")
    shutil.rmtree(plan.spec.checkpoint_dir)
    (plan.spec.out_dir / TARGET_META_FILE).write_text(json.dumps(target_meta(plan), indent=2) + "\n")
