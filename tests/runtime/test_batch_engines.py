"""Batched engine sessions: every row of a batched pass equals the same row run alone (reference
single-sequence implementations: the Hugging Face forward with its DynamicCache, the drafter's own forward),
per-row rollbacks, rows joining and leaving."""

from functools import partial

import pytest
import torch
from helpers import DrafterSequence, HfSequenceTarget

from dflash_trt.runtime.base import DrafterSession, DraftRequest, TargetSession
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

ATOL = 1e-4


def engines(model, drafter):
    """(a maker of reference sequences, the row-batched engine)."""
    layers = drafter.spec.target_layer_ids
    return partial(HfSequenceTarget, model, layers), TorchTargetEngine(model, layers)


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
    sess = batch.new_session()
    assert isinstance(sess, TargetSession)
    rows = [sess.add_row() for _ in range(3)]
    refs = {r: single() for r in rows}
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


def test_prompt_chunks_beside_verify_blocks_attend_apart_and_equal_rows_alone(tiny_pair):
    """A pass holding rows of many new tokens (prompt chunks, > SHORT_QUERIES) beside rows of a few (verify blocks):
    the two groups attend apart, and every row still equals the row alone."""
    from dflash_trt.runtime.torch_backend import SHORT_QUERIES

    family, _, _, model, drafter = tiny_pair
    single, batch = engines(model, drafter)
    rng = torch.Generator().manual_seed(4)
    sess = batch.new_session()
    rows = [sess.add_row() for _ in range(4)]
    refs = {r: single() for r in rows}
    long = SHORT_QUERIES + 9
    for step, sizes in enumerate([(6, 3, 1, 11), (4, long, 8, 2), (long + 5, 1, long, 7), (3, 2, 5, long)]):
        blocks = [ids(rng, n) for n in sizes]
        for r, blk, o in zip(rows, blocks, sess.forward(rows, blocks)):
            check_same(o, refs[r].forward(blk), (family, step, r))
            keep = int(torch.randint(0, min(len(blk), 4) + 1, (1,), generator=rng))
            sess.rollback(r, sess.length(r) - keep)
            refs[r].rollback(refs[r].length - keep)


def test_batched_target_rows_join_and_leave(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    single, batch = engines(model, drafter)
    rng = torch.Generator().manual_seed(1)
    sess = batch.new_session()
    a, b = sess.add_row(), sess.add_row()
    ref = {a: single(), b: single()}
    for r in (a, b):
        p = ids(rng, 6 + r)
        check_same(sess.forward([r], [p])[0], ref[r].forward(p), (family, "prefill alone", r))
    sess.remove_row(a)
    with pytest.raises(KeyError):
        sess.forward([a], [ids(rng, 1)])
    c = sess.add_row()  # reuses a's slot: its stale cache must not leak into c
    assert c == a and sess.length(c) == 0
    ref[c] = single()
    p = ids(rng, 4)
    check_same(sess.forward([c], [p])[0], ref[c].forward(p), (family, "joined"))
    d = sess.add_row()
    ref[d] = single()
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
    """(a maker of reference drafter sequences, the row-batched drafter engine)."""
    batch = TorchDrafterEngine.for_target(drafter, TorchTargetEngine(model, drafter.spec.target_layer_ids))
    return partial(DrafterSequence, batch), batch


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
    {1: (4, 6)},  # one row alone (batch axis 1) after the others grew the cache
    {0: (2, 4), 1: (40, 4), 2: (1, 3)},  # a long backlog next to short ones (fixed-shape graphs: two calls)
]


