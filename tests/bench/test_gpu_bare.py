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
    --grid-target's shape with the identity trtllm-serve-config checks."""
    from tiny_models import make_tiny_target

    make_tiny_target(tmp_path / "grid-target", vocab_size=96, layers=4, num_attention_heads=4, num_key_value_heads=2)
    out = subprocess.run(
        [sys.executable, "-c", DRY_RUN, "--device", "cpu", "--quick", "--pairs", "tiny"]
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
