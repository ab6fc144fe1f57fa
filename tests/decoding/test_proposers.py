"""Proposers (decoding/proposers.py, suffix.py): the suffix automaton finds the longest repeated suffix, and every
proposer is lossless: greedy output equals the target alone token for token, sampled output has the target's
distribution (with a negative control that breaks the deterministic rule and must fail)."""

import random
from dataclasses import replace

import pytest
import torch
from clocks import StoppedClock
from helpers import generate_one
from test_spec import N_SAMPLES, SETTINGS, V, chi_square_pvalue, exact_joint, sharp_pair  # noqa: F401

from dflash_trt.decoding import BatchDecoder, GenerationConfig, InputError
from dflash_trt.decoding import acceptance as acceptance_module
from dflash_trt.decoding.proposers import (
    PROPOSERS,
    REGISTRY,
    SUFFIX,
    Prices,
    RowDrafts,
    best_run,
    proposer_for,
    suffix_prior,
)
from dflash_trt.decoding.suffix import SharedSuffixes, SharedWalk, SuffixAutomaton, SuffixMatch
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


# ---- the suffix automaton ------------------------------------------------------------------
def _longest_repeat(tokens: list[int]) -> tuple[int, list[int]]:
    """Brute force: the longest suffix that also ends earlier, and the positions where it does."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        ends = [e for e in range(length - 1, n - 1) if tokens[e - length + 1 : e + 1] == tokens[n - length :]]
        if ends:
            return length, ends
    return 0, []


def test_automaton_finds_the_longest_repeated_suffix_and_what_followed_it():
    rng = random.Random(0)
    for _ in range(200):
        sam, tokens = SuffixAutomaton(), []
        for _ in range(rng.randint(1, 50)):
            tokens.append(rng.randint(0, 3))
            sam.extend(tokens[-1])
            length, ends = _longest_repeat(tokens)
            found = sam.match(5)
            if not length:
                assert found is None
                continue
            assert found is not None and found.length == length, (tokens, found)
            assert any(_copied(tokens, e + 1, 5) == found.continuation for e in ends), (tokens, found, ends)
        assert sam.size <= 2 * len(tokens) + 1  # memory: at most 2n states


def _copied(tokens: list[int], start: int, most: int) -> tuple[int, ...]:
    """What follows position `start` - 1, continued past the text's end as an overlapping copy."""
    text = list(tokens)
    for j in range(most):
        text.append(text[start + j])
    return tuple(text[start : start + most])


def test_a_run_reaching_the_texts_end_continues_the_loop():
    """A loop of period 3 (a generation cycling): the run is the loop continued, not the 2 tokens left before the
    text's end (an overlapping copy: token j of the run is token j - 3)."""
    sam = SuffixAutomaton()
    sam.extend_all([9] + [1, 2, 3] * 4)
    found = sam.match(10)
    assert found is not None and found.length == 9 and found.continuation == (1, 2, 3, 1, 2, 3, 1, 2, 3, 1)
    sam.extend_all([4, 5])  # the loop broke: "3 4 5" never occurred before, so the match is "5" alone
    assert sam.match(4) is None or sam.match(4).length < 3


def test_automaton_reads_the_most_recent_earlier_occurrence():
    sam = SuffixAutomaton()
    sam.extend_all([7, 8, 1, 7, 8, 2, 7, 8])
    assert sam.match(1) == SuffixMatch(2, 2, (2,))  # after the second "7 8" (the newest), not the first


def test_automaton_stops_growing_at_its_bound():
    sam = SuffixAutomaton(max_tokens=10)
    sam.extend_all(list(range(50)))
    assert len(sam.tokens) == 10 and sam.size <= 21
    assert sam.match(4) is None  # a full automaton proposes nothing (its text no longer ends where the row does)


