"""deploy/'s pods and Slurm job, executed (`make test-pods`; tests/pods.py is the runner and says what it applies):
every overlay renders with kubectl kustomize, and each pod's init containers, containers, probes, preStop hooks and
drain run in a sandbox built as the kubelet and containerd build one; the sbatch script runs with pyxis' and enroot's
defaults. TensorRT-LLM, trtllm-build and the GPU are the labelled stand-ins of tests/pods_image/.

One "namespace" (Cluster) holds the operator's objects: the checkpoints claim (a tiny random pair whose heads split
at tp 8), the engines share (owned by uid/gid 10001, mode 0755, as deploy/README.md tells operators to make it), the
API key and the launcher's ssh keys. Needs root, bubblewrap, `ip netns`, sshd (`make test-pods` installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pods import ROOT, Cluster, Image, Pod, PodFailed, SlurmJob, config_maps, new_work, pod_templates, render

K8S = ROOT / "deploy" / "k8s"
pytestmark = pytest.mark.timeout(900)


def _tiny_checkpoints(root: Path) -> None:
    from dflash_trt.models.tiny import make_tiny_drafter, make_tiny_target

    # 8 query and 8 KV heads: the multi-node overlay's tp 8 splits them. The demo target's tokenizer (its vocabulary
    # size): the Triton repository works on text
    demo = ROOT / "models" / "target"
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    target = make_tiny_target(root / "target", layers=4, vocab_size=vocab, num_attention_heads=8, num_key_value_heads=8)
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(demo / name, root / "target" / name)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    missing = [
        t for t in ("bwrap", "setpriv", "nsenter", "ip", "sshd") if not shutil.which(t, path="/usr/sbin:/usr/bin")
    ]
    if os.geteuid() != 0 or missing:
        pytest.fail(f"the pod runner needs root and {missing or 'its tools'}: run `make test-pods` as root")
    work = new_work()
    image = Image.build(work)
    checkpoints = work / "pv" / "checkpoints"
    _tiny_checkpoints(checkpoints)
    subprocess.run(["chmod", "-R", "a+rX", str(checkpoints)], check=True)  # readable by the pods' users
    engines = work / "pv" / "engines"
    engines.mkdir(parents=True)
    os.chown(engines, 10001, 10001)  # deploy/README.md, "Least privilege": the share's root owned by uid/gid 10001
    os.chmod(engines, 0o755)
    keys = work / "ssh"
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id")], check=True)
    secrets = {
        "dflash-api-key": {"key": b"pods-test-key\n"},
        "dflash-mpi-ssh": {"id_ed25519": (keys / "id").read_bytes(), "authorized_keys": (keys / "id.pub").read_bytes()},
    }
    c = Cluster(work, image, {}, secrets, {"dflash-checkpoints": checkpoints, "dflash-engines": engines})
    yield c
    mounted = str(work) in Path("/proc/self/mountinfo").read_text()  # never delete through a mount point
    if not os.environ.get("PODS_KEEP") and not mounted:  # PODS_KEEP: a failed run's pods and logs, to read
        shutil.rmtree(work, ignore_errors=True)


def _with_render(cluster: Cluster, overlay: str) -> dict[str, dict]:
    docs = render(K8S / overlay)
    cluster.config_maps |= config_maps(docs)
    return pod_templates(docs)


def _built(cluster: Cluster, pod: Pod) -> dict:
    """The manifest of the engines the pod's init step says it built (its engines-dir, on the share)."""
    engines_dir = (cluster.work / "pods" / pod.name / "volumes/run/engines-dir").read_text().strip()
    return json.loads((cluster.claims["dflash-engines"] / Path(engines_dir).name / "manifest.json").read_text())


def _serves_and_drains(pod: Pod) -> dict[str, int]:
    pod.start()
    pod.wait_ready()
    return pod.stop()


