"""PyTorch engines: the Hugging Face target and the DFlash drafter, on CPU or CUDA (protocols: `base.py`).

Target: a static preallocated KV cache in the style of gpt-fast, `[layers, slots, kv_heads, C, head_dim]`,
one slot per row, plus each row's length. A forward packs the rows' new tokens into one sequence (the
projections, MLPs and lm_head see real tokens only, so a pass costs what its tokens cost), writes their
K/V at their own positions (`length[r] + i`), and for attention alone pads the queries to the longest
row (of its group: rows of many new tokens, prompt chunks, attend apart from verify blocks) and attends
over the first max(length + n) cache positions with the mask `key position <= query position`. Stale K/V beyond a row's length (rolled-back drafts, other rows' longer contexts) are never
visible, because every position a query can see was written in this pass or is committed, so a rollback
is just `length[r] = m` (no copy). Slots and C grow by doubling (a copy, rare); removed rows free their slot.

The layers are run here, not through the Hugging Face forward (whose caches hold one length for the
whole batch): the same modules and weights (norms, q/k/v/o projections, Qwen3's q/k norms, rotary
embedding, MLP), with the attention written out. Families: Qwen3, Qwen2, LLaMA (3.x too), Mistral and
Qwen3-MoE with full attention. The others (linear attention, sliding windows, sinks: `hybrid.layered_refusal`)
run one Hugging Face forward per row with per-row rollback (`hybrid.HfRowsSession`).

Drafter: the same slot scheme for its context cache; one round for all rows is
`models.drafter_batch.packed_round` (the batched ONNX graph computes the same, padded: `ragged_round`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from transformers import PreTrainedModel

from ..models.attention import grouped_attention
from ..models.drafter import DFlashDrafter
from ..models.drafter_batch import packed_round
from ..models.target import DTYPES, load_target
from .base import Draft, DraftRequest, EngineOptions, PassArgmax, TargetOutput, dtype_name
from .hybrid import HfRowsSession, layered_refusal
from .rows import SlotCacheRows


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary embedding (rotate_half convention): x [b, heads, n, d], cos/sin [b, n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


# Hugging Face's RMSNorm of these families: weight * (x normalised in float32, cast back). In float32 that is
# F.rms_norm to the bit (tests/runtime/test_torch_fused.py), one op where the module runs six.
_RMS_NORMS = frozenset({"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm"})
_GATED_MLPS = frozenset({"Qwen3MLP", "Qwen2MLP", "LlamaMLP", "MistralMLP", "Qwen3MoeMLP"})


def _norm(module: Any) -> Any:
    """The norm as one op where it is exactly F.rms_norm (float32), else the module itself."""
    if type(module).__name__ not in _RMS_NORMS or module.weight.dtype != torch.float32:
        return module
    shape, weight, eps = (module.weight.shape[0],), module.weight, float(module.variance_epsilon)
    return lambda x: torch.nn.functional.rms_norm(x, shape, weight, eps)


def _fuse(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear layers that read the same input as one matrix (and bias); the layers' own parameters become views
    of it, so the weights are held once. One GEMM costs the host one call where it paid one per layer."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


class _Layer(NamedTuple):
    """One decoder layer as the packed pass runs it: its norms (one op each where exact), q/k/v as one
    projection, and gate/up as one where the MLP is a plain gated one (a mixture of experts runs as its module)."""

    norm_in: Any
    norm_post: Any
    q_norm: Any  # None without Qwen3's per-head q/k norms
    k_norm: Any
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    qkv_sizes: list[int]
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None
    mlp: Any

    @classmethod
    def of(cls, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = {m.bias is None for m in projections}
        if len(bias) != 1:
            raise ValueError("q/k/v projections with and without bias")
        sizes = [int(m.weight.shape[0]) for m in projections]
        gated = type(mlp).__name__ in _GATED_MLPS and mlp.gate_proj.bias is None and mlp.up_proj.bias is None
        qk = hasattr(attn, "q_norm")
        return cls(
            _norm(layer.input_layernorm),
            _norm(layer.post_attention_layernorm),
            _norm(attn.q_norm) if qk else None,
            _norm(attn.k_norm) if qk else None,
            _fuse(*projections),
            sizes,
            _fuse(mlp.gate_proj, mlp.up_proj) if gated else None,
            mlp,
        )

    def mlp_of(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return cast(torch.Tensor, self.mlp(h))
        gate, up = torch.nn.functional.linear(h, *self.gate_up).chunk(2, dim=-1)
        return cast(torch.Tensor, self.mlp.down_proj(self.mlp.act_fn(gate) * up))


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
        untyped: Any = model  # transformers' methods are untyped
        self.model: Any = untyped
        self.vocab_size = int(text.vocab_size)
        self.max_context = int(getattr(text, "max_position_embeddings", 1 << 30))
        self.feature_layer_ids = tuple(feature_layer_ids)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # families the layers below cannot express run one Hugging Face forward per row (runtime/hybrid.py)
        self.per_row_reason = layered_refusal(text)
        if self.per_row_reason is not None:
            return
        self.base: Any = untyped.get_decoder()
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.n_kv_heads = int(text.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        with torch.no_grad():
            self.plans = [_Layer.of(layer) for layer in self.layers]
        self.final_norm = _norm(self.base.norm)

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

    def new_session(self) -> TorchTargetSession | HfRowsSession:
        if self.per_row_reason is not None:
            return HfRowsSession(self.model, self.feature_layer_ids)
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
        groups = _attention_groups(rows, starts, counts, (vr, vi, pos), dev)
        slots = groups[0].layout.slots if len(groups) == 1 else torch.tensor(list(rows), device=dev)
        w_rows, w_pos = slots[vr], pos[vr, vi]

        x = e.base.embed_tokens(flat)[None]  # [1, T, H]
        cos, sin = e.base.rotary_emb(x, w_pos[None])
        want = set(e.feature_layer_ids) if features else set()
        outs: dict[int, torch.Tensor] = {}
        for li, (layer, plan) in enumerate(zip(e.layers, e.plans)):
            attn = layer.self_attn
            h = plan.norm_in(x)
            q, k, v = (
                p.view(1, total, -1, e.head_dim)
                for p in torch.split(torch.nn.functional.linear(h, *plan.qkv), plan.qkv_sizes, dim=-1)
            )
            if plan.q_norm is not None:
                q, k = plan.q_norm(q), plan.k_norm(k)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)  # [1, heads, T, d]
            ck, cv = self.k[li], self.v[li]
            ck[w_rows, :, w_pos] = k[0].transpose(0, 1)
            cv[w_rows, :, w_pos] = v[0]
            if len(groups) == 1:
                a = groups[0].attend(q[0].transpose(0, 1), ck, cv, e.scaling)
            else:  # each group's tokens attend apart, their outputs go back to their places in the packed pass
                a = q.new_empty(total, q.shape[1], e.head_dim)
                for g in groups:
                    assert g.tokens is not None
                    a[g.tokens] = g.attend(q[0, :, g.tokens].transpose(0, 1), ck, cv, e.scaling)
            x = x + attn.o_proj(a.reshape(1, total, -1))
            x = x + plan.mlp_of(plan.norm_post(x))
            if li in want:
                outs[li] = x[0]
        self._advance(rows, starts, counts)

        feats = torch.split(torch.cat([outs[i] for i in e.feature_layer_ids], dim=-1), counts) if want else None
        head = e.model.get_output_embeddings()
        if last_logits_only:
            logits = head(e.final_norm(x[0, count_t.cumsum(0) - 1])).float()  # [b, V]
            scored = [1] * b
        else:
            logits, scored = head(e.final_norm(x[0])).float(), counts  # [T, V]
        per_row, top = logits.split(scored), PassArgmax(logits)
        first = list(itertools.accumulate(scored, initial=0))
        return [TargetOutput(per_row[i], None if feats is None else feats[i], top, first[i]) for i in range(b)]


# Rows with more new tokens than this (prompt chunks) attend apart from the others (verify blocks, at most a
# drafter's block): attention pads every row's queries to the longest row of its group, so a 200-token chunk
# in one group with eight 8-token blocks would have the blocks' rows attend 200 padded queries each.
SHORT_QUERIES = 32


class _AttentionGroup(NamedTuple):
    """Rows of one forward that attend together: their tokens' places in the packed pass, their batch."""

    tokens: torch.Tensor | None  # [t] the group's tokens' places in the packed pass; None: the only group
    layout: RowLayout
    rows: torch.Tensor  # [t] each token's row in the attention batch
    queries: torch.Tensor  # [t] each token's query index in its row
    n: int  # the group's longest row
    end: int  # cache positions its attention reads
    mask: torch.Tensor | None  # [S, 1, n, end], or None (every key visible, or the square causal pattern)
    causal: bool

    def attend(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, scale: float) -> torch.Tensor:
        """q [t, heads, d] of the group's tokens -> their attention outputs [t, heads, d] over one layer's cache."""
        keys, values = self.layout.batch(ck, self.end), self.layout.batch(cv, self.end)
        qp = q.new_zeros(self.layout.size, self.n, q.shape[1], q.shape[2])
        qp[self.rows, self.queries] = q
        a = grouped_attention(qp.transpose(1, 2), keys, values, mask=self.mask, causal=self.causal, scale=scale)
        return a.transpose(1, 2)[self.rows, self.queries]


