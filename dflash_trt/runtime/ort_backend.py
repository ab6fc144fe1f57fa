"""ONNX Runtime drafter engine: the exported round graph, the CPU default for serving.

The session keeps the drafter's context cache as numpy arrays and feeds it back each round
(present_k -> past_k), so a round runs only the n new context tokens and the block.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..formats import GRAPH_FILES, DrafterGraphMeta
from .base import Draft, EngineOptions, EngineUnavailable
from .cpu_threads import ort_session_options

PRECISIONS = tuple(GRAPH_FILES)


def open_graph(
    folder: str | Path,
    files: Mapping[str, str],
    precision: str,
    providers: list[str] | None,
    threads: int | None,
    export_hint: str,
) -> tuple[DrafterGraphMeta, Any]:
    """An exported drafter graph's metadata and its onnxruntime session: `files[precision]` in `folder`,
    on `providers` (CPU by default) with `threads` intra-op threads (onnxruntime's default when None)."""
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - onnxruntime is a core dependency
        raise EngineUnavailable("the onnxruntime backend needs the `onnxruntime` package") from e
    if precision not in files:
        raise ValueError(f"precision must be one of {tuple(files)}, got {precision!r}")
    folder = Path(folder)
    meta = DrafterGraphMeta.read(folder)
    path = folder / files[precision]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found ({export_hint})")
    session = ort.InferenceSession(
        str(path), ort_session_options(ort, threads), providers=providers or ["CPUExecutionProvider"]
    )
    return meta, session


class OrtDrafterEngine:
    name = "onnxruntime"

    def __init__(
        self,
        folder: str | Path,
        precision: str = "fp32",
        providers: list[str] | None = None,
        threads: int | None = None,
    ):
        self.meta, self.session = open_graph(
            folder, GRAPH_FILES, precision, providers, threads, "export it with `dflash-trt export-drafter`"
        )
        self.folder, self.providers, self.threads = Path(folder), providers, threads
        self.precision = precision
        self.block_size = self.meta.block_size
        self.mask_token_id = self.meta.mask_token_id
        self.feature_layer_ids = self.meta.feature_layer_ids
        self.max_context: int | None = None  # ONNX Runtime takes any cache length (the loop checks this limit)

    @classmethod
    def from_artifact(cls, folder: Path, options: EngineOptions) -> OrtDrafterEngine:
        return cls(folder, options.precision, threads=options.threads)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs: list[np.ndarray] = self.session.run(None, feeds)
        return outputs

    def new_session(self) -> OrtDrafterSession:
        return OrtDrafterSession(self)

    def batched(self) -> Any:
        """The exported batched graph when its folder has one (one pass for all rows), else this graph
        called once per row (`LoopedDrafterEngine`)."""
        from ..formats import BATCH_GRAPH_FILES
        from .batched import LoopedDrafterEngine
        from .ort_batch import OrtBatchDrafterEngine

        if (self.folder / BATCH_GRAPH_FILES[self.precision]).is_file():
            return OrtBatchDrafterEngine(self.folder, self.precision, self.providers, self.threads)
        return LoopedDrafterEngine(self)


class RoundGraphEngine(Protocol):
    """What a session needs from its engine: the graph's contract and one call of the graph
    (OrtDrafterEngine runs it in onnxruntime, dflash_trt.triton.bls.RemoteDrafterEngine as a Triton model)."""

    meta: DrafterGraphMeta
    mask_token_id: int

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """feeds by DRAFTER_INPUTS name -> [logits, draft_tokens, present_k, present_v]."""


class OrtDrafterSession:
    def __init__(self, engine: RoundGraphEngine):
        self.engine = engine
        empty = np.zeros(engine.meta.cache_shape(0), dtype=np.float32)
        self.past_k, self.past_v = empty, empty.copy()

    @property
    def context_length(self) -> int:
        return self.past_k.shape[3]

    def draft(self, new_features: torch.Tensor, last_token: int, block_size: int) -> Draft:
        e = self.engine
        block = np.full((1, block_size), e.mask_token_id, dtype=np.int64)
        block[0, 0] = last_token
        feats = new_features.detach().to("cpu", torch.float32).numpy()[None]
        logits, tokens, self.past_k, self.past_v = e.run(
            {"block_ids": block, "features": feats, "past_k": self.past_k, "past_v": self.past_v}
        )
        return Draft(logits=torch.from_numpy(logits[0]), tokens=torch.from_numpy(tokens[0]))
