"""ONNX Runtime drafter engine: the exported round graphs, the CPU default for serving.

Two graphs, one engine: the batched round graph (`drafter_batch.onnx`, builders/onnx_drafter_batch.py: a
batch axis over rows, ragged via block / new-context / past lengths) when the export folder has it, else
the single-sequence round graph, run once per drafting row through `rows.PerRowDrafter`. Either way the
session keeps the drafter's context cache as numpy arrays and feeds it back each round (present_k ->
past_k), so a round runs only the new context tokens and the block.

A DFlash 2 graph also returns the candidate selector's candidates and scores; the path through them is
walked here, beside the graph (`graph_draft`; builders/onnx_drafter.py says why).

The sessions take the graph call as a function, so a Triton BLS model drives the same logic with its
own model call (dflash_trt.triton.remote).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..formats import BATCH_GRAPH_FILES, GRAPH_FILES, PRECISION_DTYPES, DrafterGraphMeta
from ..models.selector import greedy_path
from .base import Draft, DrafterSession, DraftRequest, EngineOptions, EngineUnavailable
from .cpu_threads import ort_session_options
from .rows import PerRowDrafter, SlotCacheRows, backlog_groups

PRECISIONS = tuple(GRAPH_FILES)
RunFn = Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]  # feeds by input name -> the graph's outputs


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


def graph_draft(logits: np.ndarray, tokens: np.ndarray, selector: Sequence[np.ndarray], length: int) -> Draft:
    """One row's Draft from a round graph's outputs for that row (its first `length` drafted positions):
    logits [P, V], draft_tokens [P] and, from a DFlash 2 graph, candidates [P, k] and step_scores [P, k, k],
    whose greedy path is the draft."""
    draft = Draft(
        logits=torch.from_numpy(np.ascontiguousarray(logits[:length])),
        tokens=torch.from_numpy(np.ascontiguousarray(tokens[:length])),
    )
    if selector:
        draft.candidates = torch.from_numpy(np.ascontiguousarray(selector[0][:length]))
        draft.step_scores = torch.from_numpy(np.ascontiguousarray(selector[1][:length]))
        draft.tokens = greedy_path(draft.candidates, draft.step_scores)
    return draft


class OrtDrafterEngine:
    name = "onnxruntime"

    def __init__(
        self,
        folder: str | Path,
        precision: str = "fp32",
        providers: list[str] | None = None,
        threads: int | None = None,
    ):
        folder = Path(folder)
        if precision not in GRAPH_FILES:
            raise ValueError(f"precision must be one of {tuple(GRAPH_FILES)}, got {precision!r}")
        self.batched = (folder / BATCH_GRAPH_FILES[precision]).is_file()
        files = BATCH_GRAPH_FILES if self.batched else GRAPH_FILES
        self.meta, self.session = open_graph(
            folder, files, precision, providers, threads, "export it with `dflash-trt export-drafter`"
        )
        self.folder, self.precision = folder, precision
        self.dtype = PRECISION_DTYPES[precision]
        self.block_size = self.meta.block_size
        self.mask_token_id = self.meta.mask_token_id
        self.feature_layer_ids = tuple(self.meta.feature_layer_ids)
        self.max_context: int | None = None  # ONNX Runtime takes any cache length (the loop checks this limit)

    @classmethod
    def from_artifact(cls, folder: Path, options: EngineOptions) -> OrtDrafterEngine:
        return cls(folder, options.precision, threads=options.threads)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs: list[np.ndarray] = self.session.run(None, feeds)
        return outputs

    def new_session(self) -> DrafterSession:
        if self.batched:
            return BatchGraphSession(self.meta, self.run)
        return PerRowDrafter(lambda: RoundGraphSequence(self.meta, self.run))


class RoundGraphSequence:
    """One sequence over the single-sequence round graph (`run` is onnxruntime's, or a Triton model call)."""

    def __init__(self, meta: DrafterGraphMeta, run: RunFn):
        self.meta, self.run = meta, run
        empty = np.zeros(meta.cache_shape(0), dtype=np.float32)
        self.past_k, self.past_v = empty, empty.copy()

    @property
    def context_length(self) -> int:
        return int(self.past_k.shape[3])

    def draft(self, new_features: torch.Tensor, last_token: int, block_size: int) -> Draft:
        block = np.full((1, block_size), self.meta.mask_token_id, dtype=np.int64)
        block[0, 0] = last_token
        feats = new_features.detach().to("cpu", torch.float32).numpy()[None]
        logits, tokens, self.past_k, self.past_v, *selector = self.run(
            {"block_ids": block, "features": feats, "past_k": self.past_k, "past_v": self.past_v}
        )
        return graph_draft(logits[0], tokens[0], [a[0] for a in selector], block_size - 1)


class BatchGraphSession(SlotCacheRows):
    """Every row over the batched round graph: each row's context cache a slot of one numpy array."""

    def __init__(self, meta: DrafterGraphMeta, run: RunFn):
        """run(feeds) -> [logits, draft_tokens, present_k, present_v] (+ candidates, step_scores: DFlash 2)."""
        self.meta, self.run = meta, run
        m = meta
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
        m = self.meta
        if not requests:
            return []
        rows, counts, blocks, past, cap = self._plan_draft(requests)
        b, n, nb = len(rows), max(counts), max(blocks)
        feats = np.zeros((b, n, m.feature_size), np.float32)
        ids = np.full((b, nb), m.mask_token_id, np.int64)
        for i, q in enumerate(requests):
            feats[i, : counts[i]] = q.new_features.detach().to("cpu", torch.float32).numpy()
            ids[i, 0] = q.last_token
        idx = np.asarray(rows)
        logits, tokens, present_k, present_v, *selector = self.run(
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
        return [graph_draft(logits[i], tokens[i], [a[i] for a in selector], blocks[i] - 1) for i in range(b)]
