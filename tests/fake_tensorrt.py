"""A FAKE `tensorrt` module that records calls (this workplace has no TensorRT and no GPU), and below it a FAKE
TensorRT-LLM 1.2 Executor + `trtllm-build` refusal check, each behaviour naming the 1.2 source file it models.

It mimics the slice of the TensorRT 10/11 Python API that dflash_trt uses, so tests can check
the build sequence and the runtime's tensor binding. It computes nothing real; it proves
nothing about TensorRT itself, only that our code drives the API as documented.
"""

from __future__ import annotations

import ctypes
import enum
import json
import types
from pathlib import Path

import numpy as np
import torch


def make(version: str, calls: list, io: dict | None = None) -> types.ModuleType:
    """io: for the runtime, {name: (is_input, dtype_name, spec)} of the fake engine; spec is an output's shape
    function, or an input's optimization-profile range (min shape, max shape), or None (any shape)."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    major = int(version.split(".")[0])
    trt.float32, trt.float16, trt.int32, trt.int64 = "float32", "float16", "int32", "int64"

    class Logger:
        WARNING = "WARNING"

        def __init__(self, level):
            calls.append(("Logger", level))

    class NetworkDefinitionCreationFlag(enum.IntEnum):
        STRONGLY_TYPED = 1  # the real enum value is 1 in 10.x

    trt.BuilderFlag = types.SimpleNamespace(**({"FP16": "FP16"} if major < 11 else {}), TF32="TF32")
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    trt.NetworkDefinitionCreationFlag = NetworkDefinitionCreationFlag

    class Tensor:
        def __init__(self, name):
            self.name = name

    class Network:
        def __init__(self, flags):
            self.flags = flags
            self.inputs = []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

    class OnnxParser:
        def __init__(self, network, logger):
            self.network = network
            self.num_errors = 0

        def parse_from_file(self, path):
            calls.append(("parse_from_file", path))
            names = ("block_ids", "features", "past_k", "past_v")
            if "drafter_batch" in str(path):  # the batched graph (builders/onnx_drafter_batch.py)
                names = ("block_ids", "block_lengths", "features", "new_lengths", "past_k", "past_v", "past_lengths")
            self.network.inputs = [Tensor(n) for n in names]
            return True

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, mn, opt, mx):
            calls.append(("profile.set_shape", name, tuple(mn), tuple(opt), tuple(mx)))
            self.shapes[name] = (mn, opt, mx)

    class Config:
        def set_memory_pool_limit(self, pool, size):
            calls.append(("set_memory_pool_limit", pool, size))

        def set_flag(self, flag):
            calls.append(("set_flag", flag))

        def add_optimization_profile(self, profile):
            calls.append(("add_optimization_profile", sorted(profile.shapes)))
            return 0

    class Builder:
        def __init__(self, logger):
            calls.append(("Builder",))

        def create_network(self, flags=0):
            calls.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("build_serialized_network",))
            return b"FAKE-PLAN"

    # ---- runtime ----
    class Context:
        def __init__(self):
            self.shapes, self.addresses = {}, {}

        def set_input_shape(self, name, shape):
            """IExecutionContext.set_input_shape (TensorRT 10 Python API docs): False, and the shape is not
            taken, when it lies outside the engine's optimization profile for that input."""
            calls.append(("set_input_shape", name, tuple(shape)))
            bounds = io[name][2]
            if bounds is not None:
                lo, hi = bounds
                if len(shape) != len(lo) or any(not a <= d <= b for a, d, b in zip(lo, shape, hi)):
                    return False
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            return io[name][2](self.shapes)

        def set_tensor_address(self, name, address):
            calls.append(("set_tensor_address", name, address))
            self.addresses[name] = address
            return True

        def execute_async_v3(self, stream):
            calls.append(("execute_async_v3", stream))
            # write a recognisable pattern into each output buffer at the address bound to its name
            for name, (is_input, dtype, shape_fn) in io.items():
                if is_input:
                    continue
                shape = shape_fn(self.shapes)
                n = int(np.prod(shape))
                if n == 0:
                    continue
                # the buffer's element type is the engine's declared dtype (fp16 outputs of an fp16 plan)
                ctype, view = {
                    "float32": (ctypes.c_float, np.float32),
                    "float16": (ctypes.c_uint16, np.float16),
                    "int64": (ctypes.c_int64, np.int64),
                }[dtype]
                buf = np.ctypeslib.as_array((ctype * n).from_address(self.addresses[name])).view(view)
                buf[:] = FILL[name]
            return True

    class Engine:
        num_io_tensors = len(io or {})
        # ICudaEngine.device_memory_size_v2 (TensorRT 10.1+ / 11 Python API): the device memory one execution
        # context allocates (STATIC strategy: the largest profile's); a fixed figure here
        device_memory_size_v2 = FAKE_CONTEXT_MEMORY

        def get_tensor_name(self, i):
            return list(io)[i]

        def get_tensor_mode(self, name):
            return "INPUT" if io[name][0] else "OUTPUT"

        def get_tensor_dtype(self, name):
            return io[name][1]

        def create_execution_context(self):
            calls.append(("create_execution_context",))
            return Context()

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            calls.append(("deserialize_cuda_engine", bytes(data)))
            return Engine()

    trt.Logger, trt.Builder, trt.OnnxParser, trt.Runtime = Logger, Builder, OnnxParser, Runtime
    return trt


