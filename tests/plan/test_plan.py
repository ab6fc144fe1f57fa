"""`dflash-trt plan`: the default run's five files, its TensorRT-LLM YAML against DFlashDecodingConfig's fields, its
schedule fed back into the simulator against the tuned table, a trace and a measured grid as inputs, bad inputs.

Everything here is simulated (dflash_trt/sim: the real batched loop on simulated engines); nothing runs a model."""

import dataclasses
import json
import random
import shlex

import pytest
from builders.test_trtllm_serve_config import (
    DFLASH_DECODING_CONFIG_FIELDS,
    LLM_ARGS_KEYS_WE_WRITE,
    check_like_decoding_base_config,
    demo_identity,
)

from dflash_trt.cli.main import main
from dflash_trt.plan import inputs, outputs, tune
from dflash_trt.plan.inputs import PlanInputError
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET
from dflash_trt.sim.serving import Workload

yaml = pytest.importorskip("yaml")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def default_plan(tmp_path_factory):
    """`dflash-trt plan --out DIR` with no other flag, once for the module."""
    out = tmp_path_factory.mktemp("plan")
    assert main(["plan", "--out", str(out)]) == 0
    return out


def test_default_run_writes_all_five_files(default_plan, capsys):
    for name in outputs.FILES:
        assert (default_plan / name).stat().st_size > 0, name
    assert (default_plan / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((default_plan / "plan.json").read_text())
    assert [c["concurrency"] for c in doc["cells"]] == [1, 2, 4, 8, 16, 32, 64]
    assert doc["inputs"]["acceptance"]["name"] == "demo" and doc["inputs"]["acceptance"]["measured"] is True
    assert doc["inputs"]["workload"]["measured"] is False  # the lengths are assumed, and it says so
    assert doc["settings"]["max_drafts"] == 7 and doc["inputs"]["acceptance"]["max_drafts"] >= 7
    assert "A100" in doc["inputs"]["cost"]["source"] and "Llama-3-8B" in doc["inputs"]["cost"]["source"]
    for c in doc["cells"]:
        assert set(c["tokens_per_s_by_drafts"]) == {str(k) for k in range(8)}  # 0 (the target alone) .. 7
        assert c["predicted"]["ttft_ms"]["p50"] > 0 and c["predicted"]["itl_ms"]["p50"] > 0
    vllm = json.loads((default_plan / "vllm-speculative-config.json").read_text())
    ranges = vllm["num_speculative_tokens_per_batch_size"]
    assert vllm["method"] == "dflash" and ranges[0][0] == 1 and ranges[-1][1] == 64
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous inclusive ranges, as vLLM reads
    sglang = (default_plan / "sglang-args.txt").read_text()
    assert "--speculative-algorithm DFLASH" in sglang and f"--speculative-draft-model-path {DEMO_DRAFTER}" in sglang


def test_native_yaml_passes_the_dflash_decoding_config_field_check(default_plan):
    loaded = yaml.safe_load((default_plan / "trtllm-serve.yaml").read_text())
    # BaseLlmArgs.max_batch_size (tensorrt_llm/llmapi/llm_args.py): the plan bounds the batch at its largest C;
    # TorchLlmArgs.enable_iter_perf_stats (same file): what `plan check` reads; enable_chunked_prefill: as planned
    written = LLM_ARGS_KEYS_WE_WRITE | {"max_batch_size", "enable_iter_perf_stats", "enable_chunked_prefill"}
    assert set(loaded) <= written and loaded["max_batch_size"] == 64
    spec = loaded["speculative_config"]
    assert set(spec) <= DFLASH_DECODING_CONFIG_FIELDS, set(spec) - DFLASH_DECODING_CONFIG_FIELDS
    check_like_decoding_base_config(spec)
    assert spec["speculative_model"] == str(DEMO_DRAFTER.resolve()) and spec["max_draft_len"] <= 7


def _fed_back(spec, concurrency, requests, block=8):
    """The demo acceptance on the A100 8B profile with `spec`'s draft lengths, as the default plan ran it."""
    acc, cost = inputs.named_acceptance("demo"), inputs.vidur_cost("a100", "llama-3-8b", 1)
    work = Workload("demo", acc.profiles, (1.0,) * len(acc.profiles))
    return tune.run(cost.cost, work, lambda b: tune.trtllm_draft_len(spec, b), concurrency, requests, 0, block)


def test_yaml_schedule_fed_back_is_within_2_percent_of_the_tuned_table(default_plan):
    """The done-when check: the schedule read back from the written YAML, simulated at every planned concurrency,
    against the best fixed block there (plan.json's tuned table, same requests)."""
    spec = yaml.safe_load((default_plan / "trtllm-serve.yaml").read_text())["speculative_config"]
    doc = json.loads((default_plan / "plan.json").read_text())
    drafting = [c for c in doc["cells"] if c["tuned_drafts"] > 0]
    assert drafting, "no concurrency drafts: the check would prove nothing"
    for c in doc["cells"]:
        assert tune.trtllm_draft_len(spec, c["concurrency"]) == c["schedule_drafts"]
        tuned = c["tokens_per_s_by_drafts"][str(c["tuned_drafts"])]
        fed = _fed_back(spec, c["concurrency"], c["requests"]).tokens_per_s
        assert fed >= 0.98 * tuned, (c["concurrency"], fed, tuned)
        assert c["schedule_vs_tuned"] >= 0.98


def test_the_2_percent_check_catches_a_bad_schedule(default_plan):
    """Negative control: speculation off above batch 1 (a schedule ending at key 1) loses at 16 rows."""
    doc = json.loads((default_plan / "plan.json").read_text())
    cell = next(c for c in doc["cells"] if c["concurrency"] == 16)
    fed = _fed_back({"max_draft_len": 7, "draft_len_schedule": {1: 7}}, 16, cell["requests"]).tokens_per_s
    assert fed < 0.98 * cell["tokens_per_s_by_drafts"][str(cell["tuned_drafts"])]


def _trace_file(path, rate=0.7, rounds=60, seed=0):
    """Two `generate --json --trace` outputs (JSON lines), rounds of block 8 accepting each draft with `rate`."""
    rng = random.Random(seed)
    lines = []
    for _ in range(2):
        trace = []
        for _ in range(rounds):
            n = 0
            while n < 7 and rng.random() < rate:
                n += 1
            trace.append({"block_size": 8, "drafted": [rng.randrange(100) for _ in range(7)], "accepted": n})
        lines.append(json.dumps({"token_ids": [1, 2], "text": "x", "finish_reason": "length", "trace": trace}))
    path.write_text("\n".join(lines) + "\n")
    return path


SMALL = ["--concurrency", "1,8", "--min-requests", "8", "--prompt-len", "fixed:64", "--output-len", "fixed:48"]


def test_a_trace_file_as_input(tmp_path, capsys):
    trace = _trace_file(tmp_path / "trace.jsonl")
    acc = inputs.read_trace(trace)
    rounds = [r for line in trace.read_text().splitlines() for r in json.loads(line)["trace"]]
    mean_tau = 1 + sum(r["accepted"] for r in rounds) / len(rounds)
    assert acc.block_size == 8 and acc.measured
    assert acc.profiles[0].tau(8) == pytest.approx(mean_tau, rel=0.02)  # pooled rates keep the trace's tau
    out = tmp_path / "plan"
    assert main(["plan", "--out", str(out), "--trace", str(trace), "--no-progress", *SMALL]) == 0
    doc = json.loads((out / "plan.json").read_text())
    assert doc["inputs"]["acceptance"]["measured"] and str(trace) in doc["inputs"]["acceptance"]["source"]
    text = (out / "trtllm-serve.yaml").read_text()
    assert "add speculative_model" in text  # no --drafter: the YAML says what to add
    assert set(yaml.safe_load(text)["speculative_config"]) <= DFLASH_DECODING_CONFIG_FIELDS
    printed = capsys.readouterr().out
    assert "schedule vs tuned table" in printed
    spec = yaml.safe_load(text)["speculative_config"]
    key = "draft_len_schedule" if "draft_len_schedule" in spec else "max_draft_len"
    assert f"trtllm-serve.yaml: max_draft_len: {spec['max_draft_len']}" in printed and f"{key}: " in printed


def test_server_statistics_as_input(tmp_path):
    detailed = {"speculative_decoding": {"per_step_drafted": [7, 7, 3], "per_step_accepted": [7, 2, 3]}}
    (tmp_path / "stats.json").write_text(json.dumps([{"id": "a", "metrics": detailed}]))
    acc = inputs.read_trace(tmp_path / "stats.json")
    assert acc.block_size == 8 and acc.profiles[0].tau(8) > 1
    (tmp_path / "summary.json").write_text(json.dumps({"metrics": {"speculative_decoding": {"num_spec_steps": 3}}}))
    with pytest.raises(PlanInputError, match="detailed"):
        inputs.read_trace(tmp_path / "summary.json")


def test_a_measured_grid_as_input(tmp_path):
    from builders.test_trtllm_serve_config import grid

    (tmp_path / "grid.json").write_text(json.dumps(grid(target_per_token=2e-5, identity=demo_identity())))
    out = tmp_path / "plan"
    args = ["plan", "--out", str(out), "--cost-grid", str(tmp_path / "grid.json"), "--target", str(DEMO_TARGET)]
    assert main([*args, "--no-progress", *SMALL]) == 0
    assert "cost grid" in json.loads((out / "plan.json").read_text())["inputs"]["cost"]["source"]


@pytest.mark.parametrize(
    ("content", "flags", "message"),
    [
        ("{not json", [], "is not JSON"),
        ('{"block_size": 8, "drafted": [1, 2, 3, 4, 5, 6, 7], "accepted": 9}', [], "accepted 9 outside 0..7"),
        ('{"block_size": 1, "drafted": [], "accepted": 0}', [], "no round that drafted"),
        ('{"block_size": 4, "drafted": [1, 2, 3, 4], "accepted": 1}', [], "4 drafted ids (expected 3)"),
        ('{"hello": 1}', [], "neither a trace round"),
        (None, ["--profile", "nonsense"], "unknown acceptance profile 'nonsense'"),
        (None, ["--gpu", "tpu"], "no Vidur profile for GPU 'tpu'"),
        (None, ["--tp", "3"], "cannot price tp 3"),
        (None, ["--output-len", "gamma:3"], "unknown length distribution"),
        (None, ["--block-size", "32"], "drafts at most 15 tokens"),
        (None, ["--block-size", "12"], "drafts blocks of 8; plan up to that or less"),
        (None, ["--drafter", "/nonexistent"], "drafter checkpoint not found"),
    ],
)
def test_bad_input_gives_a_clear_error(tmp_path, capsys, content, flags, message):
    if content is not None:
        (tmp_path / "trace.json").write_text(content)
        flags = ["--trace", str(tmp_path / "trace.json")]
    assert main(["plan", "--out", str(tmp_path / "out"), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash-trt plan: error: ") and message in err, err
    assert not (tmp_path / "out").exists()  # nothing simulated, nothing written


def test_a_grid_of_another_target_is_refused(tmp_path, capsys):
    from builders.test_trtllm_serve_config import grid

    (tmp_path / "grid.json").write_text(json.dumps(grid(1e-5, identity=demo_identity(layers=99))))
    args = [
        "plan",
        "--out",
        str(tmp_path / "o"),
        "--cost-grid",
        str(tmp_path / "grid.json"),
        "--target",
        str(DEMO_TARGET),
    ]
    assert main(args) == 1
    assert "measured on another target" in capsys.readouterr().err


def test_trtllm_draft_lengths_follow_its_documented_schedule():
    """TensorRT-LLM's get_draft_len_for_batch_size example: {4: 4, 8: 2, 32: 1} drafts 4 up to batch 4, 2 up
    to 8, 1 up to 32 and none above; max_concurrency drafts max_draft_len up to it, none above."""
    spec = {"max_draft_len": 4, "draft_len_schedule": {4: 4, 8: 2, 32: 1}}
    got = {b: tune.trtllm_draft_len(spec, b) for b in (1, 4, 5, 8, 9, 32, 33, 500)}
    assert got == {1: 4, 4: 4, 5: 2, 8: 2, 9: 1, 32: 1, 33: 0, 500: 0}
    assert [tune.trtllm_draft_len({"max_draft_len": 7, "max_concurrency": 8}, b) for b in (8, 9)] == [7, 0]
    assert tune.trtllm_draft_len({"max_draft_len": 7}, 4096) == 7


def test_vllm_ranges_cover_every_batch_from_one_and_never_draft_zero():
    """Where the tuned table says the target alone (block 1) the range drafts 1, as TensorRT-LLM's schedule does
    (tune.dflash_drafts): under Model Runner V2 vLLM's DFlash speculator drafts its whole block every step
    (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py at 75d3c8e9), so a 0 would pay the drafter for nothing."""
    cells = [tune.Cell(c, 8, {1: 1.0}, best_block=b) for c, b in ((1, 8), (2, 8), (4, 5), (8, 5), (16, 1))]
    plan = tune.Plan(8, cells, {"max_draft_len": 7}, (0,))
    assert outputs.vllm_ranges(plan) == [[1, 2, 7], [3, 8, 4], [9, 16, 1]]
    never = tune.Plan(8, [tune.Cell(c, 8, {1: 1.0}, best_block=1) for c in (1, 8)], None, (0,))
    assert outputs.vllm_ranges(never) == [[1, 8, 1]]


def test_vllm_args_bound_the_batch_at_the_largest_planned_concurrency(tmp_path):
    """vllm-args.txt: --max-num-seqs (SchedulerConfig.max_num_seqs, vllm/config/scheduler.py at 1f8758d5: the most
    sequences one iteration runs, ge=1) at the largest planned concurrency, and the speculative config; its usage
    line hands `vllm serve` both, the JSON one argument."""
    import subprocess
    import sys

    doc, files = _written(tmp_path / "out", _plan({1: 8, 8: 5, 64: 1}), DEMO_DRAFTER)
    text = files["vllm-args.txt"]
    assert "--max-num-seqs 64: the plan covers batch sizes 1..64" in text and doc["configs"]["vllm_max_num_seqs"] == 64
    usage = text.splitlines()[0].removeprefix("# usage: ")
    stub = tmp_path / "vllm"  # stands for vllm: prints its arguments as JSON
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    command = usage.replace("vllm serve", f"{stub} serve")
    got = subprocess.run(["bash", "-c", command], cwd=tmp_path / "out", capture_output=True, text=True, check=True)
    argv = json.loads(got.stdout)
    assert argv[:2] == ["serve", "TARGET"] and argv[argv.index("--max-num-seqs") + 1] == "64"
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == json.loads(files["vllm-speculative-config.json"]) == doc["configs"]["vllm"]
    assert all(k >= 1 for _, _, k in config["num_speculative_tokens_per_batch_size"])


def test_a_plan_that_drafts_only_above_its_smallest_concurrency_says_why_trtllm_cannot():
    """TensorRT-LLM's schedule drafts max_draft_len at its smallest key, so "off at 1, on at 8" has no YAML; the
    note must say that rather than that drafting pays nowhere."""
    late = tune.Plan(8, [tune.Cell(1, 8, {1: 1.0}, best_block=1), tune.Cell(8, 8, {1: 1.0}, best_block=5)], None, (0,))
    assert "pays at C=8 but not at C=1" in outputs.no_schedule_note(late)
    never = tune.Plan(8, [tune.Cell(c, 8, {1: 1.0}, best_block=1) for c in (1, 8)], None, (0,))
    assert outputs.no_schedule_note(never).startswith("drafting pays at no planned concurrency")


def test_vllm_json_is_the_config_whatever_the_drafter_path():
    config = {"method": "dflash", "model": "/m/[]x", "num_speculative_tokens": 7}
    config["num_speculative_tokens_per_batch_size"] = [[1, 2, 7], [3, 8, 4]]
    text = outputs.vllm_json(config)
    assert json.loads(text) == config and "\n    [3, 8, 4]\n" in text


def test_the_drafters_block_is_read_where_tensorrt_llm_reads_it(tmp_path):
    """A DFlash 2 drafter written by z-lab's class keeps block_size inside dflash_config only."""
    from builders.test_trtllm_serve_config import published_spelling, save_reference_dflash2

    from dflash_trt.cli.plan import _trained_block

    folder = published_spelling(save_reference_dflash2(tmp_path / "d"))
    assert "block_size" not in json.loads((folder / "config.json").read_text())
    assert _trained_block(folder) == 4
    assert _trained_block(DEMO_DRAFTER) == json.loads((DEMO_DRAFTER / "config.json").read_text())["block_size"]


def test_the_held_out_check_reports_concurrencies_between_the_planned_ones(tmp_path):
    trace = _trace_file(tmp_path / "trace.jsonl")
    out = tmp_path / "plan"
    flags = ["--trace", str(trace), "--no-progress", "--check-seed", "3", *SMALL]
    assert main(["plan", "--out", str(out), *flags]) == 0
    held = json.loads((out / "plan.json").read_text())["held_out"]
    assert set(held) == {"1", "3", "8"}  # planned 1 and 8, and their geometric mean
    for v in held.values():
        assert 0 < v["ratio"] <= 1.0 and v["best_tokens_per_s"] >= v["schedule_tokens_per_s"]
        assert 0 <= v["best_drafts"] <= 7 and "best_block" not in v  # drafted tokens, as every plan.json key


def test_a_drafter_that_would_not_load_is_refused_before_simulating(tmp_path, capsys):
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({"block_size": 8}))
    assert main(["plan", "--out", str(tmp_path / "o"), "--drafter", str(tmp_path / "drafter")]) == 1
    err = capsys.readouterr().err
    assert "would not load as a TensorRT-LLM DFlash drafter" in err and "model_type" in err
    assert not (tmp_path / "o").exists()


def test_the_target_picks_the_nearest_profiled_shape():
    from dflash_trt.costgrid import read_target_config

    models = inputs.profiled_models("a100")
    seventy = {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672}
    assert inputs.nearest_model(seventy, models) == "llama-3-70b"
    demo = read_target_config(DEMO_TARGET)  # a 12M-parameter model: the smallest profiled shape, and it says so
    assert inputs.nearest_model(demo, models) == "llama-3-8b"
    assert "assumed: the profiled shape nearest the target" in inputs.vidur_cost("a100", None, 1, demo).source
    with pytest.raises(PlanInputError, match="no Vidur profile for model 'llama-9'"):
        inputs.vidur_cost("a100", "llama-9", 1)


def test_help_names_the_inputs_outputs_and_profiles(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needed in ("draft_len_schedule", "num_speculative_tokens_per_batch_size", "sglang-args.txt", "--trace FILE"):
        assert needed in text, needed
    assert "Vidur GPU profile: a100" in text and "llama-3-70b" in text and "at most 16" in text


# ---- configurations that do what they say (issue 56) ---------------------------------------------------------
def _plan(best, blocks=8):
    """A plan with these best blocks per concurrency, tokens/s made up so each best block wins, fed back."""
    cells = []
    for c, b in best.items():
        tokens = {k: 100.0 * c * (2.0 if k == b else 1.0) for k in range(1, blocks + 1)}
        predicted = {"tokens_per_s": tokens[b], "ttft_ms": {"p50": 1.0, "p99": 2.0}, "itl_ms": {"p50": 1.0, "p99": 2.0}}
        cells.append(tune.Cell(c, 8, tokens, b, b, {**predicted, "tau": 2.0, "mean_block": float(b)}))
    from dflash_trt.builders.trtllm_serve import speculation_limits

    return tune.Plan(blocks, cells, speculation_limits(tune.dflash_drafts(best)), (0,))


def _written(tmp_path, plan, drafter=None):
    acc, cost = (
        inputs.named_acceptance("demo"),
        inputs.vidur_cost("a100", None, 1, {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}),
    )
    settings = {"workload": "w", "step_tokens": 2048}
    doc = outputs.write(plan, acc, cost, settings, tmp_path, drafter)
    return doc, {name: (tmp_path / name).read_text() for name in outputs.FILES if name != "plan.png"}


def test_the_trtllm_schedule_never_resolves_to_zero_drafts_for_dflash(tmp_path):
    """PR 16888: 0 drafts stops DFlash's context refresh. Where the tuned table says 0 drafts at a larger batch,
    the schedule keeps 1, and the YAML bounds the batch at the largest planned concurrency."""
    assert tune.dflash_drafts({1: 8, 8: 5, 64: 1}) == {1: 7, 8: 4, 64: 1}
    assert tune.dflash_drafts({1: 1, 8: 5}) == {1: 0, 8: 4}  # no drafting at the smallest: target alone, as before
    plan = _plan({1: 8, 8: 5, 64: 1})
    _, files = _written(tmp_path, plan)
    loaded = yaml.safe_load(files["trtllm-serve.yaml"])
    assert loaded["max_batch_size"] == 64
    assert all(tune.trtllm_draft_len(loaded["speculative_config"], b) >= 1 for b in range(1, 65))
    text = files["trtllm-serve.yaml"]
    assert "#16888" in text and "flash-attn" in text and "#19159" in text and "enable_chunked_prefill" in text
    # PR 16888's get_draft_len_for_batch_size (open) would floor the length above the largest key at
    # min_runtime_draft_len (1 for DFlash): the header says what 00043967 does there and what the PR would do
    assert "min_runtime_draft_len, 1" in text and "16888" in text


def test_the_attention_note_says_trtllm_needs_flashinfer(tmp_path):
    """DFlashDecodingConfig.attention_backend (llm_args.py): TRTLLM on SM100 / SM103 needs FlashInfer."""
    _, files = _written(tmp_path, _plan({1: 8, 8: 5, 64: 3}), DEMO_DRAFTER)
    line = next(x for x in files["trtllm-serve.yaml"].splitlines() if x.startswith("# attention:"))
    assert "TRTLLM needs no flash-attn but needs FlashInfer" in line and "needs none" not in line


def test_trtllm_serves_prompts_chunked_as_the_plan_simulated(tmp_path):
    """The plan chunks prompts within a step budget; BaseLlmArgs.enable_chunked_prefill defaults to False, and
    TensorRT-LLM's DFlash supports chunked prefill (dflash.py _store_prefill_context, TensorRT-LLM 00679c66)."""
    doc, files = _written(tmp_path, _plan({1: 8, 8: 5, 64: 3}), DEMO_DRAFTER)
    assert yaml.safe_load(files["trtllm-serve.yaml"])["enable_chunked_prefill"] is True
    note = " ".join(doc["notes"]["trtllm"])
    assert "_store_prefill_context" in note and "chunked at 2048 tokens a step" in note and "differ" not in note


def test_the_written_configs_switch_on_the_metrics_plan_check_reads(tmp_path):
    """trtllm-serve's /metrics is empty unless enable_iter_perf_stats (TorchLlmArgs, default False); SGLang serves
    no /metrics without --enable-metrics. Both files carry them, the target-alone YAML too."""
    _, files = _written(tmp_path / "a", _plan({1: 8, 8: 5, 64: 3}), DEMO_DRAFTER)
    assert yaml.safe_load(files["trtllm-serve.yaml"])["enable_iter_perf_stats"] is True
    flags = [line for line in files["sglang-args.txt"].splitlines() if not line.startswith("#")]
    assert "--enable-metrics" in shlex.split(flags[0])
    _, alone = _written(tmp_path / "b", dataclasses.replace(_plan({1: 8, 8: 5}), limits=None))
    assert yaml.safe_load(alone["trtllm-serve.yaml"])["enable_iter_perf_stats"] is True


def _block_keys(x, where=""):
    """Every key under `x` that counts blocks (drafts + 1) rather than drafted tokens."""
    if isinstance(x, dict):
        own = [f"{where}.{k}" for k in x if "block" in str(k)]
        return own + [p for k, v in x.items() for p in _block_keys(v, f"{where}.{k}")]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in _block_keys(v, f"{where}[{i}]")]
    return []


def test_every_file_speaks_in_drafted_tokens_and_heads_with_its_range(tmp_path):
    plan = _plan({1: 8, 8: 5, 64: 3})
    doc, files = _written(tmp_path, plan, DEMO_DRAFTER)
    block = outputs.sglang_block(plan)[0]
    sglang = files["sglang-args.txt"]
    assert f"{block - 1} drafted tokens per request per step" in sglang
    assert f"--speculative-num-draft-tokens {block}" in sglang and f"{block} = {block - 1} drafts + 1" in sglang
    assert "default of 48" in sglang and "--max-running-requests 64" in sglang  # says what the flag replaces
    assert "drafted tokens per request per step" in files["trtllm-serve.yaml"] and "1..64" in files["trtllm-serve.yaml"]
    assert [c["schedule_drafts"] for c in doc["cells"]] == [c.schedule_block - 1 for c in plan.cells]
    assert doc["configs"]["sglang_drafts"] == block - 1
    assert [c["predicted"]["mean_drafts"] for c in doc["cells"]] == [7.0, 4.0, 2.0]  # _plan's mean block, less 1
    assert not _block_keys(doc), _block_keys(doc)  # plan.json keys drafted tokens only (its "units" says so)
    assert set(doc["cells"][0]["tokens_per_s_by_drafts"]) == {str(k) for k in range(8)}
    taus = doc["inputs"]["acceptance"]["tau_by_drafts"]
    assert taus["0"] == 1.0 and len(taus) == 8 and doc["inputs"]["acceptance"]["max_drafts"] == 7
    table = outputs.table(plan).splitlines()
    assert table[1].split()[1:3] == ["7", "7"] and "anchor token excluded" in table[-1]
    fixed = json.loads(files["vllm-speculative-config-fixed.json"])
    assert fixed["num_speculative_tokens"] == block - 1 and "num_speculative_tokens_per_batch_size" not in fixed
    notes = " ".join(doc["notes"]["vllm"])
    assert "32374" in notes and "51510" in notes and "piecewise" in notes and "data parallel" in notes
    # Model Runner V2: the schedule acts on verification (PR 45953 ran DFlash with one); 51510 is not about DFlash
    assert "45953" in notes and "inert" not in notes and "--max-num-seqs" in notes


def test_the_sglang_usage_line_keeps_a_drafter_path_with_spaces_one_argument(tmp_path):
    import shutil
    import subprocess
    import sys

    drafter = tmp_path / "my drafter"
    shutil.copytree(DEMO_DRAFTER, drafter)
    _, files = _written(tmp_path / "out", _plan({1: 8, 8: 5}), drafter)
    usage = files["sglang-args.txt"].splitlines()[0].removeprefix("# usage: ")
    stub = tmp_path / "launch"  # stands for python -m sglang.launch_server: prints its arguments as JSON
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    command = usage.replace("python -m sglang.launch_server", str(stub))
    got = subprocess.run(["bash", "-c", command], cwd=tmp_path / "out", capture_output=True, text=True, check=True)
    argv = json.loads(got.stdout)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(drafter.resolve())


def test_inputs_are_labelled_as_what_they_are(tmp_path, capsys):
    doc, files = _written(tmp_path, _plan({1: 8, 8: 5}))
    cost = doc["inputs"]["cost"]
    assert cost["measured"] is False  # the shape is the nearest profiled one and the drafter is modelled
    assert cost["parts"]["operators"].startswith("measured") and cost["parts"]["shape"].startswith("assumed")
    assert cost["parts"]["drafter"].startswith("modelled")
    assert doc["to_fill"] == outputs.TO_FILL and json.loads(files["vllm-speculative-config.json"])["model"] == "DRAFTER"
    out = tmp_path / "cli"
    assert (
        main(["plan", "--out", str(out), "--trace", str(_trace_file(tmp_path / "t.jsonl")), "--no-progress", *SMALL])
        == 0
    )
    printed = capsys.readouterr().out
    assert "no --drafter: fill in the drafter folder at" in printed and '"model"' in printed


def test_a_cpu_servers_cost_model_as_input(tmp_path):
    """A CPU server's start-up cost model (bench-load's in_process.cost_model), priced in its step budget: the
    input of the issue's check that a plan from a server's metrics predicts that server's tokens/s."""
    model = {
        "target": {"fixed": 8e-3, "per_row": 2e-5, "per_token": 1.5e-4, "one_token": 7.3e-3},
        "drafter": {"fixed": 3e-3, "per_row": 0.0, "per_token": 3e-5, "one_token": None},
    }
    (tmp_path / "results.json").write_text(json.dumps({"in_process": {"cost_model": model}}))
    out = tmp_path / "plan"
    args = ["plan", "--out", str(out), "--cost-model", str(tmp_path / "results.json"), "--step-tokens", "96"]
    assert main([*args, "--no-progress", *SMALL]) == 0
    doc = json.loads((out / "plan.json").read_text())
    assert doc["settings"]["step_tokens"] == 96 and doc["inputs"]["cost"]["measured"] is True
    assert "at most 96 tokens a step (the CPU server's --step-tokens)" in doc["settings"]["workload"]
    alone = doc["cells"][0]["tokens_per_s_by_drafts"]["0"]
    # the target alone at C=1 commits one token a pass of fixed + per_row + per_token (or one_token) plus host work
    assert 0.5 / (7.3e-3 + 1e-3) < alone < 1 / 7.3e-3
    (tmp_path / "bad.json").write_text(json.dumps({"target": {}}))
    with pytest.raises(PlanInputError, match="not a cost model"):
        inputs.cost_model(tmp_path / "bad.json")
