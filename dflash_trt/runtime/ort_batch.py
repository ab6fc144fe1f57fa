"""ONNX Runtime batched drafter: the exported `drafter_batch.onnx` (see builders/onnx_drafter_batch.py).

The session keeps every row's context cache in one numpy array `[layers, slots, kv_heads, C, head_dim]`;
a call gathers the rows taking part (cut to max(past) + n positions), runs the graph once and writes
the returned caches back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..formats import BATCH_GRAPH_FILES
from .base import Draft
from .batched import DraftRequest, SlotCacheRows, backlog_groups
from .ort_backend import open_graph

PRECISIONS = tuple(BATCH_GRAPH_FILES)
RunFn = Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]


class OrtBatchDrafterEngine:
    name = "onnxruntime"

    def __init__(
        self,
        folder: str | Path,
        precision: str = "fp32",
        providers: list[str] | None = None,
        threads: int | None = None,
    ):
        self.meta, self.session = open_graph(
            folder,
            BATCH_GRAPH_FILES,
            precision,
            providers,
            threads,
            "export it with dflash_trt.builders.onnx_drafter_batch",
        )
        self.block_size = self.meta.block_size
        self.mask_token_id = self.meta.mask_token_id
        self.feature_layer_ids = tuple(self.meta.feature_layer_ids)
        self.max_context: int | None = None

    def new_batch(self, run: RunFn | None = None) -> OrtBatchDrafterSession:
        return OrtBatchDrafterSession(self, run)


class OrtBatchDrafterSession(SlotCacheRows):
    def __init__(self, engine: OrtBatchDrafterEngine, run: RunFn | None = None):
        """run(feeds) -> [logits, draft_tokens, present_k, present_v]; by default the engine's onnxruntime
        session (a Triton BLS model can pass its own model call)."""
        self.engine = engine
        self.run: RunFn = run or (lambda feeds: engine.session.run(None, feeds))
        m = engine.meta
        k = np.zeros((m.num_layers, 0, m.num_kv_heads, 0, m.head_dim), dtype=np.float32)
        super().__init__(k, k.copy())

    def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def context_length(self, row: int) -> int:
        return self._row_length(row)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        # the graph pads every row's new context to the longest: rows that just joined (their prompt) get a
        # call of their own rather than making every row pay for it
        groups = backlog_groups([int(q.new_features.shape[0]) for q in requests])
        if len(groups) < 2:
            return self._draft(requests)
        drafts: dict[int, Draft] = {}
        for group in groups:
            drafts.update(zip(group, self._draft([requests[i] for i in group])))
        return [drafts[i] for i in range(len(requests))]

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        e = self.engine
        if not requests:
            return []
        rows, counts, blocks, past, cap = self._plan_draft(requests)
        b, n, nb = len(rows), max(counts), max(blocks)
        feats = np.zeros((b, n, e.meta.feature_size), np.float32)
        ids = np.full((b, nb), e.mask_token_id, np.int64)
        for i, q in enumerate(requests):
            feats[i, : counts[i]] = q.new_features.detach().to("cpu", torch.float32).numpy()
            ids[i, 0] = q.last_token
        idx = np.asarray(rows)
        logits, tokens, present_k, present_v = self.run(
            {
                "block_ids": ids,
                "block_lengths": np.asarray(blocks, np.int64),
                "features": feats,
                "new_lengths": np.asarray(counts, np.int64),
                "past_k": self.k[:, idx, :, :cap],
                "past_v": self.v[:, idx, :, :cap],
                "past_lengths": np.asarray(past, np.int64),
            }
        )
        self.k[:, idx, :, :cap], self.v[:, idx, :, :cap] = present_k, present_v
        self._advance(rows, past, counts)
        return [
            Draft(
                logits=torch.from_numpy(np.ascontiguousarray(logits[i, : blocks[i] - 1])),
                tokens=torch.from_numpy(np.ascontiguousarray(tokens[i, : blocks[i] - 1])),
            )
            for i in range(b)
        ]
