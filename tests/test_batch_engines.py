"""Batched engine sessions: every row of a batched pass equals the same row run alone (single-sequence
sessions as the reference), per-row rollbacks, rows joining and leaving."""

import pytest
import torch

from dflash_trt.runtime.batched import BatchDrafterSession, BatchTargetSession, DraftRequest
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from dflash_trt.runtime.torch_batch import TorchBatchDrafterEngine, TorchBatchTargetEngine

ATOL = 1e-4


def engines(model, drafter):
    layers = drafter.spec.target_layer_ids
    single = TorchTargetEngine(model, layers)
    batch = TorchBatchTargetEngine(model, layers)
    return single, batch


def ids(rng, n, vocab=95):
    return torch.randint(0, vocab, (n,), generator=rng)


def check_same(out, ref, what):
    assert out.logits.shape == ref.logits.shape, what
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=1e-4, msg=what)
    if ref.features is not None:
        torch.testing.assert_close(out.features, ref.features, atol=ATOL, rtol=1e-4, msg=what)


def test_batched_target_rows_equal_rows_alone_with_rollbacks(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    single, batch = engines(model, drafter)
    rng = torch.Generator().manual_seed(0)
    sess = batch.new_batch()
    assert isinstance(sess, BatchTargetSession)
    rows = [sess.add_row() for _ in range(3)]
    refs = {r: single.new_session() for r in rows}
    # prefill: three prompts of different lengths in one pass
    prompts = [ids(rng, n) for n in (5, 17, 9)]
    outs = sess.forward(rows, prompts)
    for r, p, o in zip(rows, prompts, outs):
        check_same(o, refs[r].forward(p), (family, "prefill", r))
        assert sess.length(r) == len(p)
    # verify-like steps: ragged blocks, then each row rolls back by its own amount
    for step in range(4):
        blocks = [ids(rng, n) for n in ((1, 8, 3), (4, 2, 6), (8, 8, 1), (2, 5, 7))[step]]
        outs = sess.forward(rows, blocks)
        for r, blk, o in zip(rows, blocks, outs):
            ref = refs[r].forward(blk)
            check_same(o, ref, (family, step, r))
            keep = int(torch.randint(0, len(blk) + 1, (1,), generator=rng))
            sess.rollback(r, sess.length(r) - keep)
            refs[r].rollback(refs[r].length - keep)
            assert sess.length(r) == refs[r].length
    # last_logits_only and no features
    outs = sess.forward(rows, [ids(rng, 3)] * 3, last_logits_only=True, features=False)
    assert all(o.logits.shape == (1, 96) and o.features is None for o in outs)


def test_batched_target_rows_join_and_leave(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    single, batch = engines(model, drafter)
    rng = torch.Generator().manual_seed(1)
    sess = batch.new_batch()
    a, b = sess.add_row(), sess.add_row()
    ref = {a: single.new_session(), b: single.new_session()}
    for r in (a, b):
        p = ids(rng, 6 + r)
        check_same(sess.forward([r], [p])[0], ref[r].forward(p), (family, "prefill alone", r))
    sess.remove_row(a)
    with pytest.raises(KeyError):
        sess.forward([a], [ids(rng, 1)])
    c = sess.add_row()  # reuses a's slot: its stale cache must not leak into c
    assert c == a and sess.length(c) == 0
    ref[c] = single.new_session()
    p = ids(rng, 4)
    check_same(sess.forward([c], [p])[0], ref[c].forward(p), (family, "joined"))
    d = sess.add_row()
    ref[d] = single.new_session()
    p = ids(rng, 40)  # long prompt: the cache grows while other rows hold state
    check_same(sess.forward([d], [p])[0], ref[d].forward(p), (family, "grow"))
    # non-consecutive subset (d, c) in reversed order, then everyone
    for order in ([d, c], [b, d, c]):
        blocks = [ids(rng, 1 + i * 2) for i in range(len(order))]
        for r, blk, o in zip(order, blocks, sess.forward(order, blocks)):
            check_same(o, ref[r].forward(blk), (family, order, r))
    with pytest.raises(ValueError, match="roll"):
        sess.rollback(b, sess.length(b) + 1)


def drafter_engines(model, drafter):
    single_t = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    batch_t = TorchBatchTargetEngine(model, drafter.spec.target_layer_ids)
    return TorchDrafterEngine.for_target(drafter, single_t), TorchBatchDrafterEngine.for_target(drafter, batch_t)


def check_drafts_match(batch_session, single_sessions, rng, rounds, feature_size, what):
    """Ragged draft calls (rows of different new-context and block lengths) vs each row alone."""
    for step, plan in enumerate(rounds):
        reqs, refs = [], []
        for row, (n, block) in plan.items():
            feats = torch.randn(n, feature_size, generator=rng)
            last = int(torch.randint(0, 95, (1,), generator=rng))
            reqs.append(DraftRequest(row, feats, last, block))
            refs.append(single_sessions[row].draft(feats, last, block))
        for q, got, ref in zip(reqs, batch_session.draft(reqs), refs):
            torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=1e-4, msg=(what, step, q.row))
            assert got.tokens.tolist() == ref.tokens.tolist(), (what, step, q.row)
            assert batch_session.context_length(q.row) == single_sessions[q.row].context_length


DRAFT_ROUNDS = [
    {0: (7, 8), 1: (20, 4), 2: (1, 2)},  # first calls: prompts of different lengths
    {0: (3, 8), 2: (8, 8)},  # row 1 sits this one out
    {2: (1, 5), 1: (6, 3), 0: (2, 2)},  # another order
]


def test_batched_torch_drafter_rows_equal_rows_alone(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    single, batch = drafter_engines(model, drafter)
    rng = torch.Generator().manual_seed(2)
    sess = batch.new_batch()
    assert isinstance(sess, BatchDrafterSession)
    rows = [sess.add_row() for _ in range(3)]
    check_drafts_match(sess, {r: single.new_session() for r in rows}, rng, DRAFT_ROUNDS, drafter.feature_size, family)
    sess.remove_row(1)
    r = sess.add_row()
    assert r == 1 and sess.context_length(r) == 0
    check_drafts_match(sess, {r: single.new_session()}, rng, [{r: (5, 8)}], drafter.feature_size, (family, "rejoin"))