def test_the_shared_automaton_proposes_what_an_earlier_output_continued_with():
    shared = SharedSuffixes(max_tokens=64)
    shared.add([1, 2, 3, 4, 5])
    shared.add([9, 8, 7])
    walk = SharedWalk(shared)
    walk.add([6, 6, 2, 3])  # (made unsynced: the first match walks the recorded tokens)
    assert walk.match(8) == SuffixMatch(2, 1, (4, 5))  # the run stops where that output ended
    walk.add([4, 5])
    assert walk.match(8) is None  # "2 3 4 5" ends an output: nothing followed it there


def test_the_shared_automaton_is_bounded_and_evicts_the_oldest_outputs():
    shared = SharedSuffixes(max_tokens=40)
    walk = SharedWalk(shared)
    for i in range(30):
        shared.add([100 + i, 1, 2, 3])
        assert len(shared.sam.tokens) <= 40 and shared.size <= 81
    assert shared.outputs[0][0] > 100 and shared.outputs[-1][0] == 129  # the newest kept, the oldest gone
    walk.add([129, 1])  # a walk made before the rebuilds is walked again on its next match
    assert walk.match(4) == SuffixMatch(2, 1, (2, 3))


def test_a_suffix_run_is_priced_by_its_match_and_the_rows_own_rounds():
    drafts = RowDrafts(SuffixAutomaton())
    drafts.add([1, 2, 3, 4, 5, 6, 1, 2, 3])
    run, rate = best_run(drafts, 10, Prices(row_s=1.0, token_s=0.0))
    assert run.proposer is SUFFIX and run.drafts == (4, 5, 6, 1, 2, 3, 4, 5, 6, 1)  # free tokens: all it may
    assert rate > 1.0
    dear = best_run(drafts, 10, Prices(row_s=1.0, token_s=1.0))[0]  # a token costs a whole step: never worth it
    assert dear.proposer is None and dear.name == "none"
    prior = suffix_prior(SuffixMatch(3, 1, (4,)))
    assert 0.0 < prior < suffix_prior(SuffixMatch(8, 1, (4,))) < 1.0  # a longer match is trusted more
    for _ in range(20):  # the row's suffix runs keep failing: its estimate falls below the match's prior
        SUFFIX.learn(drafts, SUFFIX, 4, 0)
    assert drafts.suffix_alpha(SuffixMatch(3, 1, (4,))) < prior / 2


def test_the_step_to_a_pass_of_drafts_is_paid_once_per_run_not_per_token():
    """A CPU's shape (`cost.EngineCost`): a one-token pass 10 ms, any larger one 20 ms + 0.5 ms a token. A run of
    k drafts costs 20.5 + 0.5 k ms, so a long run of a sound match pays; priced per token at the 1 -> 2 step
    (10.5 ms a token) no run longer than a few tokens would."""
    from dflash_trt.decoding.cost import CostModel, EngineCost
    from dflash_trt.decoding.policy import FixedBlocks

    line = EngineCost(fixed=0.02, per_token=0.0005, one_token=0.01)
    decoder = BatchDecoder.__new__(BatchDecoder)
    decoder.policy = FixedBlocks()
    decoder.policy.cost = CostModel(line, EngineCost(fixed=0.002))  # type: ignore[attr-defined]
    prices = decoder._prices(1)
    assert prices.verify_s(0) == pytest.approx(0.01)
    assert prices.verify_s(1) == pytest.approx(0.021) and prices.verify_s(16) == pytest.approx(0.0285)
    drafts = RowDrafts(SuffixAutomaton())
    text = list(range(40))
    drafts.add(text + text[:12])  # a 12-token match, 28 tokens on
    for _ in range(8):
        SUFFIX.learn(drafts, SUFFIX, 16, 16)  # the row's runs have held
    run = best_run(drafts, 16, prices)[0]
    assert run.proposer is SUFFIX and len(run.drafts) == 16
    folded = Prices(prices.row_s, prices.draft_s + prices.token_s)  # the step paid by every token
    assert len(best_run(drafts, 16, folded)[0].drafts) < 16


