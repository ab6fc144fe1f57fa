"""deploy/'s pods and Slurm job, executed (`make test-pods`; tests/pods.py is the runner and says what it applies):
every overlay renders with kubectl kustomize, and each pod's init containers, containers, probes, preStop hooks and
drain run in a sandbox built as the kubelet and containerd build one; the sbatch script runs with pyxis' and enroot's
defaults; the trtllm-serve overlays are filled from a plan first (`dflash-trt plan overlay`). TensorRT-LLM,
trtllm-build, trtllm-serve and the GPU are the labelled stand-ins of tests/pods_image/.

One "namespace" (Cluster) holds the operator's objects: the checkpoints claim (a tiny random pair whose heads split
at tp 8), the engines share (owned by uid/gid 10001, mode 0755, as deploy/README.md tells operators to make it), the
API key and the launcher's ssh keys. The LeaderWorkerSet groups run whole (tests/pods.py LwsGroup): the worker's
real sshd, the leader's mpirun across the pods' network namespaces. Needs root, bubblewrap, `ip netns`, sshd and
Open MPI with mpi4py (`make test-pods` installs them).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pods import (
    ALL_CAPS,
    DEFAULT_CAPS,
    ROOT,
    Cluster,
    Image,
    LwsGroup,
    LwsTemplate,
    Pod,
    PodFailed,
    SlurmJob,
    atomic_writer,
    capabilities,
    config_maps,
    new_work,
    pod_templates,
    render,
)

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


def test_capabilities_follow_containerds_order():
    """containerd's CRI WithCapabilities: add ALL, then drop ALL, then each add, then each drop (a name in both
    lists is dropped; `add: [ALL]` is every capability, not a capability named ALL)."""
    assert "NET_RAW" not in capabilities({"add": ["NET_RAW"], "drop": ["NET_RAW"]})
    assert capabilities({"add": ["ALL"], "drop": ["CHOWN"]}) == sorted(set(ALL_CAPS) - {"CHOWN"})
    assert "ALL" not in capabilities({"add": ["ALL"]}) and "SYS_ADMIN" in capabilities({"add": ["ALL"]})
    assert capabilities({"add": ["ALL", "IPC_LOCK"], "drop": ["ALL"]}) == ["IPC_LOCK"]
    assert capabilities({"drop": ["ALL"], "add": ["ipc_lock"]}) == ["IPC_LOCK"]
    assert capabilities({}) == sorted(DEFAULT_CAPS)


def test_a_secret_volume_with_fs_group_is_group_readable(tmp_path):
    """The kubelet's SetVolumeOwnership over a read-only (Secret / ConfigMap) volume when the pod has an fsGroup:
    group fsGroup and mode | 0440 on each file, setgid and 0550 more on each folder; without one, the mode as given."""
    with_group = atomic_writer(tmp_path / "a", {"id": b"k"}, 0o400, 2000)
    st = (with_group / "id").stat()  # through the ..data symlinks, as a process reads it
    assert (st.st_mode & 0o7777, st.st_gid) == (0o440, 2000)
    folder = with_group.stat()
    assert folder.st_gid == 2000 and folder.st_mode & 0o2550 == 0o2550
    without = atomic_writer(tmp_path / "b", {"id": b"k"}, 0o400, None)
    assert ((without / "id").stat().st_mode & 0o7777, (without / "id").stat().st_gid) == (0o400, 0)


def test_the_trtllm_build_stand_in_defaults_to_paged_context_fmha(tmp_path):
    """trtllm-build without --use_paged_context_fmha builds with it on (PluginConfig's default), as upstream."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"mapping": {"world_size": 1}}))
    (ckpt / "rank0.safetensors").write_bytes(b"weights")
    build = [sys.executable, str(ROOT / "tests/pods_image/bin/trtllm-build"), "--checkpoint_dir", str(ckpt)]
    subprocess.run([*build, "--output_dir", str(tmp_path / "out")], check=True, cwd=tmp_path, capture_output=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["build_config"]["plugin_config"]["use_paged_context_fmha"] is True


def test_a_container_without_a_prestop_gets_sigterm_while_its_neighbours_hook_runs(cluster):
    """The kubelet kills a pod's containers side by side (Pod.stop): a sidecar with no preStop is signalled at once,
    not after the server's drain. The server's hook here ends only once the sidecar has had its SIGTERM, so a runner
    that ran the hooks first would hold it to the grace period and fail."""
    loop = "while true; do sleep 0.1; done"
    shared = {"name": "shared", "mountPath": "/shared"}
    spec = {
        "terminationGracePeriodSeconds": 20,
        "volumes": [{"name": "shared", "emptyDir": {}}],
        "containers": [
            {
                "name": "server",
                "command": ["sh", "-c", f"trap 'exit 0' TERM; touch /shared/server-up; {loop}"],
                "volumeMounts": [shared],
                "lifecycle": {
                    "preStop": {
                        "exec": {
                            "command": [
                                "sh",
                                "-c",
                                "until [ -e /shared/sidecar-stopped ]; do sleep 0.1; done; touch /shared/hook-done",
                            ]
                        }
                    }
                },
            },
            {
                "name": "sidecar",
                "command": [
                    "sh",
                    "-c",
                    f"trap 'touch /shared/sidecar-stopped; exit 0' TERM; touch /shared/sidecar-up; {loop}",
                ],
                "volumeMounts": [shared],
            },
        ],
    }
    folder = cluster.work / "pods" / "stop-order-0" / "volumes" / "shared"
    with Pod(cluster, "stop-order-0", spec) as pod:
        pod.start()
        deadline = time.monotonic() + 120  # both traps set (a signal before that would meet no handler)
        while not ((folder / "server-up").exists() and (folder / "sidecar-up").exists()):
            assert time.monotonic() < deadline, "the containers did not start"
            time.sleep(0.05)
        assert pod.stop() == {"server": 0, "sidecar": 0}
        assert (folder / "hook-done").exists()


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


def test_lws_variables_reach_every_container_ahead_of_the_yamls_own(tmp_path):
    """What LwsGroup gives a group's pods before anything runs (no namespaces, no root): the names LWS gives them,
    LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX in every container and init container, replacing a
    container's own variable of the same name (addEnvVarsIfNotExists puts LWS's first and drops the duplicate), and
    every pod's /etc/hosts naming the group's pods under the LWS's subdomain."""
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/bash\n")
    own = [{"name": "LWS_GROUP_SIZE", "value": "99"}, {"name": "KEEP", "value": "1"}]
    leader = {"initContainers": [{"name": "build", "env": own}], "containers": [{"name": "serve", "env": own}]}
    worker = {"containers": [{"name": "worker"}]}
    group = LwsGroup(Cluster(tmp_path, Image(root), {}, {}, {}), LwsTemplate("grp", 3, leader, worker), 2, "ns")
    assert [p.name for p in group.pods] == ["grp-2", "grp-2-1", "grp-2-2"]
    for i, pod in enumerate(group.pods):
        for c in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            env = pod.sandbox(c).env
            lws = {k: v for k, v in env.items() if k.startswith("LWS_")}
            assert lws == {"LWS_LEADER_ADDRESS": "grp-2.grp.ns", "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": str(i)}
            assert env.get("KEEP") == ("1" if i == 0 else None)
        hosts = (pod.dir / "hosts").read_text()
        assert all(f"{name}.grp.ns.svc.cluster.local" in hosts for name in ("grp-2", "grp-2-1", "grp-2-2")), hosts


def _rank_events(log: str, name: str) -> list[dict]:
    """The JSON event lines the stand-in executor's ranks print (their stderr reaches mpirun's, the leader's log)."""
    out = []
    for line in log.splitlines():
        start = line.find("{")
        if start >= 0 and f'"event": "{name}"' in line:
            try:
                out.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                pass
    return out


def test_the_lws_group_builds_serves_across_its_pods_and_drains(cluster):
    """The multi-node overlay's group as LWS makes it (tests/pods.py LwsGroup: its variables, names, one network):
    the worker's sshd to live; the leader's init build (tp 8, on the share), then its serving container: serve.sh's
    leader role waits for the worker's sshd, mpirun starts 4 ranks in each pod (the worker's through ssh), to ready
    on the YAML's probes; a request with the API key is served; the group deleted: both pods' preStop and SIGTERM,
    every container exiting 0 within its grace period, every rank having followed every iteration."""
    docs = render(K8S / "multi-node")
    cluster.config_maps |= config_maps(docs)
    lws = LwsTemplate.of(docs)
    with LwsGroup(cluster, lws) as group:
        leader, worker = group.pods
        worker.start()  # startupPolicy LeaderCreated: the workers start with the leader, its init build included
        leader.init()
        built = _built(cluster, leader)
        assert built["serve"]["target"] == "target_tensorrt_llm", built["skipped"]
        assert built["engines"]["target_tensorrt_llm"]["tp"] == 8
        worker.wait_ready()
        leader.start()
        leader.wait_ready()
        key = cluster.secrets["dflash-api-key"]["key"].decode().strip()
        assert group.http(8000, "/generate", {"input_ids": [5, 6, 7], "max_tokens": 6})[0] == 401
        status, text = group.http(8000, "/generate", {"input_ids": [5, 6, 7], "max_tokens": 6}, key)
        assert status == 200 and len(json.loads(text)["token_ids"]) == 6, text + leader.procs["leader"].tail()
        codes = group.stop()
        log = leader.procs["leader"].log.read_text(errors="replace")
    assert codes == [{"leader": 0}, {"worker": 0}], log[-4000:]
    ranks = {e["rank"]: e["host"] for e in _rank_events(log, "standin_rank")}
    assert ranks == {r: leader.name if r < 4 else worker.name for r in range(8)}, log[-4000:]
    (shutdown,) = _rank_events(log, "fake_leader_shutdown")
    workers = _rank_events(log, "fake_worker_shutdown")
    assert sorted(e["rank"] for e in workers) == list(range(1, 8))
    assert {e["iterations"] for e in workers} == {shutdown["iterations"]} and shutdown["iterations"] >= 1


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
        job.warn()  # the time limit's warning, as the script's #SBATCH --signal asks
        assert proc.wait(timeout=330) == 0, job.log.read_text()
        assert [s["rc"] for s in job.steps] == [[0], [0]], job.log.read_text()
    finally:
        job.close()


def _filled_trtllm_serve(work: Path) -> Path:
    """deploy/k8s copied without its generated files, the trtllm-serve overlay filled as an operator fills it:
    `dflash-trt plan` (a small plan of the demo pair, as tests/deploy/test_trtllm_overlay.py makes one), then
    `dflash-trt plan overlay`. Returns the copy's k8s folder."""
    from dflash_trt.cli.main import main
    from dflash_trt.settings import DEMO_DRAFTER

    k8s = work / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("trtllm-serve.yaml", "plan-alerts.env"))
    plan = work / "plan"
    args = ["plan", "--out", str(plan), "--no-progress", "--drafter", str(DEMO_DRAFTER), "--concurrency", "1,8"]
    assert main([*args, "--min-requests", "8", "--prompt-len", "fixed:64", "--output-len", "fixed:48"]) == 0
    assert main(["plan", "overlay", "--plan", str(plan), "--out", str(k8s / "trtllm-serve")]) == 0
    return k8s


# what the pod's network runs against the two containers: completions on trtllm-serve's port, then the exporter's
# /metrics without the key (its status) and with it, until the exporter has polled every round the completions made
_CLIENT = """
import json, sys, time, urllib.error, urllib.request
http, metrics, key, n, tokens, rounds = sys.argv[1:]
for _ in range(int(n)):
    body = json.dumps({"prompt": "a", "max_tokens": int(tokens)}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
try:
    urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10)
    anonymous = 200
except urllib.error.HTTPError as e:
    anonymous = e.code
end = time.monotonic() + 30
while True:
    req = urllib.request.Request(f"http://127.0.0.1:{metrics}/metrics", headers={"Authorization": f"Bearer {key}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    done = f"vllm:spec_decode_num_drafts_total {float(rounds)}" in text
    if done or time.monotonic() > end:
        break
    time.sleep(0.5)
print(json.dumps({"anonymous": anonymous, "metrics": text}))
"""


@pytest.fixture(scope="module")
def trtllm_serve(cluster) -> tuple[Path, Path]:
    """The filled deploy/k8s copy (_filled_trtllm_serve), and a checkpoints claim holding the pair its plan was made
    for (the demo pair; the cluster's tiny pair is the engine builds')."""
    k8s = _filled_trtllm_serve(cluster.work / "trtllm-serve")
    demo = cluster.work / "pv" / "demo-checkpoints"
    for name in ("target", "drafter"):
        shutil.copytree(ROOT / "models" / name, demo / name)
    subprocess.run(["chmod", "-R", "a+rX", str(demo)], check=True)
    return k8s, demo


def test_the_trtllm_serve_pod_serves_with_the_stand_in_its_exporter_scrapes_and_it_drains(cluster, trtllm_serve):
    """The trtllm-serve overlay's pod, filled from a plan and rendered: trtllm-serve (the stand-in, on the demo pair
    in the checkpoints claim, the YAML from the ConfigMap) and the serve-metrics sidecar as written, to ready on
    their probes; completions served; the sidecar's /metrics refused without the API key and, with it, the series
    the stand-in's iteration statistics make; then preStop and SIGTERM, both exiting 0 within the grace period."""
    k8s, demo = trtllm_serve
    docs = render(k8s / "trtllm-serve")
    spec = pod_templates(docs)["single"]
    (config,) = [v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "config"]  # its hashed name
    served_yaml = yaml.safe_load(config_maps(docs)[config]["trtllm-serve.yaml"])
    assert served_yaml["speculative_config"]["speculative_model"] == "/checkpoints/drafter"
    claims = {"dflash-checkpoints": demo}
    served = Cluster(cluster.work, cluster.image, config_maps(docs), cluster.secrets, claims)
    key = cluster.secrets["dflash-api-key"]["key"].decode().strip()
    # the stand-in drafts max_draft_len a round and accepts half of them (FAKE_TRTLLM_ACCEPT's default), one round
    # of 1 + accepted tokens; requests one at a time (batch 1, below every scheduled size)
    k = int(served_yaml["speculative_config"]["max_draft_len"])
    accepted, requests, tokens = k // 2, 4, 32
    rounds = requests * math.ceil(tokens / (1 + accepted))
    with Pod(served, "dflash-trt-serve-0", spec) as pod:
        pod.start()
        took = pod.wait_ready()
        assert set(took) == {"trtllm-serve", "serve-metrics"}
        argv = [str(requests), str(tokens), str(rounds)]
        client = ["ip", "netns", "exec", pod.netns, "/usr/bin/python3", "-c", _CLIENT, "8000", "9400", key, *argv]
        r = subprocess.run(client, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr + pod.procs["trtllm-serve"].tail() + pod.procs["serve-metrics"].tail()
        seen = json.loads(r.stdout)
        codes = pod.stop()
    assert codes == {"trtllm-serve": 0, "serve-metrics": 0}, pod.log.read_text()
    assert seen["anonymous"] == 401
    from prometheus_client.parser import text_string_to_metric_families

    got = {s.name: s.value for f in text_string_to_metric_families(seen["metrics"]) for s in f.samples}
    assert got["vllm:spec_decode_num_drafts_total"] == rounds
    assert got["vllm:spec_decode_num_draft_tokens_total"] == rounds * k
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == rounds * accepted
    assert got["vllm:generation_tokens_total"] == requests * tokens


def test_the_trtllm_serve_group_serves_across_its_pods_and_drains(cluster, trtllm_serve):
    """The multi-node trtllm-serve overlay's group (over the filled one-node overlay) as LWS makes it: the worker's
    sshd to live; the leader's trtllm-group.sh waits for it over ssh and starts the world with mpirun, 4 ranks a pod
    (the worker's through ssh), each running trtllm-llmapi-launch (the stand-in): rank 0 trtllm-serve (the stand-in)
    and the comm server, the others its workers; the leader's containers to ready on their probes, a completion
    served; the group deleted: the leader's preStop ends trtllm-serve alone, so the launcher stops the world, while
    the worker's keeps its ranks until then; every container exits 0 within its grace period."""
    k8s, demo = trtllm_serve
    docs = render(k8s / "trtllm-serve-multi-node")
    work = cluster.work / "trtllm-group"  # its pods' volumes apart from the other LWS test's (the same pod names)
    served = Cluster(work, cluster.image, config_maps(docs), cluster.secrets, {"dflash-checkpoints": demo})
    with LwsGroup(served, LwsTemplate.of(docs)) as group:
        leader, worker = group.pods
        worker.start()
        worker.wait_ready()
        leader.start()
        assert set(leader.wait_ready()) == {"leader", "serve-metrics"}
        status, text = group.http(8000, "/v1/completions", {"prompt": "a", "max_tokens": 8})
        assert status == 200, text + leader.procs["leader"].tail()
        codes = group.stop()
        log = leader.procs["leader"].log.read_text(errors="replace")
    assert codes == [{"leader": 0, "serve-metrics": 0}, {"worker": 0}], log[-4000:]
    assert sorted(int(n) for n in re.findall(r"^mpi_rank: (\d+)$", log, re.M)) == list(range(8)), log[-4000:]
    # the world stopped by the launcher once trtllm-serve drained (the preStop), not killed: every worker released
    assert "MPI Comm Server (STAND-IN) stopped" in log and log.count("worker quit (STAND-IN)") == 7, log[-4000:]


def test_the_trtllm_serve_slurm_job_serves_and_drains(cluster, trtllm_serve):
    """deploy/slurm/trtllm-serve.sbatch on one node with two tasks (tp 2): the shared folder filled as its header
    says (`dflash-trt plan overlay --out DATA --drafter-path DATA/drafter`, the demo pair beside it), the stand-in
    trtllm-llmapi-launch making rank 0 trtllm-serve (the stand-in) with the comm server and rank 1 a worker, the
    exporter step beside rank 0 reaching trtllm-serve by the node's name; to /health, completions served and scraped
    through the exporter with the key; then the time limit's warning as the script's #SBATCH --signal asks: the
    server drains and exits 0, the launcher stops the world, the worker quits 0, the exporter exits 0, and the job
    ends 0 with nothing left to kill."""
    from dflash_trt.cli.main import main

    data = cluster.work / "slurm-trtllm-data"
    for name in ("target", "drafter"):
        shutil.copytree(ROOT / "models" / name, data / name)
    plan = cluster.work / "trtllm-serve" / "plan"  # the trtllm_serve fixture's plan
    assert main(["plan", "overlay", "--plan", str(plan), "--out", str(data), "--drafter-path", f"{data}/drafter"]) == 0
    key = cluster.secrets["dflash-api-key"]["key"].decode().strip()
    (data / "api-key").write_text(key + "\n")
    subprocess.run(["chown", "-R", "1000:1000", str(data)], check=True)
    served = yaml.safe_load((data / "trtllm-serve.yaml").read_text())
    k = int(served["speculative_config"]["max_draft_len"])
    accepted, requests, tokens = k // 2, 4, 32
    rounds = requests * math.ceil(tokens / (1 + accepted))
    work = cluster.work / "slurm-trtllm-job"
    work.mkdir()
    job = SlurmJob(cluster.image, work)
    env = {
        "TRTLLM_IMAGE": "nvcr.io#nvidia/tensorrt-llm/release.sqsh",
        "DFLASH_DATA": str(data),
        "DFLASH_IMAGE": "dflash-trt.sqsh",
        "DFLASH_TRT_API_KEY_FILE": str(data / "api-key"),
    }
    try:
        proc = job.start(ROOT / "deploy/slurm/trtllm-serve.sbatch", env, ntasks=2)
        end = time.monotonic() + 300
        while not (job.ready(8000, "/health") and job.ready(9400, "/health")):
            if proc.poll() is not None:
                raise PodFailed(f"the job exited {proc.returncode} before serving\n{job.log.read_text()}")
            assert time.monotonic() < end, job.log.read_text()
            time.sleep(1)
        client = ["ip", "netns", "exec", job.netns, "/usr/bin/python3", "-c", _CLIENT, "8000", "9400", key]
        r = subprocess.run([*client, str(requests), str(tokens), str(rounds)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr + _step_logs(work)
        seen = json.loads(r.stdout)
        job.warn()  # the time limit's warning, as the script's #SBATCH --signal asks
        rc = proc.wait(timeout=120)
        assert rc == 0, job.log.read_text() + _step_logs(work)
        job.end()  # the job's end: anything still running in a step would be signalled, then killed
        # the two steps start together: the serving step (two tasks) and the exporter (one), in either order
        assert sorted(s["rc"] for s in job.steps) == [[0], [0, 0]], job.log.read_text() + _step_logs(work)
    finally:
        job.close()
    assert seen["anonymous"] == 401
    from prometheus_client.parser import text_string_to_metric_families

    got = {s.name: s.value for f in text_string_to_metric_families(seen["metrics"]) for s in f.samples}
    assert got["vllm:spec_decode_num_drafts_total"] == rounds
    assert got["vllm:generation_tokens_total"] == requests * tokens


def _step_logs(work: Path) -> str:
    return "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in sorted(work.glob("step*.log")))
