"""`dflash-trt triton-repo`: write a complete Triton model repository for a target + DFlash drafter.

    dflash           ensemble: text_input (+ max_tokens, temperature, seed, stream) -> text_output
      preprocessing    python: tokenizer (optional chat template)
      dflash_bls       python, decoupled: draft-and-verify loop, one response per verified round
      postprocessing   python: detokenize (text deltas)
    dflash_sync      the same ensemble over dflash_bls_sync (not decoupled): for HTTP and unary gRPC
    dflash_drafter   tensorrt_plan when a TensorRT plan was built, else the ONNX graph via onnxruntime (python)
    dflash_target    python: PyTorch target (CPU) or TensorRT-LLM (GPU); per-sequence KV cache by session id

Served and tested in this project: the CPU path (PyTorch target, ONNX Runtime drafter). The
`tensorrt_plan` drafter, the TensorRT-LLM target and `device: cuda` are written against the real
APIs, never run in this project: no GPU/TensorRT here (the tests check their configs only).

Sources: an engines folder (`make engines`, read through engines/manifest.json) or a target and a
drafter checkpoint (the drafter is exported to ONNX here). Configs are built as ModelConfig
messages (dflash_trt.triton.config) and the whole repository is validated before returning.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..formats import (
    BATCH_DRAFTER_INPUTS,
    BATCH_DRAFTER_OUTPUTS,
    BATCH_GRAPH_FILES,
    DRAFTER_INPUTS,
    DRAFTER_OUTPUTS,
    GRAPH_FILE,
    META_FILE,
    PLAN_FILE,
    PRECISION_DTYPES,
    DrafterGraphMeta,
    read_plan_manifest,
    serving_sources,
)
from ..triton.config import Step, check_repository, model_config, tensor, write_config

ENSEMBLE, BLS, PRE, POST = "dflash", "dflash_bls", "preprocessing", "postprocessing"
# HTTP and unary gRPC refuse any model that contains a decoupled one, so the same loop is also
# served non-decoupled (one response per request) behind a second ensemble.
ENSEMBLE_SYNC, BLS_SYNC = "dflash_sync", "dflash_bls_sync"
TARGET, DRAFTER = "dflash_target", "dflash_drafter"
DRAFTER_BATCH = "dflash_drafter_batch"  # the batched round graph: one call drafts every row of a BLS step
# The ONNX Runtime drafter runs the float32 graph: the drafter dtype every other entry point runs by default next to
# the float32 target (settings.DRAFTER_DTYPE), so seeded text at a fixed block size is theirs (the export writes
# float32 and float16 graphs, no bfloat16; the float16 one is TensorRT's source).
ONNX_PRECISION = "fp32"


@dataclass
class Sources:
    """Where each piece comes from."""

    tokenizer_dir: Path
    target_backend: str  # "torch" or "tensorrt_llm"
    target_dir: Path  # HF checkpoint (torch) or the TensorRT-LLM engine folder
    drafter_backend: str  # "onnxruntime" or "tensorrt"
    drafter_dir: Path  # folder with drafter.onnx / drafter.plan and drafter.json


@dataclass
class RepoOptions:
    max_batch_size: int = 8
    default_max_tokens: int = 64
    chat_template: bool = False
    threads: int = 0  # intra-op threads per model instance (0: the library default)
    device: str = "cpu"  # the PyTorch target's device: "cpu" or "cuda"
    symlink_weights: bool = False  # link big checkpoints instead of copying them


def shim(module: str) -> str:
    """A version folder's model.py: the code lives in the dflash_trt package installed beside Triton."""
    return f"from dflash_trt.triton.models.{module} import TritonPythonModel  # noqa: F401\n"


def sources_from_engines(engines_dir: Path) -> Sources:
    s = serving_sources(engines_dir)  # the one manifest reader: resolves relative checkpoint paths
    return Sources(s.tokenizer_dir, s.target["backend"], s.target_dir, s.drafter["backend"], s.drafter_dir)


def sources_from_checkpoints(target_dir: Path, drafter_dir: Path, work: Path) -> Sources:
    from .export_cache import cached_export, export_key
    from .hashing import tree_sha256
    from .onnx_drafter import export_from_checkpoints
    from .onnx_drafter_batch import export_batched_from_checkpoints

    def export(out: Path) -> None:
        export_from_checkpoints(drafter_dir, target_dir, out, fp16=False)
        export_batched_from_checkpoints(drafter_dir, target_dir, out, fp16=False)

    cached_export(export_key(tree_sha256(target_dir), tree_sha256(drafter_dir), fp16=False), work, export)
    return Sources(target_dir, "torch", target_dir, "onnxruntime", work)


