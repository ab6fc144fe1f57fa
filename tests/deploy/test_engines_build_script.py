"""deploy/k8s/components/engines/build-engines.sh, the pods' engine init step, run for real on the CPU path (the
ONNX drafter; TensorRT steps skip here) with the real `dflash-trt engines`, flock and rename:

- two builders of one identity at once (two groups, or a rollout's new group) build it once: the second waits on
  the lock and finds the folder; nothing half-built is ever visible, no temporary folder is left;
- a later start hashes and builds nothing (the identity is a stamp, not a content hash);
- another config or a changed checkpoint file is another identity, in a folder of its own; the drafter's graphs
  come from the export cache the script keeps on the volume when only the config changed;
- the manifest's checkpoint paths still resolve after the rename."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import make_tiny_pair

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "k8s" / "components" / "engines" / "build-engines.sh"
DFLASH = ROOT / ".venv" / "bin" / "dflash-trt"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def site(tmp_path):
    make_tiny_pair(tmp_path / "ckpt", vocab_size=64)
    (tmp_path / "engines.toml").write_text(
        f'target = "{tmp_path / "ckpt" / "target"}"\ndrafter = "{tmp_path / "ckpt" / "drafter"}"\n'
    )
    # counts the builds, and holds each one long enough for a concurrent start to meet its lock
    (tmp_path / "count.sh").write_text(
        f'echo build >> "{tmp_path / "builds"}"; sleep 2; exec "{DFLASH}" engines "$@"\n'
    )
    return tmp_path


def start(site: Path, run: str) -> subprocess.Popen:
    env = {
        **{k: v for k, v in os.environ.items() if k != "DFLASH_TRT_CACHE"},  # the script's own: on the volume
        "ENGINES_CONFIG": str(site / "engines.toml"),
        "DFLASH_ENGINES_ROOT": str(site / "engines"),
        "DFLASH_RUN_DIR": str(site / run),
        "DFLASH_ENGINES_CMD": f"bash {site / 'count.sh'}",
        "ENGINES_LOCK_WAIT_S": "240",
    }
    return subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    return out


def builds(site: Path) -> int:
    path = site / "builds"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_one_build_per_identity_then_nothing(site):
    if not DFLASH.exists():
        pytest.fail(f"{DFLASH} missing: run `make venv`")
    a, b = start(site, "run-a"), start(site, "run-b")
    finish(a), finish(b)
    assert builds(site) == 1
    folder = Path((site / "run-a" / "engines-dir").read_text().strip())
    assert (site / "run-b" / "engines-dir").read_text().strip() == str(folder)
    assert [p.name for p in (site / "engines").iterdir() if p.name.startswith(".tmp-")] == []
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (folder / manifest["sources"]["target"]["path"]).resolve() == (site / "ckpt" / "target").resolve()
    assert '"event": "engines_ready"' in finish(start(site, "run-c"))
    assert builds(site) == 1  # started again: the folder is there, nothing built

    with open(site / "engines.toml", "a") as f:
        f.write("max_batch_size = 4\n")
    out = finish(start(site, "run-d"))
    other = Path((site / "run-d" / "engines-dir").read_text().strip())
    assert builds(site) == 2 and other != folder and (other / "manifest.json").is_file() and folder.is_dir()
    # the same drafter graphs: copied from the volume's export cache, not exported again
    assert "from the export cache" in out and "exporting the drafter" not in out
    assert len(list((site / "engines" / ".export-cache" / "onnx").iterdir())) == 1

    weights = next((site / "ckpt" / "target").glob("*.safetensors"))
    os.utime(weights, (1, 1))  # a replaced checkpoint file: another identity
    finish(start(site, "run-e"))
    assert builds(site) == 3
    assert Path((site / "run-e" / "engines-dir").read_text().strip()) not in (folder, other)


@pytest.mark.parametrize(
    "config", ['drafter = "{ckpt}/drafter"\n', 'target = "{ckpt}/target"\ndrafter = "{ckpt}/gone"\n']
)
def test_an_identity_without_both_checkpoints_is_refused(site, config):
    """A config that names no target (or a checkpoint folder that is not there) stops the step, before any build:
    an identity without the checkpoints' stamp would reuse an old folder after they changed."""
    (site / "engines.toml").write_text(config.format(ckpt=site / "ckpt"))
    proc = start(site, "run-x")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and builds(site) == 0, out[-2000:]
    assert "target" in out or "not found" in out
    assert not (site / "run-x" / "engines-dir").exists()


