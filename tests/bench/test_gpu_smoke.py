"""`make gpu-smoke` (scripts/gpu_smoke.py). This machine has no GPU: the command must run and say what it skipped;
its PyTorch part is checked here on the CPU (the same code runs with device cuda on a GPU node)."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_drafter, make_tiny_target

ROOT = Path(__file__).resolve().parents[2]
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
    assert "greedy output == the same target alone" in detail and "tau " in detail and "x over" in detail
    assert "agrees with Hugging Face generate() on 2/2 prompts (24/24 tokens" in detail


def test_pytorch_part_passes_when_only_hugging_face_differs(pair, monkeypatch):
    """Hugging Face agreement is a reported figure: an HF reference that parts at a near-tie is no failure."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate

    def drifting(self, *a, **kw):  # the reference parts from the engine at its last token
        out = original(self, *a, **kw)
        out[:, -1] = (out[:, -1] + 1) % 64
        return out

    monkeypatch.setattr(GenerationMixin, "generate", drifting)
    report = gpu_smoke.Report()
    gpu_smoke.pytorch_stage(report, *pair, device="cpu", dtype="float32", max_new=12, n_prompts=2)
    ((status, _, detail),) = report.rows
    assert status == "PASS", detail
    assert "on 0/2 prompts (22/24 tokens before a difference)" in detail


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
    assert report.failed and report.rows[0][2].startswith("greedy output differs from the same target alone")


MPIRUN_STDOUT = """[TensorRT-LLM] TensorRT-LLM version: 1.2.1
[TensorRT-LLM][INFO] Engine version 1.2.1 found in the config file, assuming engine(s) built by new builder API.
{"event": "not ours"}
[TensorRT-LLM][INFO] MPI size: 2, MPI local size: 2, rank: 0
{"token_ids": [5, 6, 7], "text": null, "finish_reason": "length", "stats": {"mean_acceptance_length": 2.5}}
[TensorRT-LLM][INFO] Refreshed the MPI local session
[1764626000.123] [host:1234:0] ucx warning {unparsed
"""


def test_generate_result_is_found_in_mpiruns_mixed_stdout():
    got = gpu_smoke.parse_generate_output(MPIRUN_STDOUT)
    assert got["token_ids"] == [5, 6, 7] and got["stats"]["mean_acceptance_length"] == 2.5
    # the previous reader (the last line as JSON) fails on the same output
    with pytest.raises(ValueError):
        json.loads(MPIRUN_STDOUT.strip().splitlines()[-1])
    with pytest.raises(RuntimeError, match="no `generate --json` result"):
        gpu_smoke.parse_generate_output('[TensorRT-LLM][INFO] banner only\n{"event": "x"}\n')


