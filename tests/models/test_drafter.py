"""The drafter architecture, checkpoint format, config validation and the target features."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_drafter, make_tiny_target, tiny_drafter_config

from dflash_trt.config import ConfigError, build_target_layer_ids, load_drafter_config, validate_against_target
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.target import extract_features
from dflash_trt.runtime.base import DraftRequest
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


def published_weight_names(n_layers: int) -> set[str]:
    """The weight names of published z-lab drafters, as documented (no `model.` prefix, no embed/lm_head)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return names


def test_default_layer_ids_follow_reference_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B published drafter
    assert build_target_layer_ids(32, 1) == [16]
    assert build_target_layer_ids(6, 2) == [1, 3]


def test_checkpoint_round_trip_uses_published_names(tmp_path):
    target = make_tiny_target(vocab_size=64, layers=4)
    drafter = make_tiny_drafter(target.config, tmp_path / "d", layers=3, block_size=6)
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert names == published_weight_names(3)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["block_size"] == 6 and raw["dflash_config"]["block_size"] == 6
    assert raw["num_target_layers"] == 4
    assert raw["dflash_config"]["target_layer_ids"] == list(drafter.spec.target_layer_ids)
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d")
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    feats = torch.randn(1, 5, drafter.feature_size)
    block = torch.randn(1, 6, 64)
    k, v = drafter.empty_cache()
    assert torch.equal(drafter(feats, block, k, v)[0], loaded(feats, block, k, v)[0])


def test_loads_published_layout_with_extras(tmp_path):
    """A config as z-lab publishes it (auto_map, block_size only inside dflash_config, sharded weights)."""
    target = make_tiny_target(vocab_size=64, layers=4)
    drafter = make_tiny_drafter(target.config, layers=2, block_size=4)
    raw = tiny_drafter_config(target.config, layers=2, block_size=4)
    del raw["block_size"]
    raw["dflash_config"]["block_size"] = 4
    raw["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}  # remote code we must not need
    raw["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    state = drafter.state_dict()
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: state[k].to(torch.bfloat16).contiguous() for k in ks}, str(tmp_path / fname))
        weight_map.update({k: fname for k in ks})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.spec.block_size == 4
    assert loaded.fc.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.fc.weight, state["fc.weight"].to(torch.bfloat16).float())


