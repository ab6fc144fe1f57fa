"""Tensor parallelism must split the attention heads: the build plan refuses a tp the weight split cannot serve.

The FAKE converter split (tests/fake_tensorrt.py, fake_tp_convert_attention) models TensorRT-LLM 1.2's LLaMA /
QWen conversion and per-rank attention shapes; the plan must accept exactly the tp sizes it loads."""

import json
import subprocess
import sys

import pytest
from fake_tensorrt import fake_tp_convert_attention
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.builders.trtllm_target import (
    TP_SIZES,
    TargetBuildError,
    plan_target_build,
    spec_from_checkpoints,
    working_tp,
)
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET


def dry_run(target, drafter, out, tp):
    return subprocess.run(
        [sys.executable, "-m", "dflash_trt.cli", "build-target", "--target", str(target), "--drafter", str(drafter)]
        + ["--out", str(out), "--tp", str(tp), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("heads, kv", [(5, 1), (8, 2), (9, 3), (32, 8), (64, 8), (4, 4), (6, 2), (12, 3)])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_plan_accepts_exactly_what_the_fake_converter_loads(tmp_path, heads, kv, tp):
    from dflash_trt.builders.trtllm_target import TargetBuildSpec

    spec = TargetBuildSpec(
        target_dir=tmp_path,
        out_dir=tmp_path / "e",
        model_type="qwen3",
        tp=tp,
        block_size=8,
        feature_layer_ids=(1,),
        num_layers=4,
        num_attention_heads=heads,
        num_kv_heads=kv,
    )
    try:
        fake_tp_convert_attention(heads, kv, head_dim=64, tp=tp)
        loads = True
    except ValueError:
        loads = False
    if loads:
        plan_target_build(spec)
    else:
        with pytest.raises(TargetBuildError, match=rf"{heads} attention heads and {kv} KV heads"):
            plan_target_build(spec)
    assert (tp in working_tp(heads, kv)) == loads


def test_demo_target_at_tp2_refused_with_head_counts_and_working_tp(tmp_path):
    """The demo target has 5 query heads and 1 KV head: its query weight would split into 160-row halves
    where each rank expects 2 heads (128 rows)."""
    with pytest.raises(ValueError, match="expects q 128"):
        fake_tp_convert_attention(5, 1, head_dim=64, tp=2)
    out = dry_run(DEMO_TARGET, DEMO_DRAFTER, tmp_path / "e", 2)
    assert out.returncode != 0
    assert "5 attention heads and 1 KV heads" in out.stderr
    assert "tp values that work: [1]" in out.stderr
    assert not (tmp_path / "e").exists()


def test_eight_query_two_kv_heads_plans_cleanly_at_tp2(tmp_path):
    make_tiny_target(tmp_path / "t", family="qwen3", vocab_size=64, layers=4, hidden=128, num_attention_heads=8)
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 2)
    from transformers import AutoConfig

    make_tiny_drafter(AutoConfig.from_pretrained(tmp_path / "t"), tmp_path / "d", layers=1, block_size=4)
    out = dry_run(tmp_path / "t", tmp_path / "d", tmp_path / "e", 2)
    assert out.returncode == 0, out.stderr
    assert "--tp_size 2" in out.stdout
    spec = spec_from_checkpoints(tmp_path / "t", tmp_path / "d", tmp_path / "e", tp=2)
    assert (spec.num_attention_heads, spec.num_kv_heads) == (8, 2)
    # and tp 8 (more ranks than KV heads: replicated) plans too, tp 8 > 8 query heads would not
    assert working_tp(8, 2) == [1, 2, 4, 8]
