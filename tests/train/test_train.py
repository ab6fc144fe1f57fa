"""Drafter training: block-sparse mask, loss weights, blocks, and that a step actually learns."""

import math

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_target

from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.train.blocks import block_sparse_mask, build_blocks, position_weights, sample_anchors
from dflash_trt.train.checkpoints import new_drafter_for
from dflash_trt.train.drafter import train_drafter
from dflash_trt.train.drafter_config import DrafterTrainConfig
from dflash_trt.train.loss import drafter_loss


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
    # every position with context before it and at least one label after it
    assert anchors.tolist() == list(range(1, 19))
    ids, pos, labels, valid = build_blocks(tokens, torch.tensor([3, 10]), 4, mask_token_id=1)
    assert ids.tolist() == [103, 1, 1, 1, 110, 1, 1, 1]
    assert pos.tolist() == [3, 4, 5, 6, 10, 11, 12, 13]
    assert labels.tolist() == [[104, 105, 106], [111, 112, 113]]
    assert valid.all()


def test_anchors_and_labels_only_in_the_response():
    """The prompt is context only: anchors start at the first response token, labels past the end are masked."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = sample_anchors(30, 8, 10, gen, start=12)
        assert len(a) == 10 and a.min() >= 12 and a.max() <= 28 and len(set(a.tolist())) == 10
    tokens = torch.arange(100, 130)
    _, _, labels, valid = build_blocks(tokens, torch.tensor([12, 26]), 8, mask_token_id=1, length=30)
    assert valid[0].all()
    assert valid[1].tolist() == [True, True, True, False, False, False, False]  # 27, 28, 29 exist
    assert labels[1, :3].tolist() == [127, 128, 129]
    assert len(sample_anchors(13, 8, 10, gen, start=12)) == 0  # a response of one token: nothing to predict


def test_packed_forward_equals_inference_forward():
    """One block of the packed training pass == the same block drafted at inference time."""
    target = make_tiny_target(vocab_size=64, layers=6)
    cfg = DrafterTrainConfig(block_size=4, num_layers=2)
    d = new_drafter_for(target, cfg, mask_token_id=63).eval()
    feats = torch.randn(1, 20, d.feature_size)
    anchors = torch.tensor([5, 11])
    ids, pos, _, _ = build_blocks(torch.randint(0, 60, (20,)), anchors, 4, 63)
    emb = torch.randn(1, 8, 64)
    with torch.no_grad():
        packed = d.forward_packed(feats, emb, pos[None], anchors[None])
        k, v = d.empty_cache()
        for j, a in enumerate(anchors.tolist()):
            single = d(feats[:, :a], emb[:, 4 * j : 4 * j + 4], k, v)[0]
            torch.testing.assert_close(packed[:, 4 * j : 4 * j + 4], single, atol=1e-5, rtol=1e-5)


def test_block_sparse_attention_equals_the_dense_mask():
    """Blocks attend without the dense [m*B, S + m*B] mask, yet give the dense computation's output and
    gradients (GQA target shape: 4 query heads on 2 KV heads; several sequences, different anchors)."""
    target = make_tiny_target(vocab_size=64, layers=6)
    cfg = DrafterTrainConfig(block_size=4, num_layers=2)
    d = new_drafter_for(target, cfg, mask_token_id=63)
    S, B = 24, 4
    anchors = torch.tensor([[3, 9, 17, 20], [1, 2, 12, 22]])
    feats = torch.randn(2, S, d.feature_size)
    pos = anchors[:, :, None] + torch.arange(B)
    emb = torch.randn(2, 4 * B, 64, requires_grad=True)
    dense_mask = torch.stack([block_sparse_mask(a, B, S) for a in anchors])[:, None]
    sparse = d.forward_packed(feats, emb, pos.reshape(2, -1), anchors)
    dense = d.forward_packed_dense(feats, emb, pos.reshape(2, -1), dense_mask)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    g_sparse = torch.autograd.grad(sparse.square().sum(), [emb, d.fc.weight])
    g_dense = torch.autograd.grad(dense.square().sum(), [emb, d.fc.weight])
    for a, b in zip(g_sparse, g_dense):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_training_steps_reduce_loss_on_a_fixed_batch(tmp_path):
    target = make_tiny_target(vocab_size=64, layers=4, seed=1)
    cfg = DrafterTrainConfig(
        block_size=4,
        num_layers=1,
        steps=30,
        batch_size=2,
        seq_len=32,
        anchors_per_seq=6,
        lr=3e-3,
        warmup_ratio=0.1,
        save_every=15,
        bf16=False,
        kd_weight=0.3,
        init_norm_scale=1.0,
    )  # a random target's norm is 1: no overconfidence to temper
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


def _regen_set(seed=1, n=3, vocab=60):
    from dflash_trt.train.regen import SequenceSet

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(14, 30, (n,), generator=g).tolist()
    seqs = [torch.randint(0, vocab, (L,), generator=g).numpy().astype(np.uint16) for L in lengths]
    return SequenceSet.from_arrays(
        np.concatenate(seqs), lengths, [5 + i for i in range(n)], [f"p{i}" for i in range(n)]
    )


def test_target_features_stop_at_the_deepest_layer_and_match_hidden_states():
    from dflash_trt.train.features import target_hidden

    target = make_tiny_target(vocab_size=64, layers=6, seed=2)
    tokens = torch.randint(0, 60, (2, 12))
    with torch.no_grad():
        full = target(input_ids=tokens, output_hidden_states=True)
    calls = []
    hook = target.model.layers[5].register_forward_hook(lambda *a: calls.append(1))
    feats, teacher = target_hidden(target, tokens, [1, 3])
    assert calls == [] and teacher is None  # layers past the deepest feature layer never ran
    torch.testing.assert_close(feats, torch.cat([full.hidden_states[2], full.hidden_states[4]], -1))
    feats, teacher = target_hidden(target, tokens, [1, 5], teacher=True)
    hook.remove()
    torch.testing.assert_close(feats[..., 64:], full.hidden_states[6])  # last layer: the normed output, as HF
    torch.testing.assert_close(target.lm_head(teacher), full.logits, atol=1e-5, rtol=1e-5)


def test_feature_cache_extends_when_more_sequences_are_regenerated(tmp_path):
    """Regenerating more prompts appends shards: the cache keeps what it holds and computes only the new
    sequences; any other change (here: the first sequences differ) rebuilds it."""
    from dflash_trt.train.features import FeatureCache
    from dflash_trt.train.regen import SequenceSet

    target = make_tiny_target(vocab_size=64, layers=4, seed=2)
    first, more = _regen_set(), _regen_set(n=2, seed=9)
    both = SequenceSet.from_arrays(
        np.concatenate([first.tokens, more.tokens]),
        [*first.lengths.tolist(), *more.lengths.tolist()],
        [*first.prompt_lens.tolist(), *more.prompt_lens.tolist()],
        [*first.ids, "q0", "q1"],
    )

    def cache(data, folder="c"):
        return FeatureCache(tmp_path / folder, data, (1, 3), 64 * 2, 64, True).open_or_build(target, batch_tokens=40)

    old = np.array(cache(first).features)
    calls = []
    hook = target.model.layers[0].register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    grown = cache(both)
    hook.remove()
    assert grown.meta["done"] == 5 and sum(calls) == 2  # only the two new sequences went through the target
    n_old = int(first.offsets[-1])
    assert np.array_equal(np.array(grown.features[:n_old]), old)
    fresh = cache(both, "fresh")
    np.testing.assert_allclose(
        np.array(grown.features, dtype=np.float32), np.array(fresh.features, dtype=np.float32), atol=2e-3, rtol=2e-3
    )
    np.testing.assert_allclose(
        np.array(grown.teacher, dtype=np.float32), np.array(fresh.teacher, dtype=np.float32), atol=2e-3, rtol=2e-3
    )
    calls.clear()
    hook = target.model.layers[0].register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    cache(
        SequenceSet.from_arrays(both.tokens, both.lengths.tolist(), both.prompt_lens.tolist(), ["x", *both.ids[1:]])
    )  # a different first sequence: rebuilt from scratch
    hook.remove()
    assert sum(calls) == 5


def test_feature_cache_is_written_once_and_gives_the_same_loss(tmp_path):
    from dflash_trt.train.blocks import pad_batch
    from dflash_trt.train.features import FeatureCache

    target = make_tiny_target(vocab_size=64, layers=4, seed=2)
    cfg = DrafterTrainConfig(block_size=4, num_layers=1, anchors_per_seq=5, bf16=False, kd_weight=0.5)
    drafter = new_drafter_for(target, cfg, mask_token_id=63)
    data = _regen_set()
    cache = FeatureCache(tmp_path / "c", data, drafter.spec.target_layer_ids, drafter.feature_size, 64, True)
    cache.open_or_build(target, batch_tokens=40)
    assert (
        cache.meta["done"] == 3
        and (tmp_path / "c" / "features.f16").stat().st_size == data.offsets[-1] * drafter.feature_size * 2
    )
    mtime = (tmp_path / "c" / "features.f16").stat().st_mtime_ns
    again = FeatureCache(tmp_path / "c", data, drafter.spec.target_layer_ids, drafter.feature_size, 64, True)
    again.open_or_build(target)
    assert (tmp_path / "c" / "features.f16").stat().st_mtime_ns == mtime  # not recomputed
    seqs = [data.sequence(k) for k in range(3)]
    batch = pad_batch(seqs, data.prompt_lens.tolist())
    feats = torch.zeros(3, batch.tokens.shape[1], drafter.feature_size)
    teacher = torch.zeros(3, batch.tokens.shape[1], 64)
    for k in range(3):
        f, t = again.get(k)
        feats[k, : len(seqs[k])] = torch.from_numpy(f.astype(np.float32))
        teacher[k, : len(seqs[k])] = torch.from_numpy(t.astype(np.float32))
    with torch.no_grad():
        kw = dict(lengths=batch.lengths, prompt_lens=batch.prompt_lens)
        a = drafter_loss(drafter, target, batch.tokens, cfg, torch.Generator().manual_seed(5), **kw)[0]
        b = drafter_loss(
            drafter, target, batch.tokens, cfg, torch.Generator().manual_seed(5), features=feats, teacher=teacher, **kw
        )[0]
    torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)  # fp16 storage


def test_unwritable_feature_cache_says_so_loudly(tmp_path, capsys):
    from dflash_trt.train.features import open_feature_cache

    target = make_tiny_target(vocab_size=64, layers=4, seed=2)
    drafter = new_drafter_for(target, DrafterTrainConfig(block_size=4, num_layers=1), mask_token_id=63)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert open_feature_cache(blocker / "cache", _regen_set(), drafter, target, teacher=False) is None
    assert "WARNING: feature cache" in capsys.readouterr().err


def test_chunked_loss_equals_the_full_logits_loss():
    """Chunked lm_head + CE + KD (teacher at the used positions only) == the plain full-vocabulary formula."""
    from dflash_trt.train.loss import chunked_loss

    target = make_tiny_target(vocab_size=64, layers=4, seed=3)
    drafter = new_drafter_for(target, DrafterTrainConfig(block_size=4, num_layers=1), mask_token_id=63)
    W = target.lm_head.weight
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 64, generator=g, requires_grad=True)
    teacher = torch.randn(37, 64, generator=g)
    labels = torch.randint(0, 64, (37,), generator=g)
    weights = torch.rand(37, generator=g)
    for kd in (0.0, 0.4):
        cfg = DrafterTrainConfig(kd_weight=kd, kd_temperature=1.5, loss_chunk_rows=8, bf16=False)
        with torch.enable_grad():
            total, correct = chunked_loss(hidden, labels, weights, teacher, W, drafter, cfg)
            (grad,) = torch.autograd.grad(total, hidden)
            logits = hidden @ W.T
            ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            t = torch.log_softmax(teacher @ W.T / 1.5, -1)
            s = torch.log_softmax(logits / 1.5, -1)
            kl = (t.exp() * (t - s)).sum(-1) * 1.5**2
            ref = (((1 - kd) * ce + kd * kl) * weights).sum()
            (ref_grad,) = torch.autograd.grad(ref, hidden)
        torch.testing.assert_close(total, ref)
        torch.testing.assert_close(grad, ref_grad)
        assert correct.tolist() == (logits.argmax(-1) == labels).tolist()


def test_drafter_config_carries_rope_theta_at_the_top_level(tmp_path):
    import json

    from tiny_models import tiny_target_config
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_config(
        tiny_target_config(
            "llama", vocab_size=64, layers=4, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}
        )
    )
    drafter = new_drafter_for(target, DrafterTrainConfig(block_size=4, num_layers=1), mask_token_id=63)
    drafter.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0 and raw["rope_parameters"]["rope_theta"] == 100000.0
    assert DFlashDrafter.from_pretrained(tmp_path).config.rope_parameters["rope_theta"] == 100000.0


def test_lm_training_resumes_where_it_stopped(tmp_path, monkeypatch):
    """A run killed after its step-4 checkpoint and resumed ends with the same weights as one run
    straight through: weights, optimizer, schedule and the data stream are all restored."""
    import dflash_trt.train.lm as lm

    tokens = np.random.default_rng(0).integers(0, 60, 4000).astype(np.uint16)
    cfg = lm.LMTrainConfig(steps=8, batch_size=2, seq_len=16, eval_every=2, eval_batches=1, bf16=False)
    straight = make_tiny_target()
    lm.train_lm(straight, tokens, tokens, cfg)

    real, calls = lm.held_out_loss, []

    def killed_at_third_evaluation(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # step 6, before its checkpoint: the step-4 one is the last
        return real(*args)

    monkeypatch.setattr(lm, "held_out_loss", killed_at_third_evaluation)
    try:
        lm.train_lm(make_tiny_target(), tokens, tokens, cfg, checkpoint_dir=tmp_path)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(lm, "held_out_loss", real)
    resumed = make_tiny_target()
    report = lm.train_lm(resumed, tokens, tokens, cfg, checkpoint_dir=tmp_path)
    assert report.steps == 8 and [h["step"] for h in report.history] == [2, 4, 6, 8]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(ValueError, match="other settings"):  # another schedule never resumes this one
        lm.train_lm(
            make_tiny_target(), tokens, tokens, lm.LMTrainConfig(**{**vars(cfg), "steps": 9}), checkpoint_dir=tmp_path
        )
    # a budget the checkpoint has already spent: the saved weights and report, no step more
    spent = lm.train_lm(
        make_tiny_target(),
        tokens,
        tokens,
        lm.LMTrainConfig(**{**vars(cfg), "time_budget_s": 1e-9}),
        checkpoint_dir=tmp_path,
    )
    assert (
        spent.steps == 8 and spent.history == report.history and spent.seconds >= report.history[-1]["seconds"] - 0.05
    )


def test_training_device_auto_follows_torch_and_refuses_a_missing_gpu(monkeypatch):
    from dflash_trt.train.common import training_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device("auto") == "cpu"
    assert training_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="no CUDA GPU"):
        training_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        training_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_device("auto") == "cuda"


def test_the_drafter_trains_where_the_target_lives(tmp_path):
    """train_drafter moves the drafter to the target's device (a GPU run moves only the target), and the
    loss draws its blocks from the CPU generator wherever it runs: the same blocks, the same loss."""
    target = make_tiny_target(vocab_size=64, layers=4, seed=1)
    cfg = DrafterTrainConfig(
        block_size=4, num_layers=1, steps=1, batch_size=2, seq_len=32, anchors_per_seq=4, bf16=False
    )
    drafter = new_drafter_for(target, cfg, mask_token_id=63)
    seen = []
    drafter.to = lambda device: seen.append(torch.device(device)) or drafter  # records the move (CPU only here)
    train_drafter(drafter, target, torch.randint(0, 60, (2, 32)).numpy(), tmp_path, cfg)
    assert seen == [target.device]
