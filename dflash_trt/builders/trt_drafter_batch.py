"""TensorRT FP16 plan of the BATCHED drafter graph (`drafter_batch.onnx`): one optimization profile with
a batch axis (rows) beside the block, new-context and cache axes.

Written against the real TensorRT API like `trt_drafter.py` (whose builder it shares), never run in this
project: there is no TensorRT or GPU here, and no runtime session drives this plan yet (the batched
TensorRT drafter session is future work). Tests check the profile and the call sequence with the fake
`tensorrt` module in tests/fake_tensorrt.py.
"""

from __future__ import annotations

from pathlib import Path

from ..formats import BATCH_GRAPH_FILES, DrafterGraphMeta
from .trt_drafter import ProfileShapes, build_plan

BATCH_PLAN_FILE = "drafter_batch.plan"
BATCH_PLAN_MANIFEST = "drafter_batch.plan.json"


def batch_profile_shapes(
    meta: DrafterGraphMeta,
    max_rows: int,
    max_context: int | None = None,
    max_new_tokens: int | None = None,
    opt_rows: int | None = None,
) -> dict[str, ProfileShapes]:
    """min / opt / max per input. opt = a steady-state step: opt_rows rows (default max_rows / 2), each
    with a full block of new context and a half-full cache. The cache axis holds max(past) + new, so its
    max is the context plus the longest new-context run."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    B, F = meta.block_size, meta.feature_size
    ctx = min(max_context or meta.max_context, meta.max_context)
    new = min(max_new_tokens or ctx, ctx)
    opt = max(1, min(opt_rows or max_rows // 2 or 1, max_rows))

    def cache(rows: int, t: int) -> tuple[int, ...]:
        return (meta.num_layers, rows, meta.num_kv_heads, t, meta.head_dim)

    def rows_only(n: int) -> tuple[int, ...]:
        return (n,)

    return {
        "block_ids": ProfileShapes((1, 2), (opt, B), (max_rows, B)),
        "block_lengths": ProfileShapes(rows_only(1), rows_only(opt), rows_only(max_rows)),
        "features": ProfileShapes((1, 1, F), (opt, B, F), (max_rows, new, F)),
        "new_lengths": ProfileShapes(rows_only(1), rows_only(opt), rows_only(max_rows)),
        "past_k": ProfileShapes(cache(1, 1), cache(opt, ctx // 2 + B), cache(max_rows, ctx + new)),
        "past_v": ProfileShapes(cache(1, 1), cache(opt, ctx // 2 + B), cache(max_rows, ctx + new)),
        "past_lengths": ProfileShapes(rows_only(1), rows_only(opt), rows_only(max_rows)),
    }


def build_batched_drafter_plan(
    graph_dir: str | Path,
    out_dir: str | Path,
    *,
    max_rows: int = 32,
    typing: str | None = None,
    max_context: int | None = None,
    max_new_tokens: int | None = None,
    workspace_gib: float = 4.0,
) -> Path:
    meta = DrafterGraphMeta.read(graph_dir)
    shapes = batch_profile_shapes(meta, max_rows, max_context, max_new_tokens)
    return build_plan(
        graph_dir,
        out_dir,
        (BATCH_GRAPH_FILES["fp32"], BATCH_GRAPH_FILES["fp16"]),
        shapes,
        BATCH_PLAN_FILE,
        BATCH_PLAN_MANIFEST,
        typing=typing,
        workspace_gib=workspace_gib,
    )
