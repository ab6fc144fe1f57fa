"""The hybrid's choice and the proposers' prices (decoding/proposers.py, loop.py): the hybrid never vetoes the block
policy's DFlash block on a weaker estimate of its own and reads the policy's estimate of the row; a run is priced at
the tokens its step really holds and the drafter's pass among the rows that use it; a decoder without a cost model
times the target's own, so that suffix runs on text that does not repeat do not lose to the target alone."""

from collections.abc import Sequence

import pytest
import torch
from clocks import priced_engines
from helpers import generate_one

from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.decoding.adaptive import AdaptiveBlocks
from dflash_trt.decoding.cost import CostModel, EngineCost
from dflash_trt.decoding.estimates import AcceptanceTracker
from dflash_trt.decoding.proposers import DFLASH, REGISTRY, SUFFIX, Prices, RowDrafts, best_run
from dflash_trt.decoding.suffix import SuffixAutomaton
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from dflash_trt.sim.engines import SimTargetEngine, VirtualClock

HYBRID = REGISTRY["hybrid"]
SAMPLED = SamplingParams(temperature=1.0)


class _Row:
    """What a proposer reads of a row (`proposers.ProposingRow`)."""

    def __init__(self, drafts: RowDrafts, max_drafts: int = 15):
        self.prompt_ids: list[int] = []
        self.generated: list[int] = []
        self.drafts, self.max_drafts = drafts, max_drafts


# ---- finding 2: never slower than DFlash ----------------------------------------------------
def test_the_hybrid_never_answers_no_draft_where_the_policy_chose_a_block():
    """Prices at which the hybrid's own estimate (the default 0.6) finds a block of 8 not worth its drafter pass:
    the policy, which weighed that block against no draft at its estimate, chose it; the hybrid must take it."""
    drafts = RowDrafts(SuffixAutomaton())
    drafts.add(list(range(30)))  # nothing repeats: no suffix run
    dear = Prices(row_s=1.0, token_s=0.05, drafter_row_s=2.0)
    assert HYBRID.pick(_Row(drafts), 8, dear) == (DFLASH, 8, ())
    assert HYBRID.pick(_Row(drafts), 1, dear).proposer is None  # no block chosen: no draft


def test_a_suffix_run_takes_the_round_only_where_it_earns_more_than_the_policys_block():
    """A row whose suffix run (a 6-token match) earns more than DFlash at the hybrid's old guess (0.6) but less
    than DFlash at what the policy learned of the row (0.95): the policy's estimate decides."""
    text = list(range(40))
    prices = Prices(row_s=1.0, token_s=0.02, draft_s=0.1, drafter_row_s=0.3, drafter_token_s=0.01)

    def pick(dflash_alpha: float | None):
        drafts = RowDrafts(SuffixAutomaton())
        drafts.add(text + text[:6])
        if dflash_alpha is not None:
            drafts.follow_policy(AcceptanceTracker(prior_alpha=dflash_alpha))
        return HYBRID.pick(_Row(drafts), 8, prices)

    assert pick(None).proposer is SUFFIX  # the guess: the run looks better
    assert pick(0.95).proposer is DFLASH  # what the policy knows of the row


def test_a_row_whose_runs_keep_failing_stops_taking_them():
    """Counts gathered on other text may overrate a request's runs: each failed run tempers what the row's next
    runs are expected to earn (`RunCalibration`), so after a few the row's rounds go back to its DFlash block,
    while a row whose runs come true keeps them."""
    text = list(range(40))
    prices = Prices(row_s=1.0, token_s=0.02, draft_s=0.1, drafter_row_s=0.3, drafter_token_s=0.01)
    picks = {}
    for outcome in ("kept", "failed"):
        drafts = RowDrafts(SuffixAutomaton())
        drafts.add(text + text[:6])
        drafts.follow_policy(AcceptanceTracker(prior_alpha=0.6))
        picks[outcome] = []
        for _ in range(6):
            pick = HYBRID.pick(_Row(drafts), 8, prices)
            picks[outcome].append(pick.proposer)
            if pick.proposer is not SUFFIX:
                break
            accepted = len(pick.drafts) if outcome == "kept" else 0
            HYBRID.learn(drafts, SUFFIX, len(pick.drafts), accepted)
            assert drafts.calibration.factor == (
                1.0 if outcome == "kept" else pytest.approx(4.0 / (4.0 + drafts.calibration.expected))
            )
    assert picks["kept"] == [SUFFIX] * 6  # runs that come true are not tempered (the factor stays 1)
    assert picks["failed"][0] is SUFFIX and picks["failed"][-1] is DFLASH and len(picks["failed"]) <= 5