FAKE_CONTEXT_MEMORY = 3 * 2**20  # the fake engine's activation memory per execution context
FILL = {"logits": 0.5, "draft_tokens": 7, "present_k": 1.0, "present_v": 2.0}


# ---- TensorRT-LLM 1.2: a FAKE `tensorrt_llm.bindings.executor` and a FAKE `trtllm-build` check -----------------
# Each behaviour below names the TensorRT-LLM 1.2 source it models; none of it was checked against a real runtime.


def trtllm_build_refusals(argv: list[str]) -> list[str]:
    """The refusals of tensorrt_llm/commands/build.py (1.2) that a `trtllm-build` command line would hit."""
    flags: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true"
            flags[a] = nxt
    refusals = []
    if "--gather_context_logits" in flags and int(flags.get("--max_draft_len", "0")) > 0:
        refusals.append("Gather context logits is not support with draft len > 0")  # build.py main()
    if int(flags.get("--workers", "1")) > 1 and "--model_cls_file" in flags:
        # build.py: workers > 1 spawn processes and pickle the class imported from --model_cls_file
        refusals.append("Can't pickle <class 'models.DFlash...'>: import of module 'models' failed")
    return refusals


def fake_tp_convert_attention(num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> None:
    """FAKE of a LLaMA / QWen checkpoint conversion's attention split at `tp` ranks, then its weight load.

    Models tensorrt_llm/models/{llama,qwen}/convert.py (1.2): the query weight [num_heads * head_dim, hidden] is
    cut into tp equal row blocks (`split`, which asserts the rows divide); KV weights are split the same way, or
    first repeated by `dup_kv_weight` (asserting tp % num_kv_heads == 0) when there are fewer KV heads than ranks.
    Each rank's attention (tensorrt_llm/layers/attention.py) is built for num_heads // tp query heads and
    ceil(num_kv_heads / tp) KV heads, and loading a weight of another shape fails. Raises ValueError as the load
    would; returns None when every rank's weights fit."""
    q_rows = num_heads * head_dim
    if q_rows % tp:
        raise ValueError(f"Unable to split: shape=({q_rows}, hidden) (dim=0) tp_size={tp}")
    q_block = q_rows // tp
    if num_kv_heads < tp:
        if tp % num_kv_heads:
            raise ValueError(f"dup_kv_weight: assert tp_size % num_head == 0 ({tp} % {num_kv_heads})")
        kv_block = head_dim  # repeated to tp heads, one per rank
    else:
        kv_rows = num_kv_heads * head_dim
        if kv_rows % tp:
            raise ValueError(f"Unable to split: shape=({kv_rows}, hidden) (dim=0) tp_size={tp}")
        kv_block = kv_rows // tp
    expect_q = (num_heads // tp) * head_dim
    expect_kv = -(-num_kv_heads // tp) * head_dim
    if (q_block, kv_block) != (expect_q, expect_kv):
        raise ValueError(
            f"weight shape mismatch on each rank: q {q_block} rows / kv {kv_block} rows loaded, the rank's "
            f"attention expects q {expect_q} / kv {expect_kv}"
        )


def make_trtllm_executor(calls: list, model_fn, rank: int = 0) -> types.ModuleType:
    """model_fn(tokens) -> {output name: np.ndarray [len(tokens), H]}: what the engine's marked outputs hold."""
    ex = types.ModuleType("tensorrt_llm.bindings.executor")
    ex.reused = []  # tokens reused per request, for tests
    ex.iterations = []  # request ids run together, per modelled executor iteration

    class AdditionalModelOutput:
        def __init__(self, name, gather_context=False):
            self.name, self.gather_context = name, gather_context

    class OutputConfig:
        def __init__(self, return_context_logits=False, additional_model_outputs=None, **kw):
            self.return_context_logits = return_context_logits
            self.additional_model_outputs = list(additional_model_outputs or [])

    class KvCacheConfig:
        def __init__(self, enable_block_reuse=False, **kw):
            self.enable_block_reuse = enable_block_reuse

    class ExecutorConfig:
        def __init__(
            self,
            max_beam_width=1,
            kv_cache_config=None,
            additional_model_outputs=None,
            enable_chunked_context=False,
            **kw,
        ):
            self.kv_cache_config = kv_cache_config or KvCacheConfig()
            self.additional_model_outputs = list(additional_model_outputs or [])
            self.enable_chunked_context = enable_chunked_context

    class Request:
        # nanobind executor/request.cpp (NVIDIA/TensorRT-LLM commit 008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc):
        # input_token_ids and max_tokens, then nb::kw_only(): every other parameter by keyword only
        def __init__(
            self,
            input_token_ids,
            max_tokens,
            *,
            streaming=False,
            output_config=None,
            cache_salt_id=None,
            external_draft_tokens_config=None,
            **kw,
        ):
            self.input_token_ids, self.max_tokens, self.streaming = list(input_token_ids), max_tokens, streaming
            self.output_config = output_config or OutputConfig()
            self.cache_salt_id, self.external_draft_tokens_config = cache_salt_id, external_draft_tokens_config

    class Executor:
        def __init__(self, engine_dir, model_type, config):
            cfg = json.loads((Path(engine_dir) / "config.json").read_text())
            build = cfg["build_config"]
            # the engine's activation dtype (config.json pretrained_config.dtype, written by every build): the
            # dtype of its marked outputs
            self.dtype = getattr(torch, cfg["pretrained_config"]["dtype"])
            plugin = build.get("plugin_config", {})
            self.tokens_per_block = plugin.get("tokens_per_block", 4)
            # trtGptModelInflightBatching.cpp fixExecutorConfig (b35ac1b6): context logits, or an engine built
            # without paged context FMHA, switch block reuse off. A test config that omits the flag stands for
            # an engine built with it (trtllm-build's default)
            self.reuse = (
                config.kv_cache_config.enable_block_reuse
                and not build.get("gather_context_logits", False)
                and plugin.get("use_paged_context_fmha", True)
            )
            # attentionOp.cpp (eea41b73) AttentionOp::initialize: context FMHA only for fp16 / bf16, any other
            # dtype falls back to unfused MHA, whose context phase attends over the request's new tokens only
            # (enqueueContext: attention_seq_len_2 = input_seq_length). Modelled where a config says outright
            # that an fp32 engine has paged context FMHA (what build-target wrote before it built fp32 without)
            self.unfused_context = cfg["pretrained_config"]["dtype"] not in ("float16", "bfloat16") and bool(
                plugin.get("use_paged_context_fmha")
            )
            self.gather_context_logits = build.get("gather_context_logits", False)
            # trtGptModel.h: maxInputLen = maxSequenceLen - 1 with chunked context, else min(that, maxNumTokens)
            limit = build["max_seq_len"] - 1
            if not config.enable_chunked_context:
                limit = min(limit, build["max_num_tokens"])
            self.max_input_len = limit
            self.declared = {o.name for o in config.additional_model_outputs}
            self.blocks: set = set()  # (salt, tokens of a whole block prefix): the reusable KV blocks
            self.pending: dict = {}
            self.ready: dict = {}  # responses computed, not yet awaited
            self.shutdown_called = False
            calls.append(("Executor", str(engine_dir), config))

        def can_enqueue_requests(self):  # executorImpl.cpp: leader mode, only the leader rank
            return rank == 0 and not self.shutdown_called

        def shutdown(self):
            calls.append(("shutdown", rank))
            self.shutdown_called = True

        def enqueue_request(self, request):
            if not self.can_enqueue_requests():  # executorImpl.cpp enqueueRequest: TLLM_CHECK
                raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: Cannot enqueue requests on this rank")
            calls.append(request)
            rid = len(calls)
            self.pending[rid] = request
            return rid

        def enqueue_requests(self, requests):  # executor.h enqueueRequests: one id per request, in order
            return [self.enqueue_request(r) for r in requests]

        def _error(self, rid, msg):
            return types.SimpleNamespace(has_error=lambda: True, error_msg=msg, result=None, request_id=rid)

        def await_responses(self, ids=None):
            """executor.h: an id -> its responses; a list of ids -> one list per id, in that order; None -> any
            ready. Modelled in-flight batching: an await runs every request pending then as ONE iteration."""
            calls.append(("await", ids))
            if self.pending:
                ex.iterations.append(sorted(self.pending))
                for rid in sorted(self.pending):
                    self.ready[rid] = self._run(rid, self.pending.pop(rid))
            if ids is None:
                out, self.ready = list(self.ready.values()), {}
                return out
            if isinstance(ids, int):
                return [self.ready.pop(ids)] if ids in self.ready else []
            return [[self.ready.pop(i)] if i in self.ready else [] for i in ids]

        def _run(self, rid, r):
            tokens, salt, tpb = r.input_token_ids, r.cache_salt_id, self.tokens_per_block
            if len(tokens) > self.max_input_len:  # llmRequest.cpp validate
                return self._error(
                    rid, f"Prompt length ({len(tokens)}) exceeds maximum input length ({self.max_input_len})."
                )
            if r.output_config.return_context_logits and not self.gather_context_logits:
                return self._error(rid, "gather_context_logits must be enabled at build time to return context logits")
            wanted = r.output_config.additional_model_outputs
            if wanted and r.external_draft_tokens_config is not None:  # inflightBatchingUtils.cpp
                return self._error(rid, "additional outputs with draft tokens: index mismatch")
            undeclared = [o.name for o in wanted if o.name not in self.declared]
            if undeclared:
                return self._error(rid, f"additional output {undeclared} not in ExecutorConfig")
            reused = 0  # whole blocks of this salt's earlier requests; the last token is always computed
            if self.reuse:
                while reused + tpb <= len(tokens) and (salt, tuple(tokens[: reused + tpb])) in self.blocks:
                    reused += tpb
                reused = min(reused, len(tokens) - 1)
                for end in range(tpb, len(tokens) + 1, tpb):
                    self.blocks.add((salt, tuple(tokens[:end])))
            ex.reused.append(reused)
            values = model_fn(tokens)
            if reused and self.unfused_context:  # the new rows computed without the reused prefix
                values = {
                    k: np.concatenate([np.asarray(v)[:reused], np.asarray(model_fn(tokens[reused:])[k])])
                    for k, v in values.items()
                }
            outputs = []
            for o in wanted:
                if o.name not in values:  # not marked in this engine: the runtime returns nothing under that name
                    continue
                full = torch.from_numpy(np.asarray(values[o.name], dtype=np.float32)).to(self.dtype)
                # handleContextLogits.cpp / copyAdditionalOutputs: host buffer sized to the prompt, rows of
                # reused tokens never written (uninitialised memory; NaN here so a misuse shows). The buffer
                # reaches Python as a torch.Tensor of the engine's dtype (nanobind/common/customCasters.h,
                # type_caster<executor::Tensor>::from_cpp), not numpy
                buf = torch.full_like(full, float("nan"))
                buf[reused:] = full[reused:]
                outputs.append(
                    types.SimpleNamespace(name="context_" + o.name, output=buf)
                )  # llmRequest.cpp createResult
                outputs.append(
                    types.SimpleNamespace(
                        name="generation_" + o.name, output=torch.zeros((1, 0, full.shape[-1]), dtype=self.dtype)
                    )
                )
            result = types.SimpleNamespace(
                output_token_ids=[[0]], context_logits=None, additional_outputs=outputs, is_final=True
            )
            return types.SimpleNamespace(has_error=lambda: False, error_msg="", result=result, request_id=rid)

    ex.AdditionalModelOutput, ex.OutputConfig, ex.KvCacheConfig = AdditionalModelOutput, OutputConfig, KvCacheConfig
    ex.ExecutorConfig, ex.Request, ex.Executor = ExecutorConfig, Request, Executor
    ex.ModelType = types.SimpleNamespace(DECODER_ONLY="DECODER_ONLY")
    return ex


def install_trtllm(monkeypatch, module: types.ModuleType) -> None:
    """Make `import tensorrt_llm.bindings.executor` return the fake."""
    import sys

    for name in ("tensorrt_llm", "tensorrt_llm.bindings"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", module)
    sys.modules["tensorrt_llm"].bindings = sys.modules["tensorrt_llm.bindings"]
    sys.modules["tensorrt_llm.bindings"].executor = module


MPI_POLL_S = 0.005  # how often a waiting rank looks for a message (Open MPI's blocking recv spins a core)


def wait_message(comm, source: int, timeout: float | None = None):
    """comm.recv without spinning: poll, sleep, then receive. None after `timeout` seconds."""
    import time

    end = None if timeout is None else time.monotonic() + timeout
    while not comm.iprobe(source=source):
        if end is not None and time.monotonic() > end:
            return None
        time.sleep(MPI_POLL_S)
    return comm.recv(source=source)


def tensor_parallel(base: type, comm, rank: int, size: int, event, wait, answer_timeout: float = 30.0) -> type:
    """The FAKE executor class `base` as one rank of a tensor-parallel world over real MPI (`comm`, mpi4py): each
    executor iteration the leader (rank 0) runs is one step every other rank takes part in, as the tensor-parallel
    collectives tie every rank to every iteration: the leader sends it to every rank and each rank answers (a rank
    that does not answer within `answer_timeout` is lost, and the leader's iteration fails). A non-leader's
    `shutdown()` (what dflash-trt's serve_worker() calls) returns when the leader shuts its executor down
    (executorImpl.cpp, Executor::Impl::shutdown). `event(**fields)` reports life-cycle events; `wait(comm, source,
    timeout)` receives one message (None after the timeout)."""

    class Executor(base):  # type: ignore[misc,valid-type]
        iterations = 0

        def await_responses(self, ids=None):
            ran = bool(self.pending)
            out = super().await_responses(ids)
            if ran and rank == 0:
                Executor.iterations += 1
                for peer in range(1, size):
                    comm.send(("iteration", Executor.iterations), dest=peer)
                for peer in range(1, size):
                    if wait(comm, peer, answer_timeout) is None:
                        event(event="fake_rank_lost", rank=peer)
                        raise RuntimeError(f"tensor-parallel rank {peer} did not take part in the iteration")
            return out

        def shutdown(self):
            if self.shutdown_called:
                return
            super().shutdown()
            if rank == 0:
                for peer in range(1, size):
                    comm.send(("shutdown", 0), dest=peer)
                event(event="fake_leader_shutdown", iterations=Executor.iterations)
                return
            while True:  # a worker: every leader iteration, then the leader's shutdown
                kind, n = wait(comm, 0)
                if kind == "shutdown":
                    event(event="fake_worker_shutdown", rank=rank, iterations=Executor.iterations)
                    return
                Executor.iterations = n
                comm.send(("done", n), dest=0)

    return Executor
