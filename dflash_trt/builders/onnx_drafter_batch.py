"""Export the BATCHED drafter round to one ONNX graph, `drafter_batch.onnx`, beside the single-sequence
`drafter.onnx` (which stays as it is: same folder, same `drafter.json`).

Inputs:  block_ids [b, B] int64 (row r: [last, MASK x (B_r - 1)], padded), block_lengths [b] int64,
         features [b, n, F] float32 (row r: n_r new context rows, padded), new_lengths [b] int64,
         past_k / past_v [layers, b, kv_heads, C, head_dim] float32, past_lengths [b] int64,
         with C >= max(past_lengths) + n (the caller pads the cache; see models/drafter_batch.py).
Outputs: logits [b, B-1, V] float32, draft_tokens [b, B-1] int64, present_k / present_v (the cache
         with each row's new context written at past_lengths[r] + i; same shape as past_k).
A DFlash 2 drafter's graph adds candidates and step_scores (formats.SELECTOR_OUTPUTS; the path is walked
beside the graph, as for the single-sequence graph: builders/onnx_drafter.py). Row r's outputs beyond B_r - 1
are padding. The same function (`ragged_round`) runs the PyTorch
batched drafter, so the two backends compute one thing.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..formats import BATCH_DRAFTER_INPUTS, BATCH_DRAFTER_OUTPUTS, BATCH_GRAPH_FILES, DrafterGraphMeta
from ..models.drafter import DFlashDrafter
from ..models.drafter_batch import ragged_round
from .onnx_drafter import round_outputs, write_graphs

BATCH_INPUT_NAMES, BATCH_OUTPUT_NAMES = BATCH_DRAFTER_INPUTS, BATCH_DRAFTER_OUTPUTS


def batch_cache_shape(meta: DrafterGraphMeta, rows: int, length: int) -> tuple[int, ...]:
    return (meta.num_layers, rows, meta.num_kv_heads, length, meta.head_dim)


class BatchedDrafterRound(nn.Module):
    """ragged_round + the target's embedding and lm_head + argmax."""

    embed_weight: torch.Tensor  # buffers (registered in __init__)
    lm_head_weight: torch.Tensor

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.drafter = drafter.eval()
        self.register_buffer("embed_weight", embed_weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach().clone(), persistent=False)

    def forward(
        self,
        block_ids: torch.Tensor,
        block_lengths: torch.Tensor,
        features: torch.Tensor,
        new_lengths: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        past_lengths: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        d = self.drafter
        hidden, present_k, present_v = ragged_round(
            d,
            features,
            new_lengths,
            d.embed_block(block_ids, self.embed_weight),
            block_lengths,
            past_k,
            past_v,
            past_lengths,
        )
        return round_outputs(d, hidden[:, 1:], block_ids[:, 0], self.lm_head_weight, present_k, present_v)


def _distinct_sizes(avoid: int, count: int) -> list[int]:
    """Tracing sizes >= 2, distinct from each other and from the block size (else the exporter ties axes)."""
    return [s for s in (2, 3, 5, 7, 11, 13, 17) if s != avoid][:count]


def batch_example_inputs(meta: DrafterGraphMeta, rows: int, new: int, cap: int, block: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    ids = torch.full((rows, block), meta.mask_token_id, dtype=torch.long)
    ids[:, 0] = 1
    past = torch.tensor([(cap - new) - i % 2 for i in range(rows)], dtype=torch.long)
    return (
        ids,
        torch.tensor([block - i % 2 for i in range(rows)], dtype=torch.long),
        torch.randn(rows, new, meta.feature_size, generator=g),
        torch.tensor([new - i % 2 for i in range(rows)], dtype=torch.long),
        torch.randn(batch_cache_shape(meta, rows, cap), generator=g) * 0.1,
        torch.randn(batch_cache_shape(meta, rows, cap), generator=g) * 0.1,
        past,
    )


def export_batched_round(module: BatchedDrafterRound, meta: DrafterGraphMeta, path: Path) -> Path:
    Dim = torch.export.Dim
    rows_ex, new_ex, cap_ex = _distinct_sizes(meta.block_size, 3)
    cap_ex = cap_ex + new_ex  # C >= past + n
    b = Dim("rows", min=1, max=4096)
    blk = Dim("block", min=2, max=max(meta.block_size, 2))
    n = Dim("new_tokens", min=1, max=meta.max_context)
    c = Dim("cache_len", min=1, max=2 * meta.max_context)
    dynamic_shapes = {
        "block_ids": {0: b, 1: blk},
        "block_lengths": {0: b},
        "features": {0: b, 1: n},
        "new_lengths": {0: b},
        "past_k": {1: b, 3: c},
        "past_v": {1: b, 3: c},
        "past_lengths": {0: b},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            batch_example_inputs(meta, rows_ex, new_ex, cap_ex, meta.block_size),
            dynamic_shapes=dynamic_shapes,
            input_names=list(BATCH_INPUT_NAMES),
            output_names=list(meta.output_names(BATCH_OUTPUT_NAMES)),
            dynamo=True,
            external_data=True,
            optimize=True,
            verbose=False,
        )
        assert program is not None  # dynamo=True returns the program
        program.save(str(path), external_data=True)
    return path


def export_batched_drafter(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    out_dir: str | Path,
    fp16: bool = False,
) -> dict[str, Path]:
    """Write drafter_batch.onnx (+ .data), optionally its fp16 twin, and drafter.json into out_dir."""
    return write_graphs(
        drafter,
        embed_weight,
        lm_head_weight,
        out_dir,
        fp16,
        BatchedDrafterRound,
        export_batched_round,
        BATCH_GRAPH_FILES,
    )


def export_batched_from_checkpoints(
    drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path, fp16: bool = False
) -> dict[str, Path]:
    """export_batched_drafter from the two checkpoints (the target lends its embedding table and lm_head)."""
    from ..models.target import load_target

    target = load_target(Path(target_dir), torch.float32)
    drafter = DFlashDrafter.from_pretrained(Path(drafter_dir), torch.float32)
    embed = cast(torch.Tensor, target.get_input_embeddings().weight)
    head: torch.Tensor = target.get_output_embeddings().weight  # type: ignore[no-untyped-call]  # unannotated
    return export_batched_drafter(drafter, embed, head, out_dir, fp16)
