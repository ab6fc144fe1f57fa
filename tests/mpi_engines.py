"""What the MPI launch tests share (tests/deploy/test_mpi_serve.py on loopback, test_netns_launch.py across two
network namespaces, tests/runtime/test_trtllm_ranks.py): an engines folder whose target is a TensorRT-LLM engine
folder that tests/mpi_rank.py's FAKE executor loads, the FAKE executor's rule for a rank's GPU, and the JSON event
lines the ranks print."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers import make_tiny_pair

# FAKE hardware: the file in an engines folder that says how many GPUs each node of the fake cluster has (a rank
# started by mpirun over ssh gets no test environment, so the fake reads it where every rank reads its engine).
NODE_GPUS_FILE = "FAKE_NODE_GPUS"
# Mapping's gpus_per_node default (tensorrt_llm/mapping.py, NVIDIA/TensorRT-LLM b35ac1b6: Mapping(world_size=1,
# rank=0, gpus_per_node=8, ...)), what a checkpoint converted without it records
MAPPING_DEFAULT_GPUS_PER_NODE = 8


def fake_build_mapping(commands: list[list[str]], tp: int) -> dict[str, int]:
    """FAKE conversion + trtllm-build: the `mapping` in the engine's config.json from the commands the project
    plans. The conversion (dflash_trt/builders/trtllm_convert.py) saves Mapping(world_size=tp, gpus_per_node=
    --gpus_per_node, tp_size=tp).to_dict() in the checkpoint (tensorrt_llm/mapping.py at b35ac1b6); trtllm-build
    keeps the checkpoint's mapping and has no --gpus_per_node of its own at 1.2 (tensorrt_llm/commands/build.py at
    65f1d153; removed with auto_parallel, NVIDIA/TensorRT-LLM PR 8329), so it must not be given one."""
    convert, build = commands
    if "--gpus_per_node" in build:
        raise SystemExit("trtllm-build: error: unrecognized arguments: --gpus_per_node (FAKE argparse, exit 2)")
    gpus = MAPPING_DEFAULT_GPUS_PER_NODE
    if "--gpus_per_node" in convert:
        gpus = int(convert[convert.index("--gpus_per_node") + 1])
    return {"world_size": tp, "tp_size": tp, "pp_size": 1, "gpus_per_node": gpus}


def executor_device(
    config: dict[str, Any],
    rank: int,
    node_gpus: int | None,
    device_ids: list[int] | None = None,
    world_size: int = 1,
) -> int:
    """FAKE of the GPU TensorRT-LLM 1.2's Executor gives `rank`, as the sources write it. The world is built from
    the engine's `pretrained_config.mapping.gpus_per_node` (cpp/tensorrt_llm/executor/executorImpl.cpp at b35ac1b6,
    Executor::Impl::loadModel: WorldConfig::mpi(jsonConfig.getGpusPerNode(), tp, pp, cp, deviceIds)); WorldConfig::mpi
    lowers it to the node's GPUs, with a warning, when they are fewer than min(world size, gpus_per_node)
    (cpp/tensorrt_llm/runtime/worldConfig.cpp, the version with cp and enableAttentionDP). Without device ids they
    are 0..gpus_per_node-1 (the constructor's std::iota); with them, at most gpus_per_node unique ids below it;
    rank r runs on deviceIds[r % deviceIds.size()] (cpp/include/tensorrt_llm/runtime/worldConfig.h, getDevice).
    `node_gpus` is the FAKE hardware (None: unknown, nothing lowered)."""
    mapping = config.get("pretrained_config", {}).get("mapping") or {}
    gpus_per_node = int(mapping.get("gpus_per_node", MAPPING_DEFAULT_GPUS_PER_NODE))
    if node_gpus is not None and node_gpus < min(world_size, gpus_per_node):
        gpus_per_node = node_gpus  # [TensorRT-LLM][WARNING] ... gpusPerNode will be set to <deviceCount>
    if device_ids is None:
        ids = list(range(gpus_per_node))
    else:
        if len(device_ids) > gpus_per_node or len(set(device_ids)) != len(device_ids):
            raise RuntimeError(
                f"[TensorRT-LLM][ERROR] Assertion failed: device ids {device_ids} (gpusPerNode {gpus_per_node})"
            )
        if not all(0 <= d < gpus_per_node for d in device_ids):
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: device ids {device_ids} < {gpus_per_node}")
        ids = list(device_ids)
    return ids[rank % len(ids)]


def with_device_rule(executor_module, rank: int, node_gpus: int | None, world_size: int = 1):
    """The fake executor module with the Executor's device rule (executor_device) applied at construction; the
    device a rank got is `Executor.device` (what a real rank passes to cudaSetDevice)."""
    base = executor_module.Executor

    class Executor(base):
        def __init__(self, engine_dir, model_type, config):
            engine = json.loads((Path(engine_dir) / "config.json").read_text())
            parallel = getattr(config, "parallel_config", None)
            ids = getattr(parallel, "device_ids", None) if parallel is not None else None
            self.device = executor_device(engine, rank, node_gpus, ids, world_size)
            super().__init__(engine_dir, model_type, config)

    executor_module.Executor = Executor
    return executor_module


def fake_trtllm_engines(root: Path, config_toml: str = "", node_gpus: int | None = None) -> Path:
    """engines/ as `make engines` writes it on a GPU machine from an engines.toml holding `config_toml` (its
    `tp` and `gpus_per_node`): the ONNX drafter built for real, the target as a TensorRT-LLM engine folder
    (config.json + dflash_target.json) that the fake executor loads, its mapping what trtllm-build writes from the
    project's own conversion and build plan (fake_build_mapping). `node_gpus`: the fake cluster's GPUs per node (NODE_GPUS_FILE)."""
    from dflash_trt.builders.engines import build_engines, read_config
    from dflash_trt.builders.trtllm_target import TargetBuildSpec, plan_target_build
    from dflash_trt.config import load_drafter_config

    make_tiny_pair(root, vocab_size=96, seed=3)  # no tokenizer: a request for N tokens runs exactly N
    (root / "engines.toml").write_text('target = "target"\ndrafter = "drafter"\noutput = "engines"\n' + config_toml)
    cfg = read_config(root / "engines.toml", root)
    build_engines(cfg, log=lambda *_: None)
    out = root / "engines"
    _, spec = load_drafter_config(root / "drafter")
    folder = out / "target_trtllm"
    (folder / "engine").mkdir(parents=True)
    plan = plan_target_build(
        TargetBuildSpec(
            target_dir=root / "target",
            out_dir=folder,
            model_type="qwen3",
            tp=cfg.tp,
            block_size=spec.block_size,
            feature_layer_ids=tuple(spec.target_layer_ids),
            num_layers=4,
            gpus_per_node=cfg.gpus_per_node or None,  # as engines.py's _build_trtllm passes it
        )
    )
    build = {"max_seq_len": 256, "max_num_tokens": 256, "plugin_config": {"tokens_per_block": 4}}
    mapping = fake_build_mapping(plan.commands, cfg.tp)
    pretrained = {"vocab_size": 96, "hidden_size": 64, "dtype": "float32", "mapping": mapping}
    config = {"pretrained_config": pretrained, "build_config": build}
    (folder / "build-command.txt").write_text(plan.describe() + "\n")  # what a GPU machine would have run
    if node_gpus is not None:
        (out / NODE_GPUS_FILE).write_text(f"{node_gpus}\n")
    (folder / "engine" / "config.json").write_text(json.dumps(config))
    layers = list(spec.target_layer_ids)
    meta = {
        "engine_dir": "engine",
        "feature_layer_ids": layers,
        "feature_outputs": [f"dflash_feature_{i}" for i in layers],
        "final_hidden_output": "dflash_final_hidden",
        "target_dir": str(root / "target"),
    }
    (folder / "dflash_target.json").write_text(json.dumps(meta))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["engines"]["target_tensorrt_llm"] = {"backend": "tensorrt_llm", "role": "target", "dir": "target_trtllm"}
    manifest["serve"]["target"] = "target_tensorrt_llm"
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def json_events(text: str, name: str) -> list[dict]:
    """The JSON event lines named `name` in a job's output (mpirun may put two ranks' lines on one line)."""
    decoder, out = json.JSONDecoder(), []
    i = text.find('{"')
    while i != -1:
        try:
            e, end = decoder.raw_decode(text, i)
        except ValueError:
            end = i + 1
        else:
            if isinstance(e, dict) and e.get("event") == name:
                out.append(e)
        i = text.find('{"', end)
    return out