def test_single_node_pod_builds_serves_and_drains(cluster):
    spec = _with_render(cluster, "single-node")["single"]
    with Pod(cluster, "dflash-trt-0", spec) as pod:
        pod.init()
        built = _built(cluster, pod)
        assert built["serve"]["target"] == "target_tensorrt_llm", built["skipped"]
        assert _serves_and_drains(pod) == {"server": 0}


def test_the_groups_leader_builds_and_the_worker_serves_sshd_and_drains(cluster):
    specs = _with_render(cluster, "multi-node")
    with Pod(cluster, "dflash-trt-group-0", specs["leader"]) as leader:
        leader.init()
        built = _built(cluster, leader)
        assert built["serve"]["target"] == "target_tensorrt_llm", built["skipped"]
        assert built["engines"]["target_tensorrt_llm"]["tp"] == 8
    with Pod(cluster, "dflash-trt-group-0-1", specs["worker"]) as worker:
        assert _serves_and_drains(worker) == {"worker": 0}


def _no_gpu_for_tritonserver(repo: Path) -> list[str]:
    """STAND-IN for the GPU, on tritonserver's side: a KIND_GPU instance group needs a GPU tritonserver can see
    (model_lifecycle: "specifies invalid or unsupported gpu id"), which this machine has not; the groups the init
    step wrote become KIND_CPU, their `gpus` dropped, and nothing else changes. Returns the models changed."""
    from dflash_trt.triton.config import parse_config, pb2, write_config

    changed = []
    for path in sorted(repo.glob("*/config.pbtxt")):
        cfg = parse_config(path)
        gpu_groups = [g for g in cfg.instance_group if g.kind == pb2().ModelInstanceGroup.KIND_GPU]
        for group in gpu_groups:
            group.kind = pb2().ModelInstanceGroup.KIND_CPU
            del group.gpus[:]
        if gpu_groups:
            write_config(path.parent, cfg)
            changed.append(cfg.name)
    return changed


def test_the_triton_pod_loads_the_repository_and_drains(cluster):
    spec = _with_render(cluster, "triton")["triton"]
    with Pod(cluster, "dflash-triton-0", spec) as pod:
        pod.init()
        assert "dflash_target" in _no_gpu_for_tritonserver(cluster.work / "pods" / pod.name / "volumes" / "repo")
        codes = _serves_and_drains(pod)
        assert codes == {"tritonserver": 0}, pod.procs["tritonserver"].tail()


def test_the_slurm_job_builds_serves_and_drains(cluster):
    data = cluster.work / "slurm-data"  # DFLASH_DATA: the user's shared folder
    shutil.copytree(cluster.claims["dflash-checkpoints"], data / "checkpoints")
    (data / "engines.toml").write_text(
        f'target = "{data}/checkpoints/target"\ndrafter = "{data}/checkpoints/drafter"\noutput = "{data}/engines"\n'
        'tp = 1\nprecision = "fp16"\nmax_batch_size = 8\nmax_input_len = 256\nmax_seq_len = 512\n'
    )
    subprocess.run(["chown", "-R", "1000:1000", str(data)], check=True)
    job = SlurmJob(cluster.image, cluster.work)
    try:
        proc = job.start(
            ROOT / "deploy/slurm/dflash-serve.sbatch", {"DFLASH_IMAGE": "dflash-trt.sqsh", "DFLASH_DATA": str(data)}
        )
        end = time.monotonic() + 600
        while not job.ready(8000):
            if proc.poll() is not None:
                raise PodFailed(f"the job exited {proc.returncode} before serving\n{job.log.read_text()}")
            assert time.monotonic() < end, job.log.read_text()
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)  # the time limit's --signal=B:TERM, or scancel --signal=TERM --batch
        assert proc.wait(timeout=330) == 0, job.log.read_text()
        assert [s["rc"] for s in job.steps] == [[0], [0]], job.log.read_text()
    finally:
        job.close()
