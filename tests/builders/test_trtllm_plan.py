"""TensorRT-LLM target build planned as command lines and rank files (TensorRT-LLM itself cannot run here).
The FAKE trtllm-build check (tests/fake_tensorrt.py) models the refusals of tensorrt_llm/commands/build.py (1.2)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from fake_tensorrt import trtllm_build_refusals
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.builders.trtllm_target import (
    FATAL_BUILD_FLAGS,
    FEATURES_MODEL_FILE,
    TargetBuildError,
    TargetBuildSpec,
    engine_max_context,
    launch_command,
    plan_target_build,
    spec_from_checkpoints,
)


def spec(tp, model_type="qwen3", **kw):
    base = dict(
        target_dir="/m/target",
        out_dir="/e/target",
        model_type=model_type,
        tp=tp,
        block_size=16,
        feature_layer_ids=(1, 9, 17, 25, 33),
        num_layers=36,
    )
    base.update(kw)
    from pathlib import Path

    base["target_dir"], base["out_dir"] = Path(base["target_dir"]), Path(base["out_dir"])
    return TargetBuildSpec(**base)


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_plan_for_each_tp(tp):
    plan = plan_target_build(spec(tp), python="python3")
    assert plan.checkpoint_files == ["config.json"] + [f"rank{r}.safetensors" for r in range(tp)]
    assert plan.engine_files == ["config.json"] + [f"rank{r}.engine" for r in range(tp)]
    convert, build = plan.commands
    assert convert[:3] == ["python3", "-m", "dflash_trt.builders.trtllm_convert"]
    assert flag(convert, "--tp_size") == str(tp)
    assert flag(convert, "--model_cls") == "QWenForCausalLM"
    assert flag(convert, "--model_dir") == "/m/target" and flag(convert, "--output_dir") == "/e/target/checkpoint"
    assert flag(convert, "--feature_layer_ids") == "1,9,17,25,33"
    assert build[0] == "trtllm-build"
    assert (
        flag(build, "--checkpoint_dir") == "/e/target/checkpoint" and flag(build, "--output_dir") == "/e/target/engine"
    )
    assert trtllm_build_refusals(build) == []
    # no context logits (they switch KV reuse off) and no external-draft flags (refused with them, and
    # additional outputs cannot be combined with draft tokens)
    assert not set(FATAL_BUILD_FLAGS) & set(build)
    assert flag(build, "--use_paged_context_fmha") == "enable"
    assert flag(build, "--model_cls_file") == str(FEATURES_MODEL_FILE)
    assert flag(build, "--model_cls_name") == "DFlashQWenForCausalLM"
    assert flag(build, "--workers") == "1"  # ranks built in turn by one process, at any tp
    # the whole context fits one pass: the runtime's input limit is max_seq_len - 1
    assert int(flag(build, "--max_num_tokens")) >= int(flag(build, "--max_seq_len")) == 4096
    assert plan.spec.max_context == 4095 == int(flag(build, "--max_input_len"))
    assert plan.feature_outputs == [f"dflash_feature_{i}" for i in (1, 9, 17, 25, 33)]
    assert plan.outputs[-1] == "dflash_final_hidden"
    launch = launch_command("engines", tp, ["serve"])
    assert (launch[:3] == ["mpirun", "-n", str(tp)]) == (tp > 1)
    assert launch[-4:] == ["dflash-trt", "serve", "--engines", "engines"]


@pytest.mark.parametrize("dtype, reuse", [("float16", True), ("bfloat16", True), ("float32", False)])
def test_kv_block_reuse_only_where_context_attention_is_fused(tmp_path, dtype, reuse):
    """TensorRT-LLM runs fp32 context attention unfused, over the new tokens only (attentionOp.cpp), so a reused
    prefix would be left out of every round: an fp32 engine is built without paged context FMHA, which makes the
    Executor switch reuse off (fixExecutorConfig), and dflash_target.json records whether it reuses blocks."""
    from dflash_trt.builders.trtllm_target import target_meta

    plan = plan_target_build(spec(2, dtype=dtype), python="python3")
    convert, build = plan.commands
    assert flag(convert, "--dtype") == dtype
    assert flag(build, "--use_paged_context_fmha") == ("enable" if reuse else "disable")
    assert trtllm_build_refusals(build) == []
    assert plan.spec.block_reuse is reuse and target_meta(plan)["kv_block_reuse"] is reuse


def test_fake_build_check_refuses_the_previous_flags():
    """Negative control: the command line used before this design is refused by the modelled build.py."""
    old = [
        "trtllm-build",
        "--model_cls_file",
        "f.py",
        "--speculative_decoding_mode",
        "draft_tokens_external",
        "--max_draft_len",
        "15",
        "--gather_context_logits",
        "--workers",
        "2",
    ]
    assert len(trtllm_build_refusals(old)) == 2


def test_max_context_follows_max_num_tokens():
    s = spec(1, max_num_tokens=2048)
    assert s.max_context == 2048 == int(flag(plan_target_build(s).commands[1], "--max_input_len"))
    assert engine_max_context({"build_config": {"max_seq_len": 4096, "max_num_tokens": 2048}}) == 2048
    assert engine_max_context({"build_config": {"max_seq_len": 4096, "max_num_tokens": 8192}}) == 4095


def test_dry_run_prints_build_and_launch_without_fatal_flags(tmp_path):
    target = make_tiny_target(tmp_path / "t", family="qwen3", vocab_size=64, layers=5)
    make_tiny_drafter(target.config, tmp_path / "d", layers=2, block_size=6)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_trt.cli",
            "build-target",
            "--target",
            str(tmp_path / "t"),
            "--drafter",
            str(tmp_path / "d"),
            "--out",
            str(tmp_path / "e"),
            "--tp",
            "2",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    build = next(line for line in lines if line.startswith("trtllm-build")).split()
    assert trtllm_build_refusals(build) == [] and not set(FATAL_BUILD_FLAGS) & set(build)
    assert "--tp_size 2" in out.stdout and "rank1.engine" in out.stdout
    assert any(line.startswith("launch: mpirun -n 2 --allow-run-as-root dflash-trt serve --engines") for line in lines)
    assert not (tmp_path / "e").exists()  # a dry run writes nothing


def test_qwen3_moe_uses_qwen_classes():
    convert, build = plan_target_build(spec(1, "qwen3_moe")).commands
    assert flag(convert, "--model_cls") == "QWenForCausalLM"
    assert flag(build, "--model_cls_name") == "DFlashQWenForCausalLM"


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma4"])
def test_build_target_refuses_families_without_a_1_2_engine_by_name(tmp_path, family):
    """Real transformers configs of each family (no weights needed: the family is refused first, before the
    drafter is read); the refusal names the family and both routes that serve it."""
    from transformers import AutoConfig

    AutoConfig.for_model(family).save_pretrained(tmp_path / "t")
    with pytest.raises(TargetBuildError) as refused:
        spec_from_checkpoints(tmp_path / "t", tmp_path / "no-drafter", tmp_path / "e", tp=1)
    message = str(refused.value)
    assert f"model_type {family!r}" in message and "TensorRT-LLM 1.2" in message
    assert "trtllm-serve-config" in message and "dflash-trt serve --target" in message
    with pytest.raises(TargetBuildError, match=f"{family!r}.*trtllm-serve-config"):
        plan_target_build(spec(3, family))  # before the shape checks (tp 3 is refused too)


def test_make_engines_skips_the_target_engine_of_a_refused_family(tmp_path, monkeypatch):
    """On a machine with TensorRT-LLM, `make engines` reports the 1.2 target step as skipped with the refusal
    (the routes that work) instead of failing the whole build; the registry is told TensorRT-LLM is usable
    (FAKE: it is not installed here) and nothing reaches a TensorRT-LLM call."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from dflash_trt.builders import engines

    AutoConfig.for_model("qwen3_5").save_pretrained(tmp_path / "t")
    cfg = SimpleNamespace(target=tmp_path / "t", drafter=tmp_path / "d", tp=1, gpus_per_node=0, precision="fp16")
    cfg.max_batch_size, cfg.max_seq_len = 8, 4096
    ctx = SimpleNamespace(cfg=cfg, block_size=4, log=lambda *_: None, out=tmp_path / "e", engines={})
    ctx.sources, ctx.spec = {"target": {"sha256": "-"}}, SimpleNamespace(target_layer_ids=(1, 2))
    step = next(s for s in engines.STEPS if s.name == "target_tensorrt_llm")
    monkeypatch.setattr("dflash_trt.runtime.registry.unavailable_reason", lambda role, backend: None)
    report = engines.BuildReport()
    engines._run_step(step, ctx, {}, report)
    assert report.built == [] and "'qwen3_5'" in report.skipped["target_tensorrt_llm"]
    assert "trtllm-serve-config" in report.skipped["target_tensorrt_llm"]


