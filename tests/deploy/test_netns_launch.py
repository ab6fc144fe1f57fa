"""The multi-node launch of a LeaderWorkerSet group, for real, on one machine: two network namespaces joined by a veth
pair, each with its own address, hostname (a UTS namespace), /etc/hosts and /etc/resolv.conf (`ip netns exec` binds
/etc/netns/NS/ over /etc), as two pods of a group are. The pods' own launch script, deploy/k8s/base/scripts/serve.sh,
runs in both, with nothing added to the `mpirun` line it builds (no DFLASH_MPI_ARGS):

- names resolve as cluster DNS resolves them: a real resolver (dnsmasq) per namespace holds the headless Service's
  records under `svc.cluster.local`, resolv.conf has the pod's search domains and ndots:5, and /etc/hosts only the
  pod's own name (what the kubelet writes): LWS_LEADER_ADDRESS (`<lws>-<group>.<lws>.<namespace>`) and the worker's
  name are found through the search domains, as in a cluster;
- Open MPI is a copy of Debian's under a prefix (tests/deploy/relocate_ompi.sh; NVIDIA's images keep it in
  /opt/hpcx/ompi) on the leader pod's PATH but not on the PATH of the worker's ssh session, so the worker finds orted
  only through the prefix serve.sh gives mpirun (--prefix, and its absolute path, which Open MPI's orterun(1) reads as
  the same --prefix): a bare `mpirun` there fails the launch;
- the worker role starts a real sshd (Debian's openssh-server) from the keys of a Secret-like folder;
- the leader role waits for it over ssh, writes the hostfile from the LWS variables and starts `mpirun` for two ranks
  per pod (tp 4, DFLASH_GPUS_PER_POD 2) across the namespaces; the ranks run tests/mpi_rank.py, the `serve` command
  on the labelled FAKE TensorRT-LLM executor, which gives each rank the GPU TensorRT-LLM 1.2's Executor gives it
  from the engine's gpus_per_node (rank % gpus_per_node, lowered to the node's GPUs where they are fewer than
  min(world size, gpus_per_node): worldConfig.cpp WorldConfig::mpi) on fake nodes of 2 GPUs: an engine that
  records 1 would put both ranks of a pod on GPU 0, which dflash-trt's own check refuses on every rank before the
  executor is built (issue 54, point 1; the loopback case is tests/deploy/test_mpi_serve.py's).

Checked: every rank runs where the hostfile maps it, on its own GPU, started by the relocated Open MPI (the worker's
ranks by its orted); rank 0 serves HTTP in the leader namespace and answers, the worker's ranks follow every
iteration; the pods' prestop.sh drains rank 0 and every rank ends with 0; a killed worker rank makes /ready fail and
the job end non-zero. Needs root and `ip netns` (CI has both); `make sshd-env mpi-env`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mpi_engines import fake_trtllm_engines, json_events

from dflash_trt.server.process import listening_port

ROOT = Path(__file__).resolve().parents[2]
SERVE_SH = ROOT / "deploy" / "k8s" / "base" / "scripts" / "serve.sh"
PRESTOP_SH = ROOT / "deploy" / "k8s" / "base" / "scripts" / "prestop.sh"
TAG = f"dfl{os.getpid() % 100000}"
NS = {"leader": f"{TAG}l", "worker": f"{TAG}w"}
SUBNET = "10.241.17"
ADDR = {"leader": f"{SUBNET}.1", "worker": f"{SUBNET}.2"}
# what LWS gives the pods of group 0 of the LeaderWorkerSet `dflash-trt-group` in namespace `ns`
HOST = {"leader": "dflash-trt-group-0.dflash-trt-group.ns", "worker": "dflash-trt-group-0-1.dflash-trt-group.ns"}
# cluster DNS: the pod's resolv.conf (Kubernetes' ClusterFirst policy: <namespace>.svc.<domain>, svc.<domain>,
# <domain>; ndots:5) and the records of the headless Service under svc.cluster.local
SEARCH = "ns.svc.cluster.local svc.cluster.local cluster.local"
FQDN = {role: f"{HOST[role]}.svc.cluster.local" for role in HOST}
MPI_PREFIX = Path("/opt/dflash-test-ompi")  # the Makefile's MPI_TEST_PREFIX (tests/deploy/relocate_ompi.sh)
# the group: 2 pods x 2 GPUs, one tp-4 engine recording 2 GPUs per node (engines.toml, as the manifests' ConfigMap)
GPUS_PER_POD = 2
GROUP_TOML = f"tp = {2 * GPUS_PER_POD}\ngpus_per_node = {GPUS_PER_POD}\n"
CLONE_NEWNET = 0x40000000

pytestmark = pytest.mark.timeout(240)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on this machine"
    probe = f"{TAG}probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` is not available here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


DNS: list[subprocess.Popen] = []  # the resolvers: they outlive each group, as cluster DNS outlives the pods


def _kill_namespace_processes(everything: bool = False) -> None:
    """SIGKILL every process inside this test's namespaces (`ip netns pids`: only what this test started), the
    resolvers too only with `everything`."""
    for ns in NS.values():
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in map(int, r.stdout.split()):
            if not everything and pid in {d.pid for d in DNS}:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _tools() -> None:
    for path, target in (
        ("/usr/sbin/sshd", "sshd-env"),
        ("/usr/sbin/dnsmasq", "sshd-env"),
        (MPI_PREFIX / "bin" / "orted", "mpi-env"),
    ):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} missing: run `make {target}` (make test does)")
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        assert not Path(folder).resolve().is_relative_to(MPI_PREFIX), f"{MPI_PREFIX} must be on no PATH: {folder}"


def _pod_files(role: str, ns: str) -> None:
    """What the kubelet gives a pod: /etc/hosts with its own name only, resolv.conf pointing at cluster DNS."""
    folder = Path("/etc/netns") / ns  # `ip netns exec` binds each file over /etc/<name>
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text(f"127.0.0.1 localhost\n{ADDR[role]} {FQDN[role]} {HOST[role].split('.')[0]}\n")
    (folder / "resolv.conf").write_text(f"nameserver 127.0.0.1\nsearch {SEARCH}\noptions ndots:5\n")


def _start_dns(ns: str, log: Path) -> None:
    """A real resolver in namespace `ns` on 127.0.0.1:53 holding the headless Service's records: names under
    cluster.local it does not hold answer NXDOMAIN (the search list then tries the next domain), nothing is
    forwarded. Its processes end with the namespace's (_kill_namespace_processes)."""
    records = [f"--host-record={FQDN[r]},{ADDR[r]}" for r in NS]
    cmd = ["ip", "netns", "exec", ns, "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv"]
    cmd += ["--no-hosts", "--listen-address=127.0.0.1", "--bind-interfaces", "--local=/cluster.local/"]
    cmd += [f"--pid-file={log.with_suffix('.pid')}", "--log-queries", f"--log-facility={log}", *records]
    dns = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    DNS.append(dns)  # `ip netns exec` execs dnsmasq in its own process
    end = time.monotonic() + 20
    while True:  # the leader's short LWS name, through the search list
        r = subprocess.run(
            ["ip", "netns", "exec", ns, "getent", "hosts", HOST["worker"]], capture_output=True, text=True
        )
        if r.returncode == 0:
            assert r.stdout.split()[0] == ADDR["worker"], r.stdout
            return
        assert time.monotonic() < end, f"dnsmasq in {ns} does not answer: {log.read_text() if log.exists() else ''}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def netns(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    _tools()
    made: list[str] = []
    logs = tmp_path_factory.mktemp("dns")
    try:
        for role, ns in NS.items():
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _pod_files(role, ns)
        _run(
            "ip",
            "link",
            "add",
            f"{TAG}a",
            "netns",
            NS["leader"],
            "type",
            "veth",
            "peer",
            f"{TAG}b",
            "netns",
            NS["worker"],
        )
        for role, dev in (("leader", f"{TAG}a"), ("worker", f"{TAG}b")):
            ip = ("ip", "netns", "exec", NS[role], "ip")
            _run(*ip, "addr", "add", f"{ADDR[role]}/24", "dev", dev)
            _run(*ip, "link", "set", dev, "up")
            _run(*ip, "link", "set", "lo", "up")
        for role, ns in NS.items():
            _start_dns(ns, logs / f"{role}.log")
        yield logs
    finally:
        _kill_namespace_processes(everything=True)
        for dns in DNS:
            dns.wait(30)
        DNS.clear()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # the veth pair goes with them
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    """The group's engines, built from GROUP_TOML by the project's own plan; fake nodes of GPUS_PER_POD GPUs."""
    return fake_trtllm_engines(tmp_path_factory.mktemp("netns-engines"), GROUP_TOML, node_gpus=GPUS_PER_POD)


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    """The dflash-mpi-ssh Secret as a pod mounts it: files behind symlinks, readable by all (defaultMode 0444)."""
    folder = tmp_path_factory.mktemp("secret")
    data = folder / "..data"
    data.mkdir()
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(data / "id_ed25519"))
    (data / "authorized_keys").write_text((data / "id_ed25519.pub").read_text())
    for name in ("id_ed25519", "authorized_keys"):
        (data / name).chmod(0o444)
        (folder / name).symlink_to(Path("..data") / name)
    return folder