def test_a_new_proposer_is_a_class_and_the_registry_holds_it():
    assert set(REGISTRY) == set(PROPOSERS)
    assert [proposer_for(n).name for n in PROPOSERS] == list(PROPOSERS)
    with pytest.raises(ValueError, match="proposer must be one of"):
        proposer_for("eagle")


# ---- greedy: every proposer equals the target alone -----------------------------------------
def _repetitive(rng: torch.Generator) -> list[int]:
    """A prompt that repeats a random phrase (as agents and rewrites resend text), so suffix runs fire."""
    phrase = torch.randint(0, 95, (int(torch.randint(3, 12, (1,), generator=rng)),), generator=rng).tolist()
    return phrase * int(torch.randint(2, 4, (1,), generator=rng)) + phrase[: len(phrase) // 2]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_equals_target_alone_with_every_proposer(tiny_pair, proposer):
    family, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    # unpriced (no time passes, `StoppedClock`): a row drafts whenever a suffix matches, whatever the machine's load
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), clock=StoppedClock())
    base = BatchDecoder(TorchTargetEngine(model))
    rng = torch.Generator().manual_seed(5)
    by: dict[str, int] = {}
    for trial in range(8):
        prompt = _repetitive(rng) if trial % 2 == 0 else torch.randint(0, 95, (20,), generator=rng).tolist()
        n = int(torch.randint(10, 50, (1,), generator=rng))
        expected = generate_one(base, prompt, GenerationConfig(max_new_tokens=n)).token_ids
        got = generate_one(spec, prompt, GenerationConfig(max_new_tokens=n, proposer=proposer))
        assert got.token_ids == expected, (family, proposer, trial)
        for name, count in got.stats.drafted_by.items():
            by[name] = by.get(name, 0) + count
        assert {r["proposer"] for r in got.stats.trace()} <= {*PROPOSERS, "none"}
        assert got.stats.proposer == proposer
    if proposer_for(proposer).keeps_suffix:
        assert by.get("suffix", 0) > 0, "suffix runs must be verified for the test to mean anything"
    if not proposer_for(proposer).uses_drafter:
        assert "dflash" not in by


def test_batched_rows_of_different_proposers_each_equal_the_target_alone(tiny_pair):
    _, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    base = BatchDecoder(TorchTargetEngine(model))
    rng = torch.Generator().manual_seed(9)
    prompts = [_repetitive(rng) for _ in range(6)]
    configs = [GenerationConfig(max_new_tokens=30, proposer=PROPOSERS[i % len(PROPOSERS)]) for i in range(6)]
    got = spec.generate(prompts, configs)
    for prompt, result in zip(prompts, got):
        assert result.token_ids == generate_one(base, prompt, GenerationConfig(max_new_tokens=30)).token_ids


def test_a_target_without_a_drafter_gets_suffix_runs(tiny_pair):
    _, _, _, model, _ = tiny_pair
    alone = BatchDecoder(TorchTargetEngine(model), clock=StoppedClock())  # unpriced: a match is drafted
    prompt = [5, 6, 7, 8, 9, 10] * 3
    expected = generate_one(alone, prompt, GenerationConfig(max_new_tokens=30)).token_ids
    for proposer in ("suffix", "hybrid"):
        got = generate_one(alone, prompt, GenerationConfig(max_new_tokens=30, proposer=proposer))
        assert got.token_ids == expected
        assert got.stats.drafted_by.get("suffix", 0) > 0 and got.stats.suffix_states > 0


def test_a_step_where_no_row_takes_a_dflash_block_makes_no_drafter_call(tiny_pair):
    from helpers import CountingDrafter

    _, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    counting = CountingDrafter(TorchDrafterEngine.for_target(drafter, target))
    dec = BatchDecoder(target, counting, clock=StoppedClock())  # unpriced: a match is drafted
    generate_one(dec, [3, 4, 5] * 4, GenerationConfig(max_new_tokens=20, proposer="suffix"))
    assert counting.tokens_handed == []  # a suffix row holds no drafter row
    got = generate_one(dec, [3, 4, 5, 6] * 6, GenerationConfig(max_new_tokens=40, proposer="hybrid"))
    rounds = [r["proposer"] for r in got.stats.trace()]
    assert "suffix" in rounds
    assert len(counting.tokens_handed) == rounds.count("dflash")  # one drafted row per DFlash round, no more