def test_build_target_cli_refuses_gpt_oss_with_the_route(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("gpt_oss").save_pretrained(tmp_path / "t")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    args = ["build-target", "--target", tmp_path / "t", "--drafter", tmp_path / "d", "--out", tmp_path / "e"]
    out = subprocess.run(
        [sys.executable, "-m", "dflash_trt.cli", *map(str, args), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "'gpt_oss'" in out.stderr and "trtllm-serve-config" in out.stderr


def test_llama_family_uses_llama_classes():
    convert, build = plan_target_build(spec(2, "llama", feature_layer_ids=(1, 2))).commands
    assert flag(convert, "--model_cls") == "LLaMAForCausalLM"
    assert flag(build, "--model_cls_name") == "DFlashLLaMAForCausalLM"


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(tp=3), "tp must be one of"),
        (dict(model_type="gemma3"), "cannot expose its layer features"),
        (dict(feature_layer_ids=(1, 40)), r"feature layers \[40\] outside"),
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(max_num_tokens=8), "max_num_tokens"),
    ],
)
def test_refusals_name_the_problem(bad, message):
    kw = dict(tp=1)
    kw.update(bad)
    with pytest.raises(TargetBuildError, match=message):
        plan_target_build(spec(**kw))


def test_spec_from_real_checkpoint_configs(tmp_path):
    target = make_tiny_target(tmp_path / "t", family="llama", vocab_size=64, layers=5)
    make_tiny_drafter(target.config, tmp_path / "d", layers=2, block_size=6)
    s = spec_from_checkpoints(tmp_path / "t", tmp_path / "d", tmp_path / "e", tp=4)
    assert (s.model_type, s.tp, s.block_size, s.num_layers) == ("llama", 4, 6, 5)
    assert s.feature_layer_ids == (1, 2)  # build_target_layer_ids(5, 2)
    plan = plan_target_build(s)
    assert s.block_size == 6 and "--max_draft_len" not in plan.commands[1]


def test_feature_model_file_defines_the_planned_classes():
    tree = ast.parse(FEATURES_MODEL_FILE.read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert {"DFlashLLaMAForCausalLM", "DFlashQWenForCausalLM"} <= classes


@pytest.mark.parametrize("command", ["build-target", "serve"])
def test_help_gives_the_tensor_parallel_launch_line(command, capsys):
    from dflash_trt.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "mpirun -n N --allow-run-as-root dflash-trt serve --engines engines" in capsys.readouterr().out


def test_the_timing_cache_goes_into_the_builds_scratch_folder_never_the_working_directory():
    """trtllm-build writes its timing cache to --output_timing_cache, default 'model.cache' relative to the working
    directory (tensorrt_llm/commands/build.py, builder.py BuildConfig at 008b2b8d): a pod's image WORKDIR or a
    read-only container root fails the build there, after the engines are made (tests/deploy/test_pods.py runs it)."""
    plan = plan_target_build(spec(1))
    cache = Path(flag(plan.commands[1], "--output_timing_cache"))
    assert cache.is_absolute() and cache.parent == plan.spec.checkpoint_dir  # removed with it after the build
