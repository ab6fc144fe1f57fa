"""The simulator's fair references (issue 40): the peers as their docs configure them, tables tuned per
concurrency, the exact per-step optimum and its certificate; the H100 profiles, the what-if GPU, CUDA-graph
padding and the T = 1 acceptance."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_trt.decoding import GenerationConfig
from dflash_trt.decoding.step import StepRows
from dflash_trt.sim.acceptance import PAPER_T1_B16, paper_profiles
from dflash_trt.sim.cost import ProfileCost, vllm_capture_sizes
from dflash_trt.sim.engines import sim_engines
from dflash_trt.sim.optimum import Optimum
from dflash_trt.sim.policies import TrtllmSchedule, VllmTable, sim_decoder, table_k, vllm_ranges
from dflash_trt.sim.profiles import layer_profile
from dflash_trt.sim.serving import simulate, workload


def test_h100_profiles_are_vidurs_llama2():
    p = layer_profile("h100", "llama-2-7b")
    assert p.tps == [1, 2, 4, 8]
    # an H100 runs the same op faster than an A100 runs Llama-3-8B's (smaller MLP too, but both weight bound)
    assert ProfileCost("h100", "llama-2-7b").target([1], [512], 1) < ProfileCost().target([1], [512], 1)
    assert ProfileCost("h100", "llama-2-70b", 4).comm(16) > 0
    with pytest.raises(ValueError, match="no measured profile"):
        ProfileCost("h100", "llama-3-8b")


def test_past_a_profiles_last_count_time_grows_with_the_tokens():
    """Vidur's H100 profiles end at 4096 tokens; a chunked step of 8192 costs twice the last measured layer (its
    GEMMs are compute bound there), and the optimum's floor follows (never above the price)."""
    for model, tp in (("llama-2-7b", 1), ("llama-2-70b", 4)):
        c = ProfileCost("h100", model, tp)
        assert c.op(8192) == pytest.approx(2 * c.op(4096), rel=1e-9)
        assert c.op(12000) > c.op(8192) > c.op(4096)
        assert 0 < c.op_floor(np.array([8192]))[0] <= c.op(8192)


def test_what_if_is_derived_from_datasheets_and_named():
    w = ProfileCost.what_if("b200-like-what-if")
    assert w.label == "b200-like-what-if" and w.gpu == "a100"  # read from the A100's profile
    assert w.time_scale == pytest.approx(8.0e12 / 2.039e12)
    assert w.token_scale == pytest.approx((2.25e15 / 8.0e12) / (312e12 / 2.039e12))
    a = ProfileCost()
    assert w.target([1] * 8, [512] * 8, 8) < a.target([1] * 8, [512] * 8, 8) / 3  # ~3.9x the bandwidth


def test_cuda_graphs_pad_to_captured_sizes():
    sizes = vllm_capture_sizes()
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512
    on, off = ProfileCost(graph_sizes=sizes), ProfileCost()
    assert [on.padded(n) for n in (1, 3, 5, 9, 511, 513)] == [1, 4, 8, 16, 512, 513]
    assert list(on.padded_many(np.array([3, 9, 600]))) == [4, 16, 600]
    # 9 tokens run as 16: the 16-token price of the layers, not the 9-token one
    assert on.target([9], [512], 9) > off.target([9], [512], 9)
    assert on.target([16], [512], 16) == off.target([16], [512], 16)


def test_t1_acceptance_is_the_papers():
    assert paper_profiles(temperature=1.0)["math500"].tau(16) == pytest.approx(PAPER_T1_B16["math500"])
    assert workload("paper-t1").profiles[0].tau(16) < workload("paper").profiles[0].tau(16)
    with pytest.raises(ValueError, match="T = 0 and T = 1"):
        paper_profiles(temperature=0.5)


def _rows(n: int, cap: int = 16) -> StepRows:
    return StepRows([], np.full(n, cap), np.zeros(n, np.int64), np.zeros(n, bool), np.ones(n), n)


def test_trtllm_default_has_no_threshold_and_the_variant_switches_off():
    assert TrtllmSchedule().threshold is None
    work = workload("mixed", prompt_len="uniform:16-64", output_len="uniform:32-64")
    plain = simulate(ProfileCost(), work, "trtllm-schedule", concurrency=1, requests=8)
    gated = simulate(ProfileCost(), work, "trtllm-schedule-threshold", concurrency=1, requests=8)
    assert plain.mean_block > 12  # batch 1: the whole block (less at a row's end), whatever the acceptance
    assert gated.mean_block < plain.mean_block  # the poor rows' 1/15 rate switched it off


