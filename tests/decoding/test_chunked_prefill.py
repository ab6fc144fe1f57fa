"""Chunked prefill: prompts enter in pieces inside the verify pass, and nothing a row returns changes. Greedy rows
equal the target alone, chunked or separate, with rows of mixed prompt lengths joining while others stream, chunk
boundaries inside prompts and budgets smaller than one verify block; the drafter is handed exactly the features a
whole-prompt prefill gives it; a seeded sampled row returns the same tokens either way; the policy prices the
chunks that ride in a step's pass."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from clocks import StoppedClock
from helpers import _WrappedDrafter, _WrappedDrafterSession
from test_batch_decode import random_prompts, reference, torch_engines

from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.decoding.adaptive import RowChoice, choose_blocks
from dflash_trt.decoding.chunking import MIN_CHUNK
from dflash_trt.decoding.cost import CostModel, EngineCost, price


class _SpySession(_WrappedDrafterSession):
    def draft(self, requests):
        for q in requests:
            self.owner.seen.setdefault(q.row, []).append(q.new_features.clone())
        return super().draft(requests)


class SpyDrafter(_WrappedDrafter):
    """The real drafter engine, recording the features each of its rows is handed (per drafter row, in order)."""

    session_class = _SpySession

    def __init__(self, engine):
        super().__init__(engine)
        self.seen: dict[int, list[torch.Tensor]] = {}


def staggered(dec, prompts, configs, joins):
    """Run `dec` with prompt i joining before step joins[i]; the rows, and per step its profile."""
    rows, profiles, step = [], [], 0
    pending = sorted(zip(joins, range(len(prompts))))
    while pending or dec.active:
        while pending and pending[0][0] <= step:
            i = pending.pop(0)[1]
            rows.append((i, dec.add(prompts[i], configs[i])))
        profiles.append(dec.step().profile)
        step += 1
    return [r for _, r in sorted(rows, key=lambda x: x[0])], profiles


@pytest.mark.parametrize(
    ("prefill", "step_tokens"), [("separate", 256), ("chunked", 256), ("chunked", 7), ("chunked", 3)]
)
def test_greedy_rows_joining_mid_stream_equal_the_target_alone(tiny_pair, prefill, step_tokens):
    family, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    rng = torch.Generator().manual_seed(5)
    prompts = random_prompts(rng, 3) + [torch.randint(0, 95, (n,), generator=rng).tolist() for n in (41, 13, 50)]
    configs = [GenerationConfig(max_new_tokens=8 + 2 * i, block_size=[None, 4, 1, None, 2, 8][i]) for i in range(6)]
    dec = BatchDecoder(target, drafter_engine, prefill=prefill, step_tokens=step_tokens)
    rows, profiles = staggered(dec, prompts, configs, joins=[0, 0, 1, 2, 2, 4])
    for i, (row, p, c) in enumerate(zip(rows, prompts, configs)):
        assert row.result().token_ids == reference(model, p, c.max_new_tokens), (family, prefill, step_tokens, i)
    chunked = [p for p in profiles if p.chunk_rows]
    if prefill == "separate":
        assert not chunked and sum(p.prefill_tokens for p in profiles) == sum(map(len, prompts))
        return
    # the prompts that joined while rows ran entered in chunks inside the verify pass, within the budget (at least
    # a quarter of it, and MIN_CHUNK tokens if the budget has them; a budget below one verify block too), or whole
    # once no row ran
    assert sum(p.chunk_tokens + p.prefill_tokens for p in profiles) == sum(map(len, prompts))
    assert all(p.verify_rows > 0 for p in chunked)
    floor = max(step_tokens // 4, min(MIN_CHUNK, step_tokens))
    assert all(p.chunk_tokens <= max(step_tokens - sum(p.blocks), floor) for p in chunked)
    assert len(chunked) >= 2  # chunk boundaries inside prompts (at 256 too: a prompt joins a step after another)
    assert not dec.active and dec.target_session.slots.live.count(True) == 0


def test_a_row_mid_prompt_is_not_drafted_for_and_the_drafter_gets_every_prompt_feature(tiny_pair):
    """The drafter's first draft for a chunked row takes the features of the whole prompt, equal to what one
    whole-prompt pass gives (up to float rounding), and no draft comes before the prompt is all in. No time passes
    (`StoppedClock`): the pacer has no seconds to bound a step by, so the budget alone cuts the prompt (on the wall
    clock a prefill that a busy machine slowed made the pacer cut it further, into one step more)."""
    family, _, _, model, drafter = tiny_pair
    rng = torch.Generator().manual_seed(6)
    streaming = random_prompts(rng, 2)
    long_prompt = torch.randint(0, 95, (75,), generator=rng).tolist()
    first_drafts = {}
    for prefill in ("separate", "chunked"):
        target, real = torch_engines(model, drafter)
        spy = SpyDrafter(real)
        dec = BatchDecoder(target, spy, prefill=prefill, step_tokens=20, clock=StoppedClock())
        cfg = GenerationConfig(max_new_tokens=12, block_size=4)
        others = [dec.add(p, cfg) for p in streaming]
        dec.step()
        row = dec.add(long_prompt, cfg)
        steps_before_first_token = 0
        while not row.generated:
            dec.step()
            steps_before_first_token += 1
            if not row.generated:
                assert row.drafter_row not in spy.seen  # mid-prompt: never drafted for
        # chunked: 20 tokens a step less the two running rows' blocks of 4 -> 12 prompt tokens a step
        assert steps_before_first_token == (1 if prefill == "separate" else -(-75 // 12))
        handle = row.drafter_row
        dec.run()
        first_drafts[prefill] = spy.seen[handle][0]
        assert all(r.result().finish_reason == "length" for r in [*others, row])
    whole, chunked = first_drafts["separate"], first_drafts["chunked"]
    assert whole.shape[0] == len(long_prompt) + 0 and chunked.shape == whole.shape, family
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)


def test_seeded_sampled_row_is_the_same_chunked_or_separate(tiny_pair):
    family, _, _, model, drafter = tiny_pair
    rng = torch.Generator().manual_seed(7)
    prompts = random_prompts(rng, 2) + [torch.randint(0, 95, (50,), generator=rng).tolist()]
    cfg = GenerationConfig(max_new_tokens=20, block_size=4, sampling=SamplingParams(temperature=0.9, seed=11))
    out = {}
    for prefill in ("separate", "chunked"):
        target, drafter_engine = torch_engines(model, drafter)
        dec = BatchDecoder(target, drafter_engine, prefill=prefill, step_tokens=16)
        rows, _ = staggered(dec, prompts, [cfg] * 3, joins=[0, 0, 2])
        out[prefill] = [r.result().token_ids for r in rows]
    assert out["chunked"] == out["separate"], family


def test_cancelling_a_row_mid_prompt_frees_its_rows(tiny_pair):
    _, _, _, model, drafter = tiny_pair
    target, drafter_engine = torch_engines(model, drafter)
    dec = BatchDecoder(target, drafter_engine, step_tokens=8)
    running = dec.add([1, 2, 3], GenerationConfig(max_new_tokens=20))
    dec.step()
    joining = dec.add(list(range(60)), GenerationConfig(max_new_tokens=5))
    dec.step()
    assert 0 < joining.prefilled < 60 and joining.target_row is not None and not joining.generated
    dec.cancel(joining)
    assert joining.result().finish_reason == "cancelled" and dec.active == [running]
    assert dec.target_session.slots.live.count(True) == 1
    dec.run()
    assert running.result().token_ids == reference(model, [1, 2, 3], 20)


def test_options_are_checked():
    with pytest.raises(ValueError, match="prefill must be one of"):
        BatchDecoder(object(), prefill="interleaved")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step_tokens must be >= 1"):
        BatchDecoder(object(), step_tokens=0)  # type: ignore[arg-type]


def test_riding_chunks_price_the_rows_on_top_of_them():
    """A chunk in the pass is spent whatever the rows draft: a choice is priced on top of it (never as a one-token
    pass) and without its own seconds, so under a linear cost it does not move the choice (a chunk step that
    lowered the bar drafted what plain steps do not: measured: docs/design.md, "Chunked prefill"); under a bent cost, tokens
    beyond the chunk are priced at the slope they meet there."""
    t = EngineCost(fixed=1e-3, per_row=1e-4, per_token=1e-4, one_token=5e-4)
    riding = EngineCost(fixed=1e-3, per_row=1e-4, per_token=1e-4, one_token=5e-4, riding_rows=1, riding_tokens=200)
    assert price(t, 1, np.array([1.0]))[0] == pytest.approx(5e-4)
    assert price(riding, 1, np.array([1.0]))[0] == pytest.approx(1e-3 + 1e-4 + 1e-4)
    cost = CostModel(t, EngineCost(fixed=2e-3, per_row=1e-4, per_token=1e-4))
    rows = [RowChoice(alpha=a, max_block=8) for a in (0.45, 0.45, 0.7, 0.8)]
    for chunk in (40, 200, 2000):
        assert choose_blocks(rows, cost, riding=(1, chunk)) == choose_blocks(
            rows, CostModel(replace(t, one_token=None), cost.drafter)
        )
    # a knee at 256 tokens: cheap tokens below, 20x dearer beyond; a 250-token chunk leaves the drafts the dear part
    bent = EngineCost(fixed=1e-3, per_row=1e-5, per_token=2e-4, knee=256, below_knee=1e-5)
    bent_cost = CostModel(bent, EngineCost(fixed=2e-4, per_row=1e-5, per_token=1e-5))
    alone = sum(choose_blocks(rows, bent_cost))
    beside = sum(choose_blocks(rows, bent_cost, riding=(1, 250)))
    assert beside < alone


def test_where_prompts_queue_the_drafts_stay_within_the_room_the_chunks_leave():
    """Rule 8: rows that would draft long blocks beside a chunk keep the step's verify tokens within `most_tokens`
    (a queued prompt's chunk would lose every token beyond); sizes a request fixed are kept, and a lone row and an
    unfitted cost model (rules 3 and 2) are held to it too."""
    cost = CostModel(
        EngineCost(fixed=1e-3, per_row=1e-5, per_token=1e-5), EngineCost(fixed=2e-4, per_row=1e-5, per_token=1e-5)
    )
    rows = [RowChoice(alpha=0.9, max_block=8) for _ in range(6)]
    free = choose_blocks(rows, cost, riding=(1, 400))
    assert sum(free) > 20
    bounded = choose_blocks(rows, cost, riding=(1, 400), most_tokens=20)
    assert 6 < sum(bounded) <= 20  # still drafts, within the room
    fixed = [RowChoice(alpha=0.9, max_block=8, fixed=8) for _ in range(2)] + rows[:4]
    assert choose_blocks(fixed, cost, riding=(1, 400), most_tokens=12) == [8, 8, 1, 1, 1, 1]
    assert choose_blocks(rows[:1], cost, riding=(1, 400)) == [8]
    assert choose_blocks(rows[:1], cost, riding=(1, 400), most_tokens=3) == [3]
    dear = CostModel(cost.target, EngineCost(fixed=2e-3, per_row=1e-5, per_token=1e-5))  # a drafter pass's price
    assert choose_blocks(rows[:1], dear, riding=(1, 400)) == [8]
    assert choose_blocks(rows[:1], dear, riding=(1, 400), most_tokens=2) == [1]  # block 2 does not pay for a pass
    assert choose_blocks(rows[:1], cost, riding=(1, 400), most_tokens=1) == [1]
    unfitted = CostModel(EngineCost(), EngineCost())
    assert choose_blocks(rows, unfitted, most_tokens=20) == [3] * 6
    assert choose_blocks(fixed, unfitted, most_tokens=20) == [8, 8, 1, 1, 1, 1]
    assert choose_blocks(rows, cost, riding=(1, 400), most_tokens=0) == free  # 0: no bound
