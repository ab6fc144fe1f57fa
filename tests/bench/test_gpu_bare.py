"""scripts/gpu_bare.py (`make gpu-bare`), the GPU script for a bare GPU host. No GPU here: it must skip cleanly,
what it carries must fit 64 MiB and need no package beyond torch + transformers, and its parts run at toy sizes
on the CPU (--device cpu --quick), so the GPU run starts from code that ran."""

import json
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
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            DRY_RUN,
            "--device",
            "cpu",
            "--quick",
            "--pairs",
            "tiny",
            "--out",
            str(tmp_path / "gpu"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
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
    assert "| tiny-8q-2kv | yes | 1 |" in (tmp_path / "gpu" / "README.md").read_text()


def test_full_shape_is_llama3_8b_with_a_5_layer_drafter():
    assert gpu_bare.LLAMA3_8B["hidden_size"] == 4096 and gpu_bare.LLAMA3_8B["num_hidden_layers"] == 32
    assert gpu_bare.LLAMA3_8B["num_attention_heads"] % 2 == 0 == gpu_bare.LLAMA3_8B["num_key_value_heads"] % 2
