"""`make gpu-smoke` (scripts/gpu_smoke.py). This machine has no GPU: the command must run and say what it skipped;
its PyTorch part is checked here on the CPU (the same code runs with device cuda on a GPU node)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_drafter, make_tiny_target

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_smoke)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip lines of a machine without a GPU")
def test_make_gpu_smoke_on_a_cpu_machine_says_what_it_skipped():
    out = subprocess.run(
        ["make", "-s", "gpu-smoke", f"GPU_SMOKE_PYTHON={sys.executable}", "TP=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("environment: ") and '"cuda": false' in lines[0]
    skipped = {line.split(":")[0][5:] for line in lines if line.startswith("SKIP ")}
    assert {
        "pytorch engines on cuda",
        "drafter TensorRT plan",
        "TensorRT-LLM target engine (tp 2)",
        "engines end to end (generate --engines)",
    } <= skipped
    assert any("no CUDA GPU visible" in line for line in lines)
    assert any("needs the Python package tensorrt_llm" in line for line in lines)
    assert lines[-1] == "gpu-smoke: 0 passed, 0 failed, 4 skipped"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    target = make_tiny_target(root / "target", vocab_size=64, layers=4)
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=4)
    return root / "target", root / "drafter"


def test_pytorch_part_checks_equality_and_reports_tau_and_speedup(pair):
    report = gpu_smoke.Report()
    gpu_smoke.pytorch_stage(report, *pair, device="cpu", dtype="float32", max_new=12, n_prompts=2)
    ((status, part, detail),) = report.rows
    assert status == "PASS" and part == "pytorch engines on cpu (float32)", detail
    assert "greedy output == target alone == HF generate()" in detail and "tau " in detail and "x over" in detail


def test_pytorch_part_fails_when_drafted_output_differs(pair, monkeypatch):
    from dflash_trt.decoding import BatchDecoder, GenerationConfig

    original = BatchDecoder.generate

    def corrupted(self, prompts, configs=GenerationConfig()):  # a broken loop: the drafted run loses its last token
        results = original(self, prompts, configs)
        per_prompt = [configs] * len(results) if isinstance(configs, GenerationConfig) else configs
        for config, result in zip(per_prompt, results):
            if config.block_size != 1 and len(result.token_ids) > 4:
                result.token_ids[-1] = (result.token_ids[-1] + 1) % 64
        return results

    monkeypatch.setattr(BatchDecoder, "generate", corrupted)
    report = gpu_smoke.Report()
    gpu_smoke.pytorch_stage(report, *pair, device="cpu", dtype="float32", max_new=12, n_prompts=2)
    assert report.failed and report.rows[0][2].startswith("greedy output differs")