def test_a_later_request_drafts_from_an_earlier_ones_output_of_its_own_tenant_only(tiny_pair):
    _, _, _, model, _ = tiny_pair
    # unpriced (no time passes): a row drafts whenever a suffix matches, so what it accepts is the matches' doing
    alone = BatchDecoder(TorchTargetEngine(model), clock=StoppedClock())
    prompt = list(range(10, 40))  # no repeat inside: only the shared automaton can propose
    config = GenerationConfig(max_new_tokens=40, proposer="suffix", tenant="a")
    expected = generate_one(alone, prompt, GenerationConfig(max_new_tokens=40)).token_ids
    first, again = generate_one(alone, prompt, config), generate_one(alone, prompt, config)
    assert first.token_ids == again.token_ids == expected
    assert again.stats.accepted_by.get("suffix", 0) > first.stats.accepted_by.get("suffix", 0)
    # another tenant's request, and a request of no tenant (the default), read nothing of tenant a's outputs
    for other in (replace(config, tenant="b"), replace(config, tenant=None)):
        assert generate_one(alone, prompt, other).stats.accepted_by == first.stats.accepted_by
    no_shared = BatchDecoder(TorchTargetEngine(model), shared_suffix_tokens=0, clock=StoppedClock())
    generate_one(no_shared, prompt, config)
    alone_again = generate_one(no_shared, prompt, config)  # per request only: the first output is not seen
    assert alone_again.stats.accepted_by.get("suffix", 0) < again.stats.accepted_by.get("suffix", 0)


def test_the_least_recently_served_tenant_is_dropped_past_the_bound():
    from dflash_trt.decoding.sharing import TenantSuffixes

    pool = TenantSuffixes(64, max_tenants=2)
    a = pool.of("a")
    assert pool.of(None) is None and pool.of("a") is a
    pool.of("b")
    pool.of("a")  # a served again: b is now the least recent
    pool.of("c")
    assert pool.tenants == 2 and pool.of("a") is a
    assert pool.of("b") is not None and pool.tenants == 2  # b starts again from nothing (c was dropped)


def test_an_unknown_proposer_is_an_input_error(tiny_pair):
    _, _, _, model, _ = tiny_pair
    with pytest.raises(InputError, match="proposer must be one of"):
        BatchDecoder(TorchTargetEngine(model)).add([1, 2], GenerationConfig(proposer="eagle"))


# ---- sampling: the target's distribution, with a negative control --------------------------
SAMPLED_PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # every token of V repeats: suffix runs from the first round


def _sample_counts(model, drafter, proposer: str) -> tuple[dict, int]:
    """Every seed's tokens. Unpriced (`Prices()`: a verify token costs nothing), so a row drafts whenever a suffix
    matches: which runs are verified is then no matter of the machine's timings, and losslessness must hold for any
    choice of runs. One tenant for every seed: each request's suffix runs also match the earlier seeds' outputs (a
    request without a tenant matches its own few tokens only, too few drafts to test their acceptance)."""
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    spec._prices = lambda n: Prices()  # type: ignore[method-assign]
    counts: dict = {}
    accepted = 0
    for seed in range(N_SAMPLES):
        config = GenerationConfig(max_new_tokens=4, sampling=SETTINGS["T1"](seed), proposer=proposer, tenant="seeds")
        r = generate_one(spec, SAMPLED_PROMPT, config)
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        accepted += r.stats.accepted_by.get("suffix", 0)
    return counts, accepted


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_sampled_suffix_and_hybrid_drafts_keep_the_targets_distribution(sharp_pair, proposer):  # noqa: F811
    model, drafter = sharp_pair
    expected = exact_joint(model, SAMPLED_PROMPT, SETTINGS["T1"](0), 4)
    counts, accepted = _sample_counts(model, drafter, proposer)
    assert accepted > N_SAMPLES * 0.05, "suffix drafts must be accepted often enough to test their acceptance"
    p = chi_square_pvalue(counts, expected, N_SAMPLES)
    assert p > 1e-3, f"{proposer} samples deviate from the target distribution (p={p:.2e})"


