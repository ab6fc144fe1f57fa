"""The adaptive block-size policy: decisions on synthetic costs and acceptance rates, the cost fit,
and the acceptance tracker. Pure arithmetic: no models, no timing."""

import math

import pytest

from dflash_trt.decoding.adaptive import (
    AcceptanceTracker, CostModel, LinearCost, RowChoice, choose_blocks, expected_tokens,
)

# GPU-like: a pass costs about the same for 1 or 100 tokens (memory-bound)
MEMORY_BOUND = CostModel(LinearCost(10e-3, 0.1e-3, 0.01e-3), LinearCost(2e-3, 0.05e-3, 0.005e-3))
# CPU-like at a large batch: every token costs (compute-bound)
COMPUTE_BOUND = CostModel(LinearCost(2e-3, 0.2e-3, 1.0e-3), LinearCost(1e-3, 0.1e-3, 0.1e-3))


def test_expected_tokens():
    assert expected_tokens(0.5, 1) == 1.0
    assert expected_tokens(1.0, 8) == 8.0
    assert expected_tokens(0.0, 8) == 1.0
    assert math.isclose(expected_tokens(0.5, 3), 1 + 0.5 + 0.25)


def test_high_acceptance_drafts_full_blocks_when_tokens_are_cheap():
    rows = [RowChoice(alpha=0.9, max_block=8) for _ in range(4)]
    assert choose_blocks(rows, MEMORY_BOUND) == [8, 8, 8, 8]


def test_a_row_whose_drafts_fail_does_not_draft():
    rows = [RowChoice(alpha=0.9, max_block=8), RowChoice(alpha=0.02, max_block=8), RowChoice(alpha=0.9, max_block=8)]
    blocks = choose_blocks(rows, MEMORY_BOUND)
    assert blocks[1] == 1 and blocks[0] > 1 and blocks[2] > 1


def test_compute_bound_batch_drafts_shorter_blocks():
    rows = [RowChoice(alpha=0.7, max_block=8) for _ in range(16)]
    cheap = choose_blocks(rows, MEMORY_BOUND)
    dear = choose_blocks(rows, COMPUTE_BOUND)
    assert sum(dear) < sum(cheap)
    assert max(dear) < 8


def test_nobody_drafts_when_drafting_never_pays():
    rows = [RowChoice(alpha=0.3, max_block=8) for _ in range(8)]
    costly_drafter = CostModel(LinearCost(2e-3, 0.2e-3, 1e-3), LinearCost(50e-3, 1e-3, 1e-3))
    assert choose_blocks(rows, costly_drafter) == [1] * 8


def test_fixed_rows_and_caps_are_respected():
    rows = [RowChoice(alpha=0.0, max_block=8, fixed=6), RowChoice(alpha=0.99, max_block=3),
            RowChoice(alpha=0.99, max_block=1)]
    blocks = choose_blocks(rows, MEMORY_BOUND)
    assert blocks[0] == 6  # a request's own block_size wins, even a hopeless one
    assert blocks[1] == 3 and blocks[2] == 1  # never beyond what the row may draft
    assert choose_blocks([], MEMORY_BOUND) == []


def test_choice_beats_every_uniform_block_size():
    """The chosen mix scores at least as well as any single size for everyone (a brute-force check)."""
    rows = [RowChoice(alpha=a, max_block=8) for a in (0.95, 0.8, 0.5, 0.2, 0.05, 0.9)]
    for cost in (MEMORY_BOUND, COMPUTE_BOUND):
        def rate(blocks):
            tokens = sum(expected_tokens(r.alpha, b) for r, b in zip(rows, blocks))
            return tokens / cost.step_time(blocks, [1] * len(blocks))

        chosen = rate(choose_blocks(rows, cost))
        assert all(chosen >= rate([b] * len(rows)) * (1 - 1e-9) for b in range(1, 9))


def test_linear_cost_fit_recovers_coefficients_and_refits_online():
    truth = LinearCost(3e-3, 0.5e-3, 0.2e-3)
    samples = [(r, r * b, truth(r, r * b)) for r in (1, 4, 16) for b in (1, 4, 8)]
    fit = LinearCost.fit(samples)
    for got, want in ((fit.fixed, truth.fixed), (fit.per_row, truth.per_row), (fit.per_token, truth.per_token)):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12)
    with pytest.raises(ValueError, match=">= 3 samples"):
        LinearCost.fit(samples[:2])
    model = CostModel(LinearCost(), LinearCost())
    for r, t, s in samples * 2:
        model.observe("target", r, t, s)
    model.refit()
    assert math.isclose(model.target.per_token, truth.per_token, rel_tol=1e-6)
    assert model.drafter == LinearCost()  # no drafter observations: unchanged


def test_acceptance_tracker_falls_and_recovers():
    t = AcceptanceTracker()
    start = t.alpha
    for _ in range(10):
        t.update(drafted=7, accepted=0)
    low = t.alpha
    assert low < 0.2 < start
    for _ in range(10):
        t.update(drafted=7, accepted=7)
    assert t.alpha > 0.9
    idle = AcceptanceTracker()
    for _ in range(10):
        idle.update(drafted=7, accepted=0)
    for _ in range(100):
        idle.update(drafted=0, accepted=0)  # not drafting: drifts back towards the prior, to be tried again
    assert idle.alpha > low + 0.3


def test_decoder_refits_its_cost_model_online(tiny_pair):
    """With refit_every, the batched step feeds its observed passes back into the cost model."""
    import torch

    from dflash_trt.decoding import GenerationConfig
    from dflash_trt.decoding.batch import BatchDecoder
    from dflash_trt.runtime.torch_batch import TorchBatchDrafterEngine, TorchBatchTargetEngine

    _, _, _, model, drafter = tiny_pair
    target = TorchBatchTargetEngine(model, drafter.spec.target_layer_ids)
    cost = CostModel(LinearCost(1e-2, 0.0, 1e-6), LinearCost(1e-3, 0.0, 1e-7))
    dec = BatchDecoder(target, TorchBatchDrafterEngine.for_target(drafter, target), adaptive=True, cost=cost,
                       refit_every=4)
    dec.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9]], GenerationConfig(max_new_tokens=24))
    seen = cost._seen["target"]
    assert len(seen) >= 16 and all(s > 0 for _, _, s in seen)
    assert cost.target != LinearCost(1e-2, 0.0, 1e-6)  # refitted from what ran
