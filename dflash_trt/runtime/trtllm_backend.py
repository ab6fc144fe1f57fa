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

NOT RUN on real hardware in this project (no TensorRT / TensorRT-LLM / GPU here); the tests drive it
against a labelled fake of the Executor that models the behaviours above.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.utils.dlpack

from ..formats import CONTEXT_PREFIX, FINAL_HIDDEN_OUTPUT, TARGET_META_FILE, engine_max_context
from .base import EngineOptions, EngineUnavailable, TargetOutput


def _executor_module() -> Any:
    try:
        import tensorrt_llm.bindings.executor as trtllm
    except ImportError as e:
        raise EngineUnavailable("the tensorrt_llm target needs TensorRT-LLM 1.2 (NVIDIA's container, see the Dockerfile)") from e
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
        raise FileNotFoundError(f"no *.safetensors in {target_dir}: the lm_head for verification logits comes from there")
    for wanted in ("lm_head.weight", "model.embed_tokens.weight"):
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                if wanted in st.keys():
                    weight: torch.Tensor = st.get_tensor(wanted)
                    return weight
    raise KeyError(f"neither lm_head.weight nor model.embed_tokens.weight in {target_dir}")


def _new_salt() -> int:
    return secrets.randbits(63) + 1  # CacheSaltIDType is uint64 (executor/types.h); 0 is avoided


class TrtllmTargetEngine:
    name = "tensorrt_llm"

    def __init__(self, folder: str | Path, kv_cache_free_fraction: float = 0.85, device: str | None = None):
        trtllm = _executor_module()
        folder = Path(folder)
        meta = json.loads((folder / TARGET_META_FILE).read_text())
        engine_dir = folder / meta["engine_dir"]
        config = json.loads((engine_dir / "config.json").read_text())
        if config.get("build_config", {}).get("gather_context_logits"):
            raise EngineUnavailable(
                f"{engine_dir} was built with --gather_context_logits: TensorRT-LLM 1.2 then disables KV block reuse "
                "and every round re-runs the whole sequence; rebuild it with `dflash-trt build-target`")
        pretrained = config.get("pretrained_config", {})
        self.feature_layer_ids: tuple[int, ...] = tuple(int(i) for i in meta["feature_layer_ids"])
        self.feature_outputs: list[str] = list(meta["feature_outputs"])
        self.final_output: str = str(meta.get("final_hidden_output", FINAL_HIDDEN_OUTPUT))
        self.vocab_size = int(pretrained["vocab_size"])
        self.max_context = engine_max_context(config)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.lm_head = load_lm_head(meta["target_dir"])[: self.vocab_size].to(self.device)
        self.trtllm = trtllm
        names = [*self.feature_outputs, self.final_output]
        # AdditionalModelOutput(name, gather_context): nanobind executor/request.cpp (1.2)
        outputs = [trtllm.AdditionalModelOutput(name, gather_context=True) for name in names]
        self.output_config = trtllm.OutputConfig(additional_model_outputs=outputs)
        self.output_config_no_features = trtllm.OutputConfig(
            additional_model_outputs=[trtllm.AdditionalModelOutput(self.final_output, gather_context=True)])
        # ExecutorConfig / KvCacheConfig: nanobind executor/executorConfig.cpp (1.2)
        executor_config = trtllm.ExecutorConfig(
            max_beam_width=1,
            kv_cache_config=trtllm.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=kv_cache_free_fraction),
            additional_model_outputs=outputs,
        )
        self.executor: Any = trtllm.Executor(engine_dir, trtllm.ModelType.DECODER_ONLY, executor_config)
        # executorImpl.cpp: only the leader rank (or the orchestrator) can enqueue requests
        self.is_leader = bool(self.executor.can_enqueue_requests())

    @classmethod
    def from_artifact(cls, folder: Path, options: EngineOptions) -> "TrtllmTargetEngine":
        return cls(folder, device=options.device)  # the feature layers were fixed when the engine was built

    def new_session(self) -> "TrtllmTargetSession":
        if not self.is_leader:
            raise RuntimeError("this MPI rank is not the TensorRT-LLM leader: only rank 0 runs sessions (serve_worker here)")
        return TrtllmTargetSession(self)

    def serve_worker(self) -> None:
        """On a non-leader rank: take part in the tensor-parallel work until the leader shuts down."""
        self.executor.shutdown()

    def close(self) -> None:
        self.executor.shutdown()


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
        del self.path[held + 1:]
        for token in new:
            node = node.setdefault(token, {})
            self.path.append(node)

    def truncate(self, length: int) -> None:
        del self.path[length + 1:]


