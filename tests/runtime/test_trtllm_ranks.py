"""Tensor-parallel ranks of a TensorRT-LLM target: each rank's device, and what a non-leader rank loads.

Against the FAKE executor (tests/fake_tensorrt.py: leader mode, only rank 0 enqueues; executorImpl.cpp, 1.2) with the
Executor's device rule (tests/mpi_engines.py executor_device: TensorRT-LLM 1.2's rank % gpus_per_node from the engine's
mapping, lowered to the node's GPUs) and a FAKE lm_head that records where it is moved (no GPU here; torch.cuda is patched to report GPUs)."""

import json
import types
from pathlib import Path

import pytest
import torch
from fake_tensorrt import install_trtllm, make_trtllm_executor
from mpi_engines import executor_device, fake_build_mapping, with_device_rule
from test_trtllm_fake import engine_folder, hf_outputs, tiny  # noqa: F401 - fixture

from dflash_trt.builders.engines import EnginesConfigError, read_config
from dflash_trt.builders.trtllm_target import TargetBuildError, TargetBuildSpec, plan_target_build
from dflash_trt.runtime import trtllm_backend
from dflash_trt.runtime.base import EngineUnavailable
from dflash_trt.runtime.trtllm_backend import (
    TrtllmTargetEngine,
    executor_gpus_per_node,
    mpi_node_ranks,
    mpi_rank,
    mpi_world_size,
    rank_device,
)
from dflash_trt.runtime.trtllm_memory import FRACTION_CAP, MemoryPlanError


class RecordingHead:
    """Stands in for the lm_head weight: records every device it is moved to."""

    def __init__(self, moves):
        self.moves = moves

    def __getitem__(self, item):
        return self

    def to(self, device, *a, **kw):
        self.moves.append(str(device))
        return self