def _in_netns(ns: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread living in network namespace `ns` (setns(2) moves only the calling thread): HTTP to the leader."""

    def enter() -> None:
        fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {ns}")
        finally:
            os.close(fd)

    return concurrent.futures.ThreadPoolExecutor(1, initializer=enter)


class Pod:
    """serve.sh in one namespace, with its own hostname (like a pod), in its own session; output in `log`."""

    def __init__(self, role: str, env: dict[str, str], log: Path):
        self.log = log
        hostname = HOST[role].split(".")[0]
        cmd = ["ip", "netns", "exec", NS[role], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [*cmd, hostname, "bash", str(SERVE_SH)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**env, "DFLASH_ROLE": role},
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class Group:
    """A worker pod (sshd) and a leader pod (mpirun across both namespaces) of one LeaderWorkerSet group."""

    def __init__(self, engines: Path, secret: Path, tmp: Path):
        (tmp / "engines.toml").write_text(GROUP_TOML)  # the ConfigMap serve.sh reads tp and gpus_per_node from
        self.run_dir, self.sshd = tmp / "run", {r: Path(f"/run/{TAG}-{r}-sshd") for r in NS}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "DFLASH_"))}
        common = {
            **base,
            "ENGINES_CONFIG": str(tmp / "engines.toml"),
            "DFLASH_SSH_SECRET": str(secret),
            "DFLASH_SSH_PORT": "2222",
        }
        self.http = _in_netns(NS["leader"])
        self.worker = Pod("worker", {**common, "DFLASH_SSHD_DIR": str(self.sshd["worker"])}, tmp / "worker.log")
        leader_env = {
            **common,
            # the image: Open MPI under a prefix on no PATH (as NVIDIA's images set OPAL_PREFIX=/opt/hpcx/ompi and
            # its lib folder on LD_LIBRARY_PATH; the Dockerfile records the prefix in /etc/dflash-mpi-prefix)
            "DFLASH_MPI_PREFIX": str(MPI_PREFIX),
            "OPAL_PREFIX": str(MPI_PREFIX),
            "LD_LIBRARY_PATH": str(MPI_PREFIX / "lib"),
            # on the pod's PATH (the image's ENV), not on the PATH of the worker's ssh session (sshd's default)
            "PATH": os.pathsep.join((str(MPI_PREFIX / "bin"), os.environ.get("PATH", ""))),
            # the pod spec (deploy/k8s/multi-node/leaderworkerset.yaml) and what LWS adds
            "DFLASH_SSHD_DIR": str(self.sshd["leader"]),
            "LWS_LEADER_ADDRESS": HOST["leader"],
            "LWS_GROUP_SIZE": "2",
            "DFLASH_GPUS_PER_POD": str(GPUS_PER_POD),
            "DFLASH_ENGINES": str(engines),
            "DFLASH_RUN_DIR": str(self.run_dir),
            # the test's: its rank wrapper, one thread a rank, a free port, a shorter wait for the worker
            "DFLASH_SERVE_EXE": f"{sys.executable} {ROOT / 'tests' / 'mpi_rank.py'}",
            "DFLASH_SERVE_ARGS": "--threads 1 --no-adaptive",
            "PORT": "0",
            "WORKER_WAIT_S": "60",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        }
        self.leader = Pod("leader", leader_env, tmp / "leader.log")
        try:
            self.url = self._wait_listening()
        except BaseException:
            self.close()  # the fixture never gets the group: end its processes here
            raise

    def events(self, name: str) -> list[dict]:
        return json_events(self.leader.text(), name)

    def get(self, path: str) -> httpx.Response:
        return self.http.submit(httpx.get, self.url + path, timeout=10).result()

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.http.submit(httpx.post, self.url + path, json=body, timeout=60).result()

    def _wait_listening(self, timeout: float = 120) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.leader.proc.poll() is not None:
                raise AssertionError(f"the leader exited with {self.leader.proc.returncode}:\n{self.logs()}")
            port = listening_port(self.leader.text())
            if port is not None:
                return f"http://{ADDR['leader']}:{port}"
            time.sleep(0.2)
        raise AssertionError(f"rank 0 never listened:\n{self.logs()}")

    def logs(self) -> str:
        return f"--- leader\n{self.leader.text()[-4000:]}\n--- worker\n{self.worker.text()[-2000:]}"

    def close(self) -> None:
        self.leader.stop()
        self.worker.stop()
        _kill_namespace_processes()  # what sshd started for mpirun (orted, ranks) lives in sessions of its own
        self.http.shutdown(wait=False)
        for folder in self.sshd.values():
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def group(netns, engines, secret, tmp_path):
    g = None
    try:
        g = Group(engines, secret, tmp_path)
        yield g
    finally:
        if g is not None:
            g.close()


def test_leader_and_worker_namespaces_serve_and_drain_together(netns, group):
    assert group.get("/ready").status_code == 200
    got = group.post("/generate", {"input_ids": [5, 6, 7], "max_tokens": 9})
    assert got.status_code == 200 and len(got.json()["token_ids"]) == 9, group.logs()
    ranks = {e["rank"]: e for e in group.events("fake_rank")}
    assert sorted(ranks) == [0, 1, 2, 3]
    leader, worker = (HOST[r].split(".")[0] for r in ("leader", "worker"))
    # two ranks per pod, in the hostfile's order: ranks 2 and 3 really ran in the worker's namespace
    assert {r: e["host"] for r, e in ranks.items()} == {0: leader, 1: leader, 2: worker, 3: worker}
    # each on its own GPU of its node, by the Executor's rule from the engine's gpus_per_node (2, the pod's)
    devices = {e["rank"]: (e["host"], e["device"]) for e in group.events("fake_rank_device")}
    assert devices == {0: (leader, 0), 1: (leader, 1), 2: (worker, 0), 3: (worker, 1)}
    # started by the relocated Open MPI: mpirun's own ranks by mpirun, the worker's by the orted its ssh session ran
    # from the prefix (on no PATH: serve.sh's --prefix found it), every rank on that Open MPI's libmpi
    daemons = {r: e["daemon"] for r, e in ranks.items()}
    orterun, orted = str(MPI_PREFIX / "bin" / "orterun"), str(MPI_PREFIX / "bin" / "orted")
    assert daemons == {0: orterun, 1: orterun, 2: orted, 3: orted}
    assert {e["libmpi"] for e in ranks.values()} == {str(MPI_PREFIX / "lib" / "libmpi.so.40")}
    # the worker's name came from the resolver, through the search list (the pods' hosts files hold only their own)
    assert f"query[A] {FQDN['worker']}" in (netns / "leader.log").read_text()
    pid_file = group.run_dir / "serve.pid"
    assert int(pid_file.read_text()) == ranks[0]["pid"]
    prestop = subprocess.run(
        ["bash", str(PRESTOP_SH)], env={**os.environ, "DFLASH_PID_FILE": str(pid_file)}, timeout=120
    )
    assert prestop.returncode == 0
    assert group.leader.proc.wait(60) == 0, group.logs()
    assert sorted((e["rank"], e["code"]) for e in group.events("fake_rank_exit")) == [(r, 0) for r in range(4)]
    (shutdown,) = group.events("fake_leader_shutdown")
    workers = group.events("fake_worker_shutdown")
    assert sorted(e["rank"] for e in workers) == [1, 2, 3]
    assert {e["iterations"] for e in workers} == {shutdown["iterations"]} and shutdown["iterations"] >= 9
    assert group.worker.proc.poll() is None  # the worker pod's sshd outlives the job, as the pod does


def test_a_killed_worker_rank_fails_ready_and_ends_the_job(group):
    assert group.post("/generate", {"input_ids": [1], "max_tokens": 3}).is_success
    (rank3,) = [e for e in group.events("fake_rank") if e["rank"] == 3]  # on the worker's node
    os.kill(rank3["pid"], signal.SIGKILL)
    try:  # the next request fails (500) or the connection drops as the job ends: either way, no hang
        group.post("/generate", {"input_ids": [1], "max_tokens": 3})
    except httpx.TransportError:
        pass
    end = time.monotonic() + 60
    while True:
        try:
            if group.get("/ready").status_code != 200:
                break
        except httpx.TransportError:  # rank 0 is gone: the probe fails too
            break
        assert time.monotonic() < end, "rank 0 stayed ready without its worker"
        time.sleep(0.1)
    code = group.leader.proc.wait(90)
    assert code != 0, group.logs()


def test_sshd_refuses_the_secret_mount_itself(netns, secret, tmp_path):
    """Negative control for the worker's copy: sshd with StrictModes on, pointed at the Secret-like folder itself
    (its files behind symlinks, in a world-writable tree like a pod's volume mounts), refuses the key that serve.sh's
    root-owned 0600 copy lets in (the leader's login in the tests above)."""
    _tools()
    folder = Path(f"/run/{TAG}-control-sshd")
    folder.mkdir(mode=0o700)
    log = tmp_path / "sshd.log"
    sshd = None
    try:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "host"))
        (folder / "sshd_config").write_text(
            f"Port 2223\nHostKey {folder / 'host'}\nAuthorizedKeysFile {secret / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes yes\nUsePAM no\n"
        )
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        with open(log, "wb") as f:
            sshd = subprocess.Popen(
                ["ip", "netns", "exec", NS["worker"], "/usr/sbin/sshd", "-D", "-e", "-f", str(folder / "sshd_config")],
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        key = folder / "id"
        shutil.copy(secret / "id_ed25519", key)
        key.chmod(0o600)
        ssh = ["ip", "netns", "exec", NS["leader"], "ssh", "-p", "2223", "-i", str(key), "-o", "BatchMode=yes"]
        ssh += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5"]
        end = time.monotonic() + 20
        while True:
            r = subprocess.run([*ssh, ADDR["worker"], "true"], capture_output=True, text=True, timeout=30)
            if "Connection refused" not in r.stderr or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
        assert "bad ownership or modes" in log.read_text(), log.read_text()  # StrictModes, not a wrong key
    finally:
        if sshd is not None and sshd.poll() is None:
            os.killpg(sshd.pid, signal.SIGKILL)
            sshd.wait(30)
        _kill_namespace_processes()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    ("toml", "refused"), [("tp = 4\n", True), ("tp = 4\ngpus_per_node = 8\n", True), (GROUP_TOML, False)]
)
def test_the_leader_refuses_an_engine_whose_gpus_per_node_is_not_the_pods(tmp_path, toml, refused):
    """serve.sh's leader, before any ssh: an engines.toml whose gpus_per_node (absent: tp) is not the pod's GPUs
    is refused by name: the engine is to say what the pod has (smaller: two ranks on one GPU by the Executor's
    rank % gpus_per_node; larger: TensorRT-LLM 1.2 lowers it with a warning). No namespace."""
    (tmp_path / "engines.toml").write_text(toml)
    env = {
        "PATH": os.environ["PATH"],
        "DFLASH_ROLE": "leader",
        "ENGINES_CONFIG": str(tmp_path / "engines.toml"),
        "DFLASH_ENGINES": str(tmp_path),
        "DFLASH_RUN_DIR": str(tmp_path / "run"),
        "DFLASH_SSH_SECRET": str(tmp_path / "no-secret"),  # an accepted config goes on and fails here, on the key
        "DFLASH_SSHD_DIR": str(tmp_path / "sshd"),
        "LWS_LEADER_ADDRESS": HOST["leader"],
        "LWS_GROUP_SIZE": "2",
        "DFLASH_GPUS_PER_POD": str(GPUS_PER_POD),
    }
    r = subprocess.run(["bash", str(SERVE_SH)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert ("gpus_per_node" in r.stderr and r.returncode == 2) == refused, r.stderr
