"""The training entry points run end to end at CI size: the demo-model script and the CLI."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import CORPUS, make_tokenizer
from tiny_models import make_tiny_target

from dflash_trt.models.drafter import DFlashDrafter

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).parent / "dflash-trt"


def run(cmd, timeout=600):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_demo_script_smoke(tmp_path):
    run([sys.executable, "scripts/make_demo_models.py", "--smoke", "--threads", "1",
         "--out", tmp_path / "models", "--cache", tmp_path / "cache"])
    for name in ("target", "drafter", "ar-draft"):
        assert (tmp_path / "models" / name / "config.json").exists(), name
    drafter = DFlashDrafter.from_pretrained(tmp_path / "models" / "drafter")
    assert drafter.spec.block_size == 8
    # the smoke models serve: generate runs on them
    out = run([CLI, "generate", "--target", tmp_path / "models" / "target", "--drafter", tmp_path / "models" / "drafter",
               "--prompt", "def f(x):", "--max-new-tokens", "8", "--json"])
    assert json.loads(out.stdout)["stats"]["new_tokens"] >= 1


def test_train_drafter_cli_smoke(tmp_path):
    tok = make_tokenizer(tmp_path / "target")
    make_tiny_target(tmp_path / "target", vocab_size=len(tok), layers=4)
    (tmp_path / "corpus.txt").write_text("".join(CORPUS) * 5)
    args = [CLI, "train-drafter", "--target", tmp_path / "target", "--data", tmp_path / "corpus.txt",
            "--out", tmp_path / "drafter", "--steps", "4", "--batch-size", "2", "--seq-len", "32",
            "--anchors", "4", "--block-size", "4", "--layers", "1", "--regenerate", "4", "--prompt-len", "8"]
    run(args)
    drafter = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert drafter.spec.mask_token_id == tok.mask_token_id
    assert json.loads((tmp_path / "drafter" / "training.json").read_text())["steps"] == 4
    run(args[:-4] + ["--steps", "6", "--resume", "--data", tmp_path / "drafter" / "regenerated.npy"])
    assert json.loads((tmp_path / "drafter" / "training.json").read_text())["steps"] == 6


def test_help_runs():
    assert "--regenerate" in run([CLI, "train-drafter", "--help"]).stdout
    assert "--smoke" in run([sys.executable, "scripts/make_demo_models.py", "--help"]).stdout
