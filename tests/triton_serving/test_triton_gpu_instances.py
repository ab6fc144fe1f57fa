"""Triton repository for a TensorRT-LLM target: where Triton puts its instances, with Triton's placement rule
modelled (no GPU, no TensorRT-LLM here; the engine folder and plan are placeholders, only configs are checked).

The rule (Triton's docs/user_guide/model_configuration.md, "Instance Groups", and model_config.proto,
ModelInstanceGroup.count / .gpus): a KIND_GPU group places `count` instances on each GPU in `gpus`, or on EVERY
visible GPU when `gpus` is empty; a KIND_CPU group places `count` instances on the CPU."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient is part of the dev extra")

from helpers import make_text_models  # noqa: E402

from dflash_trt.builders.triton_repo import TritonTpUnsupported, write_repository  # noqa: E402
from dflash_trt.triton.config import parse_config, validate_repository  # noqa: E402


def triton_instances(cfg, visible_gpus: int) -> list[str]:
    """The instances Triton creates for a model config: 'gpu:N' or 'cpu' per instance (modelled rule)."""
    placed = []
    for group in cfg.instance_group:
        kind = type(group).Kind.Name(group.kind)
        if kind == "KIND_GPU":
            for gpu in list(group.gpus) or range(visible_gpus):
                placed += [f"gpu:{gpu}"] * group.count
        else:
            placed += ["cpu"] * group.count
    return placed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-trtllm")
    target, drafter = make_text_models(root)
    onnx_repo = write_repository(root / "onnx-repo", target=target, drafter=drafter)
    return root, target, onnx_repo


def trtllm_engines(root, target, onnx_repo, tp: int):
    engines = root / f"engines-tp{tp}"
    shutil.rmtree(engines, ignore_errors=True)
    (engines / "drafter-tensorrt").mkdir(parents=True)
    (engines / "drafter-tensorrt" / "drafter.plan").write_bytes(b"placeholder, not a TensorRT plan")
    # the plan's manifest as builders/trt_drafter.py writes it, as far as the repository reads it (its precision)
    (engines / "drafter-tensorrt" / "drafter.plan.json").write_text(
        json.dumps({"plan": "drafter.plan", "precision": "fp16"})
    )
    shutil.copy(onnx_repo / "dflash_drafter" / "1" / "drafter-onnx" / "drafter.json", engines / "drafter-tensorrt")
    folder = engines / "target-tensorrt_llm"
    (folder / "engine").mkdir(parents=True)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    (folder / "engine" / "config.json").write_text(
        json.dumps({"pretrained_config": {"vocab_size": vocab}, "build_config": {"max_seq_len": 256}})
    )
    (folder / "dflash_target.json").write_text(
        json.dumps({"engine_dir": "engine", "tp": tp, "feature_layer_ids": [1, 2], "target_dir": str(target)})
    )
    (engines / "manifest.json").write_text(
        json.dumps(
            {
                "sources": {"target": {"path": str(target)}},
                "engines": {
                    "drafter_trt": {"backend": "tensorrt", "role": "drafter", "dir": "drafter-tensorrt"},
                    "target_trtllm": {"backend": "tensorrt_llm", "role": "target", "dir": "target-tensorrt_llm"},
                },
                "serve": {"drafter": "drafter_trt", "target": "target_trtllm"},
            }
        )
    )
    return engines


def test_tp1_target_is_one_instance_pinned_to_gpu0_on_an_8_gpu_node(checkpoints, tmp_path):
    root, target, onnx_repo = checkpoints
    out = write_repository(tmp_path / "repo", engines=trtllm_engines(root, target, onnx_repo, tp=1))
    cfg = parse_config(out / "dflash_target" / "config.pbtxt")
    assert cfg.parameters["backend"].string_value == "tensorrt_llm"
    # no `device`: the output layer runs on the executor rank's GPU (trtllm_backend.rank_device), never the CPU
    assert "device" not in cfg.parameters
    assert triton_instances(cfg, visible_gpus=8) == ["gpu:0"]  # every call of a session meets its KV cache
    drafter = parse_config(out / "dflash_drafter" / "config.pbtxt")
    assert triton_instances(drafter, visible_gpus=8) == ["gpu:0"]  # beside the target's features
    assert validate_repository(out) == []
    # negative control: the same group without `gpus` (as written before) gives one executor per GPU
    del cfg.instance_group[0].gpus[:]
    assert triton_instances(cfg, visible_gpus=8) == [f"gpu:{i}" for i in range(8)]


def test_cpu_target_stays_one_cpu_instance(checkpoints):
    _, _, onnx_repo = checkpoints
    cfg = parse_config(onnx_repo / "dflash_target" / "config.pbtxt")
    assert triton_instances(cfg, visible_gpus=8) == ["cpu"]


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_above_1_is_refused_naming_the_alternatives(checkpoints, tmp_path, tp):
    root, target, onnx_repo = checkpoints
    with pytest.raises(TritonTpUnsupported, match=f"built for tp {tp}") as e:
        write_repository(tmp_path / "repo", engines=trtllm_engines(root, target, onnx_repo, tp=tp))
    assert f"mpirun -n {tp} --allow-run-as-root dflash-trt serve" in str(e.value)
    assert "trtllm-serve-config" in str(e.value) and "orchestrator mode" in str(e.value)
    assert not (tmp_path / "repo").exists()


def test_cli_refuses_tp2_with_a_clear_message(checkpoints, tmp_path, capsys):
    from dflash_trt.cli import main

    root, target, onnx_repo = checkpoints
    engines = trtllm_engines(root, target, onnx_repo, tp=2)
    assert main(["triton-repo", "--engines", str(engines), "--out", str(tmp_path / "repo")]) == 1
    assert "built for tp 2" in capsys.readouterr().err
