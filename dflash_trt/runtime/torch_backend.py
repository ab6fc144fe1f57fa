"""PyTorch engines: the Hugging Face target and the DFlash drafter, on CPU or CUDA (protocols: `base.py`).

Target: a static preallocated KV cache in the style of gpt-fast, `[layers, slots, kv_heads, C, head_dim]`,
one slot per row, plus each row's length. A forward packs the rows' new tokens into one sequence (the
projections, MLPs and lm_head see real tokens only, so a pass costs what its tokens cost), writes their
K/V at their own positions (`length[r] + i`), and for attention alone pads the queries to the longest
row and attends over the first max(length + n) cache positions with the mask `key position <= query
position`. Stale K/V beyond a row's length (rolled-back drafts, other rows' longer contexts) are never
visible, because every position a query can see was written in this pass or is committed, so a rollback
is just `length[r] = m` (no copy). Slots and C grow by doubling (a copy, rare); removed rows free their slot.

The layers are run here, not through the Hugging Face forward (whose caches hold one length for the
whole batch): the same modules and weights (norms, q/k/v/o projections, Qwen3's q/k norms, rotary
embedding, MLP), with the attention written out. Families: Qwen3, Qwen2, LLaMA, Mistral with full
attention (sliding-window layers are refused).

Drafter: the same slot scheme for its context cache; one round for all rows is
`models.drafter_batch.packed_round` (the batched ONNX graph computes the same, padded: `ragged_round`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from ..models.attention import grouped_attention
from ..models.drafter import DFlashDrafter
from ..models.drafter_batch import packed_round
from ..models.target import DTYPES, load_target
from .base import Draft, DraftRequest, EngineOptions, TargetOutput
from .rows import SlotCacheRows


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary embedding (rotate_half convention): x [b, heads, n, d], cos/sin [b, n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class RowLayout:
    """Where a call's rows sit in the batch its attention runs on.

    Attention needs each row's cache as one `[rows, kv_heads, C, head_dim]` batch. When the call's slots
    lie close together (the usual case: every live row verifies each step), that batch is the view of the
    slot span lo..hi, no copy; slots in the span that are not in the call ride along as idle rows, whose
    results are dropped. Otherwise (a few scattered rows, e.g. two joiners' prefill) the rows' caches are
    gathered (a copy of their first `end` positions). Joins and leaves scatter the slots, so before this
    most steady-state passes copied every row's K and V in every layer."""

    def __init__(self, rows: Sequence[int], device: torch.device, max_idle: int):
        self.slots = torch.tensor(list(rows), dtype=torch.long, device=device)
        lo, hi = min(rows), max(rows)
        if hi - lo + 1 <= len(rows) + max_idle:
            self.span: slice | None = slice(lo, hi + 1)
            self.size = hi - lo + 1
            self.local = self.slots - lo  # each call row's place in the attention batch
        else:
            self.span, self.size = None, len(rows)
            self.local = torch.arange(len(rows), device=device)

    def batch(self, cache: torch.Tensor, end: int) -> torch.Tensor:
        """One layer's cache [slots, heads, C, d] -> the attention batch's first `end` positions."""
        if self.span is not None:
            return cache[self.span, :, :end]
        return cache[:, :, :end].index_select(0, self.slots)


class TorchTargetEngine:
    """A Hugging Face causal LM run layer by layer on a per-row static cache (see the module docstring)."""

    name = "torch"

    def __init__(self, model: PreTrainedModel, feature_layer_ids: tuple[int, ...] = ()):
        text = model.config.get_text_config()
        layer_types = getattr(text, "layer_types", None) or []
        window = getattr(text, "sliding_window", None)
        uses_window = any(t != "full_attention" for t in layer_types) or (
            getattr(text, "use_sliding_window", True)
            and window is not None
            and window < int(getattr(text, "max_position_embeddings", 1 << 30))
        )
        if uses_window:
            raise ValueError("the batched target supports full-attention layers only (this one uses a sliding window)")
        untyped: Any = model  # transformers' methods are untyped
        self.model: Any = untyped
        self.base: Any = untyped.get_decoder()
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.vocab_size = int(text.vocab_size)
        self.max_context = int(getattr(text, "max_position_embeddings", 1 << 30))
        self.num_layers = len(self.layers)
        self.n_kv_heads = int(text.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.qk_norm = hasattr(attn, "q_norm")
        self.feature_layer_ids = tuple(feature_layer_ids)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @classmethod
    def from_artifact(cls, checkpoint: Path, options: EngineOptions) -> TorchTargetEngine:
        """Served from the Hugging Face checkpoint itself (no build step)."""
        model = load_target(checkpoint, DTYPES[options.dtype], options.device or "cpu")
        return cls(model, options.feature_layer_ids)

    @property
    def embed_weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.model.get_input_embeddings().weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.model.get_output_embeddings().weight)

    def new_session(self) -> TorchTargetSession:
        return TorchTargetSession(self)


class TorchTargetSession(SlotCacheRows):
    def __init__(self, engine: TorchTargetEngine):
        self.engine = engine
        self.cache_limit = engine.max_context
        shape = (engine.num_layers, 0, engine.n_kv_heads, 0, engine.head_dim)
        k = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        super().__init__(k, torch.zeros_like(k))

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.k.dtype, device=self.k.device)

    # ---- rows ---------------------------------------------------------------------------
    def length(self, row: int) -> int:
        return self._row_length(row)

    def rollback(self, row: int, length: int) -> None:
        current = self.length(row)
        if not 0 <= length <= current:
            raise ValueError(f"cannot roll row {row} back to {length}: it holds {current} tokens")
        self.slots.lengths[row] = length

    # ---- the pass -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        rows: Sequence[int],
        tokens: Sequence[torch.Tensor],
        *,
        last_logits_only: bool = False,
        features: bool = True,
    ) -> list[TargetOutput]:
        e = self.engine
        if not rows or len(rows) != len(tokens):
            raise ValueError("forward needs one token tensor per row, and at least one row")
        for r in rows:
            self.slots.check(r)
        if len(set(rows)) != len(rows):
            raise ValueError("a row appears twice in one forward")
        counts = [int(t.numel()) for t in tokens]
        if min(counts) < 1:
            raise ValueError("every row needs at least one new token")
        starts = [self.slots.lengths[r] for r in rows]
        end = max(s + n for s, n in zip(starts, counts))
        if end > e.max_context:
            raise ValueError(f"a row would hold {end} tokens, beyond the target's context length {e.max_context}")
        self._reserve(self.slots.capacity, end)
        b, n, total = len(rows), max(counts), sum(counts)
        dev = e.device
        # Packed: the real tokens of all rows in one sequence [1, T]. Every layer but attention runs on
        # them alone (no padding, so a pass costs what its real tokens cost: rows with block 1 next to rows
        # with block 8 do not pay for 8); attention scatters the queries into [rows, longest, ...] and back.
        flat = torch.cat([t.to(dev).view(-1) for t in tokens])
        count_t = torch.tensor(counts, device=dev)
        valid = torch.arange(n, device=dev)[None, :] < count_t[:, None]  # [b, n]
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(n, device=dev)[None, :]
        vr, vi = valid.nonzero(as_tuple=True)  # row-major: the order of `flat`
        # an idle row costs the target its share of attention only (projections and MLPs run on real tokens)
        layout = RowLayout(rows, dev, max_idle=len(rows))
        w_rows, w_pos, a_rows = layout.slots[vr], pos[vr, vi], layout.local[vr]
        # idle rows of the span see positions 0..n-1 (never an empty softmax); their output is dropped
        a_pos = torch.arange(n, device=dev)[None, :].repeat(layout.size, 1)
        a_pos[layout.local] = pos
        # the dense mask only where a pass needs one (models/attention.py: flash takes none, and no mask with
        # grouped heads): one token per row at a common length sees every key; a prefill from 0 of rows of one
        # length is the square causal pattern; anything else (verify passes, ragged rows) is masked
        sees_all = n == 1 and all(s == end - 1 for s in starts)
        causal = not sees_all and n == end and all(c == n for c in counts)
        mask = None
        if not (sees_all or causal):
            mask = (torch.arange(end, device=dev)[None, None, :] <= a_pos[:, :, None])[:, None]  # [S, 1, n, end]

        x = e.base.embed_tokens(flat)[None]  # [1, T, H]
        cos, sin = e.base.rotary_emb(x, w_pos[None])
        want = set(e.feature_layer_ids) if features else set()
        outs: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(e.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, total, -1, e.head_dim)
            k = attn.k_proj(h).view(1, total, -1, e.head_dim)
            v = attn.v_proj(h).view(1, total, -1, e.head_dim)
            if e.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)  # [1, heads, T, d]
            ck, cv = self.k[li], self.v[li]
            ck[w_rows, :, w_pos] = k[0].transpose(0, 1)
            cv[w_rows, :, w_pos] = v[0]
            keys, values = layout.batch(ck, end), layout.batch(cv, end)
            qp = q.new_zeros(layout.size, n, q.shape[1], e.head_dim)
            qp[a_rows, vi] = q[0].transpose(0, 1)
            a = grouped_attention(qp.transpose(1, 2), keys, values, mask=mask, causal=causal, scale=e.scaling)
            x = x + attn.o_proj(a.transpose(1, 2)[a_rows, vi].reshape(1, total, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if li in want:
                outs[li] = x[0]
        self._advance(rows, starts, counts)

        feats = torch.split(torch.cat([outs[i] for i in e.feature_layer_ids], dim=-1), counts) if want else None
        head = e.model.get_output_embeddings()
        if last_logits_only:
            last = e.base.norm(x[0, count_t.cumsum(0) - 1])  # [b, H]
            per_row = list(head(last).float().split(1))
        else:
            per_row = list(head(e.base.norm(x[0])).float().split(counts))
        return [TargetOutput(logits=per_row[i], features=None if feats is None else feats[i]) for i in range(b)]


def shared_weights(
    drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding table and lm_head as the drafter uses them: shared when the dtypes match, else
    copies in the drafter's dtype (a bfloat16 drafter next to a float32 target; one copy when tied)."""
    dtype = drafter.fc.weight.dtype
    if embed.dtype == dtype and lm_head.dtype == dtype:
        return embed, lm_head
    embed_copy = embed.to(dtype)
    return embed_copy, embed_copy if lm_head is embed else lm_head.to(dtype)


class TorchDrafterEngine:
    """The drafter plus the target's embedding table and lm_head (shared, not copied)."""

    name = "torch"

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        self.drafter = drafter.eval()
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        self.block_size = drafter.spec.block_size
        self.mask_token_id = drafter.spec.mask_token_id
        self.feature_layer_ids = tuple(drafter.spec.target_layer_ids)
        self.max_context: int | None = None  # the cache grows with the context (RoPE positions have no cap)

    @classmethod
    def for_target(cls, drafter: DFlashDrafter, target: TorchTargetEngine) -> TorchDrafterEngine:
        return cls(drafter.to(target.device), *shared_weights(drafter, target.embed_weight, target.lm_head_weight))

    @classmethod
    def from_artifact(cls, checkpoint: Path, options: EngineOptions) -> TorchDrafterEngine:
        raise ValueError(
            f"the PyTorch drafter {checkpoint} runs on its target's embedding and lm_head: load it "
            "with its target (dflash_trt.loading.load_decoder), or export it (`dflash-trt export-drafter`)"
        )

    def new_session(self) -> TorchDrafterSession:
        return TorchDrafterSession(self)


class TorchDrafterSession(SlotCacheRows):
    def __init__(self, engine: TorchDrafterEngine):
        self.engine = engine
        super().__init__(*engine.drafter.empty_cache(batch=0, device=engine.embed_weight.device))

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.k.dtype, device=self.k.device)

    def context_length(self, row: int) -> int:
        return self._row_length(row)

    @torch.inference_mode()
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        e, d = self.engine, self.engine.drafter
        if not requests:
            return []
        rows, counts, blocks, past, _ = self._plan_draft(requests)
        dev = e.embed_weight.device
        # idle rows cost the drafter a whole block each (unlike the target, where only attention pads), so
        # few are worth a copy; gathering a row's cache (and writing it back) is cheap at drafter depth
        layout = RowLayout(rows, dev, max_idle=len(rows) // 8)
        nb = max(blocks)
        # per attention row: valid context after this round and block length; idle rows of the span keep
        # their context (their block's scratch K/V go after it) and run a 1-token block
        if layout.span is not None:
            span = range(layout.span.start, layout.span.stop)
            context = [self.slots.lengths[s] if self.slots.live[s] else 0 for s in span]
            block_len = [1] * len(span)
        else:
            context, block_len = [0] * len(rows), [1] * len(rows)
        local = layout.local.tolist()
        for a, p, c, blk in zip(local, past, counts, blocks):
            context[a], block_len[a] = p + c, blk
        end = max(context) + nb
        self._reserve(self.slots.capacity, end)
        if layout.span is not None:
            cache_k, cache_v = self.k[:, layout.span, :, :end], self.v[:, layout.span, :, :end]
        else:
            cache_k, cache_v = self.k[:, layout.slots, :, :end], self.v[:, layout.slots, :, :end]
        count_t = torch.tensor(counts, device=dev)
        first = torch.repeat_interleave(count_t.cumsum(0) - count_t, count_t)  # each feature's row start
        feature_pos = torch.repeat_interleave(torch.tensor(past, device=dev), count_t)
        feature_pos = feature_pos + torch.arange(len(first), device=dev) - first
        ids = torch.full((layout.size, nb), e.mask_token_id, dtype=torch.long, device=dev)
        ids[layout.local, 0] = torch.tensor([q.last_token for q in requests], device=dev)
        hidden = packed_round(
            d,
            torch.cat([q.new_features for q in requests]).to(device=dev, dtype=self.k.dtype),
            torch.repeat_interleave(layout.local, count_t),
            feature_pos,
            d.embed_block(ids, e.embed_weight),
            torch.tensor(block_len, device=dev),
            torch.tensor(context, device=dev),
            cache_k,
            cache_v,
            every_key_visible=all(c + bl == end for c, bl in zip(context, block_len)),
        )
        if layout.span is None:  # a gathered copy: write it back
            self.k[:, layout.slots, :, :end], self.v[:, layout.slots, :, :end] = cache_k, cache_v
        self._advance(rows, past, counts)
        # [b, nb-1, V] logits and the greedy draft (DFlash 2: with the selector's candidates and scores)
        logits, tokens, cands, scores = d.block_outputs(
            hidden[layout.local, 1:], ids[layout.local, 0], e.lm_head_weight
        )
        return [
            Draft(
                logits=logits[i, : blocks[i] - 1],
                tokens=tokens[i, : blocks[i] - 1],
                candidates=None if cands is None else cands[i, : blocks[i] - 1],
                step_scores=None if scores is None else scores[i, : blocks[i] - 1],
            )
            for i in range(len(rows))
        ]
