"""Drafter training: block-sparse mask, loss weights, blocks, and that a step actually learns."""

import math

import numpy as np
import torch
from tiny_models import make_tiny_target

from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.train.drafter import (
    DrafterTrainConfig,
    block_sparse_mask,
    build_blocks,
    drafter_loss,
    new_drafter_for,
    position_weights,
    sample_anchors,
    train_drafter,
)


def test_mask_is_block_sparse():
    anchors = torch.tensor([2, 5, 9])
    B, S = 4, 12
    mask = block_sparse_mask(anchors, B, S)
    assert mask.shape == (3 * B, S + 3 * B)
    for j, a in enumerate(anchors.tolist()):
        for q in range(j * B, (j + 1) * B):
            # context: exactly the prefix before the anchor
            assert mask[q, :S].tolist() == [k < a for k in range(S)]
            # blocks: bidirectional inside its own block, nothing of the others
            own = [S + j * B + i for i in range(B)]
            assert all(mask[q, k] for k in own)
            assert not any(mask[q, k] for k in range(S, S + 3 * B) if k not in own)


def test_loss_weights_decay_as_specified():
    w = position_weights(16, gamma=7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    for k in range(1, 16):
        assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)
    assert torch.all(w[1:] < w[:-1])


def test_blocks_and_anchors():
    tokens = torch.arange(100, 120)
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(20, 4, 50, gen)
    assert len(anchors) == 16 and anchors.min() >= 1 and anchors.max() <= 16 and len(set(anchors.tolist())) == 16
    ids, pos, labels = build_blocks(tokens, torch.tensor([3, 10]), 4, mask_token_id=1)
    assert ids.tolist() == [103, 1, 1, 1, 110, 1, 1, 1]
    assert pos.tolist() == [3, 4, 5, 6, 10, 11, 12, 13]
    assert labels.tolist() == [[104, 105, 106], [111, 112, 113]]


def test_packed_forward_equals_inference_forward():
    """One block of the packed training pass == the same block drafted at inference time."""
    target = make_tiny_target(vocab_size=64, layers=6)
    cfg = DrafterTrainConfig(block_size=4, num_layers=2)
    d = new_drafter_for(target, cfg, mask_token_id=63).eval()
    feats = torch.randn(1, 20, d.feature_size)
    anchors = torch.tensor([5, 11])
    ids, pos, _ = build_blocks(torch.randint(0, 60, (20,)), anchors, 4, 63)
    emb = torch.randn(1, 8, 64)
    mask = block_sparse_mask(anchors, 4, 20)[None, None]
    with torch.no_grad():
        packed = d.forward_packed(feats, emb, pos[None], mask)
        k, v = d.empty_cache()
        single = d(feats[:, :11], emb[:, 4:], k, v)[0]
    torch.testing.assert_close(packed[:, 4:], single, atol=1e-5, rtol=1e-5)


def test_training_steps_reduce_loss_on_a_fixed_batch(tmp_path):
    target = make_tiny_target(vocab_size=64, layers=4, seed=1)
    cfg = DrafterTrainConfig(block_size=4, num_layers=1, steps=30, batch_size=2, seq_len=32, anchors_per_seq=6,
                             lr=3e-3, warmup_ratio=0.1, save_every=15, bf16=False, kd_weight=0.3)
    drafter = new_drafter_for(target, cfg, mask_token_id=63)
    fixed = torch.randint(0, 60, (1, 32), generator=torch.Generator().manual_seed(3)).repeat(2, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        before = float(drafter_loss(drafter, target, fixed, cfg, g)[0])
    summary = train_drafter(drafter, target, fixed.numpy(), tmp_path, cfg)
    with torch.no_grad():
        after = float(drafter_loss(drafter, target, fixed, cfg, torch.Generator().manual_seed(0))[0])
    assert after < before * 0.9, (before, after)
    assert summary["history"][-1]["step"] == 30
    # the frozen target did not move, the checkpoint reloads in the published format
    assert all(not p.requires_grad for p in target.parameters())
    reloaded = DFlashDrafter.from_pretrained(tmp_path)
    torch.testing.assert_close(reloaded.fc.weight, drafter.fc.weight)
    # resume continues from the saved step
    cfg2 = DrafterTrainConfig(**{**cfg.__dict__, "steps": 35})
    summary2 = train_drafter(reloaded, target, fixed.numpy(), tmp_path, cfg2, resume=True)
    assert summary2["history"][-1]["step"] == 35 and len(summary2["history"]) == 3


def test_precomputed_features_give_the_same_loss():
    from dflash_trt.train.drafter import _precompute_features

    target = make_tiny_target(vocab_size=64, layers=4, seed=2)
    cfg = DrafterTrainConfig(block_size=4, num_layers=1, seq_len=24, anchors_per_seq=5, bf16=False)
    drafter = new_drafter_for(target, cfg, mask_token_id=63)
    seqs = torch.randint(0, 60, (3, 24), generator=torch.Generator().manual_seed(1))
    cached = _precompute_features(drafter, target, seqs, cfg)
    assert cached is not None and cached.shape == (3, 24, drafter.feature_size)
    with torch.no_grad():
        a = drafter_loss(drafter, target, seqs, cfg, torch.Generator().manual_seed(5))[0]
        b = drafter_loss(drafter, target, seqs, cfg, torch.Generator().manual_seed(5), features=cached.float())[0]
    torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)  # fp16 storage of the features
