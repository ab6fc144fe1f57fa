"""The adaptive block-size policy: decisions on synthetic costs and acceptance rates, the cost fit,
and the acceptance tracker. Pure arithmetic: no models, no timing."""

import itertools
import math
import random
import warnings

import numpy as np
import pytest

from dflash_trt.decoding import adaptive
from dflash_trt.decoding.adaptive import RowChoice, choose_blocks
from dflash_trt.decoding.cost import Correction, CostModel, EngineCost, token_sweep
from dflash_trt.decoding.estimates import AcceptanceTracker, ProbeSchedule, expected_tokens

# GPU-like: a pass costs about the same for 1 or 100 tokens (memory-bound)
MEMORY_BOUND = CostModel(EngineCost(10e-3, 0.1e-3, 0.01e-3), EngineCost(2e-3, 0.05e-3, 0.005e-3))
# CPU-like at a large batch: every token costs (compute-bound)
COMPUTE_BOUND = CostModel(EngineCost(2e-3, 0.2e-3, 1.0e-3), EngineCost(1e-3, 0.1e-3, 0.1e-3))


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
    costly_drafter = CostModel(EngineCost(2e-3, 0.2e-3, 1e-3), EngineCost(50e-3, 1e-3, 1e-3))
    assert choose_blocks(rows, costly_drafter) == [1] * 8


def test_fixed_rows_and_caps_are_respected():
    rows = [
        RowChoice(alpha=0.0, max_block=8, fixed=6),
        RowChoice(alpha=0.99, max_block=3),
        RowChoice(alpha=0.99, max_block=1),
    ]
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


def _rate(rows, cost, blocks):
    tokens = sum(expected_tokens(r.alpha, b) for r, b in zip(rows, blocks))
    return tokens / cost.step_time(blocks, [r.new_context for r in rows])


def _reference_ascent(rows, cost, sweeps=3):
    """The previous policy, kept as a reference: coordinate ascent from "nobody drafts" and from
    "everyone drafts the most", the better of the two."""

    def ascend(blocks):
        best = _rate(rows, cost, blocks)
        for _ in range(sweeps):
            changed = False
            for i, r in enumerate(rows):
                if r.fixed is not None:
                    continue
                for b in range(1, r.max_block + 1):
                    trial = blocks[:i] + [b] + blocks[i + 1 :]
                    s = _rate(rows, cost, trial)
                    if s > best * (1 + 1e-9):
                        best, blocks, changed = s, trial, True
            if not changed:
                break
        return best, blocks

    low = ascend([r.fixed if r.fixed is not None else 1 for r in rows])
    high = ascend([r.fixed if r.fixed is not None else r.max_block for r in rows])
    return max(low, high, key=lambda x: x[0])[1]


def _exhaustive(rows, cost, min_gain=0.0):
    choices = [
        [r.fixed]
        if r.fixed is not None
        else [r.max_block]
        if r.probe and r.max_block > 1
        else range(1, r.max_block + 1)
        for r in rows
    ]
    best = max((list(c) for c in itertools.product(*choices)), key=lambda b: _rate(rows, cost, b))
    quiet = [c[0] for c in choices]  # nobody drafts, when that is allowed
    if all(b == 1 for b in quiet) and _rate(rows, cost, best) <= _rate(rows, cost, quiet) * (1 + min_gain):
        return quiet
    return best


def _random_instance(rng, n_rows):
    cost = CostModel(
        EngineCost(
            rng.uniform(1e-3, 20e-3),
            rng.uniform(0, 1e-3),
            rng.choice([1e-5, 1e-4, 1e-3, 3e-3]),
            one_token=rng.choice([None, rng.uniform(1e-3, 20e-3)]),
        ),
        EngineCost(rng.uniform(0, 20e-3), rng.uniform(0, 1e-3), rng.uniform(0, 1e-3)),
    )
    rows = []
    for _ in range(n_rows):
        fixed = rng.choice([None] * 5 + [1, 3, 8])
        rows.append(
            RowChoice(
                alpha=rng.choice([0.0, 1.0, rng.random(), rng.random()]),
                max_block=rng.randint(1, 8),
                new_context=rng.randint(1, 4),
                fixed=fixed,
                probe=rng.random() < 0.2,
            )
        )
    return rows, cost


