"""Triton model repository: written from typed configs, and every kind of breakage caught with a clear message."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient is part of the dev extra")

from helpers import make_text_models  # noqa: E402

from dflash_trt.builders.triton_repo import write_repository  # noqa: E402
from dflash_trt.triton.config import ConfigError, check_repository, parse_config, validate_repository  # noqa: E402

MODELS = {
    "dflash",
    "dflash_sync",
    "preprocessing",
    "postprocessing",
    "dflash_bls",
    "dflash_bls_sync",
    "dflash_target",
    "dflash_drafter",
    "dflash_drafter_batch",
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-config")
    target, drafter = make_text_models(root)
    return write_repository(root / "repo", target=target, drafter=drafter)


@pytest.fixture
def broken(repo, tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy, symlinks=True)
    return copy


def test_repository_is_complete_and_valid(repo):
    assert {p.name for p in repo.iterdir()} == MODELS
    assert validate_repository(repo) == []
    bls = parse_config(repo / "dflash_bls" / "config.pbtxt")
    assert bls.model_transaction_policy.decoupled and bls.max_batch_size == 8
    assert not parse_config(repo / "dflash_bls_sync" / "config.pbtxt").model_transaction_policy.decoupled
    steps = [s.model_name for s in parse_config(repo / "dflash" / "config.pbtxt").ensemble_scheduling.step]
    assert steps == ["preprocessing", "dflash_bls", "postprocessing"]
    assert (repo / "dflash_drafter" / "1" / "drafter-onnx" / "drafter.onnx").is_file()
    assert (repo / "dflash_target" / "1" / "target" / "config.json").is_file()
    # the batched drafter graph, and the BLS told to draft every row of a step in one call of it
    assert (repo / "dflash_drafter_batch" / "1" / "drafter-onnx" / "drafter_batch.onnx").is_file()
    batch = parse_config(repo / "dflash_drafter_batch" / "config.pbtxt")
    assert [t.name for t in batch.input][:2] == ["block_ids", "block_lengths"]
    assert bls.parameters["drafter_batch_model"].string_value == "dflash_drafter_batch"
    # the dtype the drafter computes in (the fp32 graph's), for the BLS to report beside seeded text
    for name in ("dflash_bls", "dflash_bls_sync"):
        assert parse_config(repo / name / "config.pbtxt").parameters["drafter_dtype"].string_value == "float32"


def test_broken_ensemble_map_is_caught(broken):
    path = broken / "dflash" / "config.pbtxt"
    path.write_text(path.read_text().replace('value: "_input_ids"', 'value: "_input_idz"', 1))
    errors = validate_repository(broken)
    assert any("'_input_idz'" in e and "no ensemble input or step output provides" in e for e in errors), errors
    with pytest.raises(ConfigError, match="_input_idz"):
        check_repository(broken)


def test_ensemble_map_to_unknown_model_input_is_caught(broken):
    path = broken / "dflash" / "config.pbtxt"
    path.write_text(path.read_text().replace('key: "text_input"', 'key: "prompt"', 1))
    errors = validate_repository(broken)
    assert any("names input 'prompt'" in e for e in errors), errors
    assert any("does not feed its required inputs ['text_input']" in e for e in errors), errors


def test_dtype_mismatch_between_producer_and_consumer_is_caught(broken):
    path = broken / "postprocessing" / "config.pbtxt"
    text = path.read_text()
    head, sep, tail = text.partition('name: "new_tokens"')
    path.write_text(head + sep + tail.replace("TYPE_INT32", "TYPE_INT64", 1))
    errors = validate_repository(broken)
    assert any("'num_tokens' is TYPE_INT32 from dflash_bls" in e and "wants TYPE_INT64" in e for e in errors), errors


def test_missing_version_folder_is_caught(broken):
    shutil.rmtree(broken / "dflash_bls" / "1")
    errors = validate_repository(broken)
    assert errors == ["dflash_bls: missing version folder (expected dflash_bls/1/)"]


def test_missing_model_file_is_caught(broken):
    (broken / "dflash_target" / "1" / "model.py").unlink()
    assert validate_repository(broken) == ["dflash_target: version 1 has no model.py"]


def test_misspelled_field_is_caught(broken):
    path = broken / "dflash_target" / "config.pbtxt"
    path.write_text(path.read_text().replace("instance_group", "instance_grup", 1))
    errors = validate_repository(broken)
    assert len(errors) == 1 and "dflash_target/config.pbtxt" in errors[0] and "instance_grup" in errors[0], errors


def test_cli_writes_repository_and_refuses_to_overwrite(tmp_path, capsys):
    from dflash_trt.cli import main

    target, drafter = make_text_models(tmp_path)
    out = tmp_path / "repo"
    assert main(["triton-repo", "--target", str(target), "--drafter", str(drafter), "--out", str(out)]) == 0
    assert validate_repository(out) == []
    assert main(["triton-repo", "--target", str(target), "--drafter", str(drafter), "--out", str(out)]) == 1
    assert "exists (pass --force" in capsys.readouterr().err


def test_cli_without_model_arguments_uses_the_demo_models(tmp_path, monkeypatch, capsys):
    """Like every other command, `triton-repo --out DIR` defaults to the demo models."""
    from dflash_trt import settings
    from dflash_trt.cli import main

    monkeypatch.setattr(settings, "DEMO_TARGET", tmp_path / "no-demo" / "target")
    monkeypatch.setattr(settings, "DEMO_DRAFTER", tmp_path / "no-demo" / "drafter")
    assert main(["triton-repo", "--out", str(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err
    assert f"target directory not found: {tmp_path / 'no-demo' / 'target'}" in err and "demo models" in err
    assert not (tmp_path / "repo").exists()


def test_engines_manifest_with_tensorrt_plan_gives_a_tensorrt_plan_drafter(repo, tmp_path):
    """--engines: the manifest's serve section picks the backends. The plan bytes are a placeholder
    (no TensorRT here): this checks the repository layout and config only, not that Triton loads it."""
    import json

    engines = tmp_path / "engines"
    (engines / "drafter-tensorrt").mkdir(parents=True)
    (engines / "drafter-tensorrt" / "drafter.plan").write_bytes(b"placeholder, not a TensorRT plan")
    # the precision builders/trt_drafter.py records in the plan's manifest (the rest of it is not read here)
    (engines / "drafter-tensorrt" / "drafter.plan.json").write_text(json.dumps({"precision": "fp16"}))
    shutil.copy(repo / "dflash_drafter" / "1" / "drafter-onnx" / "drafter.json", engines / "drafter-tensorrt")
    target = repo / "dflash_target" / "1" / "target"
    (engines / "manifest.json").write_text(
        json.dumps(
            {
                "sources": {"target": {"path": str(target)}},
                "engines": {
                    "drafter_trt": {"backend": "tensorrt", "role": "drafter", "dir": "drafter-tensorrt"},
                    "target_torch": {"backend": "torch", "role": "target", "checkpoint": str(target)},
                },
                "serve": {"drafter": "drafter_trt", "target": "target_torch"},
            }
        )
    )
    out = write_repository(tmp_path / "repo", engines=engines)
    drafter = parse_config(out / "dflash_drafter" / "config.pbtxt")
    assert drafter.platform == "tensorrt_plan" and not drafter.backend
    assert (out / "dflash_drafter" / "1" / "model.plan").read_bytes().startswith(b"placeholder")
    assert [t.name for t in drafter.input] == ["block_ids", "features", "past_k", "past_v"]
    assert not (out / "dflash_drafter_batch").exists()  # no batched plan served: the BLS loops per row
    bls = parse_config(out / "dflash_bls" / "config.pbtxt").parameters
    assert "drafter_batch_model" not in bls
    assert bls["drafter_dtype"].string_value == "float16"  # what the plan computes in, for the BLS to report
    assert validate_repository(out) == []
