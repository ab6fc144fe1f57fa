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

Written against the real API (tensorrt_llm.bindings.executor), never run in this project (no TensorRT /
TensorRT-LLM / GPU here). Two cases it guards without having seen them: reuse that also covers some of
the new tokens (an identical sequence ran before) returns fewer than n rows, so the request is re-sent
with a fresh `cache_salt_id` (no block can match it); context logits are [tokens, vocab_size_padded]
(padded to a multiple of tp), so rows are sliced to the real vocabulary.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import torch

from .base import EngineOptions, EngineUnavailable, TargetOutput


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

    @classmethod
    def from_artifact(cls, folder: Path, options: EngineOptions) -> "TrtllmTargetEngine":
        return cls(folder)  # the feature layers were fixed when the engine was built

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
        new = [int(t) for t in token_ids.view(-1).tolist()]
        n = len(new)
        logits, feats = self._rows(self._request(self.tokens + new, features), n, features)
        if logits is None:  # reuse covered new tokens too: once more, with a salt no cached block carries
            logits, feats = self._rows(self._request(self.tokens + new, features, salt=secrets.randbits(63)), n, features)
            if logits is None:
                raise RuntimeError(f"TensorRT-LLM returned fewer than {n} rows for {n} new tokens even without KV reuse")
        self.tokens.extend(new)
        return TargetOutput(logits=logits[-1:] if last_logits_only else logits, features=feats)

    def _request(self, tokens: list[int], features: bool, salt: int | None = None):
        e, trtllm = self.engine, self.engine.trtllm
        request = trtllm.Request(
            input_token_ids=tokens,
            max_tokens=1,  # the engine always samples one token; we read the context logits instead
            streaming=False,
            output_config=e.output_config if features else e.output_config_no_features,
            cache_salt_id=salt,
        )
        request_id = e.executor.enqueue_request(request)
        response = e.executor.await_responses(request_id)[0]
        if response.has_error():
            raise RuntimeError(f"TensorRT-LLM request failed: {response.error_msg}")
        return response.result

    def _rows(self, result, n: int, features: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last n rows of the context logits (and features); (None, None) when fewer were computed."""
        e = self.engine
        raw = _as_torch(result.context_logits)
        logits = raw.reshape(-1, raw.shape[-1])[:, : e.vocab_size]  # [tokens, vocab_size_padded] -> real vocab
        if logits.shape[0] < n:
            return None, None
        feats = None
        if features:
            by_name = {o.name: _as_torch(o.output) for o in result.additional_outputs or []}
            missing = [name for name in e.feature_outputs if name not in by_name]
            if missing:
                raise RuntimeError(
                    f"engine returned no {missing}: rebuild it with `dflash-trt build-target` (features marked as outputs)"
                )
            rows = [by_name[name].reshape(-1, by_name[name].shape[-1]) for name in e.feature_outputs]
            if min(r.shape[0] for r in rows) < n:
                return None, None
            feats = torch.cat([r[-n:] for r in rows], -1).float().cpu()
        return logits[-n:].float().cpu(), feats

    def rollback(self, length: int) -> None:
        if length > len(self.tokens):
            raise ValueError(f"cannot roll back to {length}: only {len(self.tokens)} tokens held")
        del self.tokens[length:]

    def close(self) -> None:
        """Nothing held here beyond the token list: the executor frees a request's KV blocks when it ends."""
