"""CI smoke of `dflash-trt bench` on tiny models built from configs (real CLI, real ONNX export and
onnxruntime session, real HF generate / assisted generation / prompt lookup)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_text_models
from tiny_models import make_tiny_target
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "dflash-trt"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    make_text_models(root)
    tok = AutoTokenizer.from_pretrained(root / "target")
    make_tiny_target(root / "ar-draft", vocab_size=len(tok), layers=1, seed=1, tie_word_embeddings=True)
    tok.save_pretrained(root / "ar-draft")
    return root


def bench(models: Path, out: Path, *extra):
    cmd = [
        CLI,
        "bench",
        "--smoke",
        "--threads",
        "1",
        "--no-progress",
        "--target",
        models / "target",
        "--drafter",
        models / "drafter",
        "--ar-draft",
        models / "ar-draft",
        "--out",
        out,
        *extra,
    ]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_bench_smoke_writes_table_json_and_plots(models, tmp_path):
    proc = bench(models, tmp_path, "--block-sizes", "2", "4", "16", "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report) >= {"meta", "notes", "timings", "results", "summary", "acceptance_histograms", "equality"}

    names = [m["name"] for m in report["meta"]["methods"]]
    assert names == [
        "baseline",
        "hf-generate",
        "dflash-torch-b2",
        "dflash-torch-b4",
        "dflash-ort-b2",
        "dflash-ort-b4",
        "hf-assisted",
        "prompt-lookup",
    ]
    assert report["meta"]["skipped_block_sizes"] == [16]  # above the drafter's trained size 4

    # every temperature x length x set x method has a row, each with the numbers the table shows
    rows = report["results"]
    assert len(rows) == 2 * 1 * 3 * len(names)
    for r in rows:
        assert r["tokens"] == 12 * r["runs"]  # fixed-length runs: EOS is ignored by every method
        assert r["tokens_per_s"] > 0 and r["speedup"]["min"] <= r["speedup"]["median"] <= r["speedup"]["max"]
        split = r["time_split"]
        assert abs(split["target"] + (split["draft"] or 0) + split["other"] - 1) < 0.02
        if r["family"] == "baseline":
            assert r["speedup"]["median"] == 1.0 and r["mean_acceptance_length"] == 1.0
        if r["family"].startswith("dflash"):
            assert r["ceiling"] > 0 and 1 <= r["mean_acceptance_length"] <= r["block_size"]
        if r["temperature"] > 0:
            assert r["target_nll"] > 0
    timings = report["timings"]["12"]
    assert timings["target_step_ms"] > 0 and set(timings["draft_ms"]) == {"torch", "onnxruntime"}

    # the equality check ran on every greedy run of every lossless method
    eq = report["equality"]
    assert eq["ran"] and eq["passed"] and not eq["mismatches"]
    assert eq["checked"] == 3 * (len(names) - 1)  # 3 sets x 1 prompt x methods other than the baseline

    hist = report["acceptance_histograms"]["dflash-torch-b4"]
    assert set(hist) == {"0", "1"} and all(1 <= int(k) <= 4 for h in hist.values() for k in h)

    assert "### Speedup over the target alone" in proc.stdout and "PASSED" in proc.stdout
    for png in ("speedup.png", "acceptance_hist.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrong_method_output_fails_the_benchmark(models, tmp_path):
    proc = bench(
        models,
        tmp_path,
        "--temperatures",
        "0",
        "--methods",
        "dflash-torch",
        "--corrupt-method",
        "dflash-torch-b2",
        "--no-plots",
    )
    assert proc.returncode == 1
    assert "MISMATCH: dflash-torch-b2" in proc.stderr and "greedy outputs differ" in proc.stderr
    eq = json.loads((tmp_path / "results.json").read_text())["equality"]
    assert not eq["passed"] and {m["method"] for m in eq["mismatches"]} == {"dflash-torch-b2"}
    assert len(eq["mismatches"]) == 3 and eq["identical"] == 3  # b4 still equals the baseline


def test_bench_user_errors_are_one_line(models, tmp_path):
    proc = bench(models, tmp_path, "--ar-draft", tmp_path / "missing", "--methods", "hf-assisted")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "hf-assisted needs a small autoregressive draft model" in proc.stderr