def test_batched_torch_drafter_rows_equal_rows_alone(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    single, batch = drafter_engines(model, drafter)
    rng = torch.Generator().manual_seed(2)
    sess = batch.new_session()
    assert isinstance(sess, DrafterSession)
    rows = [sess.add_row() for _ in range(3)]
    check_drafts_match(sess, {r: single() for r in rows}, rng, DRAFT_ROUNDS, drafter.feature_size, family)
    sess.remove_row(1)
    r = sess.add_row()
    assert r == 1 and sess.context_length(r) == 0
    check_drafts_match(sess, {r: single()}, rng, [{r: (5, 8)}], drafter.feature_size, (family, "rejoin"))


@pytest.fixture(scope="module")
def batch_graph(tiny_pair, tmp_path_factory):
    from dflash_trt.builders.onnx_drafter_batch import export_batched_drafter

    family, _, _, model, drafter = tiny_pair
    out = tmp_path_factory.mktemp(f"onnx-batch-{family}")
    export_batched_drafter(drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight, out)
    return out


def test_batched_onnx_drafter_rows_equal_rows_alone(tiny_pair, batch_graph):
    """Real onnxruntime: the batched graph's rows equal the PyTorch drafter's, each row alone."""
    import onnxruntime as ort

    from dflash_trt.builders.onnx_drafter_batch import BATCH_INPUT_NAMES
    from dflash_trt.formats import BATCH_GRAPH_FILES
    from dflash_trt.runtime.ort_backend import BatchGraphSession, OrtDrafterEngine

    family, _, _, model, drafter = tiny_pair
    single, _ = drafter_engines(model, drafter)
    graph = ort.InferenceSession(str(batch_graph / BATCH_GRAPH_FILES["fp32"]), providers=["CPUExecutionProvider"])
    assert [i.name for i in graph.get_inputs()] == list(BATCH_INPUT_NAMES)
    shapes = {i.name: i.shape for i in graph.get_inputs()}
    # the batch, block, new-context and cache axes stayed symbolic (an int means the exporter fixed it)
    assert all(isinstance(shapes[k][0], str) for k in ("block_ids", "features", "past_lengths"))
    assert isinstance(shapes["past_k"][1], str) and isinstance(shapes["past_k"][3], str)
    engine = OrtDrafterEngine(batch_graph)
    assert engine.batched
    calls: list[int] = []  # rows per graph call

    def run(feeds):
        calls.append(len(feeds["block_ids"]))
        return engine.session.run(None, feeds)

    sess = BatchGraphSession(engine.meta, run)
    assert isinstance(sess, DrafterSession)
    rows = [sess.add_row() for _ in range(3)]
    rng = torch.Generator().manual_seed(3)
    check_drafts_match(sess, {r: single() for r in rows}, rng, DRAFT_ROUNDS, drafter.feature_size, (family, "onnx"))
    assert calls == [3, 2, 3, 1, 2, 1]  # one call per round, but the round with a 40-row backlog made two
    out = sess.draft([DraftRequest(1, torch.randn(2, drafter.feature_size, generator=rng), 5, 8)])
    assert out[0].tokens.shape == (7,)


def test_batched_loop_with_onnx_drafter_equals_target_alone(tiny_pair, batch_graph):
    """The batched step on the real onnxruntime batched drafter: greedy rows equal the target alone."""
    from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder, FixedBlocks, GenerationConfig
    from dflash_trt.decoding.cost import measure_costs
    from dflash_trt.runtime.ort_backend import OrtDrafterEngine

    family, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    ort_drafter = OrtDrafterEngine(batch_graph)
    cost = measure_costs(target, ort_drafter, rows=(1, 2, 3), blocks=(1, 2, 4), context=16, repeats=1)
    assert min(cost.target.fixed, cost.target.per_row, cost.target.per_token) >= 0 and cost.target(4, 8) > 0
    rng = torch.Generator().manual_seed(5)
    prompts = [ids(rng, n).tolist() for n in (3, 11, 25)]
    configs = [GenerationConfig(max_new_tokens=n, block_size=b) for n, b in ((20, 8), (33, 3), (9, None))]
    for adaptive in (False, True):
        policy = AdaptiveBlocks(cost) if adaptive else FixedBlocks()
        got = BatchDecoder(target, ort_drafter, policy=policy).generate(prompts, configs)
        base = BatchDecoder(TorchTargetEngine(model))
        for p, c, r in zip(prompts, configs, got):
            alone = base.generate([p], GenerationConfig(max_new_tokens=c.max_new_tokens))[0]
            assert r.token_ids == alone.token_ids, family


def test_onnx_drafter_opens_the_batched_graph_where_the_folder_has_it(tiny_pair, batch_graph, tmp_path):
    """An engine is batched: the ONNX drafter runs the single-sequence graph once per row (PerRowDrafter)
    where no batched graph exists, the batched graph where it does (both draft the same); the PyTorch
    drafter shares its target's weights (not copies)."""
    import shutil

    from dflash_trt.builders.onnx_drafter import export_drafter
    from dflash_trt.runtime.ort_backend import BatchGraphSession, OrtDrafterEngine
    from dflash_trt.runtime.rows import PerRowDrafter

    family, _, _, model, drafter = tiny_pair
    _, target = engines(model, drafter)
    _, torch_drafter = drafter_engines(model, drafter)
    assert target.model is model and torch_drafter.drafter is drafter  # the same weights, not copies
    assert torch_drafter.embed_weight is model.get_input_embeddings().weight
    assert target.feature_layer_ids == torch_drafter.feature_layer_ids

    folder = tmp_path / "onnx"
    export_drafter(
        drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight, folder, fp16=False
    )
    single = OrtDrafterEngine(folder)  # no batched graph there yet
    assert not single.batched and isinstance(single.new_session(), PerRowDrafter)
    for f in batch_graph.iterdir():
        if f.name.startswith("drafter_batch"):
            shutil.copy(f, folder / f.name)
    batched = OrtDrafterEngine(folder)
    assert batched.batched and isinstance(batched.new_session(), BatchGraphSession)
    rng = torch.Generator().manual_seed(4)
    sessions = [e.new_session() for e in (single, batched)]
    rows = [[s.add_row() for _ in range(2)] for s in sessions]
    for step in range(3):
        reqs = [
            (torch.randn(n, drafter.feature_size, generator=rng), int(torch.randint(0, 95, (1,), generator=rng)), b)
            for n, b in ((5 - step, 8), (1 + step, 3))
        ]
        a, b = (s.draft([DraftRequest(r, *q) for r, q in zip(rs, reqs)]) for s, rs in zip(sessions, rows))
        for x, y in zip(a, b):
            torch.testing.assert_close(x.logits, y.logits, atol=ATOL, rtol=1e-4, msg=(family, step))


def test_backlog_groups_split_only_rows_far_above_the_median():
    from dflash_trt.runtime.rows import backlog_groups

    assert backlog_groups([3, 2, 4, 1]) == [[0, 1, 2, 3]]
    assert backlog_groups([3, 113, 2, 4, 150]) == [[0, 2, 3], [1, 4]]  # two rows brought their prompts
    assert backlog_groups([20, 30, 25]) == [[0, 1, 2]]  # all long: one call, nothing to save
    assert backlog_groups([1, 12]) == [[0, 1]]  # short padding is cheaper than a second call
    assert backlog_groups([]) == []


def test_scattered_rows_run_as_a_slot_span_or_gathered(tiny_pair):
    """Calls whose slots lie close together run on the span of slots (the slots in between, live or free,
    ride along as idle rows); scattered ones gather their rows. Either way each row equals itself alone,
    and an idle row's cache is untouched (its next call still matches)."""
    family, _, _, model, drafter = tiny_pair
    single_t, batch_t = engines(model, drafter)
    rng = torch.Generator().manual_seed(3)
    t_sess = batch_t.new_session()
    rows = [t_sess.add_row() for _ in range(12)]
    t_ref = {r: single_t() for r in rows}
    t_sess.remove_row(6)  # a free slot inside the span
    live = [r for r in rows if r != 6]
    for r in live:
        p = ids(rng, 3 + r)
        check_same(t_sess.forward([r], [p])[0], t_ref[r].forward(p), (family, "prefill", r))
    calls = [
        live,  # every live row: the span 0..11 with the free slot idle
        [10, 1, 3, 2, 4, 0, 5, 8, 9],  # a subset in any order: span 0..10, slots 6 (free) and 7 (live) idle
        [11, 0],  # far apart: gathered
        list(reversed(live)),
    ]
    for call in calls:
        blocks = [ids(rng, 1 + (r % 4)) for r in call]
        for r, blk, o in zip(call, blocks, t_sess.forward(call, blocks)):
            check_same(o, t_ref[r].forward(blk), (family, "target", call, r))

    # the drafter tolerates fewer idle rows (one per 8 in the call: an idle row costs it a whole block)
    single_d, batch_d = drafter_engines(model, drafter)
    d_sess = batch_d.new_session()
    rows = [d_sess.add_row() for _ in range(19)]
    d_ref = {r: single_d() for r in rows}
    d_sess.remove_row(6)
    live = [r for r in rows if r != 6]
    calls = [
        live,  # span with the free slot idle
        [r for r in live if r != 12],  # 17 rows: span 0..18 with slots 6 (free) and 12 (live) idle
        [18, 0, 9],  # gathered
        [r for r in live if r not in (12, 13, 14)],  # 15 rows, 4 idle: gathered
        live,
    ]
    plan = [{r: (1 + r % 3, 2 + r % 5) for r in call} for call in calls]
    plan[0] = {r: (4 + r, 4) for r in live}  # first drafts bring their prompt
    check_drafts_match(d_sess, d_ref, rng, plan, drafter.feature_size, (family, "drafter"))
