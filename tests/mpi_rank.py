"""One rank of `dflash-trt serve` under a real `mpirun`, with the FAKE TensorRT-LLM executor (this workplace has no
TensorRT-LLM and no GPU): tests/deploy/test_mpi_serve.py runs `mpirun -n 2 python tests/mpi_rank.py serve --engines ...`.

The fake is tests/fake_tensorrt.py's executor (leader-only enqueue, the modelled outputs computed by the real tiny
Hugging Face target), plus what a tensor-parallel world adds, over real MPI (mpi4py on Open MPI):

- every rank builds its executor on the GPU TensorRT-LLM 1.2's Executor gives it (tests/mpi_engines.py
  executor_device: rank % the engine's gpus_per_node, lowered to the node's GPUs where they are fewer than
  min(world size, gpus_per_node)), on a fake node with as many GPUs as the engines folder's FAKE_NODE_GPUS says;
  an engine recording fewer GPUs per node than the node's ranks is refused by dflash-trt's own check first
  (trtllm_backend.check_node_ranks, from Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE);
- only rank 0 (the leader, executorImpl.cpp canEnqueueRequests) can enqueue;
- each executor iteration the leader runs is one step the other ranks take part in: the leader sends it to every
  rank and each rank answers, as the tensor-parallel collectives tie every rank to every iteration;
- a non-leader's `shutdown()` (what `serve_worker()` calls) returns when the leader shuts its executor down
  (executorImpl.cpp, Executor::Impl::shutdown), and the rank then exits.

A worker that dies makes the leader's next iteration fail (its answer never comes) and mpirun end the job, as a
lost rank does to real tensor-parallel collectives; this rank prints one JSON line per life-cycle event.
Only CUDA is faked beyond the executor: `registry.cuda_available` answers True so the registry lets the
TensorRT-LLM backend load (its lm_head then runs on the CPU).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import socket
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from fake_tensorrt import make_trtllm_executor, tensor_parallel, wait_message  # noqa: E402
from mpi4py import MPI  # noqa: E402
from mpi_engines import NODE_GPUS_FILE, with_device_rule  # noqa: E402

ANSWER_TIMEOUT_S = 30.0  # a rank that does not answer an iteration within this is lost


def event(**fields) -> None:
    print(json.dumps(fields), file=sys.stderr, flush=True)


def hf_model_fn(target_dir: str, layers: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(tokens):
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        hs = out.hidden_states
        values = {f"dflash_feature_{i}": hs[i + 1][0].numpy() for i in layers}
        values["dflash_final_hidden"] = hs[-1][0].numpy()
        return values

    return run


def install(engines: Path, comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    meta = json.loads((engines / "target_trtllm" / "dflash_target.json").read_text())
    ex = make_trtllm_executor([], hf_model_fn(meta["target_dir"], list(meta["feature_layer_ids"])), rank=rank)
    node_gpus_file = engines / NODE_GPUS_FILE
    node_gpus = int(node_gpus_file.read_text()) if node_gpus_file.is_file() else None
    base = with_device_rule(ex, rank, node_gpus, size).Executor

    parallel = tensor_parallel(base, comm, rank, size, event, wait_message, ANSWER_TIMEOUT_S)

    class Executor(parallel):
        """The fake executor of one rank of a tensor-parallel world (see the module docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            event(event="fake_rank_device", rank=rank, host=socket.gethostname(), device=self.device)

    ex.Executor = Executor
    for name in ("tensorrt_llm", "tensorrt_llm.bindings", "tensorrt_llm.bindings.executor"):
        module = ex if name.endswith("executor") else types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec (the registry) sees it
        sys.modules[name] = module
    sys.modules["tensorrt_llm"].bindings = sys.modules["tensorrt_llm.bindings"]
    sys.modules["tensorrt_llm.bindings"].executor = ex

    from dflash_trt.runtime import registry

    registry.cuda_available = lambda: True  # the one other fake: CUDA (the registry's check for this backend)


def launcher() -> dict[str, str]:
    """Which Open MPI started this rank: the daemon's executable (mpirun's own ranks: mpirun; a remote node's:
    the orted its ssh session ran) and the libmpi this process mapped."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libmpi.so" in line}
    return {"daemon": os.path.realpath(f"/proc/{os.getppid()}/exe"), "libmpi": ",".join(sorted(libs))}


def main(argv: list[str]) -> int:
    comm = MPI.COMM_WORLD
    event(
        event="fake_rank",
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        pid=os.getpid(),
        host=socket.gethostname(),
        **launcher(),
    )
    install(Path(argv[argv.index("--engines") + 1]), comm)
    from dflash_trt.cli import main as cli_main

    code = cli_main(argv)
    event(event="fake_rank_exit", rank=comm.Get_rank(), code=code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
