"""What makes a TensorRT-LLM target engine's identity, and what its folder keeps after the build:

- the target step's key holds the GPUs' architecture (an engine runs only on the architecture it was built for),
  so an engines folder shared by two GPU generations rebuilds rather than serving a foreign engine;
- the converted TensorRT-LLM checkpoint (as large as the engine) is removed once the engine is built.

TensorRT-LLM cannot run here: the build's two commands are replaced by a LABELLED FAKE that writes the files the real
convert / trtllm-build steps write (one rank file per GPU), so run_plan's own bookkeeping is what is tested."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import make_tiny_pair

from dflash_trt.builders import engines, trtllm_target
from dflash_trt.builders.engines import STEPS, BuildContext, read_config, step_key
from dflash_trt.config import load_drafter_config


def _target_key(tmp_path: Path, monkeypatch, arch: str | None) -> str:
    monkeypatch.setattr(engines, "gpu_arch", lambda: arch)
    (tmp_path / "engines.toml").write_text('target = "target"\ndrafter = "drafter"\ntp = 2\n')
    cfg = read_config(tmp_path / "engines.toml", tmp_path)
    _, spec = load_drafter_config(cfg.drafter)
    sources = {r: {"path": r, "sha256": "0" * 64} for r in ("target", "drafter")}
    ctx = BuildContext(cfg, tmp_path / "engines", sources, spec, spec.block_size, {}, lambda *_: None)
    (step,) = [s for s in STEPS if s.name == "target_tensorrt_llm"]
    return step_key(*step.key(ctx, step.versions()))


def test_target_key_holds_the_gpu_architecture(tmp_path, monkeypatch):
    make_tiny_pair(tmp_path, vocab_size=64)
    hopper, ampere = (_target_key(tmp_path, monkeypatch, a) for a in ("sm_90", "sm_80"))
    assert hopper != ampere
    assert _target_key(tmp_path, monkeypatch, "sm_90") == hopper  # the same GPUs: the same key, nothing rebuilt


def test_run_plan_removes_the_converted_checkpoint(tmp_path, monkeypatch):
    tiny = tmp_path / "models"
    make_tiny_pair(tiny, vocab_size=64)
    spec = trtllm_target.spec_from_checkpoints(tiny / "target", tiny / "drafter", tmp_path / "out", tp=2)
    plan = trtllm_target.plan_target_build(spec)
    ran: list[list[str]] = []

    def fake_run(cmd, check):  # FAKE: what the convert and trtllm-build steps write, rank files per GPU
        ran.append(cmd)
        is_convert = "dflash_trt.builders.trtllm_convert" in cmd
        folder, files = (
            (spec.checkpoint_dir, plan.checkpoint_files) if is_convert else (spec.engine_dir, plan.engine_files)
        )
        if not is_convert:  # trtllm-build reads the converted checkpoint: it must still be there
            assert all((spec.checkpoint_dir / f).is_file() for f in plan.checkpoint_files)
        folder.mkdir(parents=True, exist_ok=True)
        for f in files:
            (folder / f).write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trtllm_target.subprocess, "run", fake_run)
    monkeypatch.setattr("dflash_trt.runtime.registry.require", lambda *a, **k: None)
    trtllm_target.run_plan(plan, log=lambda *_: None)
    assert len(ran) == 2
    assert not spec.checkpoint_dir.exists()
    assert sorted(p.name for p in spec.engine_dir.iterdir()) == sorted(plan.engine_files)
    assert json.loads((spec.out_dir / trtllm_target.TARGET_META_FILE).read_text())["tp"] == 2


def test_a_start_with_unchanged_files_reads_no_file_and_a_touched_one_is_hashed_not_rebuilt(tmp_path, monkeypatch):
    """The manifest records each checkpoint's and engine folder's stamp (names, sizes, mtimes): a rerun whose stamps
    match reuses the recorded hashes without reading a byte (a 70B checkpoint plus its engine: about 420 GB); a
    touched file (another mtime, same bytes) costs one hash and no build, and its new stamp is recorded."""
    import os

    from dflash_trt.builders import hashing

    make_tiny_pair(tmp_path / "ckpt", vocab_size=64)
    (tmp_path / "engines.toml").write_text('target = "ckpt/target"\ndrafter = "ckpt/drafter"\noutput = "engines"\n')
    cfg = read_config(tmp_path / "engines.toml", tmp_path)
    assert cfg.output == tmp_path / "engines"
    first, report = engines.build_engines(cfg, log=lambda *_: None)
    assert report.built == ["drafter_onnx"]

    def no_reading(*_a, **_k):
        raise AssertionError("a file was hashed on a start whose stamps match")

    with monkeypatch.context() as m:
        m.setattr(engines, "tree_sha256", no_reading)
        m.setattr(engines, "file_sha256", no_reading)
        again, report = engines.build_engines(cfg, log=lambda *_: None)
    assert report.unchanged == ["drafter_onnx"] and again == first

    weights = next((tmp_path / "ckpt" / "target").glob("*.safetensors"))
    onnx = next((cfg.output / "drafter-onnx").glob("*.onnx"))
    for path in (weights, onnx):
        os.utime(path, (1, 1))  # the same bytes, another mtime
    hashed: list[str] = []
    real = hashing.tree_sha256
    monkeypatch.setattr(engines, "tree_sha256", lambda p: hashed.append(str(p)) or real(p))
    third, report = engines.build_engines(cfg, log=lambda *_: None)
    assert report.unchanged == ["drafter_onnx"] and report.built == []  # hashed again, not rebuilt
    assert hashed == [str(cfg.target)]  # the drafter checkpoint's stamp still matched
    assert third["sources"]["target"]["sha256"] == first["sources"]["target"]["sha256"]
    assert third["sources"]["target"]["stamp"] != first["sources"]["target"]["stamp"]
    assert third["engines"]["drafter_onnx"]["stamp"] != first["engines"]["drafter_onnx"]["stamp"]