def _target_meta(src: Sources) -> tuple[int, int]:
    """(vocab_size, max_context) of the target, read from its config files."""
    if src.target_backend == "torch":
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(src.target_dir, local_files_only=True).get_text_config()
        return int(text.vocab_size), int(getattr(text, "max_position_embeddings", 1 << 30))
    meta = json.loads((src.target_dir / "dflash_target.json").read_text())
    config = json.loads((src.target_dir / meta["engine_dir"] / "config.json").read_text())
    from ..formats import engine_max_context

    return int(config.get("pretrained_config", {})["vocab_size"]), engine_max_context(config)


def _copy(src: Path, dst: Path, symlink: bool) -> None:
    if symlink:
        dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())
    elif src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)


def _save_tokenizer(src: Path, dst: Path) -> object:
    from ..models.target import load_tokenizer

    tok = load_tokenizer(src)
    if tok is None:
        raise FileNotFoundError(f"no tokenizer in {src}: the Triton ensemble works on text and needs one")
    from ..models.target import save_portable

    save_portable(tok, dst)
    return tok


# ---- the models -----------------------------------------------------------------------------


def _text_models(repo: Path, src: Sources, opt: RepoOptions) -> object:
    tok = None
    for name, module, inputs, outputs in (
        (
            PRE,
            "preprocessing",
            [tensor("text_input", "TYPE_STRING", [1])],
            [tensor("input_ids", "TYPE_INT64", [-1]), tensor("input_length", "TYPE_INT32", [1])],
        ),
        (
            POST,
            "postprocessing",
            [
                tensor("output_ids", "TYPE_INT64", [-1]),
                tensor("output_length", "TYPE_INT32", [1]),
                tensor("new_tokens", "TYPE_INT32", [1]),
                tensor("finish_reason", "TYPE_STRING", [1]),
            ],
            [tensor("text_output", "TYPE_STRING", [1])],
        ),
    ):
        version = repo / name / "1"
        version.mkdir(parents=True)
        (version / "model.py").write_text(shim(module))
        tok = _save_tokenizer(src.tokenizer_dir, version / "tokenizer")
        params = {"tokenizer_dir": "tokenizer"}
        if name == PRE:
            params["chat_template"] = "true" if opt.chat_template else "false"
        write_config(
            repo / name,
            model_config(
                name,
                backend="python",
                max_batch_size=opt.max_batch_size,
                inputs=inputs,
                outputs=outputs,
                parameters=params,
                dynamic_batching=True,
            ),
        )
    return tok


def _drafter_model(repo: Path, src: Sources, opt: RepoOptions) -> DrafterGraphMeta:
    meta = DrafterGraphMeta.read(src.drafter_dir)
    if meta.selector_top_k:
        # the Triton drafter models and the BLS client pass the four DFlash 1 outputs only
        raise ValueError(
            "a DFlash 2 drafter (candidate selector) is not supported in the Triton repository; "
            "serve it with `dflash-trt serve` (PyTorch or ONNX Runtime drafter)"
        )
    L, H, D, F, V = meta.num_layers, meta.num_kv_heads, meta.head_dim, meta.feature_size, meta.vocab_size
    cache = ("TYPE_FP32", [L, 1, H, -1, D])
    inputs = [
        tensor(name, *t)
        for name, t in zip(DRAFTER_INPUTS, (("TYPE_INT64", [1, -1]), ("TYPE_FP32", [1, -1, F]), cache, cache))
    ]
    outputs = [
        tensor(name, *t)
        for name, t in zip(DRAFTER_OUTPUTS, (("TYPE_FP32", [1, -1, V]), ("TYPE_INT64", [1, -1]), cache, cache))
    ]
    version = repo / DRAFTER / "1"
    version.mkdir(parents=True)
    if src.drafter_backend == "tensorrt":
        # Written against Triton's tensorrt_plan platform, never run in this project: no GPU/TensorRT here.
        _copy(src.drafter_dir / PLAN_FILE, version / "model.plan", opt.symlink_weights)
        # Pinned beside the target (GPU 0): the features come from there, and a replica per GPU would only
        # hold more copies of the plan.
        cfg = model_config(
            DRAFTER,
            platform="tensorrt_plan",
            inputs=inputs,
            outputs=outputs,
            instance_kind="KIND_GPU",
            instance_gpus=[0],
        )
    else:
        folder = version / "drafter-onnx"
        folder.mkdir()
        for name in (GRAPH_FILE, GRAPH_FILE + ".data", META_FILE):
            if (src.drafter_dir / name).exists():
                _copy(src.drafter_dir / name, folder / name, opt.symlink_weights)
        (version / "model.py").write_text(shim("drafter"))
        cfg = model_config(
            DRAFTER,
            backend="python",
            inputs=inputs,
            outputs=outputs,
            parameters={"onnx_dir": "drafter-onnx", "precision": ONNX_PRECISION, "threads": str(opt.threads)},
        )
    write_config(repo / DRAFTER, cfg)
    if src.drafter_backend != "tensorrt" and (src.drafter_dir / BATCH_GRAPH_FILES[ONNX_PRECISION]).exists():
        _drafter_batch_model(repo, src, opt, meta)
    return meta