@pytest.fixture
def gpus(monkeypatch):
    def with_gpus(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return with_gpus


@pytest.mark.parametrize("env", ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"])
def test_rank_from_the_mpi_launcher(monkeypatch, env):
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert mpi_rank() == 0
    monkeypatch.setenv(env, "3")
    assert mpi_rank() == 3


def engine_config(gpus_per_node=None) -> dict:
    mapping = (
        {} if gpus_per_node is None else {"mapping": {"world_size": 8, "tp_size": 8, "gpus_per_node": gpus_per_node}}
    )
    return {"pretrained_config": mapping}


def test_rank_r_runs_on_gpu_r_mod_the_engines_gpus_per_node(gpus):
    gpus(4)
    assert [str(rank_device(r, 4)) for r in range(8)] == [f"cuda:{r % 4}" for r in range(8)]
    # the fake executor's rule (the sources') gives the same devices
    assert [executor_device(engine_config(4), r, 4) for r in range(8)] == [r % 4 for r in range(8)]
    gpus(0)
    assert str(rank_device(5, 4)) == "cpu"


def test_an_engine_recording_8_gpus_per_node_runs_on_4_gpu_nodes_lowered_with_a_warning(gpus, caplog):
    """TensorRT-LLM 1.2 runs it: WorldConfig::mpi lowers gpusPerNode to the GPUs it sees, with a warning, when they
    are fewer than min(mpiSize, gpusPerNode) (cpp/tensorrt_llm/runtime/worldConfig.cpp, the version with cp and
    enableAttentionDP, called by executorImpl.cpp b35ac1b6 loadModel). "Invalid device ordinal" (TensorRT-LLM issues
    1494, 3123) was the v0.9-era WorldConfig, which had no such check. rank_device mirrors 1.2 and logs."""
    gpus(4)
    assert executor_gpus_per_node(8, 8, 4) == 4
    assert [executor_device(engine_config(), r, 4, world_size=8) for r in range(8)] == [r % 4 for r in range(8)]
    with caplog.at_level("WARNING", logger="dflash_trt.runtime.trtllm_backend"):
        assert [str(rank_device(r, 8, world_size=8, node_ranks=4)) for r in range(8)] == [
            f"cuda:{r % 4}" for r in range(8)
        ]
    assert "records gpus_per_node 8, this node has 4 GPU(s): TensorRT-LLM runs with 4" in caplog.text
    # not lowered where the world fits the node's GPUs: 2 ranks on a 4-GPU node, an engine recording 8
    assert executor_gpus_per_node(8, 2, 4) == 8
    assert [str(rank_device(r, 8, world_size=2, node_ranks=2)) for r in range(2)] == ["cuda:0", "cuda:1"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_trt.runtime.trtllm_backend"):
        rank_device(5, 4, world_size=8, node_ranks=4)  # the node's own value: nothing to say
    assert caplog.text == ""


def test_an_engine_recording_fewer_gpus_per_node_than_the_nodes_ranks_is_refused(gpus):
    """The hazard 1.2 runs silently: gpus_per_node 2 with 4 ranks on one 4-GPU node puts ranks 0-3 on GPUs 0,1,0,1
    (nothing lowered: 4 GPUs are not fewer than min(4, 2)). dflash-trt's own check refuses it, GPU or not."""
    gpus(4)
    assert [executor_device(engine_config(2), r, 4, world_size=4) for r in range(4)] == [0, 1, 0, 1]
    for rank in range(4):
        with pytest.raises(EngineUnavailable, match="4 MPI ranks run on this node but the engine's gpus_per_node is 2"):
            rank_device(rank, 2, world_size=4, node_ranks=4)
    gpus(0)
    with pytest.raises(EngineUnavailable, match="two ranks sharing a GPU .refused by dflash-trt"):
        rank_device(1, 1, world_size=4, node_ranks=2)
    # a node with fewer GPUs than its ranks: 1.2 lowers to them, and the ranks share them
    gpus(1)
    with pytest.raises(EngineUnavailable, match="2 MPI ranks run on this node but the GPUs per node TensorRT-LLM"):
        rank_device(1, 2, world_size=2, node_ranks=2)


def test_the_mpi_world_from_the_launchers_environment(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    assert (mpi_world_size(), mpi_node_ranks()) == (1, None)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert (mpi_world_size(), mpi_node_ranks()) == (4, 2)


def test_explicit_device_ids_follow_the_executors_checks():
    """worldConfig.cpp: at most gpus_per_node unique ids, each below it; rank r takes ids[r % len(ids)]."""
    assert [executor_device(engine_config(4), r, 4, [2, 3]) for r in range(4)] == [2, 3, 2, 3]
    for bad in ([0, 0], [4], [0, 1, 2, 3, 0]):
        with pytest.raises(RuntimeError, match="Assertion failed"):
            executor_device(engine_config(4), 0, 4, bad)


def spec(tp: int, gpus_per_node: int | None, tmp_path) -> TargetBuildSpec:
    return TargetBuildSpec(tmp_path, tmp_path / "out", "llama", tp, 4, (1, 2), 4, gpus_per_node=gpus_per_node)


@pytest.mark.parametrize(("tp", "gpus_per_node", "recorded"), [(8, 4, 4), (4, 2, 2), (2, None, 2), (8, None, 8)])
def test_gpus_per_node_reaches_the_engine_through_the_conversion(tmp_path, tp, gpus_per_node, recorded):
    plan = plan_target_build(spec(tp, gpus_per_node, tmp_path))
    convert, _ = plan.commands
    assert convert[convert.index("--gpus_per_node") + 1] == str(recorded)  # Mapping(..., gpus_per_node=)
    # the checkpoint's mapping is the engine's (fake_build_mapping: trtllm-build keeps it)
    mapping = fake_build_mapping(plan.commands, tp)
    assert mapping["gpus_per_node"] == recorded
    engine = {"pretrained_config": {"mapping": mapping}}
    assert [executor_device(engine, r, recorded, world_size=tp) for r in range(tp)] == [r % recorded for r in range(tp)]


def test_trtllm_build_is_given_no_gpus_per_node(tmp_path):
    """TensorRT-LLM 1.2's trtllm-build has no --gpus_per_node (tensorrt_llm/commands/build.py at 65f1d153; it went
    with auto_parallel, NVIDIA/TensorRT-LLM PR 8329): argparse would exit 2 on it and no engine would be built."""
    plan = plan_target_build(spec(8, 4, tmp_path))
    assert plan.commands[1][0] == "trtllm-build"
    assert not [flag for flag in plan.commands[1] if flag.startswith("--gpus_per_node")]
    with pytest.raises(SystemExit, match="unrecognized arguments: --gpus_per_node"):
        fake_build_mapping([plan.commands[0], [*plan.commands[1], "--gpus_per_node", "4"]], 8)
    # a checkpoint converted without it records Mapping's default (tensorrt_llm/mapping.py: gpus_per_node=8)
    convert = [f for f in plan.commands[0]]
    del convert[convert.index("--gpus_per_node") : convert.index("--gpus_per_node") + 2]
    assert fake_build_mapping([convert, plan.commands[1]], 8)["gpus_per_node"] == 8


def test_ranks_that_do_not_fill_whole_nodes_are_refused(tmp_path):
    with pytest.raises(TargetBuildError, match="tp 8 does not fill whole nodes of 3 GPUs"):
        plan_target_build(spec(8, 3, tmp_path))
    (tmp_path / "engines.toml").write_text("tp = 8\ngpus_per_node = 3\n")
    with pytest.raises(EnginesConfigError, match="tp 8 does not fill whole nodes of 3 GPUs"):
        read_config(tmp_path / "engines.toml", tmp_path)
    (tmp_path / "engines.toml").write_text("tp = 8\ngpus_per_node = 4\n")
    assert read_config(tmp_path / "engines.toml", tmp_path).gpus_per_node == 4


@pytest.mark.parametrize("path", ["engines.toml", "deploy/k8s/multi-node/engines.toml"])
def test_the_shipped_configs_record_the_gpus_of_their_nodes(path):
    """The multi-node group is 2 pods x DFLASH_GPUS_PER_POD GPUs: its engine must record those GPUs per node."""
    import re

    from dflash_trt.builders.engines import read_config as read

    root = Path(__file__).resolve().parents[2]
    cfg = read(root / path, root)
    if "multi-node" in path:
        lws = (root / "deploy/k8s/multi-node/leaderworkerset.yaml").read_text()
        (per_pod,) = set(re.findall(r"DFLASH_GPUS_PER_POD, value: \"(\d+)\"", lws))
        assert cfg.gpus_per_node == int(per_pod) and cfg.tp > cfg.gpus_per_node
    else:
        assert cfg.gpus_per_node in (0, cfg.tp)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_only_the_leader_loads_an_lm_head_on_its_ranks_gpu(monkeypatch, tiny, gpus, rank):  # noqa: F811
    root, model, _ = tiny
    gpus(2)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
    moves, loads = [], []
    monkeypatch.setattr(trtllm_backend, "load_lm_head", lambda d: loads.append(d) or RecordingHead(moves))
    queried = []  # free memory, asked on the leader only (it sizes the KV cache around what it loads next)
    free = 1 * 2**30 + 96 * 64 * 4 + 2**20  # headroom + the lm_head + 1 MiB: the KV cache gets 1 MiB of it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: queried.append(str(d)) or (free, 80 * 2**30))
    install_trtllm(monkeypatch, with_device_rule(make_trtllm_executor([], hf_outputs(model), rank=rank), rank, 2, 4))
    folder = engine_folder(root, root / "target", mapping={"world_size": 4, "tp_size": 4, "gpus_per_node": 2})
    if rank == 0:
        with pytest.raises(MemoryPlanError, match="leaving the KV cache less than 5%"):
            TrtllmTargetEngine(folder)
        free = 20 * 2**30
    engine = TrtllmTargetEngine(folder)
    assert engine.executor.device == rank % 2  # the fake executor's GPU is the one the lm_head would go to
    assert engine.rank == rank and str(engine.device) == f"cuda:{rank % 2}"
    if rank == 0:
        assert engine.is_leader and moves == ["cuda:0"] and len(loads) == 1
        assert queried == ["cuda:0", "cuda:0"] and engine.kv_cache_free_fraction == FRACTION_CAP
    else:
        assert not engine.is_leader and moves == [] and loads == [] and engine.lm_head is None
        assert queried == [] and engine.kv_cache_free_fraction == FRACTION_CAP


@pytest.mark.parametrize("rank", [0, 1])
def test_a_non_leader_rank_loads_no_drafter(monkeypatch, tiny, tmp_path, rank):  # noqa: F811
    """load_decoder_from_engines on a tp > 1 TensorRT-LLM target: the target first, the drafter on the leader only."""
    from dflash_trt.loading import load_decoder_from_engines
    from dflash_trt.runtime import registry

    root, model, _ = tiny
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
    install_trtllm(monkeypatch, make_trtllm_executor([], hf_outputs(model), rank=rank))
    engines = tmp_path / "engines"
    engine_folder(engines, root / "target", name="target-tensorrt_llm")
    (engines / "drafter-tensorrt").mkdir()
    (engines / "manifest.json").write_text(
        json.dumps(
            {
                "sources": {"target": {"path": str(root / "target")}},
                "engines": {
                    "drafter_trt": {"backend": "tensorrt", "role": "drafter", "dir": "drafter-tensorrt"},
                    "target_trtllm": {"backend": "tensorrt_llm", "role": "target", "dir": "target-tensorrt_llm"},
                },
                "serve": {"drafter": "drafter_trt", "target": "target_trtllm"},
            }
        )
    )
    drafters = []
    drafter = types.SimpleNamespace(feature_layer_ids=(1, 2), block_size=8)
    monkeypatch.setattr(registry, "drafter_engine", lambda *a, **kw: drafters.append(a) or drafter)
    # the registry's availability check wants a real tensorrt_llm and a GPU: construct the engine directly
    monkeypatch.setattr(
        registry, "target_engine", lambda name, path, options: TrtllmTargetEngine.from_artifact(path, options)
    )
    decoder = load_decoder_from_engines(engines)
    assert decoder.target.is_leader == (rank == 0)
    assert len(drafters) == (1 if rank == 0 else 0)
    assert (decoder.target.lm_head is None) == (rank != 0)
