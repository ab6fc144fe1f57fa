"""The load benchmark's plumbing (`dflash-trt bench load`: dflash_trt/bench/load.py, dflash_trt/bench/aiperf.py): the aiperf command line,
reading aiperf's export, and the done-figure checks and table made from the cells. The benchmark itself runs
with `make bench-load`; nothing here times anything."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.bench import load
from dflash_trt.bench.aiperf import AiperfFailed, AiperfRun, export_metrics, value


def test_aiperf_command_sends_the_dataset_and_sampling_settings(tmp_path):
    run = AiperfRun(
        "http://127.0.0.1:9",
        "m",
        "tok",
        concurrency=16,
        requests=32,
        warmup=16,
        input_file=tmp_path / "p.jsonl",
        osl=64,
        extra_inputs={"temperature": 1.0},
    )
    cmd = run.command("aiperf", tmp_path / "a")
    assert cmd[:2] == ["aiperf", "profile"]
    opts = dict(zip(cmd[2::1], cmd[3::1]))
    assert opts["--concurrency"] == "16" and opts["--request-count"] == "32" and opts["--num-warmup-requests"] == "16"
    assert opts["--custom-dataset-type"] == "single_turn" and opts["--input-file"].endswith("p.jsonl")
    assert json.loads(opts["--extra-inputs"]) == {"ignore_eos": True, "temperature": 1.0}
    assert "--isl" not in cmd and "--streaming" in cmd
    synthetic = AiperfRun("u", "m", "tok", isl=32).command("aiperf", tmp_path)
    assert synthetic[synthetic.index("--isl") + 1] == "32" and "--input-file" not in synthetic
    assert AiperfRun("u", "m", "tok", nice=15).command("aiperf", tmp_path)[:5] == [
        "nice",
        "-n",
        "15",
        "aiperf",
        "profile",
    ]


def test_export_metrics_reads_the_nested_export(tmp_path):
    nested = tmp_path / "run" / "inner"
    nested.mkdir(parents=True)
    (nested / "profile_export_aiperf.json").write_text(
        json.dumps(
            {
                "output_token_throughput": {"unit": "tokens/sec", "avg": 512.5},
                "time_to_first_token": {"unit": "ms", "avg": 30.0, "p50": 25.0, "p99": 90.0, "std": 3.0},
                "unrelated": {"avg": 1},
            }
        )
    )
    m = export_metrics(tmp_path / "run")
    assert value(m, "output_token_throughput") == 512.5
    assert m["time_to_first_token"] == {"unit": "ms", "avg": 30.0, "p50": 25.0, "p99": 90.0}
    assert "unrelated" not in m and value(m, "inter_token_latency") is None
    with pytest.raises(AiperfFailed):
        export_metrics(tmp_path / "nothing-here")


def cell(mode, c, t, tps):
    return {
        "mode": mode,
        "concurrency": c,
        "temperature": t,
        "tokens_per_s": tps,
        "ttft_ms": {"avg": 10.0, "p50": 9.0, "p99": 20.0},
        "itl_ms": {"avg": 5.0, "p50": 4.0, "p99": 8.0},
    }


def test_checks_pass_and_fail_on_the_issue_figures():
    bench = load
    proc = {
        "hf_generate": [{"concurrency": 16, "temperature": 0.0, "tokens_per_s": 400.0}],
        "per_prompt": [
            {
                "set": "code",
                "prompt": 0,
                "prompt_tokens": 100,
                "target_s": 1.0,
                "single_dflash_s": 0.40,
                "adaptive_s": 0.41,
                "adaptive_vs_target": 2.4,
                "tau_single_b8": 3.0,
                "equal": True,
                "new_tokens": 64,
                "tau_adaptive": 3.1,
                "single_vs_target": 2.5,
            },
            {
                "set": "long",
                "prompt": 3,
                "prompt_tokens": 291,
                "target_s": 1.0,
                "single_dflash_s": 2.7,
                "adaptive_s": 1.2,
                "adaptive_vs_target": 0.83,
                "tau_single_b8": 1.04,
                "equal": True,
                "new_tokens": 256,
                "tau_adaptive": 1.1,
                "single_vs_target": 0.37,
            },
        ],
    }
    cells = [
        cell("target", 16, 0.0, 500.0),
        cell("adaptive", 16, 0.0, 650.0),
        cell("target", 1, 1.0, 100.0),
        cell("adaptive", 1, 1.0, 90.0),
    ]
    found = {what: (ok, fig) for what, ok, fig in bench.checks(cells, proc)}
    assert found["c=16 T=0 adaptive >= 1.5x HF batched generate"] == (True, "1.62x")
    assert found["c=16 T=0 adaptive >= 1.2x the server's batched target"] == (True, "1.30x")
    ok, fig = found["every cell: adaptive >= 0.95x batched target"]
    assert ok is False and "0.90x (c=1, T=1)" in fig
    ok, fig = found["every prompt: adaptive >= 0.9x the target alone"]
    assert ok is False and "long prompt 3" in fig
    ok, _ = found["c=1 T=0: adaptive >= 0.97x a fixed block 8, one request alone (same prompts)"]
    assert ok is True  # 0.40 / 0.41 = 0.976
    md = bench.markdown(
        cells, proc, bench.checks(cells, proc), {"target": "t", "drafter": "d", "osl": 64, "machine": "cpu"}
    )
    assert "| 0 | 16 | 400 | 500 | 650 | 1.62x | 1.30x |" in md
    assert "- FAIL: every cell" in md


def test_a_cell_reports_its_median_run_and_lists_them_all():
    bench = load
    runs = [{"mode": "target", "tokens_per_s": t, "ttft_ms": {"p50": i}} for i, t in enumerate((700.0, 910.0, 820.0))]
    cell = bench.median_cell(runs)
    assert cell["tokens_per_s"] == 820.0 and cell["ttft_ms"] == {"p50": 2}  # the whole median run, not a mix
    assert cell["runs_tokens_per_s"] == [700.0, 910.0, 820.0]
    assert bench.median_cell(runs[:2])["tokens_per_s"] == 700.0  # even count: the lower middle


def test_every_round_runs_every_member_and_the_first_place_rotates():
    bench = load
    members = ["target", "dflash-b8", "adaptive", "hf-generate"]
    rounds = [bench.rotation(members, r) for r in range(4)]
    assert all(sorted(r) == sorted(members) for r in rounds)  # HF generate in every round, as every mode
    assert [r[0] for r in rounds] == members  # each member leads one round: none always meets the same state
    assert bench.rotation(members, 5) == rounds[1]


def test_server_side_figures_come_from_the_metrics_deltas():
    bench = load

    def page(verify_rows, verify_passes, blocks, block_rows, busy):
        return (
            f'dflash_batch_rows_sum{{pass="verify"}} {verify_rows}\n'
            f'dflash_batch_rows_count{{pass="verify"}} {verify_passes}\n'
            'dflash_batch_rows_sum{pass="prefill"} 7\ndflash_batch_rows_count{pass="prefill"} 3\n'
            f"dflash_block_size_sum {blocks}\ndflash_block_size_count {block_rows}\n"
            f'dflash_step_seconds_sum{{part="verify"}} {busy}\ndflash_step_seconds_sum{{part="draft"}} 1.0\n'
        )

    before = bench.metric_sums(page(100, 10, 150, 100, 2.0))
    after = bench.metric_sums(page(100 + 14 * 50, 10 + 50, 150 + 3 * 700, 100 + 700, 9.5))
    srv = bench.server_side(before, after)
    assert srv == {"mean_verify_rows": 14.0, "mean_block": 3.0, "prefill_passes": 0, "engine_s": 7.5}
    cells = [dict(cell("adaptive", 16, 0.0, 650.0), server=srv), cell("target", 16, 0.0, 500.0)]
    md = bench.markdown(cells, None, [], {"target": "t", "drafter": "d", "osl": 64, "machine": "cpu"})
    assert "| 0 | 16 | - | 14.0 / 3.0 |" in md  # target's run carried no server figures


def test_the_steady_state_keeps_c_rows_in_flight_and_serves_every_request(tiny_pair):
    """The in-process engine comparison: every request of the stream served once, in full, as the target alone
    would serve it, with at most C rows in a step and C in most of them."""
    from helpers import generate_one

    from dflash_trt.decoding import BatchDecoder, GenerationConfig
    from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

    bench = load
    _, _, _, model, drafter = tiny_pair
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    dec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    rng = torch.Generator().manual_seed(3)
    stream = [
        torch.randint(2, 95, (int(n),), generator=rng).tolist() for n in torch.randint(3, 30, (7,), generator=rng)
    ]
    rows_per_step, served = [], []
    step, add = dec.step, dec.add
    dec.step = lambda: (rows_per_step.append(len(dec.active)), step())[1]
    dec.add = lambda p, cfg: served.append(add(p, cfg)) or served[-1]
    assert bench.steady_state(dec, stream, c=3, n=6) == 7 * 6
    assert [r.prompt_ids for r in served] == stream and all(r.done for r in served)
    alone = BatchDecoder(TorchTargetEngine(model))
    assert [r.result().token_ids for r in served] == [
        generate_one(alone, p, GenerationConfig(max_new_tokens=6)).token_ids for p in stream
    ]
    assert max(rows_per_step) == 3 and rows_per_step.count(3) >= len(rows_per_step) // 2


def test_the_engines_alone_section_reports_both_ratios():
    bench = load
    proc = {
        "engines_alone": {
            "concurrency": 16,
            "temperature": 0.0,
            "requests": 64,
            "runs_tokens_per_s": {"hf-generate": [800.0], "target": [880.0], "adaptive": [1040.0]},
            "tokens_per_s": {"hf-generate": 800.0, "target": 880.0, "adaptive": 1040.0},
            "adaptive_vs_hf": 1.3,
            "target_vs_hf": 1.1,
        }
    }
    md = bench.markdown(
        [cell("adaptive", 16, 0.0, 650.0)], proc, [], {"target": "t", "drafter": "d", "osl": 64, "machine": "cpu"}
    )
    assert "## The engines alone: C=16, T=0" in md
    assert "| 800 | 880 | 1040 | 1.30x | 1.10x |" in md


def test_batched_hf_generate_is_each_prompt_alone(tiny_pair):
    """The batched benchmarks' reference: left-padded prompts of different lengths give, greedy, exactly n
    tokens each, the tokens our target-alone loop gives each prompt alone (the padding is masked out)."""
    from helpers import generate_one

    from dflash_trt.bench.methods import hf_generate_batch
    from dflash_trt.decoding import BatchDecoder, GenerationConfig
    from dflash_trt.runtime.torch_backend import TorchTargetEngine

    _, _, _, model, _ = tiny_pair
    prompts = [[5, 9, 11, 4, 7, 30, 2], [8, 3], [12, 40, 41, 6]]
    out = hf_generate_batch(model, prompts, 5, pad=0)
    alone = BatchDecoder(TorchTargetEngine(model))
    assert out == [generate_one(alone, p, GenerationConfig(max_new_tokens=5)).token_ids for p in prompts]
