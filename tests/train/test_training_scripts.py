"""The training entry points run end to end at CI size: the demo-model script and the CLI."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, make_tokenizer
from tiny_models import make_tiny_target

from dflash_trt.models.drafter import DFlashDrafter

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "dflash-trt"


def run(cmd, timeout=600):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def demo_script(*args):
    """scripts/make_demo_models.py at CI size (--smoke, one thread) with `args`."""
    return run([sys.executable, "scripts/make_demo_models.py", "--smoke", "--threads", "1", *args])


def test_demo_script_smoke(tmp_path):
    demo_script("--out", tmp_path / "models", "--cache", tmp_path / "cache")
    for name in ("target", "drafter", "ar-draft"):
        assert (tmp_path / "models" / name / "config.json").exists(), name
    drafter = DFlashDrafter.from_pretrained(tmp_path / "models" / "drafter")
    assert drafter.spec.block_size == 8
    # the smoke models serve: generate runs on them
    out = run(
        [
            CLI,
            "generate",
            "--target",
            tmp_path / "models" / "target",
            "--drafter",
            tmp_path / "models" / "drafter",
            "--prompt",
            "def f(x):",
            "--max-new-tokens",
            "8",
            "--json",
        ]
    )
    assert json.loads(out.stdout)["stats"]["new_tokens"] >= 1

    # continuing the drafter: its weights, new data (other prompt seed, regenerated into a new cache
    # folder), distillation on; the first run's drafter is where training starts
    first = {k: v.clone() for k, v in drafter.state_dict().items()}
    demo_script(
        *("--stages", "drafter", "--out", tmp_path / "models", "--cache", tmp_path / "cache2", "--regen-seed", "2"),
        *("--drafter-init", tmp_path / "models" / "drafter", "--drafter-kd-weight", "0.5", "--drafter-lr", "1e-9"),
        *("--device", "cpu", "--drafter-batch", "1", "--regen-batch", "4"),
    )
    assert (tmp_path / "cache2" / "regenerated-seed2.npy").exists()
    assert json.loads((tmp_path / "cache2" / "drafter-run-continued" / "init.json").read_text())["drafter_init"]
    continued = DFlashDrafter.from_pretrained(tmp_path / "models" / "drafter").state_dict()
    # lr ~0: the continued drafter is the first one (fp16 on disk both times), not a new warm start
    assert all(torch.allclose(first[k], continued[k], atol=1e-3) for k in first)
    config = json.loads((tmp_path / "models" / "drafter" / "training.json").read_text())["config"]
    assert config["kd_weight"] == 0.5 and config["batch_size"] == 1

    # continuing the target: its weights and its training record carried over; run again with the same cache,
    # the checkpoint is found and the run resumes instead of starting over
    first_record = json.loads((tmp_path / "models" / "target" / "training.json").read_text())
    target_again = ("--stages", "target", "--out", tmp_path / "more", "--cache", tmp_path / "cache3")
    target_again += ("--target-init", tmp_path / "models" / "target")
    (tmp_path / "more").mkdir()
    shutil.copytree(tmp_path / "models" / "target", tmp_path / "more" / "target")  # the tokenizer stage's output
    demo_script(*target_again)
    record = json.loads((tmp_path / "more" / "target" / "training.json").read_text())
    assert record["init"]["training"]["history"] == first_record["history"] and record["steps"] == 6
    assert (tmp_path / "cache3" / "target-run-continued" / "trainer_state.pt").is_file()
    again = demo_script(*target_again)
    assert "resuming from step 6" in again.stderr + again.stdout


def test_train_drafter_cli_smoke(tmp_path):
    tok = make_tokenizer(tmp_path / "target")
    make_tiny_target(tmp_path / "target", vocab_size=len(tok), layers=4)
    (tmp_path / "corpus.txt").write_text("".join(CORPUS) * 5)
    args = [
        CLI,
        "train-drafter",
        "--target",
        tmp_path / "target",
        "--data",
        tmp_path / "corpus.txt",
        "--out",
        tmp_path / "drafter",
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--anchors",
        "4",
        "--block-size",
        "4",
        "--layers",
        "1",
        "--regenerate",
        "4",
        "--prompt-len",
        "8",
    ]
    assert "training on cpu" in run(args).stdout  # --device auto on a machine without a GPU
    drafter = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert drafter.spec.mask_token_id == tok.mask_token_id
    assert json.loads((tmp_path / "drafter" / "training.json").read_text())["steps"] == 4
    run(args[:-4] + ["--steps", "6", "--resume", "--data", tmp_path / "drafter" / "regenerated.npy"])
    assert json.loads((tmp_path / "drafter" / "training.json").read_text())["steps"] == 6


def test_train_drafter_refuses_a_device_this_machine_lacks(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU")
    proc = subprocess.run(
        [str(CLI), "train-drafter", "--target", str(tmp_path), "--data", "stdlib", "--out", str(tmp_path / "d")]
        + ["--device", "cuda"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "no CUDA GPU" in proc.stderr, proc.stderr
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_gpu_train_demo_recipe_runs_at_smoke_size_on_the_cpu(tmp_path):
    """`make gpu-train-demo-prep` here, `make gpu-train-demo` on a GPU host: the same Makefile lines, run at
    --smoke size with --device cpu (a later --device wins), so the GPU run starts from a recipe that ran."""
    work, out = tmp_path / "gpu-demo", tmp_path / "out"
    make = ["make", "--no-print-directory", "-o", ".venv/.installed", f"GPU_DEMO={work}"]  # -o: never rebuild the venv
    run([*make, "gpu-train-demo-prep", "GPU_DEMO_ARGS=--smoke"])
    assert (work / "corpus" / "train.npy").is_file() and (work / "corpus" / "held-out.npy").is_file()
    # what the host is carried: the prompts its target continues, not the tokenized corpus
    assert sorted(p.name for p in (work / "cache").iterdir()) == ["regen-prompts-seed6.npy"]
    args = "GPU_DEMO_ARGS=--smoke --device cpu --threads 1"
    proc = run([*make, "gpu-train-demo", f"GPU_DEMO_OUT={out}", args, f"GPU_BARE_PYTHON={sys.executable}"])
    assert f"prompts from {work / 'cache' / 'regen-prompts-seed6.npy'}" in proc.stdout  # not its own stdlib
    drafter = DFlashDrafter.from_pretrained(out)
    published = DFlashDrafter.from_pretrained(ROOT / "models" / "drafter")
    assert drafter.spec == published.spec  # the published drafter trained on, in its format
    record = json.loads((out / "training.json").read_text())
    assert record["config"]["kd_weight"] == 0.5 and record["steps"] >= 1


def test_help_runs():
    assert "--regenerate" in run([CLI, "train-drafter", "--help"]).stdout
    assert "--smoke" in run([sys.executable, "scripts/make_demo_models.py", "--help"]).stdout


def test_smollm2_recipe_runs_end_to_end_and_resumes(tmp_path):
    """scripts/train_smollm2_drafter.py on a tiny chat target: regenerate -> features -> train -> publish,
    then a second run continues (no regeneration, same feature cache, more steps)."""
    from dflash_trt.train.prompts import Prompt, save_prompts

    tok = make_tokenizer(tmp_path / "target")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    tok.save_pretrained(tmp_path / "target")
    make_tiny_target(tmp_path / "target", vocab_size=len(tok), layers=4)
    work = tmp_path / "work"
    save_prompts(
        [Prompt(f"p{i}", "a.py", "chat" if i % 2 else "code", text) for i, text in enumerate(CORPUS)],
        work / "prompts-train.jsonl",
    )
    save_prompts([], work / "prompts-held-out.jsonl")
    args = [
        sys.executable,
        "scripts/train_smollm2_drafter.py",
        "--target",
        tmp_path / "target",
        "--work",
        work,
        "--max-new-tokens",
        "12",
        "--regen-batch",
        "2",
        "--block-size",
        "4",
        "--layers",
        "1",
        "--target-layer-ids",
        "1",
        "--mask-token-id",
        str(tok.mask_token_id),
        "--batch-size",
        "2",
        "--anchors",
        "4",
        "--save-every",
        "2",
        "--publish-dir",
        tmp_path / "published",
        "--committed",
        tmp_path / "committed",
    ]
    run(args + ["--phases", "regenerate,features,train,publish", "--steps", "2"])
    info = json.loads((tmp_path / "published" / "training.json").read_text())
    assert info["steps"] == 2 and info["finished"] is False and info["data"]["sequences"] == len(CORPUS)
    assert DFlashDrafter.from_pretrained(tmp_path / "published").spec.block_size == 4
    assert (tmp_path / "committed" / "regenerated.npz").is_file()  # the data the next run starts from
    shards = sorted((work / "regen").glob("shard-*.npz"))
    features = (work / "features" / "features.f16").stat().st_mtime_ns
    out = run(args + ["--phases", "regenerate,features,train", "--steps", "4"])
    assert "resuming from step 2" in out.stdout
    assert sorted((work / "regen").glob("shard-*.npz")) == shards
    assert (work / "features" / "features.f16").stat().st_mtime_ns == features
    assert json.loads((work / "drafter" / "training.json").read_text())["steps"] == 4
    # a fresh work folder starts from the committed prompts and responses: nothing to regenerate
    out = run(args + ["--work", tmp_path / "fresh", "--phases", "regenerate", "--steps", "4"])
    assert f"regenerate: {len(CORPUS)} done, 0 to go" in out.stdout
