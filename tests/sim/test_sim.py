"""The serving simulation (dflash_trt/sim): cost model against the vendored profiles, the simulated engines
against the batched protocols, the real loop on them, acceptance sampling (`dflash-trt bench sim`, the benchmark
that drives it: tests/bench/test_sim_bench.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dflash_trt.decoding import BatchDecoder, GenerationConfig, SamplingParams
from dflash_trt.runtime.base import DrafterEngine, DraftRequest, TargetEngine
from dflash_trt.sim.acceptance import PAPER_T0_B16, POOR, AcceptanceProfile, paper_profiles, tau_of
from dflash_trt.sim.cost import LinearPassCost, ProfileCost
from dflash_trt.sim.engines import sim_engines, truth, truth_many
from dflash_trt.sim.policies import KnownAcceptance, Oracle, schedule_draft_len, sim_decoder, table_k
from dflash_trt.sim.profiles import LAYER_OPS, all_reduce_profile, layer_profile
from dflash_trt.sim.serving import _uniform_ids, simulate, workload

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(0.0)


def test_profile_sums_match_the_issue():
    """Issue 28 quotes the per-layer sums of Meta-Llama-3-8B's A100 mlp.csv at tp=1; its figures for 1..512
    tokens are the sum of every profiled column (the embedding lookup included), 2048 the layer ops alone."""
    p = layer_profile("a100", "llama-3-8b")
    quoted = {1: 0.306, 16: 0.331, 128: 0.421, 256: 0.624, 512: 1.11}
    for n, ms in quoted.items():
        assert 1e3 * (p.layer(n) + p.op("emb", n)) == pytest.approx(ms, rel=0.01), n
    assert 1e3 * p.layer(2048) == pytest.approx(4.55, rel=0.01)
    assert len(LAYER_OPS) == 9
    # the ratios the issue draws: 16 rows x 8 cost ~1.27x 16 x 1; 256 x 8 ~7.3x 256 x 1
    assert p.layer(128) / p.layer(16) == pytest.approx(1.27, abs=0.05)
    assert p.layer(2048) / p.layer(256) == pytest.approx(7.3, abs=0.3)
    assert p.layer(20) == pytest.approx((p.layer(16) + p.layer(24)) / 2)  # interpolated between grid points


def test_all_reduce_and_tp():
    ar = all_reduce_profile("a100")
    sizes = [2048, 8192, 1 << 20, 1 << 24, 1 << 26]
    for tp in (2, 4, 8):
        times = [ar(s, tp) for s in sizes]
        assert times == sorted(times) and times[0] > 0  # monotone in size
    assert ar(8192, 1) == 0.0
    c1, c4 = ProfileCost(model="llama-3-70b", tp=4), ProfileCost(model="llama-3-70b", tp=8)
    assert c1.comm(16) > 0 and ProfileCost(tp=1).comm(16) == 0
    # more GPUs: each layer's matrices cost less (at 2048 tokens, compute bound)
    assert c4.op(2048) < c1.op(2048)
    with pytest.raises(ValueError, match="tp=3"):
        ProfileCost(tp=3)


def test_attention_model_against_flashattention2():
    """A 2048-token causal prefill (32 heads, head dim 128) over 32 layers: FlashAttention-2 on A100 runs it at
    150-200 TFLOP/s, i.e. 5.5-7.3 ms; decode is memory bound: 1 query over 4096 keys reads the KV at ~80 %
    of HBM bandwidth."""
    c = ProfileCost()
    prefill = 32 * c.attention([2048], [0], causal=True)
    assert 5.5e-3 <= prefill <= 7.3e-3
    decode = c.attention([1] * 64, [4096] * 64, causal=True)
    kv_bytes = 64 * 4098 * 2 * 8 * 128 * 2
    assert decode == pytest.approx(kv_bytes / (2.039e12 * 0.8), rel=0.01)
    # a verify block over the same cache reads the same bytes: nearly free next to one token
    assert c.attention([16] * 64, [4096] * 64, causal=True) < 1.05 * decode


def test_verify_costs_little_more_than_one_token_at_low_batch():
    c = ProfileCost()
    one = c.target([1] * 16, [512] * 16, 16)
    block = c.target([8] * 16, [512] * 16, 128)
    assert 1.0 < block / one < 1.5
    big = c.target([8] * 256, [512] * 256, 2048) / c.target([1] * 256, [512] * 256, 256)
    assert big > 3.0  # compute bound


def test_acceptance_fit_and_sampling():
    profiles = paper_profiles()
    for name, tau in PAPER_T0_B16.items():
        assert profiles[name].tau(16) == pytest.approx(tau, abs=1e-6)
        rates = profiles[name].rates
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # later positions accept no better
    assert POOR.tau(16) == pytest.approx(2.0, abs=1e-6)
    # sampling: the empirical tau of many rounds matches the fitted one
    rng = random.Random(0)
    p = profiles["mt-bench"]
    n = 20000
    mean = sum(1 + p.accepted([rng.random() for _ in range(15)]) for _ in range(n)) / n
    assert mean == pytest.approx(p.tau(16), rel=0.03)
    # replay: per-position rates counted from recorded rounds give back the recorded tau
    rounds = [(8, p.accepted([rng.random() for _ in range(7)])) for _ in range(5000)]
    replay = AcceptanceProfile.from_rounds("rec", rounds)
    assert replay.tau(8) == pytest.approx(1 + sum(a for _, a in rounds) / len(rounds), rel=0.03)
    assert AcceptanceProfile.from_tau("t", 4.0, 8).tau(8) == pytest.approx(4.0, abs=1e-6)


def test_batched_sampling_draws_what_the_scalar_forms_draw():
    """The engines' and workloads' vectorised forms are the scalar ones, number for number (a run's figures are
    bit-identical whichever computes them): `truth_many` is `truth`, `_uniform_ids` is `randrange` in a loop."""
    rng = random.Random(3)
    seeds = [0, 1, (1 << 24) - 1] + [rng.randrange(1 << 24) for _ in range(200)]
    positions = [0, 1, (1 << 20) + 5] + [rng.randrange(1 << 21) for _ in range(200)]
    for vocab in (256, 255, 7):
        assert truth_many(seeds, positions, vocab).tolist() == [truth(s, q, vocab) for s, q in zip(seeds, positions)]
    for lo, hi in ((7, 256), (2, 256), (0, 1), (0, 1000)):
        a, b = random.Random(11), random.Random(11)
        assert _uniform_ids(a, lo, hi, 500) == [b.randrange(lo, hi) for _ in range(500)]
        assert a.random() == b.random()  # and leaves the generator where randrange does


def test_engines_honour_the_protocols():
    profiles = [paper_profiles()["math500"], POOR]
    target, drafter, clock = sim_engines(ProfileCost(), profiles)
    assert isinstance(target, TargetEngine) and isinstance(drafter, DrafterEngine)
    ts, ds = target.new_session(), drafter.new_session()
    a, b = ts.add_row(), ts.add_row()
    t0 = clock()
    outs = ts.forward([a, b], [torch.tensor([0, 5, 6, 7]), torch.tensor([1, 9])], last_logits_only=True)
    assert clock() > t0  # a pass takes time
    assert [o.logits.shape for o in outs] == [(1, 256), (1, 256)]
    assert [o.features.shape for o in outs] == [(4, 3), (2, 3)]
    assert ts.length(a) == 4 and ts.length(b) == 2
    seed_a = int(outs[0].features[0, 1])
    assert int(outs[0].logits[0].argmax()) == truth(seed_a, 4, 256)
    # verify 3 tokens on a, roll back to 5; b untouched
    out = ts.forward([a], [torch.tensor([1, 2, 3])])[0]
    assert out.logits.shape == (3, 256) and ts.length(a) == 7
    ts.rollback(a, 5)
    assert ts.length(a) == 5 and ts.length(b) == 2
    with pytest.raises(ValueError):
        ts.rollback(a, 6)
    ts.remove_row(b)
    with pytest.raises(KeyError):
        ts.length(b)
    c = ts.add_row()  # a freed handle is reused, empty
    assert c == b and ts.length(c) == 0
    # the drafter: its block starts after the last feature; a longer block at the same place extends a shorter
    da = ds.add_row()
    d8 = ds.draft([DraftRequest(da, outs[0].features, 3, 8)])[0]
    assert d8.tokens.shape == (7,) and d8.logits.shape == (7, 256) and ds.context_length(da) == 4
    db = ds.add_row()
    d16 = ds.draft([DraftRequest(db, outs[0].features, 3, 16)])[0]
    assert (
        d16.tokens[:7].tolist()[: int((d8.tokens == d16.tokens[:7]).cumprod(0).sum())]
        == d8.tokens.tolist()[: int((d8.tokens == d16.tokens[:7]).cumprod(0).sum())]
    )
    with pytest.raises(ValueError):
        ds.draft([DraftRequest(da, outs[0].features[:1], 3, 17)])


def _decode(policy_kwargs, prompts, n):
    profiles = list(paper_profiles().values()) + [POOR]
    target, drafter, clock = sim_engines(ProfileCost(), profiles)
    dec = BatchDecoder(target, drafter if policy_kwargs is not None else None, clock=clock, **(policy_kwargs or {}))
    return dec.generate(prompts, GenerationConfig(max_new_tokens=n, sampling=GREEDY)), clock()


def test_greedy_decoder_on_sim_equals_target_alone():
    rng = random.Random(1)
    prompts = [[c] + [rng.randrange(8, 256) for _ in range(rng.randint(5, 60))] for c in range(8)]
    alone, t_alone = _decode(None, prompts, 48)
    for kwargs in ({"block_size": 16}, {"block_size": 4}):
        spec, t_spec = _decode(kwargs, prompts, 48)
        assert [r.token_ids for r in spec] == [r.token_ids for r in alone]
        assert t_spec < t_alone  # 8 rows on an A100: drafting pays
    # and each row is the ground truth of its sequence
    seq = alone[0].token_ids
    from dflash_trt.sim.engines import SEED_TOKENS, prompt_seed

    s = prompt_seed(prompts[0][:SEED_TOKENS])  # the sequence's identity: its prompt's first tokens
    assert seq == [truth(s, len(prompts[0]) + i, 256) for i in range(48)]


def test_decoder_tau_matches_fitted_rates():
    rng = random.Random(2)
    prompts = [[0] + [rng.randrange(8, 256) for _ in range(30)] for _ in range(8)]  # class 0: gsm8k
    res, _ = _decode({"block_size": 16}, prompts, 400)
    taus = [r.stats.mean_acceptance_length for r in res]
    assert sum(taus) / len(taus) == pytest.approx(PAPER_T0_B16["gsm8k"], rel=0.12)


def test_start_up_grid_on_the_virtual_clock_fits_a_knee():
    """The server's grid (rows 1/128/256, blocks 1/4/8) timed on the simulated A100: the fitted target shape
    has a knee (flat, weight-bound, then per token) and prices both ends within 10 %; a line's grid fits none."""
    from dflash_trt.decoding.cost import EngineCost, measure_costs

    target, drafter, clock = sim_engines(ProfileCost(), list(paper_profiles().values()))
    cost = measure_costs(target, drafter, rows=(1, 128, 256), context=128, repeats=1, clock=clock, knees=True)
    assert cost.target.knee > 0
    for rows, tokens in ((128, 128), (256, 2048)):
        true = ProfileCost().target([tokens // rows] * rows, [128] * rows, tokens)
        assert cost.target(rows, tokens) == pytest.approx(true, rel=0.2)
    line = [(r, t, 1e-3 + 1e-4 * r + 2e-5 * t) for r in (1, 4, 16) for t in (r, 4 * r, 8 * r)]
    assert EngineCost.fit(line).knee == 0.0


def test_start_up_token_curve_on_the_virtual_clock_follows_the_tiles():
    """With the token sweep (`measure_costs(token_curve=)`, as a GPU server and the simulator's adaptive run it),
    the fitted target prices the profile's tile step (Vidur: 128 tokens 0.41 ms per layer, 136 tokens 0.57) and
    the passes of many rows within a few percent; the knee's two slopes cannot."""
    from dflash_trt.decoding.cost import measure_costs, token_sweep

    target, drafter, clock = sim_engines(ProfileCost(), list(paper_profiles().values()))
    cost = measure_costs(
        target, drafter, rows=(1, 128, 256), context=128, repeats=1, clock=clock, token_curve=token_sweep(4096)
    )
    assert cost.target.curve
    true = ProfileCost()
    for rows, tokens in ((16, 128), (16, 136), (32, 256), (64, 512), (256, 2048)):
        new = [tokens // rows + (i < tokens % rows) for i in range(rows)]
        assert cost.target(rows, tokens) == pytest.approx(true.target(new, [128] * rows, tokens), rel=0.05)
    assert cost.target(16, 136) > 1.2 * cost.target(16, 128)


def test_the_server_measures_a_token_curve_on_a_gpu_target_only(monkeypatch):
    """`server.context.batch_decoder`: the start-up grid sweeps token counts and probes take a few rows when the
    target's device is CUDA (the simulated A100 engines stand in for a GPU's here: no pass runs on a device),
    never on a CPU; on CUDA every timing of the grid and the loop first waits for the device."""
    from dflash_trt.server.context import ServerSettings, batch_decoder

    waits: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))  # no CUDA here
    for device, curved in (("cuda", True), ("cpu", False), (None, False)):
        waits.clear()
        target, drafter, clock = sim_engines(ProfileCost(), list(paper_profiles().values()))
        target.device = device
        dec = batch_decoder(BatchDecoder(target, drafter, clock=clock), ServerSettings(max_active=16))
        assert dec.policy.cost is not None and bool(dec.policy.cost.target.curve) is curved
        assert dec.policy.probe_rows == (4 if curved else 0)  # a CPU probes every stale row, as before
        if curved:  # up to max_active x the drafter's block (16 x 16 tokens)
            assert max(x for x, _ in dec.policy.cost.target.curve) == 256
            grid_waits = len(waits)
            assert grid_waits > 0 and set(waits) == {torch.device("cuda")}
            dec.generate([[0, 20, 21, 22]], GenerationConfig(max_new_tokens=4, sampling=GREEDY, stop_token_ids=()))
            assert len(waits) > grid_waits  # the loop's step timings wait too
        else:  # the loaded decoder's clock (here the virtual one), no waits
            assert not waits and dec.clock is clock


def test_oracle_is_told_each_rows_acceptance():
    rate = POOR.equivalent_rate()
    assert tau_of([rate] * 15, 16) == pytest.approx(POOR.tau(16), rel=1e-6)  # the same tau as a constant rate
    assert paper_profiles()["math500"].equivalent_rate() > rate
    work = workload("mixed", prompt_len="uniform:16-64", output_len="uniform:16-48")
    cost = ProfileCost()
    target, drafter, clock = sim_engines(cost, work.profiles)
    dec = sim_decoder("oracle", target, drafter, clock, work.profiles, 256)
    oracle = dec.policy.policy
    assert isinstance(oracle, Oracle) and oracle.probes.every == 0  # knows, so never probes
    row = dec.new_row([len(work.profiles) - 1, 40, 41], GenerationConfig(max_new_tokens=8))  # class: POOR
    acceptance = oracle.tracker_for(row)
    assert isinstance(acceptance, KnownAcceptance) and acceptance.alpha == rate
    acceptance.update(7, 0)  # a failed round moves nothing
    assert acceptance.alpha == rate
    other = dec.new_row([len(work.profiles) - 1, 40, 41], GenerationConfig(max_new_tokens=8))
    adaptive = sim_decoder("adaptive", *sim_engines(cost, work.profiles), work.profiles, 256).policy.policy
    assert not isinstance(adaptive.tracker_for(other), KnownAcceptance)  # adaptive estimates
    fixed = simulate(cost, work, "fixed-8", concurrency=4, requests=10, keep_outputs=True)
    oracle = simulate(cost, work, "oracle", concurrency=4, requests=10, keep_outputs=True)
    assert oracle.outputs == fixed.outputs  # lossless like every policy: the target's tokens
    assert oracle.mean_block != fixed.mean_block
    with pytest.raises(ValueError, match="unknown policy"):
        sim_decoder("psychic", target, drafter, clock, work.profiles, 256)


def test_peer_schedules():
    assert [schedule_draft_len(b) for b in (1, 4, 5, 8, 9, 32, 33)] == [15, 15, 7, 7, 3, 3, 0]
    pr_example = [(1, 16, 15), (64, 128, 10), (256, 4096, 0)]  # PR 32374's, scaled to 15 drafts
    got = [table_k(b, pr_example) for b in (1, 16, 17, 63, 64, 128, 200, 256, 5000)]
    assert got == [15, 15, 15, 15, 10, 10, 10, 0, 0]


def test_linear_pass_cost():
    c = LinearPassCost(0.008, 2e-5, 1.5e-4, 0.003, 0.0, 3e-5, target_one_token=0.0073)
    assert c.target([1], [100], 1) == 0.0073
    assert c.target([8, 8], [100, 100], 16) == pytest.approx(0.008 + 4e-5 + 16 * 1.5e-4)
    assert c.drafter([8], [3], [100]) == pytest.approx(0.003 + 11 * 3e-5)


def test_the_chunk_steps_stall_bound_reaches_the_loop_and_moves_the_run():
    """`simulate(stall=...)` is the server's --prefill-stall: a tighter bound admits prompts in smaller chunks."""
    profiles = list(paper_profiles().values())
    target, drafter, clock = sim_engines(ProfileCost("a100", "llama-3-8b", 1), profiles)
    assert sim_decoder("fixed-4", target, drafter, clock, profiles, 8, stall=1.25).pacer.stall == 1.25
    runs = {
        s: simulate(
            ProfileCost("a100", "llama-3-8b", 1), workload("paper"), "fixed-4", concurrency=8, requests=24, stall=s
        )
        for s in (1.25, 4.0)
    }
    assert runs[1.25].ttft_s["p50"] > runs[4.0].ttft_s["p50"]
