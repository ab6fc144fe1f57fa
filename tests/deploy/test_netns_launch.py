"""The multi-node launch of a LeaderWorkerSet group, for real, on one machine: two network namespaces joined by a veth
pair, each with its own address, hostname (a UTS namespace) and /etc/hosts (`ip netns exec` binds /etc/netns/NS/),
as two pods of a group are. The pods' own launch script, deploy/k8s/base/scripts/serve.sh, runs in both:

- the worker role starts a real sshd (Debian's openssh-server) from the keys of a Secret-like folder;
- the leader role waits for it over ssh, writes the hostfile from the LWS variables and starts a 2-rank `mpirun`
  (Debian's Open MPI, by absolute path with --prefix) across the namespaces; the ranks run tests/mpi_rank.py, the
  `serve` command on the labelled FAKE TensorRT-LLM executor (tests/mpi_rank.py says what it models).

Checked: rank 0 serves HTTP in the leader namespace and answers, rank 1 runs in the worker namespace (its hostname)
and follows every iteration; the pods' prestop.sh drains rank 0 and both ranks end with 0; a killed worker rank
makes /ready fail and the job end non-zero. Needs root and `ip netns` (CI has both); `make sshd-env mpi-env`.
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


def _kill_namespace_processes() -> None:
    """SIGKILL every process inside this test's namespaces (`ip netns pids`: only what this test started)."""
    for ns in NS.values():
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _tools() -> None:
    for path, target in (("/usr/sbin/sshd", "sshd-env"), ("/usr/bin/mpirun", "mpi-env")):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} missing: run `make {target}` (make test does)")


@pytest.fixture(scope="module")
def netns():
    why = _why_not()
    if why:
        pytest.skip(why)
    _tools()
    made: list[str] = []
    try:
        for role, ns in NS.items():
            _run("ip", "netns", "add", ns)
            made.append(ns)
            hosts = Path("/etc/netns") / ns / "hosts"  # `ip netns exec` binds it over /etc/hosts
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{ADDR[r]} {HOST[r]}\n" for r in NS))
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
        yield NS
    finally:
        _kill_namespace_processes()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # the veth pair goes with them
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    return fake_trtllm_engines(tmp_path_factory.mktemp("netns-engines"))


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
                env={**os.environ, **env, "DFLASH_ROLE": role},
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
        (tmp / "engines.toml").write_text("tp = 2\n")
        self.run_dir, self.sshd = tmp / "run", {r: Path(f"/run/{TAG}-{r}-sshd") for r in NS}
        common = {
            "ENGINES_CONFIG": str(tmp / "engines.toml"),
            "DFLASH_SSH_SECRET": str(secret),
            "DFLASH_SSH_PORT": "2222",
            "DFLASH_MPI_PREFIX": "/usr",  # Debian's Open MPI (NVIDIA's images: /opt/hpcx/ompi, the default)
        }
        self.http = _in_netns(NS["leader"])
        self.worker = Pod("worker", {**common, "DFLASH_SSHD_DIR": str(self.sshd["worker"])}, tmp / "worker.log")
        leader_env = {
            **common,
            "DFLASH_SSHD_DIR": str(self.sshd["leader"]),
            "LWS_LEADER_ADDRESS": HOST["leader"],
            "LWS_GROUP_SIZE": "2",
            "DFLASH_GPUS_PER_POD": "1",
            "DFLASH_ENGINES": str(engines),
            "DFLASH_RUN_DIR": str(self.run_dir),
            "DFLASH_SERVE_EXE": f"{sys.executable} {ROOT / 'tests' / 'mpi_rank.py'}",
            "DFLASH_SERVE_ARGS": "--threads 1 --no-adaptive",
            "PORT": "0",
            "WORKER_WAIT_S": "60",
            "DFLASH_MPI_ARGS": f"--mca btl self,tcp --mca btl_tcp_if_include {SUBNET}.0/24 "
            f"--mca oob_tcp_if_include {SUBNET}.0/24 -x PYTHONUNBUFFERED",
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


def test_leader_and_worker_namespaces_serve_and_drain_together(group):
    assert group.get("/ready").status_code == 200
    got = group.post("/generate", {"input_ids": [5, 6, 7], "max_tokens": 9})
    assert got.status_code == 200 and len(got.json()["token_ids"]) == 9
    ranks = {e["rank"]: e for e in group.events("fake_rank")}
    assert sorted(ranks) == [0, 1]
    hosts = {e["rank"]: e["host"] for e in group.events("fake_rank")}
    assert hosts == {0: "dflash-trt-group-0", 1: "dflash-trt-group-0-1"}  # rank 1 really ran in the worker's namespace
    pid_file = group.run_dir / "serve.pid"
    assert int(pid_file.read_text()) == ranks[0]["pid"]
    prestop = subprocess.run(
        ["bash", str(PRESTOP_SH)], env={**os.environ, "DFLASH_PID_FILE": str(pid_file)}, timeout=120
    )
    assert prestop.returncode == 0
    assert group.leader.proc.wait(60) == 0, group.logs()
    assert sorted((e["rank"], e["code"]) for e in group.events("fake_rank_exit")) == [(0, 0), (1, 0)]
    (leader,) = group.events("fake_leader_shutdown")
    (worker,) = group.events("fake_worker_shutdown")
    assert worker["iterations"] == leader["iterations"] >= 9
    assert group.worker.proc.poll() is None  # the worker pod's sshd outlives the job, as the pod does


def test_a_killed_worker_rank_fails_ready_and_ends_the_job(group):
    assert group.post("/generate", {"input_ids": [1], "max_tokens": 3}).is_success
    (rank1,) = [e for e in group.events("fake_rank") if e["rank"] == 1]
    os.kill(rank1["pid"], signal.SIGKILL)
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