def test_new_rows_start_from_how_their_regimes_runs_did(tiny_pair):
    """A new row's calibration starts from the decoder's runs of its sampling regime (`RunPrior`), not from trust:
    after failed greedy runs a new greedy row discounts its runs, a sampled one does not, a row under a grammar
    teaches the pool nothing, and a benchmark's `forget_finished_outputs` starts the pools afresh."""
    decoder = BatchDecoder(TorchTargetEngine(tiny_pair[3]))
    greedy, sampled = GenerationConfig(proposer="suffix"), GenerationConfig(proposer="suffix", sampling=SAMPLED)
    failed = decoder.new_row([1, 2, 3], greedy)
    for _ in range(3):
        failed.drafts.calibration.update(3.0, 0)  # three runs expected to keep 3 tokens each kept none
    assert decoder.new_row([4, 5], greedy).drafts.calibration.factor == pytest.approx(4.0 / 13.0, rel=0.01)
    assert decoder.new_row([4, 5], sampled).drafts.calibration.factor == 1.0
    guided = decoder.new_row([1, 2, 3], greedy)
    guided.drafts.calibration.learns = False  # as a row under a grammar is made (row.py)
    guided.drafts.calibration.update(30.0, 0)
    assert decoder.new_row([4, 5], greedy).drafts.calibration.factor == pytest.approx(4.0 / 13.0, rel=0.01)
    decoder.forget_finished_outputs()
    assert decoder.new_row([4, 5], greedy).drafts.calibration.factor == 1.0


def test_the_adaptive_policys_estimate_is_the_one_the_hybrid_reads(tiny_pair):
    """A new row's DFlash estimate starts from what its regime's finished requests measured (the policy's prior),
    not from a fixed guess, and the policy, not the hybrid, learns it (one update a round, not two)."""
    _, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    policy = AdaptiveBlocks(CostModel(EngineCost(fixed=0.01, per_token=1e-4), EngineCost(fixed=1e-3)))
    policy.prior.alpha[False] = 0.93
    decoder = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), policy=policy)
    row = decoder.add([5, 6, 7, 8, 9, 10], GenerationConfig(max_new_tokens=12, proposer="hybrid"))
    decoder.step()  # the prefill: the policy makes the row's state
    assert row.drafts.dflash_estimate is policy.rows[row.id].tracker
    assert row.drafts.dflash_estimate.prior_alpha == pytest.approx(0.93)
    while not row.done:
        decoder.step()
        tracker = row.drafts.dflash_estimate
        dflash_rounds = [r for r in row.stats.trace() if r["proposer"] == "dflash"]
        assert tracker.drafted_rounds == len(dflash_rounds)  # once a round: the policy's update alone


# ---- finding 4: the lengths actually chosen, the drafter among the rows that use it ---------
def _gpu_like() -> CostModel:
    """A GPU-shaped target: flat at 10 ms up to 64 tokens (weight-bound), 0.5 ms a token beyond."""
    target = EngineCost(fixed=0.01, curve=((1, 0.0), (64, 0.0), (1024, 0.48)))
    return CostModel(target, EngineCost(fixed=0.008, per_token=1e-5))


def test_a_run_is_priced_where_the_steps_tokens_put_it_on_the_curve():
    """8 rows, the others verifying blocks of 16 (113 tokens besides a row's own): a row's run of 8 drafts costs
    what the curve says 8 more tokens cost from there (4 ms), not the flat start of 8, 16, 24 tokens (0 ms)."""
    cost = _gpu_like()
    blocks = [1] + [16] * 7
    priced = Prices.from_cost(cost, blocks, 16)
    assert priced is not None and len(priced) == 8
    target, _ = cost.current()
    expected = target(8, 113 + 8) - target(8, 113)
    assert priced[0].verify_s(8) - priced[0].verify_s(0) == pytest.approx(expected)
    assert expected == pytest.approx(0.004, rel=0.01)
    alone = Prices.from_cost(cost, [1] * 8, 16)[0]  # when nobody drafts the same run is nearly free
    assert alone.verify_s(8) - alone.verify_s(0) < expected / 10


def test_a_rows_drafter_price_is_what_the_pass_costs_more_with_it():
    """One row of 8 drafts a DFlash block: it pays the drafter's whole pass, not an eighth of it. Where all 8 draft,
    a row that left the pass would save only what it adds to it (the pass's slope), not an eighth of its fixed cost:
    the other 7 still pay that."""
    cost = _gpu_like()
    _, drafter = cost.current()
    one = Prices.from_cost(cost, [8] + [1] * 7, 16)[0]
    assert one.drafter_row_s == pytest.approx(drafter(1, 2))
    every = Prices.from_cost(cost, [8] * 8, 16)[0]
    assert every.drafter_row_s == pytest.approx(drafter(8, 16) - drafter(7, 14))
    assert every.drafter_row_s < drafter(8, 16) / 8 / 10


