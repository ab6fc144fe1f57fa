"""Dependencies and images (issue 12, findings 8-10): ranges in pyproject.toml, the exact CPU torch only in
constraints-cpu.txt, a GPU image on the container line that ships TensorRT-LLM 1.2.x, installed without replacing
the container's packages. The images themselves are not built here (no Docker engine)."""

import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# Triton's release compatibility matrix (triton-inference-server/server docs/introduction/compatibility.md):
# release of tritonserver:<yy.mm>-trtllm-python-py3 -> TensorRT-LLM version it ships.
TRTLLM_IN_RELEASE = {
    "25.12": "1.1.0",
    "26.01": "1.1.0",
    "26.02": "1.1.0",
    "26.03": "1.2.0",
    "26.04": "1.2.1",
    "26.05": "1.2.1",
    "26.06": "1.2.1",
    "26.07": "1.2.1",
}


def deps() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(d).name: Requirement(d) for d in project["dependencies"]}


def test_dependencies_are_ranges_that_admit_the_containers_versions():
    d = deps()
    assert not any(s.operator == "==" for s in d["torch"].specifier)
    for container_torch in ("2.10.0", "2.9.1", "2.13.0"):  # NVIDIA's builds (2.10.0a0+...), this machine's
        assert d["torch"].specifier.contains(container_torch), container_torch
    for version in ("4.57.1", "5.0.0", "5.24.0"):
        assert d["transformers"].specifier.contains(version), version
    assert not d["transformers"].specifier.contains("6.0.0")


def test_the_exact_cpu_torch_lives_in_the_constraints_file_only():
    pins = [line for line in (ROOT / "constraints-cpu.txt").read_text().splitlines() if line and line[0] != "#"]
    assert pins == ["torch==2.13.0"]
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==" not in makefile
    installs = [line for line in makefile.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs and all("-c $(CONSTRAINTS)" in line for line in installs), installs


def test_gpu_image_ships_tensorrt_llm_1_2_and_keeps_the_containers_packages():
    text = (ROOT / "Dockerfile").read_text()
    image = re.search(r"ARG TRITON_TRTLLM_IMAGE=nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-trtllm-python-py3", text)
    assert image and TRTLLM_IN_RELEASE[image.group(1)].startswith("1.2."), image and image.group(1)
    gpu = text[text.index("AS gpu") :]
    # the gpu stage installs through scripts/container_install.sh: pins, install under them, check them after
    assert "RUN scripts/container_install.sh" in gpu
    install = (ROOT / "scripts" / "container_install.sh").read_text()
    assert '-c "$PINS" -e .' in install and 'container_pins.py --check "$PINS"' in install
    for step in (gpu, install):
        assert not re.search(r"pip install[^\n]*(transformers|torch|tensorrt)", step)  # nothing upgrades them
    serve = (ROOT / "scripts" / "container_serve.sh").read_text()
    # by absolute path with --prefix (where the image's Open MPI lives), as deploy/k8s/base/scripts/serve.sh does
    assert '"$MPI_PREFIX/bin/mpirun" --prefix "$MPI_PREFIX" -n "$TP" --allow-run-as-root' in serve


def test_container_pins_detect_a_replaced_package(tmp_path):
    script = ROOT / "scripts" / "container_pins.py"
    pins = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^torch==\S+$", pins, re.M) and re.search(r"^transformers==\S+$", pins, re.M)
    (tmp_path / "keep.txt").write_text(pins)
    ok = subprocess.run(
        [sys.executable, str(script), "--check", str(tmp_path / "keep.txt")], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "keep.txt").write_text(re.sub(r"^torch==\S+$", "torch==2.10.0a0+nv", pins, flags=re.M))
    bad = subprocess.run(
        [sys.executable, str(script), "--check", str(tmp_path / "keep.txt")], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "torch: 2.10.0a0+nv ->" in bad.stderr