def _accept_every_draft(draft, target_probs, generator):
    from dflash_trt.decoding.sampling import sample

    return draft.shape[0], int(sample(target_probs[draft.shape[0]], generator))


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_statistical_test_catches_a_broken_deterministic_rule(sharp_pair, monkeypatch, proposer):  # noqa: F811
    """Negative control: accepting a suffix run without judging it must fail the test above."""
    model, drafter = sharp_pair
    monkeypatch.setattr(acceptance_module, "accept_deterministic", _accept_every_draft)
    expected = exact_joint(model, SAMPLED_PROMPT, SETTINGS["T1"](0), 4)
    counts, _ = _sample_counts(model, drafter, proposer)
    assert chi_square_pvalue(counts, expected, N_SAMPLES) < 1e-6


def test_a_benchmark_run_never_reads_an_earlier_runs_output_of_the_same_prompt(tiny_pair, monkeypatch):
    """The bench methods run one prompt under several methods on one decoder: each run must draft as a first
    request would, or a later suffix / hybrid run reads an earlier run's output and its acceptance is inflated."""
    from dflash_trt.bench.methods import dflash_method

    _, _, _, model, _ = tiny_pair
    decoder = BatchDecoder(TorchTargetEngine(model))
    seen: list[int] = []  # earlier outputs in the shared structure when each run starts
    generate = decoder.generate

    def counting(prompts, config, *args, **kwargs):
        assert decoder.shared_suffixes is not None
        seen.append(len(decoder.shared_suffixes.of("bench").outputs))
        return generate(prompts, replace(config, tenant="bench"), *args, **kwargs)

    monkeypatch.setattr(decoder, "generate", counting)
    method = dflash_method("suffix", "dflash", decoder, 1, proposer="suffix")
    prompt = list(range(10, 40))
    first, again = method.run(prompt, 40, 0.0, 0), method.run(prompt, 40, 0.0, 0)
    assert first.token_ids == again.token_ids
    assert seen == [0, 0]
    assert decoder.shared_suffixes is not None and decoder.shared_suffixes.of("bench").outputs  # kept till the next


@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_a_fixed_block_size_bounds_suffix_runs_too(tiny_pair, proposer):
    """block_size 1 is the target alone whatever the proposer (`serve --block-size 1`, the benchmarks' baseline);
    a fixed block of 3 verifies at most 2 suffix drafts a round; the output stays the target's. Unpriced (no time
    passes): a row drafts whenever a suffix matches, so the block is what bounds its runs."""
    _, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), clock=StoppedClock())
    base = BatchDecoder(TorchTargetEngine(model))
    prompt = [5, 6, 7, 8, 9, 10, 11] * 4
    expected = generate_one(base, prompt, GenerationConfig(max_new_tokens=30)).token_ids
    alone = generate_one(spec, prompt, GenerationConfig(max_new_tokens=30, proposer=proposer, block_size=1))
    assert alone.token_ids == expected and not alone.stats.drafted_by
    three = generate_one(spec, prompt, GenerationConfig(max_new_tokens=30, proposer=proposer, block_size=3))
    assert three.token_ids == expected and three.stats.drafted_by.get("suffix", 0) > 0
    assert max(r["block_size"] for r in three.stats.trace()) <= 3
    fixed = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), block_size=1)
    assert not generate_one(fixed, prompt, GenerationConfig(max_new_tokens=30, proposer=proposer)).stats.drafted_by