# ---- finding 8: without a drafter, no draft where a run is not worth its verify tokens ------
class _CpuSteps:
    """A simulated CPU's passes (the `priced_engines` cost protocol): a one-token pass multiplies vectors, 10 ms;
    any larger one multiplies matrices, 20 ms + 0.5 ms a token. No drafter runs in these tests."""

    def target(self, new: Sequence[int], past: Sequence[int], logits: int) -> float:
        tokens = sum(new)
        return 0.010 if tokens == 1 else 0.020 + 0.0005 * tokens

    def drafter(self, blocks: Sequence[int], new_context: Sequence[int], past: Sequence[int]) -> float:
        return 0.0


def _seconds(target, clock, prompt: list[int], n: int, proposer: str | None) -> tuple[list[int], float, int]:
    """The request's tokens, its seconds on the virtual clock and its drafted tokens, on a decoder without a
    drafter that has served a request before (its start-up costs, the target's cost grid included, paid)."""
    decoder = BatchDecoder(target, None, clock=clock)
    config = GenerationConfig(max_new_tokens=n, **({"proposer": proposer} if proposer else {}))
    generate_one(decoder, [1, 2, 3, 1, 2, 3, 1, 2, 3], GenerationConfig(max_new_tokens=4, proposer=config.proposer))
    started = clock()
    result = generate_one(decoder, prompt, config)
    return result.token_ids, clock() - started, result.stats.drafted_by.get(proposer or "", 0)


def test_suffix_runs_without_a_drafter_never_lose_to_the_target_alone():
    """A target whose text never repeats (the simulator's: a hash of the sequence and the position) over 16 ids:
    short spurious matches everywhere, that a run seldom gets right. Priced by the pacer's line (which leaves out
    the step from a one-token pass to a pass of drafts) every match drafts and the request runs slower than the
    target alone; the decoder's own timed cost prices that step and the runs that do not pay it are not drafted."""
    rng = torch.Generator().manual_seed(3)
    alone = suffix = 0.0
    for _ in range(4):
        prompt = torch.randint(0, 16, (32,), generator=rng).tolist()
        clock = VirtualClock()
        target = SimTargetEngine(_CpuSteps(), clock, vocab_size=16)  # type: ignore[arg-type]
        expected, t_alone, _ = _seconds(target, clock, prompt, 64, None)
        got, t_suffix, _ = _seconds(target, clock, prompt, 64, "suffix")
        assert got == expected
        alone, suffix = alone + t_alone, suffix + t_suffix
    assert suffix <= alone / 0.98, (suffix, alone)


def test_a_repeated_text_still_gets_its_suffix_runs_without_a_drafter(tiny_pair):
    """The prompt repeats a long stretch and the target, fed its start, continues it the same way: the priced
    choice still drafts the runs, and they pay (how much depends on how long the target keeps repeating)."""
    _, _, _, model, _ = tiny_pair

    def seconds(prompt: list[int], n: int, proposer: str | None) -> tuple[list[int], float, int]:
        target, _, clock = priced_engines(TorchTargetEngine(model), cost=_CpuSteps())  # type: ignore[arg-type]
        return _seconds(target, clock, prompt, n, proposer)

    probe, _, _ = seconds([3, 1, 4, 1, 5, 9, 2, 6], 48, None)  # what the target says after this start
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] + probe + [3, 1, 4, 1, 5, 9, 2, 6]
    expected, t_alone, _ = seconds(prompt, 40, None)
    got, t_suffix, drafted = seconds(prompt, 40, "suffix")
    assert got == expected
    assert drafted > 0 and t_suffix < t_alone / 1.1, (t_suffix, t_alone, drafted)


def test_best_run_takes_no_run_that_does_not_pay_its_step():
    """At the CPU's prices (10 ms one-token pass, 20 ms + 0.5 ms a token beyond), a one-token match's run
    (prior 0.2) is not worth its step."""
    [prices] = Prices.from_cost(
        CostModel(EngineCost(fixed=0.02, per_token=0.0005, one_token=0.01), EngineCost()), [1], 16
    )
    drafts = RowDrafts(SuffixAutomaton())
    drafts.add([1, 2, 3, 4, 5, 6, 7, 1])
    assert best_run(drafts, 16, prices)[0].proposer is None