def test_choice_is_the_exhaustive_optimum_on_small_random_instances():
    rng = random.Random(11)
    for _ in range(150):
        rows, cost = _random_instance(rng, rng.randint(1, 4))
        gain = rng.choice([0.0, 0.0, 0.1, 0.3])
        got = choose_blocks(rows, cost, min_gain=gain)
        assert all(g == r.fixed for g, r in zip(got, rows) if r.fixed is not None)
        assert all(1 <= g <= r.max_block for g, r in zip(got, rows) if r.fixed is None)
        assert all(g == r.max_block for g, r in zip(got, rows) if r.probe and r.fixed is None and r.max_block >= 2)
        assert _rate(rows, cost, got) >= _rate(rows, cost, _exhaustive(rows, cost, gain)) * (1 - 1e-9)
        if gain and all(b == 1 for b in _exhaustive(rows, cost, gain)):
            assert all(b == 1 for b in got)  # a drafting gain below the margin is not taken


def _bent(rng, cost, kind):
    """The random instance's target cost with a bent token term: a knee, or a staircase (GPU tiles)."""
    t = cost.target
    if kind == "knee":
        knee = rng.choice([4.0, 8.0, 16.0])
        target = EngineCost(t.fixed, t.per_row, t.per_token, t.one_token, knee, t.per_token * rng.choice([0, 0.1, 0.5]))
    else:
        tile, jump = rng.choice([4, 8, 12]), t.per_token * rng.choice([2, 8, 20])
        curve = tuple((float(x), (x // tile) * jump + 0.1 * t.per_token * x) for x in range(1, 40))
        target = EngineCost(t.fixed, t.per_row, 0.0, t.one_token, curve=curve)
    return CostModel(target, cost.drafter)


@pytest.mark.parametrize("kind", ["knee", "staircase"])
def test_choice_is_near_the_exhaustive_optimum_under_a_bent_cost(kind):
    """Under a knee or a tile staircase the sweep's order is at the mean token price and the choice is
    polished by single-row moves: not exact, but within 2 % of the best on small random instances (the
    staircases here are far steeper than a GPU's)."""
    rng = random.Random(7)
    worst = 1.0
    for _ in range(300):
        rows, cost = _random_instance(rng, rng.randint(1, 4))
        cost = _bent(rng, cost, kind)
        gain = rng.choice([0.0, 0.1])
        got = choose_blocks(rows, cost, min_gain=gain)
        assert all(g == r.fixed for g, r in zip(got, rows) if r.fixed is not None)
        assert all(1 <= g <= r.max_block for g, r in zip(got, rows) if r.fixed is None)
        worst = min(worst, _rate(rows, cost, got) / _rate(rows, cost, _exhaustive(rows, cost, gain)))
    assert worst >= 0.98, worst


@pytest.mark.parametrize("kind", ["line", "knee", "staircase"])
def test_leaving_out_increments_that_cannot_pay_never_lowers_the_choice(kind, monkeypatch):
    """Above POLISH_MAX_ROWS the sweeps leave out what no best choice holds (`_worth_keeping`): on random
    batches of 65-200 rows the choice rates at least what the sweeps over every increment reach, and the
    pruning does leave increments out (else this would test nothing)."""
    rng = random.Random(3)
    pruned = 0
    real = adaptive._worth_keeping

    def counting(g, *args):
        nonlocal pruned
        drafts, one_pays = real(g, *args)
        kept = drafts[:, None] & (one_pays | (np.arange(g.gain.shape[1]) == 1))
        pruned += int((g.valid & ~kept)[:, 1:].sum())
        return drafts, one_pays

    for _ in range(40):
        rows, cost = _random_instance(rng, rng.randint(adaptive.POLISH_MAX_ROWS + 1, 200))
        rows = [RowChoice(r.alpha, r.max_block * 2, r.new_context, r.fixed, r.probe) for r in rows]  # up to 16
        if kind != "line":
            cost = _bent(rng, cost, kind)
        gain = rng.choice([0.0, 0.1])
        with monkeypatch.context() as m:
            m.setattr(adaptive, "_worth_keeping", counting)
            got = choose_blocks(rows, cost, min_gain=gain)
        with monkeypatch.context() as m:  # every increment kept
            m.setattr(adaptive, "_worth_keeping", lambda g, *a: (g.valid.any(axis=1), g.one_more >= 0))
            every = choose_blocks(rows, cost, min_gain=gain)
        assert _rate(rows, cost, got) >= _rate(rows, cost, every) * (1 - 1e-12)
    assert pruned > 0


@pytest.mark.parametrize("kind", ["line", "knee", "staircase"])
def test_a_request_alone_gets_the_exhaustive_optimum_under_any_cost(kind):
    """One free row in its step: every size is rated at the true cost, so the choice is the exhaustive best
    (the margin included) whatever the token term's shape."""
    rng = random.Random(5)
    for _ in range(300):
        (row,), cost = _random_instance(rng, 1)
        row = RowChoice(row.alpha, max(2, row.max_block) * 2, row.new_context)  # free, up to 16
        if kind != "line":
            cost = _bent(rng, cost, kind)
        gain = rng.choice([0.0, 0.1, 0.3])
        (got,) = choose_blocks([row], cost, min_gain=gain)
        (best,) = _exhaustive([row], cost, gain)
        assert _rate([row], cost, [got]) == pytest.approx(_rate([row], cost, [best]), rel=1e-12)
        assert (got == 1) is (best == 1)  # the margin: drafting is taken exactly when the exhaustive search takes it


def test_a_step_ends_at_the_end_of_a_tile():
    """A GPU-like staircase: 128 tokens cost what 8 do, the 129th a third more. 16 rows that accept well
    fill exactly one tile (8 tokens each), where a line through the same points drafts past it."""
    tiles = tuple((float(x), 0.010 * (1 + x // 129) + 1e-6 * x) for x in (1, 64, 128, 129, 256, 257, 512))
    cost = CostModel(EngineCost(1e-3, 1e-5, 0.0, curve=tiles), EngineCost(1e-3, 1e-5, 1e-6))
    rows = [RowChoice(alpha=0.85, max_block=16) for _ in range(16)]
    assert sum(choose_blocks(rows, cost)) == 128
    line = CostModel(EngineCost(0.011, 1e-5, 0.010 / 256), EngineCost(1e-3, 1e-5, 1e-6))  # through the same ends
    assert sum(choose_blocks(rows, line)) > 128


def test_a_cost_with_a_measured_token_curve():
    """`with_curve`: the tokens priced by the measured one-row curve (interpolated, extrapolated along the line
    through its upper half), the fixed and per-row terms fitted to the grid; `token_sweep` steps finely where
    tiles do."""
    curve = [(1, 0.010), (128, 0.012), (136, 0.016), (256, 0.018)]
    truth = EngineCost(2e-3, 1e-4, 0.0, curve=tuple((float(x), y - 0.010) for x, y in curve))
    grid = [(r, r * b, truth(r, r * b)) for r in (1, 16, 32) for b in (1, 4, 8)]
    fit = EngineCost.with_curve(grid, curve)
    assert fit.bent and fit(16, 128) == pytest.approx(truth(16, 128)) and fit(32, 256) == pytest.approx(truth(32, 256))
    assert fit(1, 132) == pytest.approx((truth(1, 128) + truth(1, 136)) / 2)
    upper_line = np.polyfit([128, 136, 256], [0.012, 0.016, 0.018], 1)[0]  # the points at >= 256 / 2 tokens
    assert fit(1, 512) - fit(1, 256) == pytest.approx(256 * upper_line)  # beyond: along the upper half's line
    sweep = token_sweep(4096)
    assert sweep[:3] == [1, 8, 16] and 128 in sweep and 136 in sweep and sweep[-1] == 4096
    assert all(b > a for a, b in zip(sweep, sweep[1:]))


def test_past_its_end_a_curve_is_priced_along_its_upper_half_not_its_last_two_medians():
    """A GPU's pass is a line in its tokens where the sweep ends (compute bound); its last two medians carry
    noise, and a step whose prompt chunk puts the pass past the sweep prices its verify tokens at the slope
    beyond. That slope is the upper half's line: noise of a few percent at the last points moves it by about as
    much, where the last segment's slope would move by tens of percent."""
    sweep = np.array(token_sweep(4096), dtype=np.float64)
    times = 2e-3 + 2e-5 * sweep
    times[-2] *= 0.97  # two medians a few percent off, in opposite directions
    times[-1] *= 1.02
    curve = tuple(zip(sweep.tolist(), (times - times[0]).tolist()))
    cost = EngineCost(curve=curve)
    assert (times[-1] - times[-2]) / 128 > 1.5 * 2e-5  # what the last two points alone would say
    assert (cost(1, 8192) - cost(1, 4096)) / 4096 == pytest.approx(2e-5, rel=0.05)
    assert cost(1, 3072) == pytest.approx(2e-5 * (3072 - 1))  # within: as measured


def test_probes_take_the_rows_of_least_backlog_and_at_most_a_few():
    """Hundreds of stale rows: one probe step drafts for a few of each regime (the drafter takes in each
    probed row's whole backlog), those with the least backlog; the next probe comes `every` steps later."""
    probes = ProbeSchedule(every=32, max_backoff=4, max_rows=3)
    rows = [(False, 0, 100 + i) for i in range(10, 0, -1)] + [(True, 0, 5), (False, 90, 1)]
    sampled, last, backlog = (np.array(column) for column in zip(*rows))
    due = probes.due(64, sampled, last, backlog)
    assert [i for i, d in enumerate(due) if d] == [7, 8, 9, 10]  # backlogs 103, 102, 101 (greedy) and the sampled one
    probes.observe(64, False, accepted=0, drafted=21)
    assert not any(probes.due(64 + 32, sampled, last, backlog)[:10])  # greedy missed: its next probe waits 64 steps
    assert sum(ProbeSchedule(every=32, max_rows=0).due(64, sampled, last, backlog)) == 11  # 0: every stale row


def test_choice_never_scores_below_the_previous_coordinate_ascent():
    rng = random.Random(12)
    strictly_better = 0
    for _ in range(60):
        rows, cost = _random_instance(rng, rng.choice([8, 16, 32]))
        rows = [RowChoice(r.alpha, r.max_block, r.new_context, r.fixed) for r in rows]  # the ascent knows no probes
        new, old = _rate(rows, cost, choose_blocks(rows, cost)), _rate(rows, cost, _reference_ascent(rows, cost))
        assert new >= old * (1 - 1e-9)
        strictly_better += new > old * (1 + 1e-9)
    print(f"exact optimum strictly better than the ascent on {strictly_better}/60 instances")


def test_choice_edge_cases():
    # every row fixed: returned as given, drafting or not
    rows = [RowChoice(0.5, 8, fixed=4), RowChoice(0.5, 8, fixed=1)]
    assert choose_blocks(rows, MEMORY_BOUND) == [4, 1]
    # no row may draft
    assert choose_blocks([RowChoice(0.99, 1)] * 5, MEMORY_BOUND) == [1] * 5
    # a certain drafter drafts the most; a hopeless one not at all
    assert choose_blocks([RowChoice(1.0, 8)], MEMORY_BOUND) == [8]
    assert choose_blocks([RowChoice(0.0, 8)], MEMORY_BOUND) == [1]
    # an unfitted (all-zero) cost model: time is free, so every free row drafts its most (and nothing divides by 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        free = choose_blocks([RowChoice(0.1, 5), RowChoice(0.9, 3, fixed=2)], CostModel(EngineCost(), EngineCost()))
        # a step whose tokens cost nothing beyond its fixed part (a flat fit): every row drafts its most too
        flat = choose_blocks([RowChoice(a, 8) for a in (0.6, 0.9, 0.3)], CostModel(EngineCost(0.01), EngineCost(0.001)))
    assert free == [5, 2] and flat == [8, 8, 8]


def test_a_gain_below_the_margin_is_not_taken():
    # the demo pair's fitted costs at 32 rows: block 4 is expected to gain 8 % over block 1 at alpha 0.75
    cost = CostModel(EngineCost(7.5e-3, 2e-4, 1.58e-4), EngineCost(3e-3, 1.2e-4, 4.3e-5))
    rows = [RowChoice(alpha=0.75, max_block=8) for _ in range(32)]
    assert choose_blocks(rows, cost) == [4] * 32
    assert choose_blocks(rows, cost, min_gain=0.1) == [1] * 32
    assert choose_blocks(rows[:4], cost, min_gain=0.1) == choose_blocks(rows[:4], cost) != [1] * 4  # clear gains stay


def test_a_probe_row_drafts_its_whole_block_even_when_drafting_does_not_pay():
    rows = [RowChoice(alpha=0.3, max_block=8) for _ in range(8)]
    costly_drafter = CostModel(EngineCost(2e-3, 0.2e-3, 1e-3), EngineCost(50e-3, 1e-3, 1e-3))
    probed = rows[:3] + [RowChoice(alpha=0.3, max_block=8, probe=True), RowChoice(0.9, 1, probe=True)] + rows[5:]
    blocks = choose_blocks(probed, costly_drafter)
    assert blocks[3] == 8 and blocks[4] == 1  # a row that cannot draft is not forced to
    assert blocks[:3] + blocks[5:] == [1] * 6  # the others stay put: drafting still does not pay for them
    assert blocks == _exhaustive(probed, costly_drafter)


def test_linear_cost_fit_recovers_coefficients_and_refits_online():
    truth = EngineCost(3e-3, 0.5e-3, 0.2e-3)
    samples = [(r, r * b, truth(r, r * b)) for r in (1, 4, 16) for b in (1, 4, 8)]
    fit = EngineCost.fit(samples)
    for got, want in ((fit.fixed, truth.fixed), (fit.per_row, truth.per_row), (fit.per_token, truth.per_token)):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12)
    with pytest.raises(ValueError, match=">= 3 samples"):
        EngineCost.fit(samples[:2])
    model = CostModel(EngineCost(), EngineCost())
    for r, t, s in samples * 2:
        model.observe_target(r, t, s)
    model.refit()
    assert math.isclose(model.target.per_token, truth.per_token, rel_tol=1e-6)
    assert model.drafter == EngineCost()  # no drafter observations: unchanged


def test_a_one_token_pass_is_priced_apart_from_the_line():
    """On a CPU the one-token pass (a request alone, not drafting) is cheaper than the line through larger
    passes says (vector, not matrix, products); priced by the line, a lone row drafts where it loses."""
    line = EngineCost(10e-3, 0.0, 0.5e-3)
    samples = [(r, r * b, line(r, r * b)) for r in (1, 4, 16) for b in (1, 4, 8) if (r, b) != (1, 1)]
    fit = EngineCost.fit(samples + [(1, 1, 5e-3), (1, 1, 6e-3)])
    assert math.isclose(fit.per_token, line.per_token, rel_tol=1e-6) and math.isclose(
        fit.fixed, line.fixed, rel_tol=1e-6
    )
    assert fit.one_token == pytest.approx(5.5e-3) and fit(1, 1) == pytest.approx(5.5e-3)
    assert fit(2, 2) == pytest.approx(line(2, 2)) and fit(1, 4) == pytest.approx(line(1, 4))
    assert (
        EngineCost.fit([(1, 1, 5e-3), (4, 4, 7e-3), (4, 16, 9e-3)] * 2).one_token is None
    )  # too few shapes without it
    scaled = CostModel(fit, EngineCost(2e-3), target_correction=Correction(scale=2.0)).current()[0]
    assert scaled(1, 1) == pytest.approx(5.5e-3)  # with a running correction of its own ...
    model = CostModel(fit, EngineCost(2e-3))
    for _ in range(60):  # ... which one-token passes move, and only they
        model.observe_target(1, 1, 0.5 * fit(1, 1))
        model.observe_target(1, 8, 1.5 * fit(1, 8))
    assert model.target_correction.one_token == pytest.approx(
        0.5, rel=0.01
    ) and model.target_correction.scale == pytest.approx(1.5, rel=0.01)
    now = model.current()[0]
    assert now(1, 1) == pytest.approx(0.5 * fit(1, 1), rel=0.01) and now(1, 8) == pytest.approx(
        1.5 * fit(1, 8), rel=0.01
    )

    row = [RowChoice(alpha=0.6, max_block=8)]
    drafter = EngineCost(2e-3, 0.0, 0.0)
    assert choose_blocks(row, CostModel(line, drafter)) != [1]  # by the line, drafting pays ...
    assert choose_blocks(row, CostModel(EngineCost(10e-3, 0.0, 0.5e-3, one_token=5e-3), drafter)) == [
        1
    ]  # ... it does not
    two = [RowChoice(alpha=0.6, max_block=8)] * 2  # the exception is one row's one token only
    assert choose_blocks(two, CostModel(EngineCost(10e-3, 0.0, 0.5e-3, one_token=5e-3), drafter)) == choose_blocks(
        two, CostModel(line, drafter)
    )


def test_cost_corrections_follow_the_passes_that_ran_and_change_the_choice():
    """The start-up grid said a target step is dear and drafting cheap; the real passes say the opposite
    (a grid timed during a burst, a longer context for the drafter): the policy follows the passes."""
    grid = CostModel(EngineCost(10e-3, 0.1e-3, 0.2e-3), EngineCost(3e-3, 0.05e-3, 0.05e-3))
    row = [RowChoice(alpha=0.45, max_block=8)]
    assert choose_blocks(row, grid, min_gain=0.1)[0] > 1  # priced by the grid, drafting looks > 10 % ahead
    for _ in range(60):
        grid.observe_target(1, 1, 0.5 * grid.target(1, 1))
        grid.observe_drafter(1, 5, 2.0 * grid.drafter(1, 5))
    assert grid.corrections() == pytest.approx({"target": 0.5, "target_one_token": 1.0, "drafter": 2.0}, rel=0.01)
    target, drafter = grid.current()
    assert target.fixed == pytest.approx(5e-3, rel=0.01) and drafter.per_token == pytest.approx(0.1e-3, rel=0.01)
    assert grid.target.fixed == 10e-3  # the shape itself is kept
    assert choose_blocks(row, grid, min_gain=0.1) == [1]
    # one pass stalled by another process moves the correction by at most its weight x the clamp
    before = grid.target_correction.scale
    grid.observe_target(1, 1, 100.0)
    assert grid.target_correction.scale <= before + grid.scale_weight * (4.0 - before) + 1e-12
    grid.observe_target(1, 1, 0.0)  # a pass too short to time: ignored
    # start-up samples are recorded without correcting; a refit starts the correction over
    fresh = CostModel(EngineCost(1e-3, 0.0, 1e-4), EngineCost())
    fresh.observe_target(4, 4, 1.0, correct=False)
    assert fresh.target_correction.scale == 1.0 and fresh.target_correction.seen == [(4, 4, 1.0)]
    moved = CostModel(EngineCost(1e-3, 0.0, 1e-4), EngineCost())
    for r, t in [(1, 1), (4, 8), (16, 64)] * 6:
        moved.observe_target(r, t, 2e-3 + 1e-4 * t)
    assert moved.target_correction.scale > 1.0
    moved.refit()
    assert moved.target_correction.scale == 1.0 and moved.target.per_token == pytest.approx(1e-4, rel=1e-6)


def test_acceptance_tracker_falls_and_recovers():
    t = AcceptanceTracker()
    start = t.alpha
    for _ in range(20):
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
    """With refit_every, the batched step feeds its observed passes back into the cost model. The passes take what
    a simulated CPU charges for them (`priced_engines`), on a virtual clock: the seconds observed are the same on
    any machine."""
    from clocks import priced_engines

    from dflash_trt.decoding import AdaptiveBlocks, BatchDecoder, GenerationConfig
    from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

    _, _, _, model, drafter = tiny_pair
    real = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    target, drafter_engine, clock = priced_engines(real, TorchDrafterEngine.for_target(drafter, real))
    cost = CostModel(EngineCost(1e-2, 0.0, 1e-6), EngineCost(1e-3, 0.0, 1e-7))
    dec = BatchDecoder(target, drafter_engine, policy=AdaptiveBlocks(cost, refit_every=4), clock=clock)
    dec.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9]], GenerationConfig(max_new_tokens=24))
    seen = cost.target_correction.seen
    assert len(seen) >= 16 and all(s > 0 for _, _, s in seen)
    assert cost.target != EngineCost(1e-2, 0.0, 1e-6)  # refitted from what ran


def test_new_rows_start_from_what_finished_rows_of_their_regime_measured():
    from dflash_trt.decoding.estimates import AcceptancePrior

    prior = AcceptancePrior(start=0.6, weight=0.5)
    assert prior.tracker(sampled=True).alpha == pytest.approx(0.6)
    failing = prior.tracker(sampled=True)
    for _ in range(6):  # a sampled request whose drafts all fail
        failing.update(drafted=7, accepted=0)
    prior.observe(True, failing)
    assert prior.alpha[True] == pytest.approx(0.3)  # halfway from 0.6 to the measured 0
    assert prior.tracker(sampled=True).alpha == pytest.approx(0.3)
    assert prior.tracker(sampled=False).alpha == pytest.approx(0.6)  # greedy rows keep their own estimate
    short = prior.tracker(sampled=False)
    short.update(drafted=7, accepted=0)  # one round says too little
    prior.observe(False, short)
    assert False not in prior.alpha


def _finished(prior, sampled: bool, rate: float, rounds: int = 40, block: int = 8):
    """A request that drafted `rounds` rounds of `block` tokens, accepting about `rate` of each round's drafts (its
    tracker measures accepted / (accepted + the one rejection)), observed."""
    row = prior.tracker(sampled)
    per_round = round(rate * (block - 1))
    for _ in range(rounds):
        row.update(drafted=block - 1, accepted=per_round)
    prior.observe(sampled, row)


def test_the_prior_is_as_strong_as_the_requests_of_its_regime_are_alike():
    from dflash_trt.decoding.estimates import MAX_PRIOR_WEIGHT, AcceptancePrior, AcceptanceTracker

    least = AcceptanceTracker.prior_weight
    alike, apart = AcceptancePrior(), AcceptancePrior()
    for _ in range(7):  # fewer than min_requests: the tracker's own default
        _finished(alike, False, 6 / 7)
    assert alike.strength(False) == least
    for i in range(40):
        _finished(alike, False, 6 / 7)  # every request the same: nothing between them but noise
        _finished(apart, False, 0.0 if i % 2 else 6 / 7)  # half the drafter knows, half it does not
    assert alike.strength(False) == MAX_PRIOR_WEIGHT
    assert alike.tracker(False).prior_weight == MAX_PRIOR_WEIGHT
    assert apart.strength(False) == least
    assert alike.strength(True) == least  # the sampled regime has seen nothing
    close = AcceptancePrior()
    for i in range(200):  # two close classes: between the two bounds, the beta's by moments
        _finished(close, False, 2 / 7 if i % 2 else 6 / 7)
    low, high = 2 / 3, 6 / 7  # what each class's tracker measures over 40 rounds of 3 and of 7 trials
    m, noise = (low + high) / 2, (low * (1 - low) / 120 + high * (1 - high) / 280) / 2
    between = ((high - low) / 2) ** 2 - noise
    assert least < close.strength(False) < MAX_PRIOR_WEIGHT
    assert close.strength(False) == pytest.approx(m * (1 - m) / between - 1, rel=0.05)
