"""scripts/gpu_bare.py (`make gpu-bare`), the GPU script for a bare GPU host. No GPU here: it must skip cleanly,
what it carries must fit 64 MiB and need no package beyond torch + transformers, and its parts run at toy sizes
on the CPU (--device cpu --quick), so the GPU run starts from code that ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_bare.py"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bare  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip of a machine without a GPU")
def test_skips_cleanly_without_cuda(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "gpu")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SKIP gpu-bare: no CUDA GPU visible to torch") and "nothing written" in out.stdout
    assert not (tmp_path / "gpu").exists()


def test_what_it_carries_fits_64_mib_and_exists():
    files = gpu_bare.carry_files()
    assert all(f.is_file() for f in files)
    assert {"scripts/gpu_bare.py", "tests/tiny_models.py", "models/target/model.safetensors"} <= {
        str(f.relative_to(ROOT)) for f in files
    }
    assert gpu_bare.carry_bytes() <= gpu_bare.CARRY_LIMIT
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list-carry"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == len(files)
    assert "MiB of 64 MiB" in listed.stderr
    # every carried file's imports resolve inside the carry (no module of the package is left behind)
    package = {str(f.relative_to(ROOT)) for f in files if f.parts[len(ROOT.parts)] == "dflash_trt"}
    assert package == {str(f.relative_to(ROOT)) for f in (ROOT / "dflash_trt").rglob("*.py")}


DRY_RUN = """
import json, sys
import torch, transformers, safetensors.torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, AutoTokenizer
import transformers.models.llama.modeling_llama, transformers.models.qwen3.modeling_qwen3
before = {m.split('.')[0] for m in sys.modules}
sys.argv = ['gpu_bare.py'] + sys.argv[1:]
sys.path.insert(0, SCRIPTS_DIR)
import gpu_bare
rc = gpu_bare.main(sys.argv[1:])
after = {m.split('.')[0] for m in sys.modules}
new = sorted(after - before - set(sys.stdlib_module_names) - {'dflash_trt', 'tiny_models', 'gpu_bare'})
print('NEW_PACKAGES ' + json.dumps(new))
sys.exit(rc)
""".replace("SCRIPTS_DIR", repr(str(ROOT / "scripts")))


def test_dry_run_on_the_cpu_writes_at_most_8_files_and_imports_only_torch_and_transformers(tmp_path):
    """Also: no --out, so it writes under $OUT (a lent host's folder), prints its tables, and times the grid on
    --grid-target's shape with the identity trtllm-serve-config checks. 30 minutes on the clock: every stage is
    gated on it, and a shared CPU runs this dry run slower than a GPU runs the real one."""
    from tiny_models import make_tiny_target

    make_tiny_target(tmp_path / "grid-target", vocab_size=96, layers=4, num_attention_heads=4, num_key_value_heads=2)
    out = subprocess.run(
        [sys.executable, "-c", DRY_RUN, "--device", "cpu", "--quick", "--pairs", "tiny", "--max-minutes", "30"]
        + ["--grid-target", str(tmp_path / "grid-target")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path / "gpu")},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    new = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("NEW_PACKAGES "))[13:])
    assert new == [], f"the script imports packages a bare host lacks: {new}"
    files = sorted(p.name for p in (tmp_path / "gpu").iterdir())
    assert files == sorted(gpu_bare.RESULT_FILES) and len(files) <= 8
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    (pair,) = summary["pairs"]
    assert pair["pair"] == "tiny-8q-2kv" and pair["equal"]["pass"] and pair["equal"]["prompts"] == 2
    assert [c["concurrency"] for c in pair["throughput"]] == [1, 2]
    assert pair["equal"]["differ_adaptive"] == [] and pair["adaptive_start_up_s"] > 0  # the server's policy ran
    assert all(c["adaptive"]["tokens_per_s"] > 0 and c["adaptive_speedup"] > 0 for c in pair["throughput"])
    grid = json.loads((tmp_path / "gpu" / "cost_grid.json").read_text())
    assert grid["target"] and grid["drafter"] and grid["shape"]["drafter_layers"] == 5
    # the grid is the cost-table format trtllm-serve-config reads
    from dflash_trt.builders.trtllm_serve import read_cost_table

    target, drafter, context = read_cost_table(tmp_path / "gpu" / "cost_grid.json")
    assert context == 16 and target(1, 1) > 0
    readme = (tmp_path / "gpu" / "README.md").read_text()
    assert "| tiny-8q-2kv | yes | 1 |" in readme and "| target | 16 | 1 | 1 |" in readme
    assert readme.strip() in out.stdout  # printed: a host whose files are lost still shows the grid
    from dflash_trt.costgrid import check_grid_matches, read_target_config

    assert grid["identity"]["target"] == {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 96}
    assert grid["identity"]["engine"] == "torch" and grid["identity"]["tp"] == 1 and grid["identity"]["gpu"] == "cpu"
    check_grid_matches(grid, read_target_config(tmp_path / "grid-target"), tp=1)  # accepted for its target


def test_full_shape_is_llama3_8b_with_a_5_layer_drafter():
    assert gpu_bare.LLAMA3_8B["hidden_size"] == 4096 and gpu_bare.LLAMA3_8B["num_hidden_layers"] == 32
    assert gpu_bare.LLAMA3_8B["num_attention_heads"] % 2 == 0 == gpu_bare.LLAMA3_8B["num_key_value_heads"] % 2


# What a lent GPU host accepts: the tracked tree plus the paths a recipe carries, 64 MiB in all (the device
# tool's limit). The tree stays within 52 MiB so that every documented recipe fits with room for its cache.
HOST_LIMIT = 64 * 2**20
TREE_LIMIT = 52 * 2**20


def tracked_bytes() -> int:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked tree to measure")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())


def demo_prompts_bytes() -> int:
    """What `make gpu-train-demo-prep` leaves in the carried cache: the regeneration prompts, n x prompt length
    tokens of the demo vocabulary's dtype (uint16 below 65536 tokens), plus the .npy header."""
    import re

    import numpy as np

    make = (ROOT / "Makefile").read_text()
    regen = re.search(r"^GPU_DEMO_REGEN := (.*)$", make, re.M)
    assert regen, "the Makefile's GPU_DEMO_REGEN (the prompts both demo targets share) is gone"
    n = int(re.search(r"--regen-sequences (\d+)", regen.group(1)).group(1))
    vocab = json.loads((ROOT / "models" / "target" / "config.json").read_text())["vocab_size"]
    itemsize = np.dtype(np.uint16 if vocab < 65536 else np.int32).itemsize
    return n * 64 * itemsize + 128


def test_tracked_tree_and_every_documented_device_recipe_fit_a_lent_host():
    tree = tracked_bytes()
    assert tree <= TREE_LIMIT, f"the tracked tree takes {tree / 2**20:.1f} MiB (limit {TREE_LIMIT / 2**20:.0f})"
    docs = (ROOT / "docs" / "gpu.md").read_text()
    # the documented device recipes and what each carries beside the tree (docs/gpu.md names the carry)
    recipes = {"gpu_bare.py": 0, "gpu-train-demo": demo_prompts_bytes()}
    assert "python3 scripts/gpu_bare.py" in docs and "make gpu-train-demo" in docs
    assert "`carry`: `.cache/gpu-demo/cache`" in docs
    for name, carried in recipes.items():
        assert tree + carried <= HOST_LIMIT, f"{name}: {(tree + carried) / 2**20:.1f} MiB"


def test_demo_prompts_are_what_the_prep_stage_writes(tmp_path):
    """The size the recipe check assumes is the file the regen-prompts stage writes (a scaled-down draw)."""
    import numpy as np

    from dflash_trt.train.data import write_regen_prompts

    tokens = np.arange(5000, dtype=np.uint16)
    path = write_regen_prompts(tokens, tmp_path, n=100, length=64, seed=6)
    assert path.stat().st_size == 100 * 64 * 2 + 128
    drawn = np.load(path)
    assert drawn.dtype == np.uint16 and drawn.shape == (100, 64)
    assert all((row[1:] - row[:-1] == 1).all() for row in drawn)  # windows of the corpus, in order


# Stages: gated on the clock, each apart, the files rewritten after each (a killed run keeps what it measured).
def fake_pair(name, make, device, clock, quick):
    return {
        "pair": name,
        "equal": {"pass": True, "differ": [], "differ_adaptive": [], "near_ties": []},
        "throughput": [],
    }


def test_the_summary_is_on_disk_after_each_stage_so_a_killed_run_keeps_it(tmp_path, monkeypatch):
    calls = []

    def killed_at_the_second(name, *args):
        calls.append(name)
        if len(calls) == 2:
            written = json.loads((tmp_path / "summary.json").read_text())
            assert [p["pair"] for p in written["pairs"]] == ["tiny-8q-2kv"] and written["complete"] is False
            raise KeyboardInterrupt  # what a 10-minute kill looks like from inside: nothing after this runs
        return fake_pair(name, *args)

    monkeypatch.setattr(gpu_bare, "pair_stage", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        gpu_bare.main(["--device", "cpu", "--out", str(tmp_path), "--pairs", "tiny,gpt_oss"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pairs"][0]["pair"] == "tiny-8q-2kv" and summary["complete"] is False
    assert "partial" in (tmp_path / "README.md").read_text()


def test_a_stage_without_the_time_it_needs_is_skipped_and_fails_the_run(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(gpu_bare, "pair_stage", lambda name, *a: started.append(name) or fake_pair(name, *a))
    monkeypatch.setattr(gpu_bare, "cost_grid_stage", lambda *a: started.append("grid") or {})
    clock = iter([0.0, 1.0, 1.0] + [1000.0] * 20)  # perf_counter: start, pair 1 gated and written, then past it
    monkeypatch.setattr(gpu_bare.time, "perf_counter", lambda: next(clock))
    rc = gpu_bare.main(["--device", "cpu", "--out", str(tmp_path), "--max-minutes", "2", "--pairs", "tiny,qwen3_5"])
    assert rc == 1 and started == ["tiny-8q-2kv"]  # neither the second pair nor the grid started
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pairs"][1] == {"pair": "tiny-qwen3_5", "skipped": summary["pairs"][1]["skipped"]}
    assert (
        summary["pairs"][1]["skipped"].startswith("time limit: 0 s left")
        and "needs 30 s" in summary["pairs"][1]["skipped"]
    )
    assert summary["cost_grid_skipped"].startswith("time limit") and summary["complete"] is True


def test_one_pair_failing_costs_only_that_pair(tmp_path, monkeypatch):
    def second_breaks(name, *a):
        if name == "tiny-gemma4":
            raise TypeError("activate_past_recording() got an unexpected keyword argument")
        return fake_pair(name, *a)

    monkeypatch.setattr(gpu_bare, "pair_stage", second_breaks)
    rc = gpu_bare.main(["--device", "cpu", "--out", str(tmp_path), "--no-grid", "--pairs", "qwen3_5,gemma4,gpt_oss"])
    pairs = json.loads((tmp_path / "summary.json").read_text())["pairs"]
    assert rc == 1 and [p["pair"] for p in pairs] == ["tiny-qwen3_5", "tiny-gemma4", "tiny-gpt_oss"]
    assert "error" in pairs[1] and pairs[0]["equal"]["pass"] and pairs[2]["equal"]["pass"]


def test_a_parting_at_a_near_tie_is_reported_and_passes_a_wide_one_fails():
    from tiny_models import make_tiny_target

    model = make_tiny_target(None, vocab_size=64, layers=2, seed=0)
    prompt = [5, 9, 13]
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    alone = [first, 7, 7]
    wide = gpu_bare.parting(model, prompt, [(first + 1) % 64, 7, 7], alone)
    assert wide["token"] == 0 and not wide["near_tie"] and wide["margin"] >= 0
    assert wide["near_tie_below"] == pytest.approx(gpu_bare.NEAR_TIE_SPREAD * wide["near_tie_below"] / 1e-3)
    runner_up = int(model(torch.tensor([prompt])).logits[0, -1].topk(2).indices[1])
    with torch.no_grad():  # the runner-up's output row made the winner's: a tie the reduction order decides
        model.lm_head.weight[runner_up] = model.lm_head.weight[first]
    tie = gpu_bare.parting(model, prompt, [runner_up, 7, 7], alone)
    assert tie["near_tie"] and tie["margin"] < tie["near_tie_below"]
    assert gpu_bare.parting(model, prompt, alone, alone) is None


def test_the_family_pairs_run_per_row_on_the_cpu(tmp_path):
    """Qwen3.5, Gemma 4 and gpt-oss tiny pairs at toy sizes: speculative == the target alone, per row."""
    rc = gpu_bare.main(
        ["--device", "cpu", "--quick", "--no-grid", "--max-minutes", "30", "--out", str(tmp_path)]
        + ["--pairs", ",".join(gpu_bare.FAMILY_PAIRS)]
    )
    pairs = json.loads((tmp_path / "summary.json").read_text())["pairs"]
    assert rc == 0, pairs
    assert [p["pair"] for p in pairs] == ["tiny-qwen3_5", "tiny-gemma4", "tiny-gpt_oss"]
    assert all(p["equal"]["pass"] and p["equal"]["differ"] == [] and p["per_row"] for p in pairs)
    # one pair's target is steered to agree with its drafter: rounds accept several drafts, then reject one, so
    # the verify pass (Gated DeltaNet state included) is rolled back inside the block, still equal to the target
    agreeing = next(p for p in pairs if p["pair"] == f"tiny-{gpu_bare.AGREEING_PAIR}")
    assert agreeing["rollbacks_keeping_drafts"] >= 1 and agreeing["tau"] > 1.5, agreeing


def test_per_row_families_run_few_rows():
    """A per-row family runs every row as a forward pass of its own: its start-up measurement and its largest
    concurrency hold PER_ROW_ROWS rows, not the 64 of the batched pairs (which took half the host's budget)."""
    full, per_row = gpu_bare.stage_sizes(per_row=False, quick=False), gpu_bare.stage_sizes(per_row=True, quick=False)
    assert full["rows"] == 64 and max(full["levels"]) == 64
    assert per_row["rows"] == gpu_bare.PER_ROW_ROWS <= 4 and max(per_row["levels"]) == per_row["rows"]
    assert per_row["max_new"] < full["max_new"]


def test_the_cost_grid_is_on_disk_cell_by_cell_so_a_cut_keeps_what_was_measured(tmp_path, monkeypatch):
    """Killed while timing its third cell, the run leaves the two cells it measured in cost_grid.json (a host's
    time cut, or a kill, ends the script without a last write)."""
    syncs = []

    def cut_at_the_third_cell(device):
        syncs.append(device)
        if len(syncs) == 9:  # --quick: 2 timed passes x 2 synchronisations per cell
            grid = json.loads((tmp_path / "cost_grid.json").read_text())
            assert [(c["rows"], c["tokens_per_row"]) for c in grid["target"]] == [(1, 1), (1, 4)]
            raise KeyboardInterrupt

    monkeypatch.setattr(gpu_bare, "sync", cut_at_the_third_cell)
    with pytest.raises(KeyboardInterrupt):
        gpu_bare.main(["--device", "cpu", "--quick", "--pairs", "", "--max-minutes", "30", "--out", str(tmp_path)])
    grid = json.loads((tmp_path / "cost_grid.json").read_text())
    assert len(grid["target"]) == 2 and all(c["seconds"] > 0 for c in grid["target"])
    assert "| target | 16 | 1 | 4 |" in (tmp_path / "README.md").read_text()


def test_an_error_mid_grid_keeps_the_cells_measured_before_it(tmp_path, monkeypatch):
    syncs = []

    def breaks_at_the_third_cell(device):
        syncs.append(device)
        if len(syncs) == 9:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_bare, "sync", breaks_at_the_third_cell)
    rc = gpu_bare.main(["--device", "cpu", "--quick", "--pairs", "", "--max-minutes", "30", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0 and summary["cost_grid_error"].startswith("RuntimeError: CUDA error")
    assert len(json.loads((tmp_path / "cost_grid.json").read_text())["target"]) == 2
