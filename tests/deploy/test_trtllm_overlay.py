"""deploy/k8s/trtllm-serve (TensorRT-LLM's own DFlash engine) validated offline with the real tools of
test_deploy.py (kubectl kustomize, kubernetes-validate and the vendored CRD schemas, promql-parser), and its pod's
two commands run here: the FAKE trtllm-serve (tests/fake_trtllm_serve.py) in place of the NGC image's, and the real
exporter sidecar, each with the command line the rendered Deployment gives it.

- unfilled (no `dflash-trt plan overlay` yet) it does not render; filled from a plan, it renders, validates, holds
  no placeholder, and its alert and autoscaler thresholds are plan.json's `alerts`;
- the cluster rules every other overlay is held to (test_deploy.py's checks, called on this render);
- the flags and probes against trtllm-serve's source (the stand-in parses the same command line), the exporter
  the only reader of trtllm-serve's /metrics, tp = GPUs;
- the stand-in refuses what llm_args.py at the pinned commit would, and the pod reaches ready with it: /health,
  completions, the exporter's series, and `plan check --engine vllm` against the sidecar.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from deploy.test_deploy import (
    K8S,
    K8S_VERSION,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    _admits,
    deploy_tools,
    kinds,
    one,
    parsed_names,
    queries,
    tool,
)
from deploy.test_deploy import test_an_empty_query_is_an_error_and_the_fallback_holds_the_replicas as empty_is_error
from deploy.test_deploy import (
    test_autoscaled_workloads_leave_replicas_to_keda_and_monitoring_carries_the_release_label as keda_and_release,
)
from deploy.test_deploy import test_every_overlay_has_a_budget_that_never_waits_on_unready_pods as budget
from deploy.test_deploy import test_gpu_pods_request_cpu_memory_and_tolerate_the_gpu_taint as gpu_requests
from deploy.test_deploy import test_least_privilege as least_privilege
from deploy.test_deploy import test_network_policies_cover_every_pod_and_open_only_the_serving_ports as policies
from deploy.test_deploy import test_references_resolve as references
from deploy.test_deploy import test_scraping_reaches_the_http_pods_and_the_rules_select_its_job as scraping
from server_harness import after_served

from dflash_trt.builders.trtllm_llm_args import yaml_problems
from dflash_trt.cli.main import main
from dflash_trt.plan import metrics
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = "trtllm-serve"
STAND_IN = ROOT / "tests" / "fake_trtllm_serve.py"
pytestmark = pytest.mark.timeout(600)


def render(k8s: Path, overlay: str = OVERLAY) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(tool("kubectl")), "kustomize", str(k8s / overlay)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """A small plan of the demo pair, with the drafter (so trtllm-serve.yaml has a speculative_config)."""
    out = tmp_path_factory.mktemp("plan")
    args = ["plan", "--out", str(out), "--no-progress", "--drafter", str(DEMO_DRAFTER), "--concurrency", "1,8"]
    assert main([*args, "--min-requests", "8", "--prompt-len", "fixed:64", "--output-len", "fixed:48"]) == 0
    return out


@pytest.fixture(scope="module")
def k8s_copy(tmp_path_factory):
    """deploy/k8s copied without any generated file (the worktree's own may have been filled)."""
    dst = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, dst, ignore=shutil.ignore_patterns("trtllm-serve.yaml", "plan-alerts.env"))
    return dst


@pytest.fixture(scope="module")
def filled(k8s_copy, plan_dir):
    assert main(["plan", "overlay", "--plan", str(plan_dir), "--out", str(k8s_copy / OVERLAY)]) == 0
    r = render(k8s_copy)
    assert r.returncode == 0, r.stderr
    return r.stdout, [d for d in yaml.safe_load_all(r.stdout) if d]


def test_an_unfilled_overlay_does_not_render(tmp_path):
    shutil.copytree(K8S, tmp_path / "k8s", ignore=shutil.ignore_patterns("trtllm-serve.yaml", "plan-alerts.env"))
    r = render(tmp_path / "k8s")
    assert r.returncode != 0 and "trtllm-serve.yaml" in r.stderr