def test_tp2_replaces_a_target_whose_heads_do_not_split(tmp_path):
    from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

    args = argparse.Namespace(
        target=DEMO_TARGET, drafter=DEMO_DRAFTER, tp=2, out=tmp_path / "engines", engine_precision="fp16"
    )
    report = gpu_smoke.Report()
    gpu_smoke.tp_pair(args, report)
    assert args.target != DEMO_TARGET and (args.target / "config.json").is_file()
    cfg = json.loads((args.target / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 2)
    assert "5 query heads do not divide by tp 2" in report.rows[0][2]
    from dflash_trt.builders.trtllm_target import plan_target_build, spec_from_checkpoints

    # the pair keeps the half-precision engines, whose rounds reuse KV blocks as serving does (an fp32 engine runs
    # unfused context attention and is built without reuse), judged up to near-ties
    assert args.engine_precision == "fp16" and "engines in fp16" in report.rows[0][2]
    plan = plan_target_build(spec_from_checkpoints(args.target, args.drafter, tmp_path / "e", tp=2))  # plans cleanly
    build = plan.commands[1]
    assert build[build.index("--use_paged_context_fmha") + 1] == "enable"
    kept = argparse.Namespace(
        target=args.target, drafter=args.drafter, tp=2, out=tmp_path / "engines", engine_precision="fp16"
    )
    gpu_smoke.tp_pair(kept, gpu_smoke.Report())
    assert kept.target == args.target  # a target that splits is kept


def test_judge_is_exact_in_float32_and_accepts_only_near_ties_in_half_precision():
    wide, tie = (lambda i: (2.5, 3.0)), (lambda i: (0.01, 3.0))  # (top-2 margin, the logits' standard deviation)
    assert gpu_smoke.judge([1, 2, 3], [1, 2, 3], True, wide) == (True, "identical")
    assert gpu_smoke.judge([1, 2, 3], [1, 2, 4], True, tie) == (False, "differs at token 2")  # fp32: no excuse
    ok, note = gpu_smoke.judge([1, 2, 3], [1, 2, 4], False, tie)
    assert ok and note == "parts at token 2 at a near-tie (top-2 margin 0.0100 < 0.1500)"
    ok, note = gpu_smoke.judge([1, 9, 3], [1, 2, 4], False, wide)
    assert not ok and "differs at token 1, top-2 margin 2.5000" in note


def test_the_near_tie_threshold_scales_with_the_logits_spread():
    """Beside a tiny random pair's logits (standard deviation ~0.3) a margin of 0.05 is a sixth of the spread:
    a wrong token, which the former fixed 0.1 let pass as a near-tie."""
    ok, note = gpu_smoke.judge([1, 9], [1, 2], False, lambda i: (0.05, 0.3))
    assert not ok and "top-2 margin 0.0500 >= 0.0150: not a near-tie" in note
    assert gpu_smoke.judge([1, 9], [1, 2], False, lambda i: (0.05, 3.0))[0]  # the same margin beside wide logits


def test_in_a_python_with_tensorrt_llm_a_skipped_part_is_a_failure(monkeypatch, capsys):
    """A TensorRT-LLM container should run every part: a skip there (no GPU, the plan or engine not built) is
    counted as a failure with its reason, not an exit 0."""
    env = {"torch": torch.__version__, "cuda": False, "gpus": 0, "gpu_names": [], "tensorrt": "10.13"}
    monkeypatch.setattr(gpu_smoke, "environment", lambda: {**env, "tensorrt_llm": "1.2.1", "transformers": "4.57.1"})
    assert gpu_smoke.main(["--tp", "2"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("SKIP ") for line in lines)
    assert any(
        line.startswith("FAIL pytorch engines on cuda: skipped where tensorrt_llm is installed") for line in lines
    )
    assert lines[-1] == "gpu-smoke: 0 passed, 4 failed, 0 skipped"


def test_make_gpu_smoke_uses_a_python_that_has_tensorrt_llm_without_building_a_venv(tmp_path):
    """In an NGC container the venv recipe would build a CPU torch without tensorrt_llm (and need a network)."""
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "__init__.py").write_text("")  # what find_spec sees in a TensorRT-LLM image
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    dry = ["make", "-n", "-W", "pyproject.toml", "gpu-smoke", "TP=2"]
    container = subprocess.run(dry, cwd=ROOT, capture_output=True, text=True, env={**env, "PYTHONPATH": str(tmp_path)})
    assert container.returncode == 0, container.stderr
    assert "python3 scripts/gpu_smoke.py --tp 2" in container.stdout and "pip install" not in container.stdout
    plain = subprocess.run(dry, cwd=ROOT, capture_output=True, text=True, env={**env, "PYTHONPATH": ""})
    assert ".venv/bin/python scripts/gpu_smoke.py --tp 2" in plain.stdout and "pip install" in plain.stdout


def test_the_gpu_image_installs_make():
    dockerfile = (ROOT / "Dockerfile").read_text()
    gpu_stage = dockerfile[dockerfile.index(" AS gpu") :]
    install = next(line for line in gpu_stage.splitlines() if "apt-get install" in line)
    assert " make" in install.split("--no-install-recommends", 1)[1]


@pytest.fixture
def tied_target(tmp_path):
    """A tiny target whose lm_head rows t1 and t2 > t1 are equal: wherever its greedy choice is t1, t2 ties it
    exactly (argmax keeps t1, the lower id, so its greedy output is unchanged by the tie)."""
    from dflash_trt.models.target import save_portable

    model = make_tiny_target(None, vocab_size=64, layers=2)
    prompt = [1, 2, 3, 4]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    base = greedy[0, len(prompt) :].tolist()
    t1 = base[2]
    t2 = 63 if t1 != 63 else 62
    if t2 < t1:
        pytest.skip("the tiny model's token at position 2 is the last id")
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[t2] = head[t1]
    save_portable(model, tmp_path / "target")
    return tmp_path / "target", base, t2


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("precision, passes", [("fp16", True), ("fp32", False)])
def test_engines_part_accepts_a_first_divergence_only_at_a_near_tie(
    tied_target, tmp_path, monkeypatch, tp, precision, passes
):
    """The engines' verdict with a divergence injected at a real near-tie of the target (margin 0 at token 2):
    an fp16 engine passes and says where and at what margin; an fp32 engine fails. At tp 1 and 2 alike."""
    target, base, t2 = tied_target
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "manifest.json").write_text(json.dumps({"serve": {"drafter": "tensorrt", "target": "tensorrt_llm"}}))
    launched = []

    def fake_generate(folder, tp_size, ids, max_new, no_draft):
        launched.append(tp_size)
        out = list(base) if no_draft or ids != [1, 2, 3, 4] else base[:2] + [t2, 5, 6, 7]
        return {"token_ids": out, "stats": {"mean_acceptance_length": 2.0, "tokens_per_second": 100.0}}

    monkeypatch.setattr(gpu_smoke, "cli_generate", fake_generate)
    args = argparse.Namespace(target=target, tp=tp, max_new_tokens=6, engine_precision=precision)
    report = gpu_smoke.Report()
    gpu_smoke.served_engines_stage(report, args, engines)
    ((status, part, detail),) = report.rows
    assert launched and set(launched) == {tp} and f"(tp {tp})" in part
    if passes:
        assert status == "PASS", detail
        assert "up to near-ties (prompt [1, 2, 3, 4]: parts at token 2 at a near-tie (top-2 margin 0.0000" in detail
    else:
        assert status == "FAIL" and "prompt [1, 2, 3, 4]: differs at token 2" in detail, detail
