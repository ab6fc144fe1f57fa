"""Tensor-parallel ranks of a TensorRT-LLM target: each rank's device, and what a non-leader rank loads.

Against the FAKE executor (tests/fake_tensorrt.py: leader mode, only rank 0 enqueues; executorImpl.cpp, 1.2) and
a FAKE lm_head that records where it is moved (no GPU here; torch.cuda is patched to report GPUs)."""

import json
import types

import pytest
import torch
from fake_tensorrt import install_trtllm, make_trtllm_executor
from test_trtllm_fake import engine_folder, hf_outputs, tiny  # noqa: F401 - fixture

from dflash_trt.runtime import trtllm_backend
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


def test_rank_r_runs_on_gpu_r_mod_gpus_per_node(gpus):
    gpus(4)
    assert [str(rank_device(r)) for r in range(8)] == [f"cuda:{r % 4}" for r in range(8)]
    gpus(0)
    assert str(rank_device(5)) == "cpu"


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
    install_trtllm(monkeypatch, make_trtllm_executor([], hf_outputs(model), rank=rank))
    if rank == 0:
        with pytest.raises(MemoryPlanError, match="leaving the KV cache less than 5%"):
            TrtllmTargetEngine(engine_folder(root, root / "target"))
        free = 20 * 2**30
    engine = TrtllmTargetEngine(engine_folder(root, root / "target"))
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
