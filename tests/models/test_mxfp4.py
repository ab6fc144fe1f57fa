"""gpt-oss MXFP4 checkpoints (issue 54 point 8): what they need is said before loading, by the rules of
transformers' Mxfp4HfQuantizer.validate_environment (5.25.0), not after an ImportError or an out-of-memory.
The checkpoints are tiny, written here with MXFP4-named uint8 tensors: only their headers are read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_trt.models import mxfp4
from dflash_trt.models.target import load_target


@pytest.fixture
def checkpoint(tmp_path):
    """config.json of a gpt-oss MXFP4 checkpoint and one shard: 8 experts x 64 x 16 packed bytes (2 values each),
    their scales (not values), and a 1000 x 32 embedding in bf16."""
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 1}
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(8, 64, 16, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(8, 64, 1, dtype=torch.uint8),
        "model.embed_tokens.weight": torch.zeros(1000, 32, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"))
    return tmp_path


def _config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def test_the_dequantized_size_counts_two_values_a_packed_byte(checkpoint):
    assert mxfp4.safetensors_values(checkpoint) == 8 * 64 * 16 * 2 + 1000 * 32


def test_without_accelerate_the_load_is_refused_by_name_before_any_weight(checkpoint, monkeypatch):
    monkeypatch.setattr(mxfp4, "_has", lambda module: module != "accelerate")
    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    with pytest.raises(ValueError, match="only with `accelerate` installed") as info:
        load_target(checkpoint, torch.bfloat16)
    assert "kernels" in str(info.value) and "dequantize" in str(info.value) and not loads


def test_a_dequantized_model_beyond_the_gpus_free_memory_is_refused_with_its_size(checkpoint, monkeypatch):
    """No `kernels`: transformers would dequantize to bf16 and run out of memory while loading; refused first."""
    monkeypatch.setattr(mxfp4, "_has", lambda module: module != "kernels")
    monkeypatch.setattr(mxfp4, "keeps_mxfp4", lambda device: "kernels not installed")
    monkeypatch.setattr(mxfp4, "free_bytes", lambda device: 40_000)  # bytes free: below the 96,768 needed
    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    with pytest.raises(ValueError, match=r"dequantized to torch.bfloat16 \(kernels not installed\): 0.1 MB") as info:
        load_target(checkpoint, torch.bfloat16, "cuda")
    assert "install `kernels`" in str(info.value) and not loads


def test_what_fits_is_said_before_loading(checkpoint, monkeypatch):
    monkeypatch.setattr(mxfp4, "keeps_mxfp4", lambda device: "kernels not installed")
    monkeypatch.setattr(mxfp4, "free_bytes", lambda device: 10**9)
    plan = mxfp4.mxfp4_plan(checkpoint, _config(checkpoint), torch.bfloat16, "cuda")
    assert plan == "MXFP4 checkpoint dequantized to torch.bfloat16 (kernels not installed): 0.1 MB"
    monkeypatch.setattr(mxfp4, "keeps_mxfp4", lambda device: None)
    assert mxfp4.mxfp4_plan(checkpoint, _config(checkpoint), torch.bfloat16, "cuda") == (
        "MXFP4 checkpoint: experts stay packed on cuda"
    )


def test_where_mxfp4_stays_packed_follows_transformers(monkeypatch):
    monkeypatch.setattr(mxfp4, "_triton_at_least", lambda wanted: False)
    monkeypatch.setattr(mxfp4, "_kernels_usable", lambda: False)
    assert mxfp4.keeps_mxfp4(torch.device("cpu")) == (
        "triton >= 3.5 and kernels (a version transformers accepts) not installed"
    )
    monkeypatch.setattr(mxfp4, "_kernels_usable", lambda: True)
    monkeypatch.setattr(mxfp4, "_triton_at_least", lambda wanted: wanted <= (3, 4))
    assert mxfp4.keeps_mxfp4(torch.device("cpu")) == "triton >= 3.5 not installed"  # CPU needs 3.5
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert mxfp4.keeps_mxfp4(torch.device("cuda")) is None  # CUDA needs 3.4
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert mxfp4.keeps_mxfp4(torch.device("cuda")) == "the GPU's compute capability 7.0 is below 7.5"


def test_a_checkpoint_that_is_not_mxfp4_has_no_plan(tmp_path):
    from dflash_trt.models.tiny import make_tiny_target

    model = make_tiny_target(tmp_path, family="gpt_oss", vocab_size=64, layers=2)
    assert mxfp4.mxfp4_plan(tmp_path, model.config, torch.float32, "cpu") is None


def test_kernels_outside_the_range_transformers_accepts_mean_dequantizing(monkeypatch):
    """transformers' is_kernels_available() refuses a `kernels` outside the versions it supports
    (KERNELS_MIN_VERSION..KERNELS_MAX_VERSION in utils/import_utils.py) and then dequantizes: an installed but
    unsupported `kernels` must not be read as 'stays packed' (that skipped the memory check)."""
    monkeypatch.setattr(mxfp4, "_triton_at_least", lambda wanted: True)
    monkeypatch.setattr(mxfp4, "_has", lambda module: True)  # every package present, `kernels` included
    monkeypatch.setattr(
        "transformers.utils.import_utils.is_kernels_available", lambda: False
    )  # ... at a version it refuses
    assert "kernels" in (mxfp4.keeps_mxfp4(torch.device("cpu")) or "")
