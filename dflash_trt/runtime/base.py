"""The engine interface the decoding loop runs on: one family of protocols, batched by rows.

Every backend (PyTorch, ONNX Runtime, TensorRT, TensorRT-LLM, a Triton model call, a simulation)
implements these, so `dflash_trt.decoding` runs unchanged on any pair. An engine is shared and stateless;
its session holds the state (KV caches) of every sequence the loop is advancing, one *row* each:

- A row is an integer handle from `add_row()`; `remove_row()` frees it (finished, cancelled). Rows join
  and leave between calls, so a batch is never rebuilt when its membership changes.
- `TargetSession.forward` / `DrafterSession.draft` take the rows that take part in this call, each with
  its OWN number of new tokens (ragged): a verify pass mixes rows of different context lengths and block
  sizes. Backends pad (or pack) as they need; outputs are per row and never padded.
- The target's cache rolls each row back on its own (`rollback(row, length)`: rejected drafts); the
  drafter's context cache only grows (it holds committed tokens only).

A backend that can run only one sequence per call implements `rows.SequenceTarget` /
`rows.SequenceDrafter` and is served through the one generic adapter in `rows.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


class PassArgmax:
    """The argmax of every logits row of one target pass, taken for the whole pass on first use: one op and one
    transfer to the host instead of one of each per verify row, which at hundreds of rows is most of what a
    greedy step costs the host. An engine that already knows the ids (a simulation) hands them in."""

    def __init__(self, logits: torch.Tensor | None, ids: list[int] | None = None):
        # logits: [tokens, vocab] every row's logits of the pass, packed in row order
        self._logits, self._ids = logits, ids

    def ids(self, start: int, stop: int) -> list[int]:
        if self._ids is None:
            assert self._logits is not None
            self._ids = self._logits.argmax(-1).tolist()
            self._logits = None
        return self._ids[start:stop]


@dataclass(slots=True)
class TargetOutput:
    """One row's result of a target pass."""

    logits: torch.Tensor  # [n, vocab] float32 (n = 1 when last_logits_only), on the engine's device
    features: torch.Tensor | None  # [n, len(feature_layer_ids) * hidden], or None when not asked for
    # the pass's argmax, shared by its rows (None: this row takes its own); `logits` are its rows [start, start + n)
    pass_argmax: PassArgmax | None = None
    start: int = 0

    def argmax(self) -> list[int]:
        """The id of each logits row's largest logit: the target's greedy token after each scored position."""
        if self.pass_argmax is not None:
            return self.pass_argmax.ids(self.start, self.start + self.logits.shape[0])
        return self.logits.argmax(-1).tolist()


@dataclass(slots=True)
class Draft:
    """One row's result of a drafter pass."""

    logits: torch.Tensor  # [B-1, vocab] float32: the drafter's predictions for block positions 1..B-1
    tokens: torch.Tensor  # [B-1] the greedy draft: argmax of logits (DFlash 2: the selector's greedy path)
    # DFlash 2 only (models/selector.py): the top-k candidates [B-1, k] and the selector's scores of every
    # (predecessor, candidate) pair [B-1, k, k]; sampling walks them (decoding/acceptance.py)
    candidates: torch.Tensor | None = None
    step_scores: torch.Tensor | None = None


@dataclass(slots=True)
class DraftRequest:
    """One row's part of a drafter call."""

    row: int
    new_features: torch.Tensor  # [n, F] features of the tokens committed since this row's last draft (n >= 1)
    last_token: int  # block position 0; the drafter proposes block_size - 1 tokens after it
    block_size: int  # >= 2


@runtime_checkable
class TargetSession(Protocol):
    def add_row(self) -> int:
        """A new, empty row; returns its handle."""

    def remove_row(self, row: int) -> None:
        """Free a row's cache (the handle may be reused by a later add_row)."""

    def length(self, row: int) -> int:
        """Tokens held in this row's KV cache."""

    def rollback(self, row: int, length: int) -> None:
        """Drop this row's cached tokens beyond `length`; other rows are untouched."""

    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        """Append tokens[i] ([n_i] ids, n_i >= 1) to rows[i] at positions length..length+n_i-1 and score
        them, all rows in one pass. One TargetOutput per row: logits [n_i, V] ([1, V] when
        last_logits_only) and features [n_i, F] (None when not asked for)."""


@runtime_checkable
class TargetEngine(Protocol):
    name: str
    vocab_size: int
    max_context: int  # prompt + new tokens may not exceed this
    feature_layer_ids: tuple[int, ...]  # the layers whose features forward() returns, in order

    def new_session(self) -> TargetSession: ...


@runtime_checkable
class DrafterSession(Protocol):
    def add_row(self) -> int: ...

    def remove_row(self, row: int) -> None: ...

    def context_length(self, row: int) -> int:
        """Context tokens whose K/V this row's drafter cache holds (never rolled back: they are committed)."""

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One drafter pass for every request (rows of different context, new-token and block lengths)."""


@runtime_checkable
class DrafterEngine(Protocol):
    name: str
    block_size: int  # the trained block size: the most a round may use
    feature_layer_ids: tuple[int, ...]  # the target layers whose features it reads (the target must expose them)
    max_context: int | None  # the longest context it can hold (a TensorRT plan's profile); None: no limit
    # What it computes the draft distributions in, by torch's name (float32, bfloat16, float16; `dtype_name`):
    # sampled text depends on it (rejection sampling compares the target's probabilities with these), so the
    # entry points report it beside the text.
    dtype: str

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


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype by its name without the module: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


class EngineUnavailable(RuntimeError):
    """A backend whose package or device is missing on this machine."""


def cuda_devices(*engines: object) -> list[torch.device]:
    """The CUDA devices the engines run on (their `device` attribute, as the backends set it), each once."""
    out: list[torch.device] = []
    for engine in engines:
        device = getattr(engine, "device", None)
        if device is not None and torch.device(device).type == "cuda" and torch.device(device) not in out:
            out.append(torch.device(device))
    return out


def pass_clock(*engines: object) -> Callable[[], float]:
    """The clock that times the engines' passes (the decoding loop's, the start-up cost grid's): perf_counter,
    which on a CUDA device first waits for the kernels queued there. CUDA runs kernels asynchronously, so
    without the wait a pass would be timed by its launches and the adaptive policy would price drafting
    as nearly free; the loop waits for each pass's output right after it anyway (its tokens are read on the
    host), so the wait costs little."""
    devices = cuda_devices(*engines)
    if not devices:
        return time.perf_counter

    def synced() -> float:
        for device in devices:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return synced