def test_tuned_tables_follow_each_peers_rounding():
    best = {1: 16, 8: 8, 32: 4, 128: 1}
    trt = TrtllmSchedule({c: b - 1 for c, b in best.items()})
    vllm = VllmTable(16, vllm_ranges(best))
    assert vllm_ranges(best)[:2] == [(1, 7, 15), (8, 31, 7)]
    # between tuned points TensorRT-LLM takes the next key up, vLLM the range below
    assert trt.choose(_rows(20)) == [4] * 20 and vllm.choose(_rows(20)) == [8] * 20
    assert trt.choose(_rows(200)) == [1] * 200 and vllm.choose(_rows(200)) == [1] * 200
    assert table_k(5, vllm_ranges(best)) == 15
    engines = sim_engines(ProfileCost(), workload("paper").profiles)
    with pytest.raises(ValueError, match="needs its table"):
        sim_decoder("tuned-table", *engines, workload("paper").profiles, 256)


def _exhaustive(opt: Optimum, rows: list, step: StepRows) -> float:
    """The best expected tokens per second over every block assignment (brute force, few rows)."""
    past = np.array([len(r.prompt_ids) + len(r.generated) - 1 for r in rows])
    backlog = np.maximum(step.backlog.astype(np.int64), 1)
    best = 0.0
    for blocks in itertools.product(range(1, 17), repeat=len(rows)):
        b = np.array(blocks)
        tokens = sum(opt.profiles[r.prompt_ids[0]].tau(int(x)) for r, x in zip(rows, b))
        best = max(best, tokens / opt._exact_time(b, past, backlog))
    return best


@pytest.mark.parametrize("chunk", [0, 4096])
def test_optimum_matches_brute_force_and_its_bound_holds(chunk):
    """Two rows of different acceptance: every one of the 256 assignments priced; the optimum's choice is the
    best of them (or within its recorded certificate) and its bound is never below the true best; with a long
    prompt chunk riding in the pass the certificate stays tight (its own causal attention is in the bound)."""
    work = workload("mixed")
    target, drafter, clock = sim_engines(ProfileCost(), work.profiles)
    dec = sim_decoder("optimum", target, drafter, clock, work.profiles, 256)
    opt = dec.policy.policy
    assert isinstance(opt, Optimum)
    poor, good = len(work.profiles) - 1, 1  # POOR and math500
    rows = [
        dec.new_row([c] + [20 + i % 200 for i in range(280)], GenerationConfig(max_new_tokens=64)) for c in (poor, good)
    ]
    for r, n in zip(rows, (3, 40)):
        r.generated = list(range(n))
    step = StepRows(
        rows, np.full(2, 16), np.zeros(2, np.int64), np.zeros(2, bool), np.array([1.0, 5.0]), 2, int(chunk > 0), chunk
    )
    chosen = opt.choose(step)
    truth = _exhaustive(opt, rows, step)
    past = np.array([len(r.prompt_ids) + len(r.generated) - 1 for r in rows])
    got = sum(opt.profiles[r.prompt_ids[0]].tau(b) for r, b in zip(rows, chosen))
    got /= opt._exact_time(np.array(chosen), past, np.array([1, 5]))
    assert got == pytest.approx(truth, rel=1e-9) or got >= truth / (1 + opt.worst_gap)
    assert opt.bound_sum >= truth * (1 - 1e-12)  # the certificate is an upper bound
    assert opt.worst_gap < 0.25
    assert chosen[1] > chosen[0]  # the better-accepting row drafts more


def test_optimum_is_lossless_and_beats_a_fixed_block():
    work = workload("mixed", prompt_len="uniform:16-64", output_len="uniform:32-64")
    fixed = simulate(ProfileCost(), work, "fixed-4", concurrency=8, requests=16, keep_outputs=True)
    best = simulate(ProfileCost(), work, "optimum", concurrency=8, requests=16, keep_outputs=True)
    assert best.outputs == fixed.outputs  # the target's tokens, whatever the blocks
    assert best.optimum_gap is not None and 0 <= best.optimum_gap < 0.05
    assert best.tokens_per_s > fixed.tokens_per_s


def test_chunked_and_separate_prefill_give_the_same_tokens():
    """The loop's two prefill modes on the simulated engines: the same sequences (a sequence's identity is its
    prompt's first tokens, whatever the chunking), the chunks priced inside the verify pass; the optimum
    prices the chunks that ride in its steps."""
    work = workload("mixed", prompt_len="uniform:300-900", output_len="uniform:32-64")
    runs = {
        p: simulate(ProfileCost(), work, "optimum", concurrency=4, requests=10, keep_outputs=True, prefill=p)
        for p in ("chunked", "separate")
    }
    assert runs["chunked"].outputs == runs["separate"].outputs
    assert runs["chunked"].prefill == "chunked" and runs["separate"].prefill == "separate"
    gap = runs["chunked"].optimum_gap
    assert gap is not None and 0 <= gap < 0.05
    with pytest.raises(ValueError, match="prefill"):
        simulate(ProfileCost(), work, "none", concurrency=1, requests=1, prefill="whole")
