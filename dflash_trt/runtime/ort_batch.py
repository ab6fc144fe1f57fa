"""ONNX Runtime batched drafter: the exported `drafter_batch.onnx` (see builders/onnx_drafter_batch.py).

The session keeps every row's context cache in one numpy array `[layers, slots, kv_heads, C, head_dim]`;
a call gathers the rows taking part (cut to max(past) + n positions), runs the graph once and writes
the returned caches back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..formats import BATCH_GRAPH_FILES, DrafterGraphMeta
from .base import Draft, EngineUnavailable
from .batched import DraftRequest, RowSlots, grown

PRECISIONS = tuple(BATCH_GRAPH_FILES)
RunFn = Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]


class OrtBatchDrafterEngine:
    name = "onnxruntime"

    def __init__(self, folder: str | Path, precision: str = "fp32", providers: list[str] | None = None,
                 threads: int | None = None):
        try:
            import onnxruntime as ort
        except ImportError as e:  # pragma: no cover - onnxruntime is a core dependency
            raise EngineUnavailable("the onnxruntime backend needs the `onnxruntime` package") from e
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        folder = Path(folder)
        self.meta = DrafterGraphMeta.read(folder)
        path = folder / BATCH_GRAPH_FILES[precision]
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (export it with dflash_trt.builders.onnx_drafter_batch)")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session: Any = ort.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])
        self.block_size = self.meta.block_size
        self.mask_token_id = self.meta.mask_token_id
        self.feature_layer_ids = tuple(self.meta.feature_layer_ids)
        self.max_context: int | None = None

    def new_batch(self, run: RunFn | None = None) -> "OrtBatchDrafterSession":
        return OrtBatchDrafterSession(self, run)


class OrtBatchDrafterSession:
    def __init__(self, engine: OrtBatchDrafterEngine, run: RunFn | None = None):
        """run(feeds) -> [logits, draft_tokens, present_k, present_v]; by default the engine's onnxruntime
        session (a Triton BLS model can pass its own model call)."""
        self.engine = engine
        self.run: RunFn = run or (lambda feeds: engine.session.run(None, feeds))
        self.slots = RowSlots()
        m = engine.meta
        self.k = np.zeros((m.num_layers, 0, m.num_kv_heads, 0, m.head_dim), dtype=np.float32)
        self.v = self.k.copy()

    def add_row(self) -> int:
        return self.slots.add()

    def remove_row(self, row: int) -> None:
        self.slots.remove(row)

    def context_length(self, row: int) -> int:
        self.slots.check(row)
        return self.slots.lengths[row]

    def _reserve(self, slots: int, length: int) -> None:
        _, s, _, c, _ = self.k.shape
        if slots <= s and length <= c:
            return
        new_s = s if slots <= s else max(slots, 2 * s, 4)
        new_c = c if length <= c else grown(c, length)
        shape = (self.k.shape[0], new_s, self.k.shape[2], new_c, self.k.shape[4])
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        k[:, :s, :, :c], v[:, :s, :, :c] = self.k, self.v
        self.k, self.v = k, v

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        e = self.engine
        if not requests:
            return []
        rows = [q.row for q in requests]
        for r in rows:
            self.slots.check(r)
        if len(set(rows)) != len(rows):
            raise ValueError("a row appears twice in one draft call")
        counts = [int(q.new_features.shape[0]) for q in requests]
        blocks = [q.block_size for q in requests]
        if min(counts) < 1 or min(blocks) < 2:
            raise ValueError("each draft request needs >= 1 new feature row and a block of >= 2 tokens")
        past = [self.slots.lengths[r] for r in rows]
        b, n, nb = len(rows), max(counts), max(blocks)
        cap = max(past) + n
        self._reserve(self.slots.capacity, cap)
        feats = np.zeros((b, n, e.meta.feature_size), np.float32)
        ids = np.full((b, nb), e.mask_token_id, np.int64)
        for i, q in enumerate(requests):
            feats[i, : counts[i]] = q.new_features.detach().to("cpu", torch.float32).numpy()
            ids[i, 0] = q.last_token
        idx = np.asarray(rows)
        logits, tokens, present_k, present_v = self.run({
            "block_ids": ids, "block_lengths": np.asarray(blocks, np.int64), "features": feats,
            "new_lengths": np.asarray(counts, np.int64), "past_k": self.k[:, idx, :, :cap],
            "past_v": self.v[:, idx, :, :cap], "past_lengths": np.asarray(past, np.int64),
        })
        self.k[:, idx, :, :cap], self.v[:, idx, :, :cap] = present_k, present_v
        for r, p, c in zip(rows, past, counts):
            self.slots.lengths[r] = p + c
        return [
            Draft(logits=torch.from_numpy(np.ascontiguousarray(logits[i, : blocks[i] - 1])),
                  tokens=torch.from_numpy(np.ascontiguousarray(tokens[i, : blocks[i] - 1])))
            for i in range(b)
        ]
