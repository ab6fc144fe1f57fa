"""STAND-IN for tensorrt_llm.bindings.executor (TensorRT-LLM 1.2's Executor): tests/fake_tensorrt.py's executor (the
modelled outputs, leader-only enqueue, block reuse), built from what the real one reads at load and nothing else:
the engine folder (cpp/tensorrt_llm/executor/executorImpl.cpp at NVIDIA/TensorRT-LLM b35ac1b6, Executor::Impl::
loadModel: config.json and rank{r}.engine under the engine dir, r the process's MPI rank). The stand-in engine's
rank file holds the Hugging Face checkpoint it was built from (bin/trtllm-build), whose outputs the fake computes; a
path that is not mounted in the container therefore fails here as it fails there. Started by mpirun (a world of
more than one rank, as a LeaderWorkerSet group's leader starts it), every rank joins the world over real MPI
(mpi4py, as NVIDIA's image has it) and takes part in each of the leader's iterations (tests/fake_tensorrt.py
tensor_parallel): a rank that is lost fails the leader's next iteration, as a lost rank fails the collectives."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # fake_tensorrt.py, beside the stand-in package

import torch  # noqa: E402
from fake_tensorrt import make_trtllm_executor, tensor_parallel, wait_message  # noqa: E402


def _model_fn(engine_dir: Path, rank: int):
    from transformers import AutoModelForCausalLM

    layers = json.loads((engine_dir / "config.json").read_text())["pretrained_config"]["dflash_feature_layer_ids"]
    unpacked = Path(tempfile.mkdtemp(prefix="standin-engine-"))
    with tarfile.open(fileobj=io.BytesIO((engine_dir / f"rank{rank}.engine").read_bytes())) as tar:
        tar.extractall(unpacked, filter="data")
    model = AutoModelForCausalLM.from_pretrained(unpacked, torch_dtype=torch.float32).eval()

    seen: dict[tuple[int, ...], dict] = {}  # a GPU's speed stands in as a memo: the same tokens are computed once

    @torch.inference_mode()
    def run(tokens):
        key = tuple(tokens)
        if key not in seen:
            hs = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
            seen[key] = {f"dflash_feature_{i}": hs[i + 1][0].numpy() for i in layers}
            seen[key]["dflash_final_hidden"] = hs[-1][0].numpy()
        return seen[key]

    return run


_proto = make_trtllm_executor([], None)
AdditionalModelOutput, OutputConfig, KvCacheConfig = (
    _proto.AdditionalModelOutput,
    _proto.OutputConfig,
    _proto.KvCacheConfig,
)
ExecutorConfig, Request, ModelType = _proto.ExecutorConfig, _proto.Request, _proto.ModelType


def _event(**fields) -> None:
    print(json.dumps(fields), file=sys.stderr, flush=True)


def Executor(engine_dir, model_type, config):  # noqa: N802 - the binding's class name
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    module = make_trtllm_executor([], _model_fn(Path(engine_dir), rank), rank=rank)
    cls = module.Executor
    if size > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        cls = tensor_parallel(cls, comm, comm.Get_rank(), comm.Get_size(), _event, wait_message)
        _event(event="standin_rank", rank=comm.Get_rank(), size=comm.Get_size(), host=socket.gethostname())
    return cls(engine_dir, model_type, config)
