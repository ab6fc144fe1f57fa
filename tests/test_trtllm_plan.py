"""TensorRT-LLM target build planned as command lines and rank files (TensorRT-LLM itself cannot run here)."""

import ast
import json

import pytest
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.builders.trtllm_target import (
    FEATURES_MODEL_FILE,
    TargetBuildError,
    TargetBuildSpec,
    plan_target_build,
    serve_command,
    spec_from_checkpoints,
)


def spec(tp, model_type="qwen3", **kw):
    base = dict(target_dir="/m/target", out_dir="/e/target", model_type=model_type, tp=tp, block_size=16,
                feature_layer_ids=(1, 9, 17, 25, 33), num_layers=36)
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
    assert flag(build, "--checkpoint_dir") == "/e/target/checkpoint" and flag(build, "--output_dir") == "/e/target/engine"
    assert flag(build, "--speculative_decoding_mode") == "draft_tokens_external"
    assert flag(build, "--max_draft_len") == "15"  # block size - 1
    assert flag(build, "--use_paged_context_fmha") == "enable"
    assert flag(build, "--model_cls_file") == str(FEATURES_MODEL_FILE)
    assert flag(build, "--model_cls_name") == "DFlashQWenForCausalLM"
    assert flag(build, "--workers") == str(tp)
    assert plan.feature_outputs == [f"dflash_feature_{i}" for i in (1, 9, 17, 25, 33)]
    launch = serve_command("engines", tp, ["generate", "--prompt", "hi"])
    assert (launch[:3] == ["mpirun", "-n", str(tp)]) == (tp > 1)


def test_llama_family_uses_llama_classes():
    convert, build = plan_target_build(spec(2, "llama", feature_layer_ids=(1, 2))).commands
    assert flag(convert, "--model_cls") == "LLaMAForCausalLM"
    assert flag(build, "--model_cls_name") == "DFlashLLaMAForCausalLM"


@pytest.mark.parametrize("bad, message", [
    (dict(tp=3), "tp must be one of"),
    (dict(model_type="gemma3"), "cannot expose its layer features"),
    (dict(feature_layer_ids=(1, 40)), r"feature layers \[40\] outside"),
    (dict(block_size=1), "block_size must be >= 2"),
    (dict(max_input_len=5000), "max_input_len"),
])
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
    assert flag(plan.commands[1], "--max_draft_len") == "5"


def test_feature_model_file_defines_the_planned_classes():
    tree = ast.parse(FEATURES_MODEL_FILE.read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert {"DFlashLLaMAForCausalLM", "DFlashQWenForCausalLM"} <= classes