def test_old_identities_and_dead_builds_are_removed(site):
    """The shared volume keeps the ENGINES_KEEP most recently used identities (here 2) and nothing older; a
    temporary folder whose build died (its identity's lock free) goes, one whose build runs (lock held) stays."""
    import fcntl

    folders = []
    for batch in (8, 4, 2):  # three configs: three identities, used in this order
        (site / "engines.toml").write_text(
            f'target = "{site / "ckpt" / "target"}"\ndrafter = "{site / "ckpt" / "drafter"}"\n'
            f"max_batch_size = {batch}\n"
        )
        finish(start(site, f"run-{batch}"))
        folders.append(Path((site / f"run-{batch}" / "engines-dir").read_text().strip()))
    first, second, third = folders
    assert not first.exists() and second.is_dir() and third.is_dir()
    assert not (site / "engines" / f".used-{first.name}").exists()
    dead = site / "engines" / ".tmp-0123456789abcdef-gone"
    live = site / "engines" / ".tmp-fedcba9876543210-busy"
    dead.mkdir(), live.mkdir()
    with open(site / "engines" / ".lock-fedcba9876543210", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a build of that identity in progress
        out = finish(start(site, "run-2b"))  # the third identity again: nothing built, the pruner runs
    assert builds(site) == 3 and '"event": "engines_ready"' in out
    assert not dead.exists() and live.is_dir() and second.is_dir() and third.is_dir()
    assert not list((site / "engines").glob(".trash-*"))


IMAGE_USER = 10001  # the image's user (Dockerfile), which the single-node and Triton pods run as


@pytest.fixture
def shared():
    """A folder every uid can traverse (pytest's tmp_path is root's, mode 700), removed afterwards."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="engines-uid-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _as_image_user(site: Path, root: Path, run: Path) -> subprocess.CompletedProcess:
    for role in ("target", "drafter"):
        (site / "ckpt" / role).mkdir(parents=True, exist_ok=True)
    (site / "engines.toml").write_text(f'target = "{site}/ckpt/target"\ndrafter = "{site}/ckpt/drafter"\n')
    # a stand-in for `dflash-trt engines` (what is tested here is the script's own writes): the --out folder
    (site / "fake.sh").write_text('while [ $# -gt 0 ]; do [ "$1" = --out ] && mkdir -p "$2"; shift; done\n')
    env = {
        "PATH": os.environ["PATH"],
        "ENGINES_CONFIG": str(site / "engines.toml"),
        "DFLASH_ENGINES_ROOT": str(root),
        "DFLASH_RUN_DIR": str(run),
        "DFLASH_ENGINES_CMD": f"bash {site / 'fake.sh'}",
    }
    user = ["setpriv", f"--reuid={IMAGE_USER}", f"--regid={IMAGE_USER}", "--clear-groups"]
    if os.geteuid() != 0:
        user = []  # already not root: the folders below are then owned by this user, not by root
    return subprocess.run([*user, "bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the script as the image's uid (setpriv)")
def test_a_root_the_image_user_cannot_write_is_refused_by_name(shared):
    """The engines root of a ReadWriteMany claim whose share is root's (fsGroup does not reach it unless the CSI
    driver's fsGroupPolicy is File): the step stops at once and says what to change, before hashing or building;
    a run folder it cannot write likewise. The control: both owned by the image's uid, the step completes."""
    locked = shared / "engines"  # root's, 755: what uid 10001 meets on a share nobody prepared
    locked.mkdir()
    r = _as_image_user(shared, locked, shared / "run")
    assert r.returncode == 1 and f"{locked} is not writable by uid {IMAGE_USER}" in r.stderr, r
    assert "fsGroupPolicy: File" in r.stderr and "access point" in r.stderr and not list(locked.iterdir())

    os.chown(locked, IMAGE_USER, IMAGE_USER)
    run = shared / "rundir"
    run.mkdir(mode=0o755)  # root's: /run/dflash with no emptyDir mounted on it
    r = _as_image_user(shared, locked, run / "dflash")
    assert r.returncode == 1 and "DFLASH_RUN_DIR" in r.stderr and "emptyDir" in r.stderr, r

    os.chown(run, IMAGE_USER, IMAGE_USER)
    r = _as_image_user(shared, locked, run / "dflash")
    assert r.returncode == 0 and '"event": "engines_ready"' in r.stdout, r
    assert Path((run / "dflash" / "engines-dir").read_text().strip()).parent == locked


# ---- the engines step in a TensorRT-LLM container without the drafter export's modules ----------------------
def gpu_stage(dockerfile: str) -> list[str]:
    """The gpu stage's instructions, continuation lines joined."""
    text = dockerfile.split(" AS gpu\n", 1)[1].replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_engines_step_without_onnxruntime_and_onnxscript_refuses_by_name_before_building(tmp_path, monkeypatch):
    """TensorRT-LLM's requirements hold onnx but neither onnxruntime nor onnxscript: in such a Python the engines
    step stops before any build with the modules and the install line, in process and through the real CLI."""
    import sys

    from dflash_trt.builders.engines import CONTAINER_INSTALL, EnginesConfig, EnginesDependencyError, build_engines

    make_tiny_pair(tmp_path / "ckpt", vocab_size=64)
    ckpt = tmp_path / "ckpt"
    cfg = EnginesConfig(target=ckpt / "target", drafter=ckpt / "drafter", output=tmp_path / "engines")
    for name in ("onnxruntime", "onnxscript"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ModuleNotFoundError
    with pytest.raises(EnginesDependencyError) as e:
        build_engines(cfg, log=lambda _: None)
    assert "onnxruntime, onnxscript" in str(e.value) and f"`{CONTAINER_INSTALL}`" in str(e.value)
    assert not cfg.output.exists()  # refused before anything was written
    # the real CLI in a Python where both imports fail (a sitecustomize hides them, as a container lacks them)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nsys.modules['onnxruntime'] = sys.modules['onnxscript'] = None\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(ROOT)])}
    toml = tmp_path / "engines.toml"
    toml.write_text(f'target = "{cfg.target}"\ndrafter = "{cfg.drafter}"\n')
    out = subprocess.run(
        [str(DFLASH), "engines", "--config", str(toml), "--out", str(cfg.output)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "onnxruntime, onnxscript" in out.stderr and CONTAINER_INSTALL in out.stderr
    assert not cfg.output.exists()


def test_the_install_line_the_refusal_names_is_what_the_gpu_image_runs(tmp_path):
    """The gpu stage installs the project with CONTAINER_INSTALL itself; that script installs pyproject.toml's
    dependencies (which hold every EXPORT_MODULES entry) under the container's pins and checks the pins after. The
    script runs here against a recording stand-in for the container's python3 (pip cannot install into one here)."""
    import tomllib

    from dflash_trt.builders.engines import CONTAINER_INSTALL, EXPORT_MODULES

    runs = [i for i in gpu_stage((ROOT / "Dockerfile").read_text()) if i.startswith("RUN ")]
    assert any(i.split()[1] == CONTAINER_INSTALL for i in runs), runs
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
    assert set(EXPORT_MODULES) <= names
    log = tmp_path / "calls"
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')  # records each call; prints no pins
    fake.chmod(0o755)
    done = subprocess.run(
        [str(ROOT / CONTAINER_INSTALL)], cwd=ROOT, env={**os.environ, "PYTHON": str(fake)}, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "scripts/container_pins.py"
    pins = calls[1].split(" -c ")[1].split()[0]
    assert calls[1] == f"-m pip install --no-cache-dir -c {pins} -e ."
    assert calls[2] == f"scripts/container_pins.py --check {pins}"
    assert not Path(pins).exists()  # the pins file is removed afterwards
    docs = (ROOT / "docs" / "gpu.md").read_text() + (ROOT / "docs" / "deployment.md").read_text()
    assert CONTAINER_INSTALL in docs
