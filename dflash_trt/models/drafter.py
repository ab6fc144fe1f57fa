"""The DFlash drafter: Qwen3-style layers with KV injection of projected target features.

One forward pass drafts a whole block. Per layer the SAME k_proj / v_proj are applied to the
projected context features and to the block tokens and concatenated along the sequence
(K = [k(ctx); k(block)]); queries come from the block only; attention is non-causal. The
context K/V are final (they come from committed target features), so they are cached and
returned; the block's K/V are thrown away after each round.

The cache is explicit tensors (`[layers, batch, kv_heads, length, head_dim]` for K and V) so
that the same code exports to ONNX with the cache as graph inputs and outputs.

DFlash 2 drafters (config `DFlash2DraftModel`) add grouped dynamic causal convolutions around each layer's
attention and MLP and a candidate selector after the logits (models/selector.py); `block_outputs` gives what
every engine returns for a block, either generation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from ..config import ConfigError, DFlashSpec, drafter_config_from_dict, load_drafter_config
from .attention import grouped_attention
from .selector import CandidateSelector, GroupedDynamicConv, greedy_path

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# transformers leaves these unannotated; their signatures, as used here
_rotate_half = cast(Callable[[torch.Tensor], torch.Tensor], rotate_half)
_qwen3_mlp = cast(Callable[[Qwen3Config], nn.Module], Qwen3MLP)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, heads, n, hd]; cos/sin: [b, n, hd]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Boolean [q, k] mask for the rare causal / sliding-window drafter layers (newer drafters)."""
    q, k = q_pos[:, None], k_pos[None, :]
    visible = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q_pos.device)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.n_heads = config.num_attention_heads
        # Qwen3Config fills an unset num_key_value_heads with num_attention_heads
        kv_heads = config.num_key_value_heads
        self.n_kv_heads = kv_heads if kv_heads is not None else self.n_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        sliding = bool(layer_types and layer_types[layer_idx] == "sliding_attention")
        explicit_causal = getattr(config, "is_causal", None)
        # Same rule as the reference: only sliding-window layers are causal unless the config says so.
        self.causal = sliding if explicit_causal is None else bool(explicit_causal)
        self.window: int | None = config.sliding_window if sliding else None

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        block_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: block hidden [b, B, H]; ctx_k/ctx_v: cached + new context K/V [b, kvh, T, hd]. The block's own
        K/V are appended to them, or, given `block_at` [b, B] (cache positions past each row's context),
        written into ctx_k/ctx_v in place there (no copy of the cache; the mask then covers T keys only)."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        if block_at is None:
            k = torch.cat([ctx_k, k_blk], dim=2)
            v = torch.cat([ctx_v, v_blk], dim=2)
        else:
            at = torch.arange(b, device=x.device)[:, None], block_at
            ctx_k.transpose(1, 2)[at] = k_blk.transpose(1, 2)
            ctx_v.transpose(1, 2)[at] = v_blk.transpose(1, 2)
            k, v = ctx_k, ctx_v
        # Grouped-query attention without copying K/V per head and without enable_gqa next to a mask: the g
        # query heads that share a KV head are folded into the query axis (models/attention.py: the rules of
        # PyTorch's fused kernels), so a round never copies the O(context) cache.
        out = grouped_attention(q, k, v, mask=None if mask is None else mask.reshape(-1, 1, *mask.shape[-2:]))
        result: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        return result

    def forward_blocks(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_visible: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """Training: m packed blocks [b, m*B, H] attend to the context keys their block may see
        (`ctx_visible` [b, m, S]: one row per block, not per query) and, bidirectionally, to their own
        block ([m, B, B] batched), with ONE softmax over both, exactly as `forward` attends at inference.
        No dense [m*B, S + m*B] mask: the cross-block part of that mask is never materialised."""
        b, n, _ = x.shape
        m, kvh, hd = n // block_size, self.n_kv_heads, self.head_dim
        groups = self.n_heads // kvh
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, hd)).transpose(1, 2)
        q = _rope(q, cos, sin).reshape(b, kvh, groups, m, block_size, hd)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        k_blk = k_blk.reshape(b, kvh, m, block_size, hd)
        v_blk = v_blk.reshape(b, kvh, m, block_size, hd)
        scale = hd**-0.5
        # scores in fp32 (the softmax under bf16 autocast would otherwise run in bf16)
        s_ctx = torch.einsum("bkgmid,bksd->bkgmis", q, ctx_k).float() * scale
        s_ctx = s_ctx.masked_fill(~ctx_visible[:, None, None, :, None, :], float("-inf"))
        s_blk = torch.einsum("bkgmid,bkmjd->bkgmij", q, k_blk).float() * scale
        top = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True)).detach()
        p_ctx, p_blk = (s_ctx - top).exp(), (s_blk - top).exp()
        denom = p_ctx.sum(-1, keepdim=True) + p_blk.sum(-1, keepdim=True)
        out = (
            torch.einsum("bkgmis,bksd->bkgmid", p_ctx.to(ctx_v.dtype), ctx_v).float()
            + torch.einsum("bkgmij,bkmjd->bkgmid", p_blk.to(v_blk.dtype), v_blk).float()
        ) / denom
        out = out.to(v_blk.dtype)  # bf16 under autocast, else fp32
        result: torch.Tensor = self.o_proj(out.reshape(b, self.n_heads, n, hd).transpose(1, 2).reshape(b, n, -1))
        return result


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int, spec: DFlashSpec | None = None):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = _qwen3_mlp(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if spec is not None and spec.generation == 2:
            size = (config.hidden_size, spec.conv_kernel_size, spec.conv_group_size)
            self.attention_conv, self.mlp_conv = GroupedDynamicConv(*size), GroupedDynamicConv(*size)

    def _attention(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        block_at: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention sublayer's output for the normed block x; DFlash 2 convolves its input and output."""
        if self.attention_conv is None:
            return cast(torch.Tensor, self.self_attn(x, ctx_k, ctx_v, cos, sin, mask, block_at))
        x, kernel = self.attention_conv.prepare(x)
        return self.attention_conv.finish(self.self_attn(x, ctx_k, ctx_v, cos, sin, mask, block_at), kernel)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp_conv is None:
            return cast(torch.Tensor, self.mlp(x))
        x, kernel = self.mlp_conv.prepare(x)
        return self.mlp_conv.finish(self.mlp(x), kernel)

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        block_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self._attention(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask, block_at)
        return x + self._mlp(self.post_attention_layernorm(x))

    def forward_blocks(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_visible: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        x = x + self.self_attn.forward_blocks(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, ctx_visible, block_size)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class DFlashDrafter(nn.Module):
    """Parameter names equal the published checkpoints' (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, config: Qwen3Config, spec: DFlashSpec):
        super().__init__()
        self.config, self.spec = config, spec
        self.layers = nn.ModuleList(DFlashLayer(config, i, spec) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(spec.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.candidate_selector: CandidateSelector | None = None
        if spec.generation == 2:
            self.candidate_selector = CandidateSelector(
                config.vocab_size, config.hidden_size, spec.selector_rank, spec.selector_top_k
            )
        attn = self.decoder_layers[0].self_attn
        self.n_kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self._needs_mask = any(
            layer.self_attn.causal or layer.self_attn.window is not None for layer in self.decoder_layers
        )

    @property
    def decoder_layers(self) -> list[DFlashLayer]:
        """`layers` with their type (an nn.ModuleList types its items as plain Modules)."""
        return cast("list[DFlashLayer]", list(self.layers))

    # ---- shapes -------------------------------------------------------------------------
    @property
    def feature_size(self) -> int:
        return self.fc.in_features

    def empty_cache(
        self, batch: int = 1, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (len(self.layers), batch, self.n_kv_heads, 0, self.head_dim)
        dtype = dtype or self.fc.weight.dtype
        device = device or self.fc.weight.device
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [b, n, L*H] -> drafter context [b, n, H]."""
        projected: torch.Tensor = self.hidden_norm(self.fc(features))
        return projected

    # ---- inference ----------------------------------------------------------------------
    def forward(
        self,
        features: torch.Tensor,
        block_embeds: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft one block.

        features: target features of the n tokens committed since the last call [b, n, L*H],
            at positions T..T+n-1 where T = past_k.shape[3] (tokens already in the cache).
        block_embeds: embedded [last token, MASK x (B-1)] [b, B, H] at positions T+n..T+n+B-1.
        Returns final hidden states of the block [b, B, H] and the context cache grown by n.
        """
        b, n, _ = features.shape
        past = past_k.shape[3]
        n_block = block_embeds.shape[1]
        positions = torch.arange(past + n + n_block, device=features.device)
        cos, sin = self.rotary_emb(block_embeds, positions[past:].unsqueeze(0).expand(b, -1))
        ctx_cos, blk_cos = cos[:, :n], cos[:, n:]
        ctx_sin, blk_sin = sin[:, :n], sin[:, n:]
        mask = None
        ctx = self.project_context(features)
        x = block_embeds
        new_k, new_v = [], []
        for i, layer in enumerate(self.decoder_layers):
            k_new, v_new = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
            ctx_k = torch.cat([past_k[i], k_new], dim=2)
            ctx_v = torch.cat([past_v[i], v_new], dim=2)
            new_k.append(ctx_k)
            new_v.append(ctx_v)
            if self._needs_mask:
                attn = layer.self_attn
                mask = _visibility(positions[past + n :], positions, attn.causal, attn.window)
            x = layer(x, ctx_k, ctx_v, blk_cos, blk_sin, mask)
        return self.final_norm(x), torch.stack(new_k), torch.stack(new_v)

    # ---- training ----------------------------------------------------------------------
    def forward_packed(
        self, features: torch.Tensor, block_embeds: torch.Tensor, block_positions: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """Many blocks of each sequence at once (training), block-sparse without a dense mask.

        features: target features of the whole (right-padded) sequence [b, S, L*H] at positions 0..S-1;
        block_embeds: m blocks of B tokens [b, m*B, H] at block_positions [b, m*B];
        anchors: [b, m] first position of each block: block j sees context keys < anchors[:, j] and its
        own block only (what a round at position anchors[:, j] sees at inference).
        """
        if self._needs_mask:
            raise NotImplementedError("training drafters with causal / sliding-window layers is not supported")
        if self.spec.generation == 2:
            # the packed blocks would run the block convolutions across block boundaries
            raise NotImplementedError("training DFlash 2 drafters (DFlash2DraftModel) is not supported")
        b, s, _ = features.shape
        block_size = block_embeds.shape[1] // anchors.shape[1]
        ctx = self.project_context(features)
        ctx_pos = torch.arange(s, device=features.device).unsqueeze(0).expand(b, -1)
        ctx_cos, ctx_sin = self.rotary_emb(ctx, ctx_pos)
        blk_cos, blk_sin = self.rotary_emb(block_embeds, block_positions)
        ctx_visible = torch.arange(s, device=features.device)[None, None, :] < anchors[:, :, None]
        x = block_embeds
        for layer in self.decoder_layers:
            ctx_k, ctx_v = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
            x = layer.forward_blocks(x, ctx_k, ctx_v, blk_cos, blk_sin, ctx_visible, block_size)
        return self.final_norm(x)

    def forward_packed_dense(
        self,
        features: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The reference for `forward_packed`: the same blocks through one dense masked attention.

        features: target features of the whole sequence [b, S, L*H] (positions 0..S-1);
        block_embeds: all blocks concatenated [b, m*B, H] at block_positions [b, m*B];
        mask: boolean [b, 1, m*B, S + m*B] saying which context / block keys each query sees
        (block-sparse: own context prefix and own block only).
        """
        b, s, _ = features.shape
        ctx = self.project_context(features)
        ctx_pos = torch.arange(s, device=features.device).unsqueeze(0).expand(b, -1)
        ctx_cos, ctx_sin = self.rotary_emb(ctx, ctx_pos)
        blk_cos, blk_sin = self.rotary_emb(block_embeds, block_positions)
        x = block_embeds
        for layer in self.decoder_layers:
            ctx_k, ctx_v = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
            x = layer(x, ctx_k, ctx_v, blk_cos, blk_sin, mask)
        return self.final_norm(x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """`norm(x)`, typed."""
        normed: torch.Tensor = self.norm(x)
        return normed

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits through the TARGET's lm_head (with the optional knobs newer drafters use)."""
        logits = F.linear(hidden, lm_head_weight) * self.spec.output_multiplier
        cap = self.spec.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def block_outputs(
        self, hidden: torch.Tensor, anchor: torch.Tensor, lm_head_weight: torch.Tensor, walk: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What an engine returns for blocks: hidden [b, P, H] of the drafted positions (block positions 1..),
        anchor [b] (position 0's token). Returns float32 logits [b, P, V], the greedy draft tokens [b, P], and
        for DFlash 2 the candidates [b, P, k] and step_scores [b, P, k, k] (models/selector.py; None for
        DFlash 1, whose greedy draft is the argmax). walk=False (the exported graphs, whose block length is
        dynamic): DFlash 2's tokens are each position's best candidate, and the runtime walks the path."""
        logits = self.logits(hidden, lm_head_weight).float()
        if self.candidate_selector is None:
            return logits, logits.argmax(-1), None, None
        candidates, scores = self.candidate_selector.step_scores(hidden, logits, anchor)
        tokens = greedy_path(candidates, scores) if walk else candidates[..., 0]
        return logits, tokens, candidates, scores

    def embed_block(self, block_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Embed [last token, MASK...] with the TARGET's embedding table."""
        return F.embedding(block_ids, embed_weight) * self.spec.input_embedding_scale

    # ---- checkpoints --------------------------------------------------------------------
    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> DFlashDrafter:
        config, spec = drafter_config_from_dict(raw)
        return cls(config, spec)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
        """Load a published-format drafter directory (config.json + safetensors), no remote code."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"drafter directory not found: {path}")
        config, spec = load_drafter_config(path)
        model = cls(config, spec)
        state = _read_safetensors(path)
        expected = set(model.state_dict())
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise ConfigError(
                f"weights in {path}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        model.load_state_dict(state, strict=True)
        return model.to(dtype).eval()

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        raw = self.config.to_dict()
        for key in ("architectures", "dflash_config", "block_size", "num_target_layers", "transformers_version"):
            raw.pop(key, None)
        raw.update(self.spec.to_config_fields())
        raw["model_type"] = "qwen3"
        # the weights' dtype, as transformers writes it (loaders that honour it keep the drafter's precision)
        raw["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        # transformers 4.57 (the z-lab class, TensorRT-LLM 1.2) reads only the top-level fields and would
        # silently fall back to rope theta 10000
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" in rope:
            raw["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default":
                raw["rope_scaling"] = rope
        (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}  # from any device
        save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / WEIGHTS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    # Published checkpoints have no `model.` prefix; accept one if a tool added it. DFlash 2 checkpoints may
    # store the selector's codebooks without `.weight` (the reference maps them so in from_pretrained).
    state = {k.removeprefix("model."): v for k, v in state.items()}
    for book in ("predecessor_codebook", "successor_codebook"):
        bare = f"candidate_selector.{book}"
        if bare in state:
            state[f"{bare}.weight"] = state.pop(bare)
    return state