def test_missing_weight_is_named(tmp_path):
    target = make_tiny_target(vocab_size=64, layers=4)
    make_tiny_drafter(target.config, tmp_path, layers=2)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["hidden_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="hidden_norm.weight"):
        DFlashDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda c: c.update(hidden_size=32, head_dim=8), "hidden_size"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 7]), "target_layer_ids"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3]), "target_layer_ids"),  # last layer: normed in HF
        (lambda c: c.update(block_size=1), "block_size"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c["dflash_config"].update(mask_token_id=500), "mask_token_id"),
        (lambda c: c.update(num_target_layers=9), "num_target_layers"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(tmp_path, mutate, field):
    target = make_tiny_target(vocab_size=64, layers=4)
    raw = tiny_drafter_config(target.config, layers=2)
    mutate(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=field):
        config, spec = load_drafter_config(tmp_path)
        validate_against_target(config, spec, target.config)


def naive_drafter_forward(d: DFlashDrafter, features, block_embeds, start: int):
    """A from-scratch reading of the method: per layer K/V = [k(ctx); k(block)] with the SAME
    projections, queries from the block only, no mask, RoPE at absolute positions."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    ctx = d.hidden_norm(d.fc(features))[0]
    x = block_embeds[0]
    n, b = ctx.shape[0], x.shape[0]
    pos = torch.arange(start, start + n + b)
    cos, sin = d.rotary_emb(x[None], pos[None])
    cos, sin = cos[0], sin[0]
    for layer in d.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        kv_in = torch.cat([ctx, h])  # context features enter only through k_proj / v_proj
        q = a.q_norm(a.q_proj(h).view(b, a.n_heads, a.head_dim))
        k = a.k_norm(a.k_proj(kv_in).view(n + b, a.n_kv_heads, a.head_dim))
        v = a.v_proj(kv_in).view(n + b, a.n_kv_heads, a.head_dim)
        q = q * cos[n:, None] + rotate_half(q) * sin[n:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        rep = a.n_heads // a.n_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / a.head_dim**0.5
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(b, -1)
        x = x + a.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return d.norm(x)


def test_drafter_matches_method_and_cache_is_exact():
    torch.manual_seed(0)
    target = make_tiny_target(vocab_size=64, layers=6)
    d = make_tiny_drafter(target.config, layers=3, block_size=8)
    feats = torch.randn(1, 13, d.feature_size)
    block = torch.randn(1, 8, 64)
    k, v = d.empty_cache()
    with torch.no_grad():
        full, k_all, v_all = d(feats, block, k, v)
        torch.testing.assert_close(full[0], naive_drafter_forward(d, feats, block, 0), atol=1e-5, rtol=1e-5)
        # feeding the context in three pieces through the cache gives the same block output
        k, v = d.empty_cache()
        for lo, hi in [(0, 4), (4, 9)]:
            _, k, v = d(feats[:, lo:hi], block, k, v)
        inc, k2, v2 = d(feats[:, 9:], block, k, v)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k2, k_all, atol=1e-5, rtol=1e-5)
    assert k_all.shape == (3, 1, d.n_kv_heads, 13, d.head_dim)  # the cache holds context only


def test_block_attention_is_not_causal():
    """Changing the LAST block token changes the output at the FIRST position (non-causal)."""
    target = make_tiny_target(vocab_size=64, layers=4)
    d = make_tiny_drafter(target.config, layers=1, block_size=4)
    feats = torch.randn(1, 3, d.feature_size)
    block = torch.randn(1, 4, 64)
    other = block.clone()
    other[0, -1] += 1.0
    k, v = d.empty_cache()
    with torch.no_grad():
        a, b = d(feats, block, k, v)[0], d(feats, other, k, v)[0]
    assert not torch.allclose(a[0, 0], b[0, 0])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_features_are_outputs_of_the_named_layers(family):
    """Feature for layer id i == output of decoder layer i (hidden_states[i + 1]), checked with hooks."""
    model = make_tiny_target(family=family, vocab_size=64, layers=5)
    captured = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o, idx=idx: captured.__setitem__(idx, o[0] if isinstance(o, tuple) else o)
        )
        for idx, layer in enumerate(model.model.layers)
    ]
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    feats = extract_features(out.hidden_states, [0, 2, 3])
    torch.testing.assert_close(feats, torch.cat([captured[0], captured[2], captured[3]], -1))


def test_target_session_rollback_restores_state():
    model = make_tiny_target(vocab_size=64, layers=4)
    engine = TorchTargetEngine(model, (1, 2))
    session = engine.new_session()
    a, b = session.add_row(), session.add_row()
    session.forward([a], [torch.tensor([1, 2, 3, 4])])
    session.forward([a], [torch.tensor([9, 9, 9])])  # rejected drafts
    session.rollback(a, 4)
    assert session.length(a) == 4
    session.forward([b], [torch.tensor([1, 2, 3, 4])])
    [out_a] = session.forward([a], [torch.tensor([5, 6])])
    [out_b] = session.forward([b], [torch.tensor([5, 6])])
    torch.testing.assert_close(out_a.logits, out_b.logits)
    torch.testing.assert_close(out_a.features, out_b.features)
    assert out_a.features.shape == (2, 2 * 64)


def test_drafter_uses_target_embedding_and_lm_head():
    model = make_tiny_target(vocab_size=64, layers=4)
    d = make_tiny_drafter(model.config, layers=1, block_size=4)
    target = TorchTargetEngine(model, d.spec.target_layer_ids)
    engine = TorchDrafterEngine.for_target(d, target)
    assert engine.embed_weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    session = engine.new_session()
    row = session.add_row()
    feats = torch.randn(3, d.feature_size)
    [draft] = session.draft([DraftRequest(row, feats, last_token=5, block_size=4)])
    assert session.context_length(row) == 3
    assert draft.logits.shape == (3, 64) and torch.equal(draft.tokens, draft.logits.argmax(-1))
    # by hand: [5, MASK, MASK, MASK] embedded with the target's table, logits through its lm_head
    ids = torch.tensor([[5] + [d.spec.mask_token_id] * 3])
    k, v = d.empty_cache()
    with torch.no_grad():
        hidden = d(feats[None], F.embedding(ids, model.get_input_embeddings().weight), k, v)[0]
        expected = hidden[0, 1:] @ model.lm_head.weight.T
    torch.testing.assert_close(draft.logits, expected)


@pytest.mark.parametrize("mask_dims", [None, 2, 4])
def test_grouped_query_attention_matches_per_head_copies(mask_dims):
    """Folding the query heads that share a KV head into the query axis (no K/V copies) gives
    the same attention as copying K/V per head, with and without a visibility mask."""
    from tiny_models import tiny_drafter_config

    from dflash_trt.config import drafter_config_from_dict
    from dflash_trt.models.drafter import DFlashAttention

    target = make_tiny_target(vocab_size=64, layers=4)
    config, _ = drafter_config_from_dict(tiny_drafter_config(target.config, layers=1))
    attn = DFlashAttention(config, 0)
    torch.manual_seed(0)
    b, n, t = 1, 5, 7
    x = torch.randn(b, n, 64)
    ctx_k, ctx_v = torch.randn(b, attn.n_kv_heads, t, attn.head_dim), torch.randn(b, attn.n_kv_heads, t, attn.head_dim)
    cos, sin = torch.randn(b, n, attn.head_dim), torch.randn(b, n, attn.head_dim)
    mask = None
    if mask_dims:
        mask = torch.rand(n, t + n) > 0.3
        mask[:, 0] = True  # every query sees something
        if mask_dims == 4:
            mask = mask[None, None]
    with torch.no_grad():
        got = attn(x, ctx_k, ctx_v, cos, sin, mask)
        # reference: K/V copied per query head
        from dflash_trt.models.drafter import _rope

        q = _rope(attn.q_norm(attn.q_proj(x).view(b, n, attn.n_heads, attn.head_dim)).transpose(1, 2), cos, sin)
        k_blk, v_blk = attn.project_kv(x, cos, sin)
        g = attn.n_heads // attn.n_kv_heads
        k = torch.cat([ctx_k, k_blk], 2).repeat_interleave(g, 1)
        v = torch.cat([ctx_v, v_blk], 2).repeat_interleave(g, 1)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ref = attn.o_proj(ref.transpose(1, 2).reshape(b, n, -1))
    assert attn.n_heads > attn.n_kv_heads
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