def drafter_dtype(src: Sources) -> str:
    """What the repository's drafter computes in, by torch's name: the ONNX graph's precision, or the one the TensorRT
    plan was built in (its manifest). The BLS model reports it (`drafter_dtype` in its config's parameters)."""
    if src.drafter_backend == "tensorrt":
        return PRECISION_DTYPES[read_plan_manifest(src.drafter_dir)["precision"]]
    return PRECISION_DTYPES[ONNX_PRECISION]


def _drafter_batch_model(repo: Path, src: Sources, opt: RepoOptions, meta: DrafterGraphMeta) -> None:
    """dflash_drafter_batch: the batched ONNX round graph (builders/onnx_drafter_batch.py), stateless like
    dflash_drafter; each row's cache is one slot of the batch axis of past_k/past_v."""
    L, H, D, F, V = meta.num_layers, meta.num_kv_heads, meta.head_dim, meta.feature_size, meta.vocab_size
    cache = ("TYPE_FP32", [L, -1, H, -1, D])
    inputs = [
        tensor(name, *t)
        for name, t in zip(
            BATCH_DRAFTER_INPUTS,
            (
                ("TYPE_INT64", [-1, -1]),
                ("TYPE_INT64", [-1]),
                ("TYPE_FP32", [-1, -1, F]),
                ("TYPE_INT64", [-1]),
                cache,
                cache,
                ("TYPE_INT64", [-1]),
            ),
        )
    ]
    outputs = [
        tensor(name, *t)
        for name, t in zip(BATCH_DRAFTER_OUTPUTS, (("TYPE_FP32", [-1, -1, V]), ("TYPE_INT64", [-1, -1]), cache, cache))
    ]
    version = repo / DRAFTER_BATCH / "1"
    folder = version / "drafter-onnx"
    folder.mkdir(parents=True)
    batch_graph = BATCH_GRAPH_FILES[ONNX_PRECISION]
    for name in (batch_graph, batch_graph + ".data", META_FILE):
        if (src.drafter_dir / name).exists():
            _copy(src.drafter_dir / name, folder / name, opt.symlink_weights)
    (version / "model.py").write_text(shim("drafter"))
    write_config(
        repo / DRAFTER_BATCH,
        model_config(
            DRAFTER_BATCH,
            backend="python",
            inputs=inputs,
            outputs=outputs,
            parameters={
                "onnx_dir": "drafter-onnx",
                "precision": ONNX_PRECISION,
                "threads": str(opt.threads),
                "graph": "batch",
            },
        ),
    )


class TritonTpUnsupported(ValueError):
    """A tensor-parallel TensorRT-LLM target cannot be one Triton python-backend instance (the message says why)."""


def _trtllm_tp(src: Sources) -> int:
    """The tensor-parallel size a TensorRT-LLM target engine was built for (1 for any other target)."""
    if src.target_backend != "tensorrt_llm":
        return 1
    meta = json.loads((src.target_dir / "dflash_target.json").read_text())
    return int(meta.get("tp", 1))


