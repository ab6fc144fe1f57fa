"""PyTorch engines: the Hugging Face target and the DFlash drafter, on CPU or CUDA."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, cast

import torch
from transformers import DynamicCache, PreTrainedModel

from ..models.drafter import DFlashDrafter
from ..models.target import DTYPES, extract_features, load_target
from .base import Draft, EngineOptions, TargetOutput


class TorchTargetEngine:
    name = "torch"

    def __init__(self, model: PreTrainedModel, feature_layer_ids: tuple[int, ...] = ()):
        self.model = model
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.max_context = int(getattr(text, "max_position_embeddings", 1 << 30))
        self.num_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        self.feature_layer_ids = tuple(feature_layer_ids)
        self.device = next(model.parameters()).device
        # transformers renamed `past_key_values` to `cache` during 5.x; use what this version takes.
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_artifact(cls, checkpoint: Path, options: EngineOptions) -> TorchTargetEngine:
        """Served from the Hugging Face checkpoint itself (no build step)."""
        model = load_target(checkpoint, DTYPES[options.dtype])
        model.to(options.device or "cpu")  # type: ignore[arg-type]  # transformers types .to() by its decorator
        return cls(model, options.feature_layer_ids)

    @property
    def embed_weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.model.get_input_embeddings().weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        head: Any = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]
        return cast(torch.Tensor, head.weight)

    def new_session(self) -> TorchTargetSession:
        return TorchTargetSession(self)

    def batched(self) -> Any:
        """The batched engine on the same model and weights (see runtime/batched.py)."""
        from .torch_batch import TorchBatchTargetEngine

        return TorchBatchTargetEngine(self.model, self.feature_layer_ids)


class TorchTargetSession:
    def __init__(self, engine: TorchTargetEngine):
        self.engine = engine
        self.cache = DynamicCache(config=engine.model.config)
        if not all(layer.is_croppable if hasattr(layer, "is_croppable") else True for layer in self.cache.layers):
            raise ValueError("target uses a KV cache that cannot be rolled back (sliding window / linear attention)")

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True
    ) -> TargetOutput:
        start = self.length
        ids = token_ids.to(self.engine.device).view(1, -1)
        positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        want_features = features and bool(self.engine.feature_layer_ids)
        out = self.engine.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            **{self.engine.cache_kwarg: self.cache},
            logits_to_keep=1 if last_logits_only else 0,
            output_hidden_states=want_features,
        )
        feats = extract_features(out.hidden_states, self.engine.feature_layer_ids)[0] if want_features else None
        return TargetOutput(logits=out.logits[0].float(), features=feats)

    def rollback(self, length: int) -> None:
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot roll back to {length}: only {self.length} tokens cached")
        if extra:
            # a negative count removes that many tokens in 4.57 and 5.x alike; 5.x refuses a positive length
            self.cache.crop(-extra)

    def close(self) -> None:
        self.cache = DynamicCache(config=self.engine.model.config)  # the old cache's tensors go now


def shared_weights(
    drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding table and lm_head as the drafter uses them: shared when the dtypes match, else
    copies in the drafter's dtype (a bfloat16 drafter next to a float32 target; one copy when tied)."""
    dtype = drafter.fc.weight.dtype
    if embed.dtype == dtype and lm_head.dtype == dtype:
        return embed, lm_head
    embed_copy = embed.to(dtype)
    return embed_copy, embed_copy if lm_head is embed else lm_head.to(dtype)


class TorchDrafterEngine:
    """The drafter plus the target's embedding table and lm_head (shared, not copied)."""

    name = "torch"

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        self.drafter = drafter.eval()
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.block_size = drafter.spec.block_size
        self.mask_token_id = drafter.spec.mask_token_id
        self.feature_layer_ids = tuple(drafter.spec.target_layer_ids)
        self.max_context: int | None = None  # the cache grows with the context (RoPE positions have no cap)

    @classmethod
    def for_target(cls, drafter: DFlashDrafter, target: TorchTargetEngine) -> TorchDrafterEngine:
        return cls(drafter.to(target.device), *shared_weights(drafter, target.embed_weight, target.lm_head_weight))

    @classmethod
    def from_artifact(cls, checkpoint: Path, options: EngineOptions) -> TorchDrafterEngine:
        raise ValueError(
            f"the PyTorch drafter {checkpoint} runs on its target's embedding and lm_head: load it "
            "with its target (dflash_trt.loading.load_decoder), or export it (`dflash-trt export-drafter`)"
        )

    def new_session(self) -> TorchDrafterSession:
        return TorchDrafterSession(self)

    def batched(self) -> Any:
        """The batched drafter on the same weights (and the target's shared embedding and lm_head)."""
        from .torch_batch import TorchBatchDrafterEngine

        return TorchBatchDrafterEngine(self.drafter, self.embed_weight, self.lm_head_weight)


class TorchDrafterSession:
    def __init__(self, engine: TorchDrafterEngine):
        self.engine = engine
        self.past_k, self.past_v = engine.drafter.empty_cache(device=engine.embed_weight.device)

    @property
    def context_length(self) -> int:
        return self.past_k.shape[3]

    @torch.inference_mode()
    def draft(self, new_features: torch.Tensor, last_token: int, block_size: int) -> Draft:
        e = self.engine
        block = torch.full((1, block_size), e.mask_token_id, dtype=torch.long, device=e.embed_weight.device)
        block[0, 0] = last_token
        feats = new_features.to(dtype=self.past_k.dtype, device=block.device).unsqueeze(0)
        hidden, self.past_k, self.past_v = e.drafter(
            feats, e.drafter.embed_block(block, e.embed_weight), self.past_k, self.past_v
        )
        logits = e.drafter.logits(hidden[0, 1:], e.lm_head_weight).float()
        return Draft(logits=logits, tokens=logits.argmax(-1))