def test_the_filled_overlay_renders_validates_and_holds_no_placeholder(filled, plan_dir):
    text, docs = filled
    assert {d["kind"] for d in docs} == {
        "ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "ScaledObject", "PrometheusRule",
        "ServiceMonitor", "NetworkPolicy",
    }  # fmt: skip
    assert deploy_tools(["validate", K8S_VERSION], docs) == []
    # nothing base brings for the engine build is applied: no claim, no build scripts, no serve.sh
    assert not kinds(docs, "PersistentVolumeClaim") and len(kinds(docs, "ConfigMap")) == 1
    for token in ("FROM_PLAN", "DRAFTER", "local-config", str(ROOT)):
        assert token not in text, token
    (cm,) = kinds(docs, "ConfigMap")
    served = yaml.safe_load(cm["data"]["trtllm-serve.yaml"])
    assert yaml_problems(served) == []
    assert served["speculative_config"]["speculative_model"] == "/checkpoints/drafter"
    planned = yaml.safe_load((plan_dir / "trtllm-serve.yaml").read_text())
    assert {k: v for k, v in served.items() if k != "speculative_config"} == {
        k: v for k, v in planned.items() if k != "speculative_config"
    }


def test_the_thresholds_are_the_plans(filled, plan_dir):
    _, docs = filled
    alerts = json.loads((plan_dir / "plan.json").read_text())["alerts"]
    rules = {r.get("alert") or r["record"]: r for r in one(docs, "PrometheusRule")["spec"]["groups"][0]["rules"]}
    assert rules["DFlashPlanTauBelowPlan"]["expr"].split(" < ")[1].strip() == str(alerts["tau_floor"])
    assert rules["DFlashBatchAbovePlan"]["expr"].split(" > ")[1].strip() == str(alerts["batch_above"])
    triggers = {t["name"]: t for t in one(docs, "ScaledObject")["spec"]["triggers"]}
    assert triggers["running-requests"]["metadata"]["threshold"] == str(alerts["batch_above"])
    # another plan's numbers reach the render: nothing is a constant of the YAML
    (plan_dir.parent / "other").mkdir(exist_ok=True)
    other = plan_dir.parent / "other"
    for f in ("trtllm-serve.yaml", "plan.json"):
        shutil.copy(plan_dir / f, other / f)
    doc = json.loads((other / "plan.json").read_text())
    doc["alerts"] = {"tau_floor": 2.25, "batch_above": 96}
    (other / "plan.json").write_text(json.dumps(doc))
    k8s = plan_dir.parent / "k8s-other"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("trtllm-serve.yaml", "plan-alerts.env"))
    assert main(["plan", "overlay", "--plan", str(other), "--out", str(k8s / OVERLAY)]) == 0
    again = [d for d in yaml.safe_load_all(render(k8s).stdout) if d]
    exprs = " ".join(r["expr"] for r in one(again, "PrometheusRule")["spec"]["groups"][0]["rules"])
    assert "< 2.25" in exprs and "> 96" in exprs
    assert {t["metadata"]["threshold"] for t in one(again, "ScaledObject")["spec"]["triggers"]} == {"4", "96"}


