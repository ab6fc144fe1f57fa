"""TensorRT-LLM target engine (engine path, TensorRT-LLM 1.2 Executor API), built by `dflash-trt build-target`.

TensorRT-LLM has no KV rollback call: every forward is a request on the session's whole committed
prefix + the new tokens, and KV block reuse (`--use_paged_context_fmha enable`,
`KvCacheConfig(enable_block_reuse=True)`) makes the shared prefix cheap. Reused context produces no
context logits and no additional outputs, so we read the rows of the NEW tokens (always computed,
always last) and the loop keeps the accepted prefix's features itself. rollback() just forgets
tokens: rejected blocks are never matched again.

The feature outputs `dflash_feature_{i}` exist only in engines built with our model class
(trtllm_features.py); asking for them is `OutputConfig(additional_model_outputs=[
AdditionalModelOutput(name, gather_context=True)])`. With tp > 1 run under `mpirun -n tp`:
rank 0 drives the loop, the other ranks serve inside the Executor (leader mode).
Not runnable here (no TensorRT-LLM, no GPU); written against tensorrt_llm.bindings.executor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import EngineUnavailable, TargetOutput


def _executor_module():
    try:
        import tensorrt_llm.bindings.executor as trtllm
    except ImportError as e:
        raise EngineUnavailable("the tensorrt_llm target needs TensorRT-LLM 1.2 (NVIDIA's container, see the Dockerfile)") from e
    return trtllm


def _as_torch(t) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "__dlpack__"):
        return torch.from_dlpack(t)
    return torch.as_tensor(t)


class TrtllmTargetEngine:
    name = "tensorrt_llm"

    def __init__(self, folder: str | Path, kv_cache_free_fraction: float = 0.85):
        trtllm = _executor_module()
        folder = Path(folder)
        meta = json.loads((folder / "dflash_target.json").read_text())
        engine_dir = folder / meta["engine_dir"]
        config = json.loads((engine_dir / "config.json").read_text())
        pretrained = config.get("pretrained_config", {})
        self.feature_layer_ids = tuple(meta["feature_layer_ids"])
        self.feature_outputs = list(meta["feature_outputs"])
        self.vocab_size = int(pretrained["vocab_size"])
        self.max_context = int(config.get("build_config", {}).get("max_seq_len", pretrained.get("max_position_embeddings")))
        self.trtllm = trtllm
        outputs = [trtllm.AdditionalModelOutput(name, gather_context=True) for name in self.feature_outputs]
        self.output_config = trtllm.OutputConfig(return_context_logits=True, additional_model_outputs=outputs)
        self.output_config_no_features = trtllm.OutputConfig(return_context_logits=True)
        executor_config = trtllm.ExecutorConfig(
            max_beam_width=1,
            kv_cache_config=trtllm.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=kv_cache_free_fraction),
            additional_model_outputs=outputs,
        )
        self.executor = trtllm.Executor(engine_dir, trtllm.ModelType.DECODER_ONLY, executor_config)

    def new_session(self) -> "TrtllmTargetSession":
        return TrtllmTargetSession(self)


class TrtllmTargetSession:
    def __init__(self, engine: TrtllmTargetEngine):
        self.engine = engine
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def forward(self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True) -> TargetOutput:
        e, trtllm = self.engine, self.engine.trtllm
        new = [int(t) for t in token_ids.view(-1).tolist()]
        request = trtllm.Request(
            input_token_ids=self.tokens + new,
            max_tokens=1,  # the engine always samples one token; we read the context logits instead
            streaming=False,
            output_config=e.output_config if features else e.output_config_no_features,
        )
        request_id = e.executor.enqueue_request(request)
        response = e.executor.await_responses(request_id)[0]
        if response.has_error():
            raise RuntimeError(f"TensorRT-LLM request failed: {response.error_msg}")
        result = response.result
        logits = _as_torch(result.context_logits).float().view(-1, e.vocab_size)
        n = len(new)
        if logits.shape[0] < n:
            raise RuntimeError(f"engine returned {logits.shape[0]} context-logit rows for {n} new tokens")
        feats = None
        if features:
            by_name = {o.name: _as_torch(o.output) for o in result.additional_outputs or []}
            missing = [name for name in e.feature_outputs if name not in by_name]
            if missing:
                raise RuntimeError(
                    f"engine returned no {missing}: rebuild it with `dflash-trt build-target` (features marked as outputs)"
                )
            feats = torch.cat([by_name[name].view(-1, by_name[name].shape[-1])[-n:] for name in e.feature_outputs], -1)
            feats = feats.float().cpu()
        self.tokens.extend(new)
        logits = logits[-n:].cpu()
        return TargetOutput(logits=logits[-1:] if last_logits_only else logits, features=feats)

    def rollback(self, length: int) -> None:
        if length > len(self.tokens):
            raise ValueError(f"cannot roll back to {length}: only {len(self.tokens)} tokens held")
        del self.tokens[length:]
