"""One drafter round for many rows at once (ragged), in two forms that compute the same thing: padded
(`ragged_round`, the exported batched ONNX graph's fixed-rank form) and packed (`packed_round`, the
PyTorch batched session's: real rows only, the cache written in place).

Row r holds `past_lengths[r]` context K/V in its cache, brings `new_lengths[r]` new context features
and drafts a block of `block_lengths[r]` tokens. Padding is masked out of attention, so each row's
result equals the single-row `DFlashDrafter.forward`.

The cache is `[layers, rows, kv_heads, C, head_dim]` with C >= max(past_lengths) + n (the padded
new-context length): row r's new context K/V are written at positions past_lengths[r] + i. Padding
rows' K/V land beyond the row's valid length, where nothing reads them before they are overwritten.
"""

from __future__ import annotations

import torch

from .drafter import DFlashAttention, DFlashDrafter


def _visible(attn: DFlashAttention, key_valid: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Boolean [b, 1, q, k]: valid keys, restricted for the rare causal / sliding-window drafter layers."""
    visible = key_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    if attn.causal:
        visible = visible & (k <= q)
    if attn.window is not None:
        visible = visible & (q - k < attn.window)
        if not attn.causal:
            visible = visible & (k - q < attn.window)
    return visible[:, None]


def ragged_round(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    new_lengths: torch.Tensor,
    block_embeds: torch.Tensor,
    block_lengths: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    past_lengths: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """features [b, n, F], new_lengths [b]; block_embeds [b, B, H], block_lengths [b]; past_k/past_v
    [L, b, kvh, C, hd], past_lengths [b]. Returns the block's final hidden states [b, B, H] and the
    cache with the new context written (the same tensors when inplace, else new ones). This padded form
    is the exported graph's; the PyTorch session runs `packed_round`, the same computation."""
    b, n, _ = features.shape
    n_block = block_embeds.shape[1]
    cap = past_k.shape[3]
    dev = features.device
    new_pos = past_lengths[:, None] + torch.arange(n, device=dev)[None, :]  # [b, n]
    ctx_len = past_lengths + new_lengths  # valid context after this round
    blk_pos = ctx_len[:, None] + torch.arange(n_block, device=dev)[None, :]  # [b, B]
    blk_cos, blk_sin = drafter.rotary_emb(block_embeds, blk_pos)
    cache_pos = torch.arange(cap, device=dev)[None, :].expand(b, -1)
    key_valid = torch.cat(
        [cache_pos < ctx_len[:, None], torch.arange(n_block, device=dev)[None, :] < block_lengths[:, None]], dim=1
    )
    k_pos = torch.cat([cache_pos, blk_pos], dim=1)
    ctx = drafter.project_context(features)
    ctx_cos, ctx_sin = drafter.rotary_emb(block_embeds, new_pos)
    write = new_pos[:, None, :, None].expand(b, drafter.n_kv_heads, n, drafter.head_dim)
    x = block_embeds
    out_k, out_v = [], []
    masks: dict[tuple[bool, int | None], torch.Tensor] = {}
    for i, layer in enumerate(drafter.decoder_layers):
        attn = layer.self_attn
        k_new, v_new = attn.project_kv(ctx, ctx_cos, ctx_sin)
        if inplace:
            ctx_k, ctx_v = past_k[i].scatter_(2, write, k_new), past_v[i].scatter_(2, write, v_new)
        else:
            ctx_k, ctx_v = past_k[i].scatter(2, write, k_new), past_v[i].scatter(2, write, v_new)
            out_k.append(ctx_k)
            out_v.append(ctx_v)
        key = (attn.causal, attn.window)
        if key not in masks:
            masks[key] = _visible(attn, key_valid, blk_pos, k_pos)
        x = layer(x, ctx_k, ctx_v, blk_cos, blk_sin, masks[key])
    if inplace:
        return drafter.final_norm(x), past_k, past_v
    return drafter.final_norm(x), torch.stack(out_k), torch.stack(out_v)


def packed_round(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    feature_rows: torch.Tensor,
    feature_positions: torch.Tensor,
    block_embeds: torch.Tensor,
    block_lengths: torch.Tensor,
    context_lengths: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    every_key_visible: bool = False,
) -> torch.Tensor:
    """`ragged_round` without padding or copies (the PyTorch batched session's form; the same computation).

    features [T, F]: the rows' real new context, one after another; feature t belongs to row
    feature_rows[t] at cache position feature_positions[t]. block_embeds [b, B, H], block_lengths [b],
    context_lengths [b]: each row's valid context after this round. cache_k/cache_v [L, b, kvh, C, hd],
    C >= max(context_lengths) + B, written in place: the new context's K/V, and each row's block K/V as
    scratch right after its context (beyond the row's valid length, so overwritten by later context and
    never read as context). Returns the block's final hidden states [b, B, H]. every_key_visible: the caller
    knows that every row's context + block fills the cache's C positions, so a bidirectional layer needs no mask
    (PyTorch's flash kernel takes none: models/attention.py).

    Packing matters because backlogs are ragged (a row drafting for the first time brings its whole prompt,
    ~100+ features, the others a few: padded, every row paid for the prompt); writing the block into the
    cache spares each layer two copies of the whole cache (the concatenation of context and block keys)."""
    n_block = block_embeds.shape[1]
    cap = cache_k.shape[3]
    dev = block_embeds.device
    blk_pos = context_lengths[:, None] + torch.arange(n_block, device=dev)[None, :]  # [b, B]
    blk_cos, blk_sin = drafter.rotary_emb(block_embeds, blk_pos)
    cache_pos = torch.arange(cap, device=dev)[None, :].expand(block_embeds.shape[0], -1)
    key_valid = cache_pos < (context_lengths + block_lengths)[:, None]  # the context, then the row's block
    ctx = drafter.project_context(features[None])  # [1, T, H]
    ctx_cos, ctx_sin = drafter.rotary_emb(block_embeds, feature_positions[None])
    x = block_embeds
    masks: dict[tuple[bool, int | None], torch.Tensor] = {}
    for i, layer in enumerate(drafter.decoder_layers):
        attn = layer.self_attn
        k_new, v_new = attn.project_kv(ctx, ctx_cos, ctx_sin)  # [1, kvh, T, hd]
        cache_k[i].transpose(1, 2)[feature_rows, feature_positions] = k_new[0].transpose(0, 1)
        cache_v[i].transpose(1, 2)[feature_rows, feature_positions] = v_new[0].transpose(0, 1)
        key = (attn.causal, attn.window)
        if key not in masks:
            masks[key] = _visible(attn, key_valid, blk_pos, cache_pos)
        bidirectional = not attn.causal and attn.window is None
        mask = None if every_key_visible and bidirectional else masks[key]
        x = layer(x, cache_k[i], cache_v[i], blk_cos, blk_sin, mask, block_at=blk_pos)
    return drafter.final_norm(x)