def test_the_rules_every_overlay_is_held_to(filled):
    """test_deploy.py's cluster rules on this render: references resolve, scraping reaches the server pods and the
    rules select its job, no replicas under KEDA and the release label, GPU requests and toleration, empty queries
    are errors with a holding fallback, the budget, least privilege, the network policies."""
    rendered = {OVERLAY: filled[1]}
    for rule in (references, scraping, keda_and_release, gpu_requests, empty_is_error, budget, least_privilege):
        rule(rendered)
    policies(rendered)
    exprs, _ = queries(filled[1])
    names = parsed_names(exprs)
    vllm = {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"}
    assert vllm | {"vllm:num_requests_running", "vllm:num_requests_waiting", "up"} <= names


def _containers(docs):
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec, {c["name"]: c for c in spec["containers"]}


def test_flags_probes_and_the_one_reader_of_trtllm_serves_metrics(filled):
    _, docs = filled
    spec, by_name = _containers(docs)
    serve, side = by_name["trtllm-serve"], by_name["serve-metrics"]
    cmd = serve["command"]
    assert cmd[:2] == ["trtllm-serve", "/checkpoints/target"]
    flags = dict(zip(cmd[2::2], cmd[3::2]))
    assert flags["--backend"] == "pytorch" and flags["--host"] == "0.0.0.0"
    assert flags["--extra_llm_api_options"] == "/config/trtllm-serve.yaml"
    assert int(flags["--tp_size"]) == int(serve["resources"]["limits"]["nvidia.com/gpu"])  # tp inside the pod
    port = {p["name"]: p["containerPort"] for p in serve["ports"]}["http"]
    assert int(flags["--port"]) == port
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert serve[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # the sidecar reads trtllm-serve over the loopback, and the monitor scrapes the sidecar, never port http
    assert f"http://127.0.0.1:{port}" in side["command"] and side["command"][:3] == ["dflash-trt", "plan", "check"]
    sm = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert [e["port"] for e in sm] == ["metrics"] and sm[0]["authorization"]["credentials"]["name"] == "dflash-api-key"
    assert "--api-key-file" in side["command"]
    assert {m["name"] for m in serve["volumeMounts"]} & {"api-key"} == set()  # trtllm-serve has no key option
    # the config comes from the generated ConfigMap, mounted where the flag points
    (cm,) = kinds(docs, "ConfigMap")
    (vol,) = [v for v in spec["volumes"] if v["name"] == "config"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    assert any(m["mountPath"] == "/config" and m["name"] == "config" for m in serve["volumeMounts"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stand_in(argv, env=None):
    import os

    return subprocess.run(
        [sys.executable, str(STAND_IN), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "change, named",
    [
        ({"max_num_seqs": 8}, "max_num_seqs: not a TorchLlmArgs field"),
        ({"enable_iter_perf_stats": "yes"}, "enable_iter_perf_stats"),
        ({"speculative_config": {"decoding_type": "Eagle3", "max_draft_len": 7}}, "decoding_type"),
        (
            {"speculative_config": {"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "DRAFTER"}},
            "'DRAFTER' is not a drafter folder",
        ),
    ],  # fmt: skip
)
def test_the_stand_in_refuses_what_llm_args_would(tmp_path, change, named):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"enable_iter_perf_stats": True, **change}))
    r = _stand_in([str(DEMO_TARGET), "--backend", "pytorch", "--port", "0", "--extra_llm_api_options", str(cfg)])
    assert r.returncode == 1 and named in r.stderr, r.stderr
    bad_flag = _stand_in([str(DEMO_TARGET), "--max_num_seqs", "8"])
    assert bad_flag.returncode == 2 and "max_num_seqs" in bad_flag.stderr  # click: no such option


def test_the_pod_reaches_ready_with_the_stand_in_and_the_exporter_reads_it(
    filled, tmp_path, plan_dir, capsys, monkeypatch
):
    """The rendered pod's two commands, as a pod runner would start them: trtllm-serve's with the stand-in in its
    place (paths under /checkpoints and /config mapped to the demo pair and the ConfigMap's file), the sidecar's
    as written. Ready on /health, completions served, the sidecar's series what the stand-in drafted, and
    `plan check --engine vllm` against the sidecar reaches a verdict (exit 0 or 3, never an error)."""
    _, docs = filled
    _, by_name = _containers(docs)
    (cm,) = kinds(docs, "ConfigMap")
    served = yaml.safe_load(cm["data"]["trtllm-serve.yaml"])
    served["speculative_config"]["speculative_model"] = str(DEMO_DRAFTER)  # the volume's mount, here
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "trtllm-serve.yaml").write_text(yaml.safe_dump(served))
    key = tmp_path / "key"
    key.write_text("k3y\n")
    http, metrics_port = _free_port(), _free_port()
    mapping = {
        "/checkpoints/target": str(DEMO_TARGET),
        "/config/trtllm-serve.yaml": str(tmp_path / "config" / "trtllm-serve.yaml"),
        "8000": str(http),
        "0.0.0.0": "127.0.0.1",
        "http://127.0.0.1:8000": f"http://127.0.0.1:{http}",
        "9400": str(metrics_port),
        "/etc/dflash-api-key/key": str(key),
    }
    serve_cmd = [sys.executable, str(STAND_IN)] + [mapping.get(a, a) for a in by_name["trtllm-serve"]["command"][1:]]
    side_cmd = [sys.executable, "-m", "dflash_trt.cli"] + [
        mapping.get(a, a) for a in by_name["serve-metrics"]["command"][1:]
    ]
    side_cmd += ["--host", "127.0.0.1"]
    procs = [subprocess.Popen(serve_cmd), subprocess.Popen(side_cmd, stdout=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while True:  # the startup probe: /health until 200
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "never ready"
            time.sleep(0.1)
        auth = {"Authorization": "Bearer k3y"}
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{metrics_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the sidecar never answered"
            time.sleep(0.1)
        for _ in range(6):
            r = httpx.post(
                f"http://127.0.0.1:{http}/v1/completions", json={"prompt": "a", "max_tokens": 32}, timeout=30
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
        # the stand-in drafts 7 and accepts floor(0.5 * 7) = 3 a round: 32 tokens = 8 rounds of 4 per request
        got: dict = {}
        while got.get("vllm:spec_decode_num_drafts_total") != 48 and time.monotonic() < deadline:
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", headers=auth, timeout=10).text
            got = {s.name: s.value for f in _families(text) for s in f.samples}
            time.sleep(0.1)
        assert got["vllm:spec_decode_num_drafts_total"] == 48
        assert got["vllm:spec_decode_num_draft_tokens_total"] == 48 * 7
        assert got["vllm:spec_decode_num_accepted_tokens_total"] == 48 * 3
        assert got["vllm:generation_tokens_total"] == 6 * 32 and got["vllm:num_requests_running"] >= 0
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).status_code == 401
        # `plan check` against the sidecar, as against vLLM, while requests keep coming
        stop = threading.Event()

        def load():
            while not stop.is_set():
                httpx.post(f"http://127.0.0.1:{http}/v1/completions", json={"max_tokens": 16}, timeout=30)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        side = f"http://127.0.0.1:{metrics_port}"
        # the window is 8 drafts served, not its nominal second: one second of a loaded machine may hold none
        served = after_served(side, "vllm:spec_decode_num_drafts_total", 8, headers=auth)
        monkeypatch.setattr(metrics, "scrape", functools.partial(metrics.scrape, sleep=served))
        args = ["plan", "check", "--engine", "vllm", "--url", side, "--plan", str(plan_dir), "--window", "1"]
        try:
            assert main(args) == 1 and "Unauthorized" in capsys.readouterr().err  # the key is asked for
            status = main([*args, "--api-key-file", str(key), "--save", str(tmp_path / "seen.json")])
        finally:
            stop.set()
            loader.join(30)
        out = capsys.readouterr().out
        assert status in (0, 3), out
        seen = json.loads((tmp_path / "seen.json").read_text())
        assert seen["tau"] == pytest.approx(4.0) and seen["mean_drafts"] == pytest.approx(7.0)  # 1 + 3 of 7
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    # SIGTERM: the stand-in drains, then raises the signal again at its default disposition, as uvicorn does
    assert procs[0].returncode == -signal.SIGTERM


def _families(text):
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def test_plan_overlay_refuses_what_trtllm_serve_would_and_a_relative_drafter_path(plan_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(plan_dir, bad)
    (bad / "trtllm-serve.yaml").write_text((plan_dir / "trtllm-serve.yaml").read_text() + "max_num_seqs: 8\n")
    out = tmp_path / "out"
    out.mkdir()
    assert main(["plan", "overlay", "--plan", str(bad), "--out", str(out)]) == 1
    assert "max_num_seqs: not a TorchLlmArgs field" in capsys.readouterr().err and not list(out.iterdir())
    args = ["plan", "overlay", "--plan", str(plan_dir), "--out", str(out), "--drafter-path", "DRAFTER"]
    assert main(args) == 1 and "absolute path" in capsys.readouterr().err


SBATCH = ROOT / "deploy" / "slurm" / "trtllm-serve.sbatch"


def _run_sbatch(tmp_path, data, **env):
    """The sbatch script under bash with FAKE `srun` / `scontrol` (no Slurm here) that record each call's argv."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls.jsonl"
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(
            "#!/usr/bin/env python3\nimport json, sys\n"
            f"open({str(calls)!r}, 'a').write(json.dumps([{name!r}, *sys.argv[1:]]) + '\\n')\n"
            "if sys.argv[1:3] == ['show', 'hostnames']: print('node-a'); print('node-b')\n"
        )
        (bin_dir / name).chmod(0o755)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "node-[a-b]"}
    r = subprocess.run(
        ["bash", str(SBATCH)],
        env={**base, "TRTLLM_IMAGE": "nvcr.io#nvidia/tensorrt-llm/release:1.3.0rc26", "DFLASH_DATA": str(data), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    got = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return r, got


def test_the_sbatch_command_lines_parse_as_trtllm_serve_and_the_exporter_take_them(tmp_path, plan_dir):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(DEMO_TARGET, data / "target")
    shutil.copytree(DEMO_DRAFTER, data / "drafter")
    r, _ = _run_sbatch(tmp_path, data)
    assert r.returncode == 2 and "plan overlay" in r.stderr  # unfilled: refused, nothing started
    args = ["plan", "overlay", "--plan", str(plan_dir), "--out", str(data), "--drafter-path", str(data / "drafter")]
    assert main(args) == 0
    key = data / "key"
    key.write_text("k\n")
    r, calls = _run_sbatch(tmp_path, data, DFLASH_IMAGE="dflash-trt.sqsh", DFLASH_TRT_API_KEY_FILE=str(key))
    assert r.returncode == 0, r.stderr
    sruns = [c[1:] for c in calls if c[0] == "srun"]
    serve = next(c for c in sruns if "trtllm-llmapi-launch" in c)
    assert "--mpi=pmix" in serve and f"--container-mounts={data}:{data}:ro" in serve
    argv = serve[serve.index("trtllm-llmapi-launch") + 2 :]  # after `trtllm-llmapi-launch trtllm-serve`
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_trtllm_serve import load_args, parser

    parsed = parser().parse_args(argv)  # the options trtllm-serve's click command defines (serve.py at 00209af1)
    assert parsed.tensor_parallel_size == 8 and parsed.backend == "pytorch" and parsed.host == "0.0.0.0"
    assert load_args(parsed)["speculative_config"]["speculative_model"] == str(data / "drafter")
    side = next(c for c in sruns if "--serve-metrics" in c)
    from dflash_trt.cli.main import build_parser

    ns = build_parser().parse_args(side[side.index("dflash-trt") + 1 :])
    assert ns.engine == "trtllm" and ns.url == "http://node-a:8000" and ns.serve_metrics == 9400
    assert ns.api_key_file == key and "--nodelist=node-a" in side and "--overlap" in side
    # a drafter folder the nodes do not have is refused before anything starts
    yaml_file = data / "trtllm-serve.yaml"
    yaml_file.write_text(yaml_file.read_text().replace(str(data / "drafter"), "/nowhere/drafter"))
    (tmp_path / "again").mkdir()
    r, _ = _run_sbatch(tmp_path / "again", data)
    assert r.returncode == 2 and "/nowhere/drafter" in r.stderr


MULTI = "trtllm-serve-multi-node"


@pytest.fixture(scope="module")
def multi(filled, k8s_copy):
    """The LeaderWorkerSet variant, over the one-node overlay `filled` filled."""
    r = render(k8s_copy, MULTI)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_the_multi_node_variant_renders_validates_and_keeps_the_rules(multi, filled):
    assert deploy_tools(["validate", K8S_VERSION], multi) == []
    assert not kinds(multi, "Deployment") and len(kinds(multi, "LeaderWorkerSet")) == 1
    rendered = {MULTI: multi}
    for rule in (references, scraping, keda_and_release, gpu_requests, empty_is_error, budget):
        rule(rendered)
    policies(rendered)
    # the one-node overlay's config, thresholds and monitor carry over unchanged
    for kind in ("PrometheusRule", "ServiceMonitor", "ConfigMap"):
        names = {d["metadata"]["name"] for d in kinds(filled[1], kind)}
        assert names <= {d["metadata"]["name"] for d in kinds(multi, kind)}, kind
    assert one(multi, "PrometheusRule") == one(filled[1], "PrometheusRule")
    # least privilege as deploy/k8s/multi-node's groups: root for IPC_LOCK and sshd only, keys split by role; the
    # exporter a non-root user with no capability
    lwt = one(multi, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    for role, key, want in (
        ("leader", "leaderTemplate", "id_ed25519"),
        ("worker", "workerTemplate", "authorized_keys"),
    ):
        spec = lwt[key]["spec"]
        assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsUser"] == 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (ssh,) = [v["secret"] for v in spec["volumes"] if v["name"] == "ssh"]
        assert ssh["items"] == [{"key": want, "path": want}], role
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
            if c["name"] == "serve-metrics":
                assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] and sc["runAsUser"] == 10001
            else:
                assert sc["capabilities"] == {"add": ["IPC_LOCK"]}, c["name"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = {c["name"]: c for c in lwt["leaderTemplate"]["spec"]["containers"]}["leader"]
    env = {e["name"]: e.get("value") for e in leader["env"]}
    assert int(env["DFLASH_GPUS_PER_POD"]) == int(leader["resources"]["limits"]["nvidia.com/gpu"])


def test_the_groups_image_is_the_release_with_sshd(multi, filled):
    """The workers run sshd (trtllm-group.sh) and NVIDIA's release image is not known to ship one: every
    trtllm-serve container of the group runs the image ./Dockerfile builds, FROM the release tag the one-node
    overlay runs, installing openssh-server and sshd's /run/sshd."""
    release, tag = _containers(filled[1])[1]["trtllm-serve"]["image"].rsplit(":", 1)
    dockerfile = (ROOT / "deploy/k8s" / MULTI / "Dockerfile").read_text()
    assert re.search(rf"^ARG TRTLLM_RELEASE={re.escape(tag)}$", dockerfile, re.M)
    assert re.search(rf"^FROM {re.escape(release)}:\$\{{TRTLLM_RELEASE\}}$", dockerfile, re.M)
    assert "openssh-server" in dockerfile and "mkdir -p /run/sshd" in dockerfile
    lwt = one(multi, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    group = [c for key in ("leaderTemplate", "workerTemplate") for c in lwt[key]["spec"]["containers"]]
    images = {c["image"] for c in group if c["name"] != "serve-metrics"}
    assert images == {f"dflash-trtllm-group:{tag}"}, images


def test_the_groups_ports_admit_the_leaderworkersets_own_pods_only(multi):
    """As deploy/k8s/multi-node's (issue 60): any pod of the namespace can be created with
    app.kubernetes.io/name=dflash-trt, so the workers' sshd and the ranks' ports, and the leaders' ports beyond HTTP,
    admit only what the LWS controller labels its own pods with."""
    lws = one(multi, "LeaderWorkerSet")["metadata"]["name"]
    leader = {
        "app.kubernetes.io/name": "dflash-trt",
        "app.kubernetes.io/component": "server",
        LWS_NAME_LABEL: lws,
        LWS_WORKER_INDEX_LABEL: "0",
    }
    worker = leader | {"app.kubernetes.io/component": "worker", LWS_WORKER_INDEX_LABEL: "1"}
    anyone = {"app.kubernetes.io/name": "dflash-trt", "app.kubernetes.io/component": "server"}
    policy = {p["metadata"]["name"]: p for p in kinds(multi, "NetworkPolicy")}
    workers, servers = policy["dflash-trt-workers"], policy["dflash-trt-servers"]
    assert _admits(workers, leader, "ssh") and _admits(workers, worker, "29500")  # the launcher, the ranks
    assert not _admits(workers, anyone, "ssh") and not _admits(workers, anyone, "29500")
    assert _admits(servers, worker, "29500") and not _admits(servers, anyone, "29500")


def _exporter_namespaces(docs) -> list[dict]:
    (policy,) = [p for p in kinds(docs, "NetworkPolicy") if p["metadata"]["name"] == "dflash-trt-exporter"]
    return [f["namespaceSelector"]["matchLabels"] for r in policy["spec"]["ingress"] for f in r.get("from", [])]


def test_the_prometheus_namespace_is_the_cluster_settings(filled, multi, k8s_copy, tmp_path):
    """Both trtllm-serve overlays take the Prometheus namespace (the autoscaler's serverAddress, the exporter port's
    NetworkPolicy) from components/settings/settings.env, as every other overlay does, and no render names
    `monitoring` once that file names another namespace (issue 60's rule)."""
    for docs in (filled[1], multi):
        assert _exporter_namespaces(docs) == [{"kubernetes.io/metadata.name": "monitoring"}]  # the default
        assert not [d for d in docs if d["metadata"]["name"] == "dflash-settings"]  # local to the build
    k8s = tmp_path / "k8s"
    shutil.copytree(k8s_copy, k8s)  # filled: its trtllm-serve.yaml and plan-alerts.env come along
    env = k8s / "components" / "settings" / "settings.env"
    lines = env.read_text().splitlines()
    env.write_text(
        "\n".join("prometheus-namespace=obs" if ln.startswith("prometheus-namespace=") else ln for ln in lines)
    )
    for overlay in (OVERLAY, MULTI):
        r = render(k8s, overlay)
        assert r.returncode == 0, r.stderr
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        assert _exporter_namespaces(docs) == [{"kubernetes.io/metadata.name": "obs"}], overlay
        (so,) = kinds(docs, "ScaledObject")
        assert {t["metadata"]["serverAddress"] for t in so["spec"]["triggers"]} == {
            "http://prometheus-operated.obs.svc:9090"
        }, overlay
        # no namespace named `monitoring` left (the API group monitoring.coreos.com is not one)
        assert not re.search(r"(?<![\w.])monitoring(?![\w.])", r.stdout), overlay


def test_the_group_script_starts_one_world_whose_command_line_trtllm_serve_takes(tmp_path):
    """trtllm-group.sh as a leader with FAKE ssh and mpirun on PATH (no cluster here) that record their argv: the
    world is size x GPUs, over every pod of the group, and what each rank runs parses as trtllm-serve's options."""
    import os

    script = K8S / MULTI / "trtllm-group.sh"
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    (tmp_path / "mpi" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    recorder = (
        "#!/usr/bin/env python3\nimport json, sys, os\n"
        f"open({str(calls)!r}, 'a').write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n"
    )
    for path in (bin_dir / "ssh", tmp_path / "mpi" / "bin" / "mpirun"):
        path.write_text(recorder)
        path.chmod(0o755)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "id_ed25519").write_text("key\n")
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "TRTLLM_ROLE": "leader",
        "DFLASH_GPUS_PER_POD": "4",
        "LWS_GROUP_SIZE": "3",
        "LWS_LEADER_ADDRESS": "dflash-trt-group-0.dflash-trt-group.ns",
        "DFLASH_SSH_SECRET": str(secret),
        "DFLASH_SSHD_DIR": str(tmp_path / "sshd"),
        "DFLASH_MPI_PREFIX": str(tmp_path / "mpi"),
        "NCCL_SOCKET_IFNAME": "eth0",
    }
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [c[-2] for c in got if c[0] == "ssh"] == [
        "dflash-trt-group-0-1.dflash-trt-group.ns",
        "dflash-trt-group-0-2.dflash-trt-group.ns",
    ]
    (mpirun,) = [c[1:] for c in got if c[0] == "mpirun"]
    assert mpirun[mpirun.index("-n") + 1] == "12" and "NCCL_SOCKET_IFNAME" in mpirun
    # only what is set is passed on: `-x` of an unset name makes mpirun warn at every start
    exported = {mpirun[i + 1] for i, a in enumerate(mpirun) if a == "-x"}
    assert {"PATH", "NCCL_SOCKET_IFNAME"} <= exported and not exported & {"PYTHONPATH", "HF_HUB_OFFLINE"}
    hosts = (tmp_path / "sshd" / "hostfile").read_text().split("\n")
    assert [h.split()[1] for h in hosts if h] == ["slots=4"] * 3
    rank = mpirun[mpirun.index("trtllm-llmapi-launch") + 1 :]
    # rank 0's command: the script's `serve`, which records trtllm-serve's pid for the preStop and execs it
    assert rank[:3] == ["bash", str(script), "serve"]
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_trtllm_serve import parser

    parsed = parser().parse_args(rank[3:])
    assert parsed.model == "/checkpoints/target" and parsed.tensor_parallel_size == 12
    assert parsed.extra_llm_api_options == "/config/trtllm-serve.yaml" and parsed.host == "0.0.0.0"
    calls.unlink()
    r = subprocess.run(["bash", str(script)], env=env | {"PYTHONPATH": "/opt/x"}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (mpirun,) = [c[1:] for c in map(json.loads, calls.read_text().splitlines()) if c[0] == "mpirun"]
    assert "PYTHONPATH" in {mpirun[i + 1] for i, a in enumerate(mpirun) if a == "-x"}
    bad = subprocess.run(["bash", str(script)], env={**env, "TRTLLM_ROLE": "x"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "leader or worker" in bad.stderr


def test_the_leaders_prestop_returns_once_mpirun_has_ended_the_world(tmp_path):
    """trtllm-group.sh prestop as the leader: SIGTERM to trtllm-serve alone (its recorded pid), then wait while it
    drains and while mpirun, the container's first process, still ends the world: the kubelet's SIGTERM follows the
    hook, and Open MPI 4's mpirun aborts a job it is still ending on one (exit 1 after a complete drain)."""
    import signal

    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "comm").write_text("mpirun\n")
    pid_file = tmp_path / "trtllm-serve.pid"
    serve = subprocess.Popen(["bash", "-c", f'sleep 300 & echo $! > "{pid_file}"; wait $!'])
    env = {
        "PATH": "/usr/bin:/bin",
        "TRTLLM_ROLE": "leader",
        "TRTLLM_PID_FILE": str(pid_file),
        "PRESTOP_DELAY_S": "0",
        "DFLASH_PROC": str(proc),
    }
    try:
        while not pid_file.exists() or not pid_file.read_text().strip():
            time.sleep(0.05)
        hook = subprocess.Popen(["bash", str(K8S / MULTI / "trtllm-group.sh"), "prestop"], env=env)
        assert serve.wait(10) == 128 + signal.SIGTERM  # trtllm-serve drained and gone
        time.sleep(2.5)
        assert hook.poll() is None  # mpirun still ending the world
        (proc / "1" / "comm").unlink()
        (proc / "1").rmdir()
        assert hook.wait(10) == 0
    finally:
        serve.kill()
        serve.wait()
