"""`dflash-trt engines` (what `make engines` runs) on the CPU path: manifest contents, hash-based idempotence,
rebuild on changed inputs, clear skips, and `generate --engines` equal to the target alone."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from helpers import make_tiny_pair
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.builders.engines import EnginesConfigError, build_engines, read_config
from dflash_trt.builders.hashing import tree_sha256
from dflash_trt.cli.options import load_engines_or_fail as _load_engines
from dflash_trt.formats import serving_sources
from dflash_trt.settings import DEMO_MODELS_HINT


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("eng-ckpt")
    make_tiny_pair(root, vocab_size=80)
    return root


def config_file(tmp_path, checkpoints, fmt="toml", **extra):
    values = {
        "target": str(checkpoints / "target"),
        "drafter": str(checkpoints / "drafter"),
        "output": str(tmp_path / "engines"),
        **extra,
    }
    if fmt == "json":
        path = tmp_path / "engines.json"
        path.write_text(json.dumps(values))
    else:
        path = tmp_path / "engines.toml"
        path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return path


def test_manifest_then_nothing_to_do(tmp_path, checkpoints, monkeypatch):
    cfg = read_config(config_file(tmp_path, checkpoints), tmp_path)
    manifest, report = build_engines(cfg, log=lambda *_: None)
    assert report.built == ["drafter_onnx"]
    assert set(report.skipped) == {"drafter_tensorrt", "target_tensorrt_llm"}
    assert "tensorrt" in report.skipped["drafter_tensorrt"] and "not installed" in report.skipped["drafter_tensorrt"]

    on_disk = json.loads((cfg.output / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["sources"]["target"]["sha256"] == tree_sha256(checkpoints / "target")
    assert manifest["sources"]["drafter"]["sha256"] == tree_sha256(checkpoints / "drafter")
    d = manifest["engines"]["drafter_onnx"]
    assert d["backend"] == "onnxruntime"
    assert {"drafter.onnx", "drafter.onnx.data", "drafter_fp16.onnx", "drafter_fp16.onnx.data", "drafter.json"} <= set(
        d["files"]
    )
    assert {"drafter_batch.onnx", "drafter_batch_fp16.onnx"} <= set(d["files"])  # the batched round too
    from dflash_trt.runtime.ort_backend import BatchGraphSession, OrtDrafterEngine

    served = OrtDrafterEngine(cfg.output / d["dir"])
    assert served.batched and isinstance(served.new_session(), BatchGraphSession)  # one pass per step
    assert d["versions"]["onnxruntime"] and d["versions"]["torch"]
    assert d["shapes"]["logits"][2] == 80 and d["shapes"]["features"][2] == 64  # 1 feature layer x hidden 64
    assert manifest["engines"]["target_torch"]["backend"] == "torch"
    assert manifest["serve"] == {"drafter": "drafter_onnx", "target": "target_torch"}
    assert manifest["config"]["block_size"] == 4  # 0 in the config -> the drafter's trained size

    # second run, unchanged inputs: no export, manifest untouched
    before = {p: p.stat().st_mtime_ns for p in cfg.output.rglob("*") if p.is_file()}
    monkeypatch.setattr(
        "dflash_trt.builders.onnx_drafter.export_from_checkpoints",
        lambda *a, **k: pytest.fail("re-exported with unchanged inputs"),
    )
    again, report = build_engines(cfg, log=lambda *_: None)
    assert report.built == [] and report.unchanged == ["drafter_onnx"]
    assert again == manifest
    assert before == {p: p.stat().st_mtime_ns for p in cfg.output.rglob("*") if p.is_file()}


def test_changed_or_damaged_inputs_rebuild(tmp_path, checkpoints):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints, ckpt)
    cfg = read_config(config_file(tmp_path, ckpt, fmt="json"), tmp_path)
    first, _ = build_engines(cfg, log=lambda *_: None)
    # a damaged output file is noticed by its hash
    (cfg.output / "drafter-onnx" / "drafter.json").write_text("{}")
    _, report = build_engines(cfg, log=lambda *_: None)
    assert report.built == ["drafter_onnx"]
    # a changed checkpoint changes the key
    make_tiny_drafter(
        make_tiny_target(family="qwen3", vocab_size=80, layers=4).config,
        ckpt / "drafter",
        layers=1,
        block_size=4,
        seed=1,
    )
    second, report = build_engines(cfg, log=lambda *_: None)
    assert report.built == ["drafter_onnx"]
    assert second["sources"]["drafter"]["sha256"] != first["sources"]["drafter"]["sha256"]


def test_changed_exporter_code_rebuilds(tmp_path, checkpoints, monkeypatch):
    """The ONNX graph is made by our code too: a new drafter/exporter version must not reuse an old graph, neither
    the engines folder's nor the export cache's."""
    import dflash_trt.builders.hashing as hashing

    cfg = read_config(config_file(tmp_path, checkpoints, fmt="json"), tmp_path)
    build_engines(cfg, log=lambda *_: None)
    real = hashing.code_sha256
    monkeypatch.setattr(hashing, "code_sha256", lambda *m: real(*m) + "-changed")
    said: list[str] = []
    _, report = build_engines(cfg, log=lambda *m: said.append(" ".join(map(str, m))))
    assert report.built == ["drafter_onnx"]
    assert any("exporting the drafter" in m for m in said) and not any("export cache" in m for m in said)


def test_config_errors_are_clear(tmp_path, checkpoints):
    with pytest.raises(EnginesConfigError, match="unknown engines config keys \\['tp_size'\\]"):
        read_config(config_file(tmp_path, checkpoints, tp_size=2), tmp_path)
    with pytest.raises(EnginesConfigError, match="precision must be one of"):
        read_config(config_file(tmp_path, checkpoints, precision="int3"), tmp_path)
    with pytest.raises(EnginesConfigError, match="block_size must be 0"):
        read_config(config_file(tmp_path, checkpoints, block_size=1), tmp_path)
    cfg = read_config(None, tmp_path, {"target": tmp_path / "nope", "drafter": checkpoints / "drafter"})
    with pytest.raises(EnginesConfigError, match="target checkpoint not found.*" + re.escape(DEMO_MODELS_HINT)):
        build_engines(cfg, log=lambda *_: None)


def test_cli_engines_then_generate_equals_target_alone(tmp_path, checkpoints):
    cli = [sys.executable, "-m", "dflash_trt.cli"]
    cfg = config_file(tmp_path, checkpoints)
    run = subprocess.run(cli + ["engines", "--config", str(cfg)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "built      drafter_onnx" in run.stdout and "skipped    target_tensorrt_llm" in run.stdout
    rerun = subprocess.run(cli + ["engines", "--config", str(cfg)], capture_output=True, text=True, timeout=300)
    assert "up to date drafter_onnx" in rerun.stdout and "built" not in rerun.stdout

    args = ["generate", "--input-ids", "3,1,4,1,5", "--max-new-tokens", "24", "--json"]
    spec = subprocess.run(
        cli + args + ["--engines", str(tmp_path / "engines")], capture_output=True, text=True, timeout=300
    )
    base = subprocess.run(
        cli + args + ["--target", str(checkpoints / "target"), "--no-draft"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert spec.returncode == 0 and base.returncode == 0, spec.stderr + base.stderr
    got, expected = json.loads(spec.stdout), json.loads(base.stdout)
    assert got["token_ids"] == expected["token_ids"]
    assert got["stats"]["block_size"] == 4 and got["stats"]["drafted_tokens"] > 0  # the ONNX drafter ran

    missing = subprocess.run(cli + args + ["--engines", str(tmp_path / "none")], capture_output=True, text=True)
    assert missing.returncode == 1 and "make engines" in missing.stderr and "Traceback" not in missing.stderr


def test_engines_folder_moves_with_its_checkpoints(tmp_path, checkpoints):
    """Paths in the manifest are relative to it: a repo moved (or mounted in Docker) still loads; old
    manifests with absolute paths still load; --no-draft never loads the drafter."""
    from helpers import generate_one

    from dflash_trt.decoding import BatchDecoder, GenerationConfig
    from dflash_trt.loading import load_decoder_from_engines

    repo = tmp_path / "repo"
    shutil.copytree(checkpoints, repo / "models")
    cfg = read_config(None, repo, {"target": "models/target", "drafter": "models/drafter", "output": "engines"})
    manifest, _ = build_engines(cfg, log=lambda *_: None)
    assert manifest["sources"]["target"]["path"] == "../models/target"
    assert manifest["engines"]["target_torch"]["checkpoint"] == "../models/target"

    moved = tmp_path / "elsewhere"
    repo.rename(moved)
    src = serving_sources(moved / "engines")
    assert src.target_dir == src.tokenizer_dir == moved / "models" / "target"
    assert src.drafter_dir == moved / "engines" / "drafter-onnx"
    decoder = load_decoder_from_engines(moved / "engines")
    prompt, config = [3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=16)
    got = generate_one(decoder, prompt, config)
    expected = generate_one(BatchDecoder(decoder.target), prompt, config).token_ids
    assert got.token_ids == expected and got.stats.drafted_tokens > 0

    # a manifest written before paths were relative: absolute paths are read as they are
    path = moved / "engines" / "manifest.json"
    old = json.loads(path.read_text())
    old["sources"]["target"]["path"] = old["engines"]["target_torch"]["checkpoint"] = str(moved / "models" / "target")
    # ... and serving a TensorRT drafter, which cannot load here: --no-draft must not try
    old["engines"]["drafter_tensorrt"] = {"backend": "tensorrt", "role": "drafter", "dir": "drafter-tensorrt"}
    old["serve"]["drafter"] = "drafter_tensorrt"
    path.write_text(json.dumps(old))
    assert serving_sources(moved / "engines").target_dir == moved / "models" / "target"
    alone = _load_engines(moved / "engines", "float32", no_draft=True)
    assert alone.drafter is None
    assert generate_one(alone, prompt, config).token_ids == expected

    path.write_text("{}")
    with pytest.raises(ValueError, match="not a manifest `make engines` wrote"):
        serving_sources(moved / "engines")
