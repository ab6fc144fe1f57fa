"""The two engine interfaces the draft-and-verify loop runs on.

Every backend (PyTorch, ONNX Runtime, TensorRT, TensorRT-LLM) implements these, so the loop in
`dflash_trt.decoding` runs unchanged on any pair. Engines are shared and stateless; a session holds
one sequence's state (KV caches), so concurrent requests never touch each other's caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, vocab] float32 (only the last row when last_logits_only)
    features: torch.Tensor | None  # [n, len(feature_layer_ids) * hidden], or None when not asked for


@runtime_checkable
class TargetSession(Protocol):
    @property
    def length(self) -> int:
        """Tokens held in the KV cache (all committed after a rollback)."""

    def forward(
        self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True
    ) -> TargetOutput:
        """Append token_ids [n] at positions length..length+n-1 and score them."""

    def rollback(self, length: int) -> None:
        """Drop cached tokens beyond `length` (rejected draft tokens)."""

    def close(self) -> None:
        """Free the sequence's cache now (a served request ends); engines whose caches live in this
        process let them go with the session, engines that keep them elsewhere release them."""


@runtime_checkable
class TargetEngine(Protocol):
    name: str
    vocab_size: int
    max_context: int  # prompt + new tokens may not exceed this
    feature_layer_ids: tuple[int, ...]  # the layers whose features forward() returns, in order

    def new_session(self) -> TargetSession: ...


@dataclass
class Draft:
    logits: torch.Tensor  # [B-1, vocab] float32: the drafter's predictions for block positions 1..B-1
    tokens: torch.Tensor  # [B-1] argmax of logits (engines that fuse the argmax return it directly)


@runtime_checkable
class DrafterSession(Protocol):
    @property
    def context_length(self) -> int:
        """Context tokens whose K/V the drafter holds (never rolled back: they are committed)."""

    def draft(self, new_features: torch.Tensor, last_token: int, block_size: int) -> Draft:
        """Add the features [n, F] of tokens committed since the last call, draft block_size-1 tokens after last_token."""


@runtime_checkable
class DrafterEngine(Protocol):
    name: str
    block_size: int  # the trained block size: the most a round may use
    feature_layer_ids: tuple[int, ...]  # the target layers whose features it reads (the target must expose them)
    max_context: int | None  # the longest context it can hold (a TensorRT plan's profile); None: no limit

    def new_session(self) -> DrafterSession: ...


@dataclass(frozen=True)
class EngineOptions:
    """How to load an engine from its artifact (registry.drafter_engine / target_engine). Every backend
    takes the same options and uses those that apply to it."""

    dtype: str = "float32"  # PyTorch weights
    device: str | None = None  # None: the backend's own default (cpu for PyTorch, cuda for TensorRT)
    precision: str = "fp32"  # the ONNX drafter graph to run (fp32 or fp16)
    threads: int | None = None  # ONNX Runtime intra-op threads
    feature_layer_ids: tuple[int, ...] = ()  # target: the layers whose features the drafter reads


class EngineUnavailable(RuntimeError):
    """A backend whose package or device is missing on this machine."""
