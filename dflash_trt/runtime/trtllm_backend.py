"""TensorRT-LLM target engine (engine path, TensorRT-LLM 1.2 Executor API), built by `dflash-trt build-target`.

A round is one plain context-phase request over the session's whole token list (TensorRT-LLM has no KV
rollback call); KV block reuse (`KvCacheConfig(enable_block_reuse=True)`, engine built with paged context
FMHA) skips the prefix the session sent before, so a round costs the new tokens, not the sequence.

What the 1.2 runtime does, and how this module follows it (source files of the 1.2 line):
  * additional outputs come back as `context_<name>` / `generation_<name>`
    (cpp/tensorrt_llm/batch_manager/llmRequest.cpp, LlmRequest::createResult): we read `context_<name>`;
  * a context output is sized to the whole request; the rows of reused tokens are left UNWRITTEN, not dropped
    (cpp/tensorrt_llm/batch_manager/handleContextLogits.cpp, utils/inflightBatchingUtils.cpp): the session
    never reads a row it cannot prove was computed. It tracks every token sequence it sent under its salt,
    so it knows the most the runtime can have reused; the new tokens of a round were never sent at those
    positions (a bonus token differs from the rejected draft), so their rows are computed. If they were
    (a caller repeating itself), the session moves to a fresh `cache_salt_id`, where nothing can be reused;
  * each session has its own `cache_salt_id` (nanobind executor/request.cpp; the salt is part of the block
    key), so a session reuses only its own prefix, never another request's;
  * the engine marks no logits for every position (built without `--gather_context_logits`, which would
    turn reuse off: trtGptModelInflightBatching.cpp, fixExecutorConfig): logits = final-norm hidden state
    (`dflash_final_hidden`) x the target's lm_head, loaded from the HF checkpoint;
  * requests longer than min(max_seq_len - 1, max_num_tokens) are refused by the runtime
    (cpp/tensorrt_llm/batch_manager/trtGptModel.h, llmRequest.cpp validate): that is `max_context`;
  * with tp > 1 (under `mpirun -n tp`) every rank builds the Executor, only the leader can enqueue
    (cpp/tensorrt_llm/executor/executorImpl.cpp, canEnqueueRequests); a non-leader calls `serve_worker()`,
    whose `shutdown()` returns when the leader shuts down (executorImpl.cpp, Executor::Impl::shutdown).

Rows (`TrtllmTargetSession`, the batched protocol of runtime/base.py): each row is one `TrtllmSequence`;
a step builds every row's request, submits them all in one `enqueue_requests` call and only then awaits
them (`await_responses(ids)`: one list of responses per id, in the order of the ids; executor.h), so the
executor's in-flight batching runs the rows together. A row's request and response handling is the
sequence's (`_prepare` / `_finish`).

NOT RUN on real hardware in this project (no TensorRT / TensorRT-LLM / GPU here); the tests drive it
against a labelled fake of the Executor that models the behaviours above.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.utils.dlpack

from ..formats import CONTEXT_PREFIX, FINAL_HIDDEN_OUTPUT, TARGET_META_FILE, engine_max_context
from .base import EngineOptions, EngineUnavailable, TargetOutput
from .rows import PerRowTarget

log = logging.getLogger(__name__)


def _executor_module() -> Any:
    try:
        import tensorrt_llm.bindings.executor as trtllm
    except ImportError as e:
        raise EngineUnavailable(
            "the tensorrt_llm target needs TensorRT-LLM 1.2 (NVIDIA's container, see the Dockerfile)"
        ) from e
    return trtllm


def _as_torch(t: Any) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "__dlpack__"):
        return torch.utils.dlpack.from_dlpack(t)
    return torch.as_tensor(t)


def load_lm_head(target_dir: str | Path) -> torch.Tensor:
    """The target's output projection [vocab, hidden] from its safetensors (tied: the embedding table)."""
    from safetensors import safe_open

    files = sorted(Path(target_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {target_dir}: the lm_head for verification logits comes from there"
        )
    for wanted in ("lm_head.weight", "model.embed_tokens.weight"):
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                if wanted in st.keys():
                    weight: torch.Tensor = st.get_tensor(wanted)
                    return weight
    raise KeyError(f"neither lm_head.weight nor model.embed_tokens.weight in {target_dir}")


def _mpi_env(names: tuple[str, ...]) -> int | None:
    import os

    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def mpi_rank() -> int:
    """This process's MPI world rank (0 outside mpirun): what the Executor's WorldConfig::mpi reads."""
    return _mpi_env(("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")) or 0


def mpi_world_size() -> int:
    """The ranks of the MPI world (1 outside mpirun): WorldConfig::mpi's mpiSize."""
    return _mpi_env(("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")) or 1


def mpi_node_ranks() -> int | None:
    """The ranks mpirun started on this node (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS);
    None outside mpirun or where the launcher does not say."""
    return _mpi_env(("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"))


# The GPUs per node of an engine whose mapping names none: tensorrt_llm/mapping.py Mapping(gpus_per_node=8) and
# cpp/include/tensorrt_llm/runtime/worldConfig.h kDefaultGpusPerNode (8 with multi-device support).
DEFAULT_GPUS_PER_NODE = 8


def engine_gpus_per_node(config: dict[str, Any]) -> int:
    """The engine's `pretrained_config.mapping.gpus_per_node` (the conversion's Mapping records it; trtllm-build
    keeps the checkpoint's mapping), from which the Executor builds its world (executorImpl.cpp, loadModel:
    WorldConfig::mpi(gpusPerNode, ...))."""
    mapping = config.get("pretrained_config", {}).get("mapping") or {}
    return int(mapping.get("gpus_per_node", DEFAULT_GPUS_PER_NODE))


def executor_gpus_per_node(recorded: int, world_size: int, visible: int) -> int:
    """The GPUs per node the Executor runs with (TensorRT-LLM 1.2, cpp/tensorrt_llm/runtime/worldConfig.cpp,
    WorldConfig::mpi): the engine's value, lowered to the GPUs this process sees (with a warning) when they are
    fewer than min(world size, recorded value)."""
    return visible if visible < min(world_size, recorded) else recorded


def check_node_ranks(gpus_per_node: int, node_ranks: int | None, what: str) -> None:
    """OUR check, not the Executor's (1.2 runs it silently): more ranks on a node than the GPUs per node the ranks
    are spread over (rank % gpus_per_node) puts two ranks of this node on one GPU."""
    if node_ranks is not None and node_ranks > gpus_per_node:
        raise EngineUnavailable(
            f"{node_ranks} MPI ranks run on this node but {what} is {gpus_per_node}: TensorRT-LLM's Executor would "
            f"run them on GPUs rank % {gpus_per_node}, two ranks sharing a GPU (refused by dflash-trt); rebuild "
            f"the engine with gpus_per_node = the node's GPUs (engines.toml `gpus_per_node`, build-target "
            f"--gpus-per-node)"
        )


def rank_device(rank: int, gpus_per_node: int, world_size: int = 1, node_ranks: int | None = None) -> torch.device:
    """The GPU the Executor runs `rank` on: rank % the GPUs per node it runs with (executor_gpus_per_node; its
    device ids default to 0..gpus_per_node-1, worldConfig.cpp constructor, worldConfig.h getDevice).
    `gpus_per_node` is the engine's recorded value; one below this node's ranks is refused (check_node_ranks),
    one that differs from the node's GPUs is logged. CPU when no GPU is visible (the tests' fake executor)."""
    check_node_ranks(gpus_per_node, node_ranks, "the engine's gpus_per_node")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    effective = executor_gpus_per_node(gpus_per_node, world_size, visible)
    if gpus_per_node != visible:
        log.warning(
            "the engine records gpus_per_node %d, this node has %d GPU(s): TensorRT-LLM runs with %d (rank %d on "
            "GPU %d); build the engine with gpus_per_node = the node's GPUs",
            gpus_per_node,
            visible,
            effective,
            rank,
            rank % effective,
        )
    check_node_ranks(effective, node_ranks, "the GPUs per node TensorRT-LLM runs with (this node's GPUs)")
    return torch.device("cuda", rank % effective)


def executor_kv_fraction(
    folder: Path, engine_dir: Path, config: dict[str, Any], rank: int, device: torch.device
) -> float:
    """The executor's free_gpu_memory_fraction on this rank's GPU (`device`): the cap where nothing else loads (a
    non-leader rank, or no GPU: the tests' fake), else what leaves the leader's lm_head and drafter room."""
    from .trtllm_memory import FRACTION_CAP, kv_cache_fraction, leader_load, rank_engine_bytes

    if rank != 0 or not torch.cuda.is_available():  # leader mode: rank 0 is the leader (executorImpl.cpp)
        return FRACTION_CAP
    free, _ = torch.cuda.mem_get_info(device)
    return kv_cache_fraction(free, rank_engine_bytes(engine_dir, rank), leader_load(folder, config))


def _new_salt() -> int:
    return secrets.randbits(63) + 1  # CacheSaltIDType is uint64 (executor/types.h); 0 is avoided


class TrtllmTargetEngine:
    name = "tensorrt_llm"

    def __init__(self, folder: str | Path, kv_cache_free_fraction: float | None = None, device: str | None = None):
        trtllm = _executor_module()
        folder = Path(folder)
        meta = json.loads((folder / TARGET_META_FILE).read_text())
        engine_dir = folder / meta["engine_dir"]
        config = json.loads((engine_dir / "config.json").read_text())
        if config.get("build_config", {}).get("gather_context_logits"):
            raise EngineUnavailable(
                f"{engine_dir} was built with --gather_context_logits: TensorRT-LLM 1.2 then disables KV block reuse "
                "and every round re-runs the whole sequence; rebuild it with `dflash-trt build-target`"
            )
        pretrained = config.get("pretrained_config", {})
        self.feature_layer_ids: tuple[int, ...] = tuple(int(i) for i in meta["feature_layer_ids"])
        self.feature_outputs: list[str] = list(meta["feature_outputs"])
        self.final_output: str = str(meta.get("final_hidden_output", FINAL_HIDDEN_OUTPUT))
        self.vocab_size = int(pretrained["vocab_size"])
        self.max_context = engine_max_context(config)
        self.rank = mpi_rank()
        # this rank's GPU by the Executor's rule, checked before the Executor is built (rank_device)
        self.gpus_per_node = engine_gpus_per_node(config)
        executor_device = rank_device(self.rank, self.gpus_per_node, mpi_world_size(), mpi_node_ranks())
        self.trtllm = trtllm
        names = [*self.feature_outputs, self.final_output]
        # AdditionalModelOutput(name, gather_context): nanobind executor/request.cpp (1.2)
        outputs = [trtllm.AdditionalModelOutput(name, gather_context=True) for name in names]
        self.output_config = trtllm.OutputConfig(additional_model_outputs=outputs)
        self.output_config_no_features = trtllm.OutputConfig(
            additional_model_outputs=[trtllm.AdditionalModelOutput(self.final_output, gather_context=True)]
        )
        if kv_cache_free_fraction is None:  # what the leader loads next on this GPU decides (trtllm_memory.py)
            kv_cache_free_fraction = executor_kv_fraction(folder, engine_dir, config, self.rank, executor_device)
        self.kv_cache_free_fraction = kv_cache_free_fraction
        # ExecutorConfig / KvCacheConfig: nanobind executor/executorConfig.cpp (1.2)
        executor_config = trtllm.ExecutorConfig(
            max_beam_width=1,
            kv_cache_config=trtllm.KvCacheConfig(
                enable_block_reuse=True, free_gpu_memory_fraction=kv_cache_free_fraction
            ),
            additional_model_outputs=outputs,
        )
        self.executor: Any = trtllm.Executor(engine_dir, trtllm.ModelType.DECODER_ONLY, executor_config)
        # executorImpl.cpp: only the leader rank (or the orchestrator) can enqueue requests
        self.is_leader = bool(self.executor.can_enqueue_requests())
        # The lm_head (verification logits) lives on the leader's GPU, the one its executor rank runs on; a
        # non-leader rank only keeps its executor going (serve_worker) and loads nothing else.
        self.device = torch.device(device) if device else executor_device
        self.lm_head: torch.Tensor | None = None
        if self.is_leader:
            self.lm_head = load_lm_head(meta["target_dir"])[: self.vocab_size].to(self.device)

    @classmethod
    def from_artifact(cls, folder: Path, options: EngineOptions) -> TrtllmTargetEngine:
        return cls(folder, device=options.device)  # the feature layers were fixed when the engine was built

    def new_session(self) -> TrtllmTargetSession:
        if not self.is_leader:
            raise RuntimeError(
                "this MPI rank is not the TensorRT-LLM leader: only rank 0 runs sessions (serve_worker here)"
            )
        return TrtllmTargetSession(self)

    def serve_worker(self) -> None:
        """On a non-leader rank: take part in the tensor-parallel work until the leader shuts down."""
        self.executor.shutdown()

    def close(self) -> None:
        self.executor.shutdown()


@dataclass
class _Pending:
    """A round built but not yet answered: its new tokens, the tokens held before them, its request."""

    new: list[int]
    held: int
    features: bool
    request: Any


def _final_responses(executor: Any, request_ids: list[int]) -> list[Any]:
    """Each request's final response, in the order of `request_ids`.

    `await_responses(ids)` returns one list per id, in the order given, and a list may be empty
    (executor.h); a non-streaming request answers once, so we await again the ids still unanswered."""
    got: dict[int, Any] = {}
    while len(got) < len(request_ids):
        waiting = [i for i in request_ids if i not in got]
        for rid, responses in zip(waiting, executor.await_responses(waiting)):
            for response in responses:
                if response.has_error() or getattr(response.result, "is_final", True):
                    got[rid] = response
    return [got[i] for i in request_ids]


class _SentTokens:
    """Every token sequence a session sent under its current salt, as a trie: what the runtime may reuse."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}
        self.path: list[dict[int, Any]] = [self.root]  # path[i]: the node after the session's first i tokens

    def already_sent(self, held: int, new: list[int]) -> int:
        """How many of `new` (placed after the first `held` tokens) were sent at those positions before."""
        node, count = self.path[held], 0
        for token in new:
            if token not in node:
                break
            node, count = node[token], count + 1
        return count

    def add(self, held: int, new: list[int]) -> None:
        node = self.path[held]
        del self.path[held + 1 :]
        for token in new:
            node = node.setdefault(token, {})
            self.path.append(node)

    def truncate(self, length: int) -> None:
        del self.path[length + 1 :]


class TrtllmSequence:
    def __init__(self, engine: TrtllmTargetEngine):
        self.engine = engine
        self.tokens: list[int] = []
        self.salt = _new_salt()
        self.sent = _SentTokens()
        self.reuse_bound = 0  # most tokens the runtime could have reused in the last request
        self.salt_changes = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    def forward(
        self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True
    ) -> TargetOutput:
        pending = self._prepare(token_ids, features)
        request_id = self.engine.executor.enqueue_request(pending.request)
        self._sent(pending)
        response = _final_responses(self.engine.executor, [request_id])[0]
        return self._finish(pending, response, last_logits_only)

    def _prepare(self, token_ids: torch.Tensor, features: bool) -> _Pending:
        """Check a round and build its request (moving to a fresh salt if its new rows could come back unwritten)."""
        new = [int(t) for t in token_ids.view(-1).tolist()]
        n, held = len(new), len(self.tokens)
        if held + n > self.engine.max_context:
            raise ValueError(
                f"{held + n} tokens exceed the engine's input limit {self.engine.max_context} "
                "(min(max_seq_len - 1, max_num_tokens) of its build)"
            )
        if self.sent.already_sent(held, new):  # their rows could come back unwritten: start a fresh salt
            self.salt, self.sent = _new_salt(), _SentTokens()
            self.sent.add(0, self.tokens)
            self.salt_changes += 1
        return _Pending(new, held, features, self._request(self.tokens + new, features))

    def _sent(self, pending: _Pending) -> None:
        """Once a request is submitted its blocks may be cached, whatever becomes of the round: remember them."""
        self.reuse_bound = pending.held
        self.sent.add(pending.held, pending.new)

    def _finish(self, pending: _Pending, response: Any, last_logits_only: bool) -> TargetOutput:
        """Read a round's rows from its response and commit its tokens (raises, committing nothing, on an error)."""
        outputs = self._outputs(pending, response, last_logits_only)
        self.tokens.extend(pending.new)
        return outputs

    def _outputs(self, pending: _Pending, response: Any, last_logits_only: bool) -> TargetOutput:
        if response.has_error():
            raise RuntimeError(f"TensorRT-LLM request failed: {response.error_msg}")
        held, n = pending.held, len(pending.new)
        by_name = {str(o.name): _as_torch(o.output) for o in (response.result.additional_outputs or [])}
        hidden = self._new_rows(by_name, self.final_output_name, held, n)
        if last_logits_only:
            hidden = hidden[-1:]
        head = self.engine.lm_head
        if head is None:
            raise RuntimeError("no lm_head on this rank: only the leader rank computes logits")
        logits = hidden.to(self.engine.device, head.dtype) @ head.T
        feats = None
        if pending.features:
            rows = [self._new_rows(by_name, CONTEXT_PREFIX + name, held, n) for name in self.engine.feature_outputs]
            feats = torch.cat(rows, -1).float().cpu()
        # logits stay on the lm_head's GPU (the decoding loop adjusts and accepts there); features are the
        # executor's host copies, which the drafter takes in
        return TargetOutput(logits=logits.float(), features=feats)

    @property
    def final_output_name(self) -> str:
        return CONTEXT_PREFIX + self.engine.final_output

    @staticmethod
    def _new_rows(by_name: dict[str, torch.Tensor], name: str, held: int, n: int) -> torch.Tensor:
        """Rows held..held+n-1 of a context output sized to the request (rows of reused tokens are unwritten)."""
        if name not in by_name:
            raise RuntimeError(
                f"engine returned no {name!r} (got {sorted(by_name)}): rebuild it with "
                "`dflash-trt build-target` (outputs marked by trtllm_features.py)"
            )
        t = by_name[name]
        t = t.reshape(-1, t.shape[-1])
        if t.shape[0] != held + n:
            raise RuntimeError(f"{name}: {t.shape[0]} rows for a request of {held + n} tokens")
        return t[held:]

    def _request(self, tokens: list[int], features: bool) -> Any:
        e, trtllm = self.engine, self.engine.trtllm
        # Request(..., cache_salt_id=...): nanobind executor/request.cpp (1.2)
        return trtllm.Request(
            input_token_ids=tokens,
            max_tokens=1,  # the runtime samples one token after the context phase; we read the outputs instead
            streaming=False,
            output_config=e.output_config if features else e.output_config_no_features,
            cache_salt_id=self.salt,
        )

    def rollback(self, length: int) -> None:
        if length > len(self.tokens):
            raise ValueError(f"cannot roll back to {length}: only {len(self.tokens)} tokens held")
        del self.tokens[length:]
        self.sent.truncate(length)

    def close(self) -> None:
        """Nothing held here beyond the token list: the executor frees a request's KV blocks when it ends."""


class TrtllmTargetSession(PerRowTarget):
    """Every row a TrtllmSequence (the generic per-row adapter), except `forward`: it submits every row's
    request before awaiting any, so the executor's in-flight batching runs them together."""

    def __init__(self, engine: TrtllmTargetEngine):
        super().__init__(lambda: TrtllmSequence(engine))
        self.engine = engine

    def _row(self, row: int) -> TrtllmSequence:
        if row not in self.sequences:
            raise KeyError(f"no live row {row}")
        return cast(TrtllmSequence, self.sequences[row])

    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        """Submit every row's round, then await them all; all rows commit, or (on any error) none does."""
        if len(rows) != len(tokens):
            raise ValueError(f"{len(rows)} rows but {len(tokens)} token lists")
        if len(set(rows)) != len(rows):
            raise ValueError("a row appears twice in one forward call")
        sessions = [self._row(r) for r in rows]
        for r, t in zip(rows, tokens):
            if t.numel() < 1:
                raise ValueError(f"row {r}: a forward needs >= 1 new token")
        pending = [s._prepare(t, features) for s, t in zip(sessions, tokens)]  # every check before any submit
        ids = list(self.engine.executor.enqueue_requests([p.request for p in pending]))
        for s, p in zip(sessions, pending):
            s._sent(p)
        responses = _final_responses(self.engine.executor, ids)
        for r, response in zip(rows, responses):
            if response.has_error():
                raise RuntimeError(f"TensorRT-LLM request of row {r} failed: {response.error_msg}")
        outputs = [s._outputs(p, resp, last_logits_only) for s, p, resp in zip(sessions, pending, responses)]
        for s, p in zip(sessions, pending):
            s.tokens.extend(p.new)
        return outputs