def check_target_tp(src: Sources) -> None:
    """Refuse a tp > 1 TensorRT-LLM target: this repository's dflash_target would hold rank 0 of a world that
    nothing starts. In leader mode (what `dflash-trt build-target` engines run in) every rank is its own
    process under `mpirun -n tp`, and the executor's world-size check fails in a lone Triton instance;
    TensorRT-LLM's orchestrator mode (the executor spawning its worker ranks) is not implemented here."""
    tp = _trtllm_tp(src)
    if tp > 1:
        raise TritonTpUnsupported(
            f"the TensorRT-LLM target in {src.target_dir} was built for tp {tp}: a Triton dflash_target instance "
            "holds one executor on one GPU, and TensorRT-LLM's orchestrator mode (which would spawn the other "
            "ranks) is not implemented. Serve it with `mpirun -n "
            f"{tp} --allow-run-as-root dflash-trt serve --engines DIR` (the HTTP server, rank 0 serves), "
            "or on a TensorRT-LLM release with native DFlash with `dflash-trt trtllm-serve-config` + trtllm-serve; "
            "or rebuild the target with --tp 1 for Triton"
        )


def _target_model(repo: Path, src: Sources, opt: RepoOptions, feature_layer_ids: Sequence[int]) -> None:
    version = repo / TARGET / "1"
    version.mkdir(parents=True)
    _copy(src.target_dir, version / "target", opt.symlink_weights)
    (version / "model.py").write_text(shim("target"))
    # tensorrt_llm and device "cuda": written against the real APIs, never run in this project (no GPU/TensorRT here).
    gpu = src.target_backend == "tensorrt_llm" or opt.device == "cuda"
    params = {
        "backend": src.target_backend,
        "engine_dir": "target",
        "feature_layer_ids": list(feature_layer_ids),
        "threads": str(opt.threads),
        "session_ttl_s": "600",
    }
    # The PyTorch target runs where --device says. The TensorRT-LLM target gets no device: its output layer (every
    # round's verification matmul) belongs on the GPU its executor rank runs on (trtllm_backend.rank_device), which
    # a written `device` would override.
    if src.target_backend != "tensorrt_llm":
        params["device"] = opt.device
    # One instance: the sequences' KV caches live in it (see dflash_trt.triton.remote). A call may carry several
    # sessions: one session_id / cache_length / rollback_to / length per session, token_ids split by token_lengths.
    # On a GPU it is pinned to GPU 0: a KIND_GPU group without `gpus` gets one instance per visible GPU, and a
    # session's second call could land on another instance than its first ("unknown session").
    cfg = model_config(
        TARGET,
        backend="python",
        instance_kind="KIND_GPU" if gpu else "KIND_CPU",
        instance_count=1,
        instance_gpus=[0] if gpu else None,
        inputs=[
            tensor("session_id", "TYPE_UINT64", [-1]),
            tensor("token_ids", "TYPE_INT64", [-1]),
            tensor("token_lengths", "TYPE_INT64", [-1], optional=True),
            tensor("cache_length", "TYPE_INT64", [-1]),
            tensor("rollback_to", "TYPE_INT64", [-1], optional=True),
            tensor("last_logits_only", "TYPE_BOOL", [1], optional=True),
            tensor("want_features", "TYPE_BOOL", [1], optional=True),
            tensor("release", "TYPE_BOOL", [1], optional=True),
        ],
        outputs=[
            tensor("logits", "TYPE_FP32", [-1, -1]),
            tensor("features", "TYPE_FP32", [-1, -1]),
            tensor("length", "TYPE_INT64", [-1]),
        ],
        parameters=params,
    )
    write_config(repo / TARGET, cfg)


OPTIONAL_INPUTS = [
    tensor("max_tokens", "TYPE_INT32", [1], optional=True),
    tensor("temperature", "TYPE_FP32", [1], optional=True),
    tensor("seed", "TYPE_UINT64", [1], optional=True),
    tensor("stream", "TYPE_BOOL", [1], optional=True),
    tensor("proposer", "TYPE_STRING", [1], optional=True),  # decoding/proposers.py: dflash, suffix or hybrid
]
BLS_OUTPUTS = [
    tensor("output_ids", "TYPE_INT64", [-1]),
    tensor("output_length", "TYPE_INT32", [1]),
    tensor("new_tokens", "TYPE_INT32", [1]),
    tensor("finish_reason", "TYPE_STRING", [1]),
]


