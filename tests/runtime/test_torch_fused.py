"""The PyTorch target's fused layer plan (runtime/torch_backend.py `_Layer`) computes what the Hugging Face
modules compute, to the bit in float32: one F.rms_norm per norm, one GEMM for q/k/v and one for gate/up."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_trt.runtime.torch_backend import TorchTargetEngine, _Layer, _norm

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def _model(kind: str, **extra):
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SMALL, **extra)).eval()
    return LlamaForCausalLM(LlamaConfig(**SMALL, **extra)).eval()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("tokens", [1, 9, 72])
def test_layer_plan_equals_the_modules_bit_for_bit(kind, tokens):
    model = _model(kind, attention_bias=kind == "llama")
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = torch.randn(1, tokens, SMALL["hidden_size"]) * 3
    with torch.no_grad():
        h = layer.input_layernorm(x)
        want_qkv = [attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)]
        want_mlp = mlp(layer.post_attention_layernorm(x))
        plan = _Layer.of(layer)  # rebinds the modules' weights as views of the fused matrices
        assert torch.equal(plan.norm_in(x), h)
        got = torch.nn.functional.linear(h, *plan.qkv).split(plan.qkv_sizes, dim=-1)
        for g, w in zip(got, want_qkv):
            assert torch.equal(g, w)
        assert torch.equal(plan.mlp_of(plan.norm_post(x)), want_mlp)
        # the modules still compute what they did: their weights are the fused matrix's rows
        assert torch.equal(attn.k_proj(h), want_qkv[1])
        assert attn.q_proj.weight.data_ptr() == plan.qkv[0].data_ptr()


def test_norm_is_one_op_only_where_exact():
    model = _model("qwen3")
    norm = model.model.norm
    assert _norm(norm) is not norm
    assert _norm(norm.to(torch.bfloat16)) is norm  # half precision: the module's own casts, not F.rms_norm's

    class OtherNorm(torch.nn.Module):  # a family whose norm is not exactly rms_norm (e.g. Gemma's 1 + weight)
        weight = torch.nn.Parameter(torch.ones(4))
        variance_epsilon = 1e-6

    other = OtherNorm()
    assert _norm(other) is other


def test_engine_logits_unchanged_by_the_plan():
    """The engine's pass against the Hugging Face forward of the same model: the plan changes no logit beyond
    what the engine's own attention already differs by (allclose, argmax equal)."""
    model = _model("qwen3")
    ids = torch.randint(0, SMALL["vocab_size"], (20,))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    engine = TorchTargetEngine(model)
    session = engine.new_session()
    row = session.add_row()
    out = session.forward([row], [ids], features=False)[0]
    assert torch.allclose(out.logits, want, atol=1e-5, rtol=1e-5)
    assert out.argmax() == want.argmax(-1).tolist()