class TrtllmTargetSession:
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

    def forward(self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True) -> TargetOutput:
        new = [int(t) for t in token_ids.view(-1).tolist()]
        n, held = len(new), len(self.tokens)
        if held + n > self.engine.max_context:
            raise ValueError(f"{held + n} tokens exceed the engine's input limit {self.engine.max_context} "
                             "(min(max_seq_len - 1, max_num_tokens) of its build)")
        if self.sent.already_sent(held, new):  # their rows could come back unwritten: start a fresh salt
            self.salt, self.sent = _new_salt(), _SentTokens()
            self.sent.add(0, self.tokens)
            self.salt_changes += 1
        self.reuse_bound = held
        result = self._request(self.tokens + new, features)
        self.sent.add(held, new)
        by_name = {str(o.name): _as_torch(o.output) for o in (result.additional_outputs or [])}
        hidden = self._new_rows(by_name, self.final_output_name, held, n)
        if last_logits_only:
            hidden = hidden[-1:]
        logits = hidden.to(self.engine.device, self.engine.lm_head.dtype) @ self.engine.lm_head.T
        feats = None
        if features:
            rows = [self._new_rows(by_name, CONTEXT_PREFIX + name, held, n) for name in self.engine.feature_outputs]
            feats = torch.cat(rows, -1).float().cpu()
        self.tokens.extend(new)
        return TargetOutput(logits=logits.float().cpu(), features=feats)

    @property
    def final_output_name(self) -> str:
        return CONTEXT_PREFIX + self.engine.final_output

    @staticmethod
    def _new_rows(by_name: dict[str, torch.Tensor], name: str, held: int, n: int) -> torch.Tensor:
        """Rows held..held+n-1 of a context output sized to the request (rows of reused tokens are unwritten)."""
        if name not in by_name:
            raise RuntimeError(f"engine returned no {name!r} (got {sorted(by_name)}): rebuild it with "
                               "`dflash-trt build-target` (outputs marked by trtllm_features.py)")
        t = by_name[name]
        t = t.reshape(-1, t.shape[-1])
        if t.shape[0] != held + n:
            raise RuntimeError(f"{name}: {t.shape[0]} rows for a request of {held + n} tokens")
        return t[held:]

    def _request(self, tokens: list[int], features: bool) -> Any:
        e, trtllm = self.engine, self.engine.trtllm
        # Request(..., cache_salt_id=...): nanobind executor/request.cpp (1.2)
        request = trtllm.Request(
            input_token_ids=tokens,
            max_tokens=1,  # the runtime samples one token after the context phase; we read the outputs instead
            streaming=False,
            output_config=e.output_config if features else e.output_config_no_features,
            cache_salt_id=self.salt,
        )
        request_id = e.executor.enqueue_request(request)
        response = e.executor.await_responses(request_id)[0]
        if response.has_error():
            raise RuntimeError(f"TensorRT-LLM request failed: {response.error_msg}")
        return response.result

    def rollback(self, length: int) -> None:
        if length > len(self.tokens):
            raise ValueError(f"cannot roll back to {length}: only {len(self.tokens)} tokens held")
        del self.tokens[length:]
        self.sent.truncate(length)

    def close(self) -> None:
        """Nothing held here beyond the token list: the executor frees a request's KV blocks when it ends."""