def _attention_groups(
    rows: Sequence[int],
    starts: list[int],
    counts: list[int],
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dev: torch.device,
) -> list[_AttentionGroup]:
    """The forward's rows as attention groups: all in one, or the short rows and the long ones apart
    (`SHORT_QUERIES`). packed: the forward's (row, query) index of each packed token and its rows' positions."""
    long = [c > SHORT_QUERIES for c in counts]
    if all(long) or not any(long):
        return [_group(list(rows), starts, counts, None, packed, dev)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    out = []
    for want in (False, True):
        part = [i for i, k in enumerate(long) if k == want]
        tokens = torch.cat([torch.arange(offsets[i], offsets[i + 1], device=dev) for i in part])
        sub = [rows[i] for i in part], [starts[i] for i in part], [counts[i] for i in part]
        out.append(_group(*sub, tokens, None, dev))
    return out


def _group(
    rows: list[int],
    starts: list[int],
    counts: list[int],
    tokens: torch.Tensor | None,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    dev: torch.device,
) -> _AttentionGroup:
    """One attention group (`packed`: its indices when it is the forward's only group, else computed here)."""
    n, end = max(counts), max(s + c for s, c in zip(starts, counts))
    if packed is None:
        count_t = torch.tensor(counts, device=dev)
        vr, vi = (torch.arange(n, device=dev)[None, :] < count_t[:, None]).nonzero(as_tuple=True)
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(n, device=dev)[None, :]
    else:
        vr, vi, pos = packed
    # an idle row costs the target its share of attention only (projections and MLPs run on real tokens)
    layout = RowLayout(rows, dev, max_idle=len(rows))
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
    return _AttentionGroup(tokens, layout, layout.local[vr], vi, n, end, mask, causal)


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
        self.dtype = dtype_name(drafter.fc.weight.dtype)

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