def _bls_model(
    repo: Path,
    opt: RepoOptions,
    meta: DrafterGraphMeta,
    vocab_size: int,
    max_context: int,
    stop_ids: Sequence[int],
    dtype: str,
    name: str = BLS,
    decoupled: bool = True,
) -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(shim("bls"))
    params = {
        "target_model": TARGET,
        "drafter_model": DRAFTER,
        "vocab_size": str(vocab_size),
        "max_context": str(max_context),
        "feature_layer_ids": list(meta.feature_layer_ids),
        "drafter_meta": json.loads(meta.to_json()),
        "stop_token_ids": list(stop_ids),
        "default_max_tokens": str(opt.default_max_tokens),
        "drafter_dtype": dtype,
    }
    if (repo / DRAFTER_BATCH).exists():  # one drafter call per step for every drafting row
        params["drafter_batch_model"] = DRAFTER_BATCH
    inputs = OPTIONAL_INPUTS if decoupled else [t for t in OPTIONAL_INPUTS if t.name != "stream"]
    write_config(
        repo / name,
        model_config(
            name,
            backend="python",
            max_batch_size=opt.max_batch_size,
            decoupled=decoupled,
            dynamic_batching=True,
            inputs=[tensor("input_ids", "TYPE_INT64", [-1]), tensor("input_length", "TYPE_INT32", [1]), *inputs],
            outputs=BLS_OUTPUTS,
            parameters=params,
        ),
    )


def _ensemble(repo: Path, opt: RepoOptions, name: str = ENSEMBLE, bls: str = BLS, stream: bool = True) -> None:
    (repo / name / "1").mkdir(parents=True)
    inputs = OPTIONAL_INPUTS if stream else [t for t in OPTIONAL_INPUTS if t.name != "stream"]
    optional = {t.name: t.name for t in inputs}
    steps = [
        Step(PRE, {"text_input": "text_input"}, {"input_ids": "_input_ids", "input_length": "_input_length"}),
        Step(
            bls,
            {"input_ids": "_input_ids", "input_length": "_input_length", **optional},
            {
                "output_ids": "_output_ids",
                "output_length": "_output_length",
                "new_tokens": "num_tokens",
                "finish_reason": "finish_reason",
            },
        ),
        Step(
            POST,
            {
                "output_ids": "_output_ids",
                "output_length": "_output_length",
                "new_tokens": "num_tokens",
                "finish_reason": "finish_reason",
            },
            {"text_output": "text_output"},
        ),
    ]
    write_config(
        repo / name,
        model_config(
            name,
            platform="ensemble",
            max_batch_size=opt.max_batch_size,
            steps=steps,
            inputs=[tensor("text_input", "TYPE_STRING", [1]), *inputs],
            outputs=[
                tensor("text_output", "TYPE_STRING", [1]),
                tensor("finish_reason", "TYPE_STRING", [1]),
                tensor("num_tokens", "TYPE_INT32", [1]),
            ],
        ),
    )


def _empty(folder: Path) -> None:
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def write_repository(
    out: str | Path,
    *,
    engines: str | Path | None = None,
    target: str | Path | None = None,
    drafter: str | Path | None = None,
    options: RepoOptions = RepoOptions(),
    overwrite: bool = False,
) -> Path:
    out = Path(out)
    # The folder itself is kept and only its contents replaced: it may be a mount point (the Triton pod's `repo`
    # emptyDir, deploy/k8s/triton), which no process can remove; an empty one is written into as it is.
    created = not out.exists()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists (pass --force to replace it)")
        _empty(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if engines is not None:
            src = sources_from_engines(Path(engines))
            check_target_tp(src)
        else:
            if target is None or drafter is None:
                raise ValueError("give --engines DIR, or both --target DIR and --drafter DIR")
            src = sources_from_checkpoints(Path(target), Path(drafter), out / ".drafter-onnx")
        tok = _text_models(out, src, options)
        meta = _drafter_model(out, src, options)
        _target_model(out, src, options, meta.feature_layer_ids)
        vocab, max_context = _target_meta(src)
        eos = getattr(tok, "eos_token_id", None)
        stop = [eos] if isinstance(eos, int) else []
        dtype = drafter_dtype(src)
        _bls_model(out, options, meta, vocab, max_context, stop, dtype)
        _bls_model(out, options, meta, vocab, max_context, stop, dtype, name=BLS_SYNC, decoupled=False)
        _ensemble(out, options)
        _ensemble(out, options, name=ENSEMBLE_SYNC, bls=BLS_SYNC, stream=False)
    except BaseException:  # nothing half-written stays: a folder made here goes, a given one is emptied
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            _empty(out)
        raise
    finally:
        shutil.rmtree(out / ".drafter-onnx", ignore_errors=True)
    check_repository(out)
    return out
