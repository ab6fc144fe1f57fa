"""How the PyTorch engines call scaled_dot_product_attention (models/attention.py): never a mask together with
enable_gqa (PyTorch's fused kernels: flash takes no mask, the memory-efficient kernel has grouped heads compiled
out on ROCm), no dense mask where a pass needs none, and the same results as the old formulation (a dense
boolean mask with enable_gqa on every pass)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.models.attention import grouped_attention
from dflash_trt.runtime.base import DraftRequest
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

REAL_SDPA = F.scaled_dot_product_attention


@pytest.fixture
def calls(monkeypatch):
    """Every SDPA call: (mask given, enable_gqa, is_causal, query heads, key heads)."""
    seen: list[tuple[bool, bool, bool, int, int]] = []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append((attn_mask is not None, enable_gqa, is_causal, q.shape[1], k.shape[1]))
        return REAL_SDPA(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def old_formulation(q, k, v, visible):
    return REAL_SDPA(q, k, v, attn_mask=visible, enable_gqa=True)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_grouped_attention_equals_the_dense_masked_gqa_call(kv_heads):
    g = torch.Generator().manual_seed(kv_heads)
    b, heads, n, s, d = 3, 8, 5, 11, 16
    q = torch.randn(b, heads, n, d, generator=g)
    k, v = torch.randn(b, kv_heads, s, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g)
    ends = torch.tensor([11, 7, 9])  # ragged rows: row r's query i sees keys < ends[r] - n + i + 1
    q_pos = ends[:, None] - n + torch.arange(n)[None, :]
    visible = (torch.arange(s)[None, None, :] <= q_pos[:, :, None])[:, None]  # [b, 1, n, s]
    torch.testing.assert_close(grouped_attention(q, k, v, mask=visible), old_formulation(q, k, v, visible))
    everything = torch.ones(b, 1, n, s, dtype=torch.bool)
    torch.testing.assert_close(grouped_attention(q, k, v), old_formulation(q, k, v, everything))
    square_q = torch.randn(b, heads, s, d, generator=g)
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(
        grouped_attention(square_q, k, v, causal=True), old_formulation(square_q, k, v, causal), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="square"):
        grouped_attention(q, k, v, causal=True)


def test_target_passes_call_sdpa_the_way_fused_kernels_accept(calls):
    model = make_tiny_target(None, vocab_size=64, layers=2, hidden=64, num_attention_heads=8, num_key_value_heads=2)
    engine = TorchTargetEngine(model, (0, 1))
    sess = engine.new_session()
    rows = [sess.add_row(), sess.add_row()]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (6,), generator=g) for _ in rows]
    outs = sess.forward(rows, prompts)  # a prefill of rows of one length from 0: square causal
    assert calls and all(c == (False, True, True, 8, 2) for c in calls)
    calls.clear()
    step = [o.logits[-1].argmax().view(1) for o in outs]
    stepped = sess.forward(rows, step)  # one token per row at one length: sees every key, no mask, no gqa flag
    assert calls and all(c == (False, False, False, 2, 2) for c in calls)  # 4 query heads folded per KV head
    calls.clear()
    sess.forward(rows, [torch.randint(0, 64, (4,), generator=g) for _ in rows])  # a verify pass: masked, folded
    assert calls and all(c == (True, False, False, 2, 2) for c in calls)
    assert not any(mask and gqa for mask, gqa, *_ in calls)
    # the unmasked passes give what the Hugging Face forward gives (its own attention over the whole sequence)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.cat([prompt, step[i]])[None]).logits[0]
        torch.testing.assert_close(outs[i].logits, ref[:-1].float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(stepped[i].logits[-1], ref[-1].float(), atol=1e-4, rtol=1e-4)


def test_drafter_round_of_rows_at_one_length_needs_no_mask(calls):
    model = make_tiny_target(None, vocab_size=64, layers=2, hidden=64, num_attention_heads=8, num_key_value_heads=2)
    drafter = make_tiny_drafter(model.config, None, layers=1, block_size=4)
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    engine = TorchDrafterEngine.for_target(drafter, target)
    g = torch.Generator().manual_seed(1)
    width = len(drafter.spec.target_layer_ids) * 64

    def round_(even: bool):
        sess = engine.new_session()
        rows = [sess.add_row(), sess.add_row()]
        feats = [torch.randn(5 if even else 3 + 2 * i, width, generator=g) for i in range(2)]
        calls.clear()
        return sess.draft([DraftRequest(r, f, 7, 4) for r, f in zip(rows, feats)]), feats

    drafts, feats = round_(even=True)
    assert calls and all(not mask and not gqa for mask, gqa, *_ in calls)  # equal rows: no mask at all
    ragged, _ = round_(even=False)
    assert calls and all(mask and not gqa for mask, gqa, *_ in calls)  # ragged rows: a mask, the heads folded
    # the unmasked round equals each row drafted alone (the single-row forward)
    for i, f in enumerate(feats):
        alone = engine.new_session()
        r = alone.add_row()
        one = alone.draft([DraftRequest(r, f, 7, 4)])[0]
        torch.testing.assert_close(drafts[i].logits, one.logits, atol=1e-4, rtol=1e-4)
