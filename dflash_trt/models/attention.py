"""Grouped-query attention through `torch.nn.functional.scaled_dot_product_attention`, called so that PyTorch's
fused CUDA kernels can take it instead of the math kernel.

The rules are PyTorch's kernel filters (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, read at
pytorch/pytorch commit 001f694aef6f922b4fdf6d27d59162d27bf3df58; the shared checks in sdp_utils_cpp.h):

- flash (`can_use_flash_attention`): `check_for_attn_mask` refuses any attn_mask; `is_causal` is accepted only
  when query and key lengths are equal (`check_flash_causal_non_square_seqlens`); fp16 / bf16 only; grouped
  heads (fewer KV heads, `enable_gqa`) are accepted.
- memory-efficient (`can_use_mem_efficient_attention`): takes an attn_mask and fp32 too; grouped heads are
  compiled out on ROCm builds (`supports_gqa = false` under USE_ROCM), so a call with `enable_gqa` there
  falls back to the math kernel.
- math: everything, at the cost of the full [queries, keys] score matrix per head in memory.

So a pass that needs a mask never sets `enable_gqa`: the g query heads that share a KV head are folded into
the query axis ([b, kv_heads, g * n, d], the mask tiled g times along it), which every kernel accepts and which
copies no K/V. A pass that needs no mask (every query sees every key: one new token per row at a common
length) folds the same way and passes none; a square causal pass (a prefill of rows of one length from 0)
uses `is_causal` without a dense mask and lets the kernel handle the groups (`enable_gqa`, flash's case;
folding cannot be combined with `is_causal`, whose diagonal would then run across the folded rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """q [b, heads, n, d]; k, v [b, kv_heads, s, d]; mask None or boolean [b or 1, 1, n, s] (True: visible).
    causal: the square causal pattern (n == s, query i sees keys 0..i), without a mask. Returns [b, heads, n, d]."""
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if causal:
        if mask is not None or n != k.shape[2]:
            raise ValueError("causal attention here is the square pattern, without a mask")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
    groups = heads // kv_heads
    folded = q.reshape(b, kv_heads, groups * n, d)  # query head h = kv head h // groups: the groups sit together
    if mask is not None and groups > 1:
        mask = mask.repeat(1, 1, groups, 1)  # row gi * n + i of the folded axis is query i of group gi
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, n, d)
