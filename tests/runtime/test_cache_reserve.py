"""Caches sized at start-up (`SlotCacheRows.reserve`, `server.context.reserve_caches`): within the reserved rows and
positions no pass grows a cache (a growth copies the whole cache inside one step: the stall a prompt crossing 512
or 1,024 positions gave every stream), outputs stay those of rows run alone, and the budget picks the positions."""

import torch
from helpers import HfSequenceTarget

from dflash_trt.decoding import BatchDecoder
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from dflash_trt.server.context import reserve_caches


def test_reserved_target_cache_never_grows_and_rows_equal_rows_alone(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    layers = drafter.spec.target_layer_ids
    sess = TorchTargetEngine(model, layers).new_session()
    sess.reserve(3, 200)
    k, v = sess.k, sess.v
    assert k.shape[1] >= 3 and k.shape[3] >= 200
    rng = torch.Generator().manual_seed(1)
    rows = [sess.add_row() for _ in range(3)]
    refs = [HfSequenceTarget(model, layers) for _ in rows]
    for step in range(12):  # prompts, then blocks, up to 12 x 16 = 192 positions
        blocks = [torch.randint(0, 95, (16,), generator=rng) for _ in rows]
        for r, blk, out in zip(rows, blocks, sess.forward(rows, blocks)):
            torch.testing.assert_close(out.logits, refs[r].forward(blk).logits, atol=1e-4, rtol=1e-4)
    assert sess.k is k and sess.v is v, (family, "the reserved cache was replaced: it grew")


def test_unreserved_cache_grows_inside_a_pass(tiny_pair):
    """The control: without a reservation the same passes replace (grow) the cache."""
    _, _, _, model, drafter = tiny_pair
    sess = TorchTargetEngine(model, drafter.spec.target_layer_ids).new_session()
    row = sess.add_row()
    sess.forward([row], [torch.arange(16)])
    k = sess.k
    sess.forward([row], [torch.arange(16)])
    assert sess.k is not k


def test_reserve_caches_fits_the_budget_in_powers_of_two(tiny_pair):
    _, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    dec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), None)
    per_position = 4 * sum(s.position_bytes() for s in (dec.target_session, dec.drafter_session))
    assert reserve_caches(dec, 4, 0) == 0 and dec.target_session.k.shape[3] == 0  # 0: grow on demand
    context = target.max_context
    assert reserve_caches(dec, 4, per_position * context) == context  # all of it fits
    dec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), None)
    assert reserve_caches(dec, 4, per_position * 100) == 64  # the largest power of two that fits
    assert dec.target_session.k.shape[1:4:2] == (4, 64) and dec.drafter_session.k.shape[3] == 64
    assert reserve_caches(dec, 4, per_position * 15) == 0  # fewer than 16 positions: not worth reserving
