"""Tensor-parallel ranks of a TensorRT-LLM target: each rank's device, and what a non-leader rank loads.

Against the FAKE executor (tests/fake_tensorrt.py: leader mode, only rank 0 enqueues; executorImpl.cpp, 1.2) with the
Executor's device rule (tests/mpi_engines.py executor_device: deviceIds[rank % gpus_per_node] from the engine's
mapping) and a FAKE lm_head that records where it is moved (no GPU here; torch.cuda is patched to report GPUs)."""

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
from dflash_trt.runtime.trtllm_backend import TrtllmTargetEngine, mpi_rank, rank_device
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


def test_an_engine_recording_8_gpus_per_node_fails_ranks_4_to_7_on_a_4_gpu_node(gpus):
    """TensorRT-LLM issues 1494 / 3123: the default gpus_per_node (8) on 4-GPU nodes. The fake executor fails ranks
    4-7 as cudaSetDevice does; rank_device refuses them first, by name, with the fix."""
    gpus(4)
    for rank in range(8):
        if rank < 4:
            assert executor_device(engine_config(), rank, 4) == rank
            assert str(rank_device(rank, 8)) == f"cuda:{rank}"
            continue
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            executor_device(engine_config(), rank, 4)
        with pytest.raises(EngineUnavailable, match=f"rank {rank} would run on GPU {rank} .* gpus_per_node = 4"):
            rank_device(rank, 8)


def test_explicit_device_ids_follow_the_executors_checks():
    """worldConfig.cpp: at most gpus_per_node unique ids, each below it; rank r takes ids[r % len(ids)]."""
    assert [executor_device(engine_config(4), r, 4, [2, 3]) for r in range(4)] == [2, 3, 2, 3]
    for bad in ([0, 0], [4], [0, 1, 2, 3, 0]):
        with pytest.raises(RuntimeError, match="Assertion failed"):
            executor_device(engine_config(4), 0, 4, bad)


def spec(tp: int, gpus_per_node: int | None, tmp_path) -> TargetBuildSpec:
    return TargetBuildSpec(tmp_path, tmp_path / "out", "llama", tp, 4, (1, 2), 4, gpus_per_node=gpus_per_node)


@pytest.mark.parametrize(("tp", "gpus_per_node", "recorded"), [(8, 4, 4), (4, 2, 2), (2, None, 2), (8, None, 8)])
def test_gpus_per_node_reaches_the_conversion_and_the_build(tmp_path, tp, gpus_per_node, recorded):
    plan = plan_target_build(spec(tp, gpus_per_node, tmp_path))
    convert, build = plan.commands
    assert convert[convert.index("--gpus_per_node") + 1] == str(recorded)  # Mapping(..., gpus_per_node=)
    # trtllm-build writes its --gpus_per_node into the engine's mapping (fake_build_mapping reads build.py's rule)
    assert fake_build_mapping(build, tp)["gpus_per_node"] == recorded
    assert [
        executor_device({"pretrained_config": {"mapping": fake_build_mapping(build, tp)}}, r, recorded)
        for r in range(tp)
    ] == [r % recorded for r in range(tp)]


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
    install_trtllm(monkeypatch, with_device_rule(make_trtllm_executor([], hf_outputs(model), rank=rank), rank, 2))
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
