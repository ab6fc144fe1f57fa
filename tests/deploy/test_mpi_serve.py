"""The tensor-parallel leader / worker life cycle of `dflash-trt serve` under a real `mpirun -n 2` (Open MPI, mpi4py)
on this CPU machine, loopback only, with the FAKE TensorRT-LLM executor (tests/mpi_rank.py says what it models):

- rank 0 serves HTTP and answers; rank 1 runs only the engine: it takes part in every iteration of the leader's
  and serves no HTTP;
- SIGTERM to rank 0 drains (an in-flight stream finishes, /ready turns 503) and ends both ranks with exit code 0;
- a worker that dies makes rank 0 fail /ready and the job end non-zero, never hang.

Set-up: `make mpi-env` (Debian's openmpi-bin, mpi4py in the venv); `make test` runs it.
"""

from __future__ import annotations

import json
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
from server_harness import sse_events

from dflash_trt.server.process import listening_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tests" / "mpi_rank.py"
LONG = {"input_ids": [1, 2, 3], "max_tokens": 120, "block_size": 4, "stream": True}

pytestmark = pytest.mark.timeout(300)


def mpirun() -> str:
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.fail("mpirun not found: run `make mpi-env` (Debian's openmpi-bin; make test does)")
    r = subprocess.run([sys.executable, "-c", "import mpi4py.MPI"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"mpi4py does not import in this venv: run `make mpi-env`\n{r.stderr[-2000:]}")
    return exe


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    """A tp-2 engine on one fake node of 2 GPUs: each rank on its own GPU by the Executor's rule."""
    return fake_trtllm_engines(tmp_path_factory.mktemp("mpi-serve"), "tp = 2\n", node_gpus=2)


class Job:
    """`mpirun -n 2` of tests/mpi_rank.py serve; its output (both ranks) in one log."""

    def __init__(self, engines: Path, log: Path, *serve_args: str):
        self.log = log
        env = {
            **os.environ,
            "OMPI_ALLOW_RUN_AS_ROOT": "1",  # CI runs as root
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1",  # 2 ranks on a 2-core machine
            "PYTHONUNBUFFERED": "1",
            # this tree's dflash_trt in every rank (mpirun passes it on with -x)
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        }
        cmd = [
            mpirun(),
            "-n",
            "2",
            "--bind-to",
            "none",
            "--mca",
            "btl",
            "self,tcp",
            "--mca",
            "btl_tcp_if_include",
            "lo",
            "--mca",
            "oob_tcp_if_include",
            "lo",
            "-x",
            "PYTHONPATH",
            "-x",
            "PYTHONUNBUFFERED",
            sys.executable,
            str(LAUNCHER),
            "serve",
            "--engines",
            str(engines),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--threads",
            "1",
            "--no-adaptive",
            *serve_args,
        ]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = self._wait_listening()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, name: str) -> list[dict]:
        return json_events(self.text(), name)

    def _wait_listening(self, timeout: float = 180) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"mpirun exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            port = listening_port("\n".join(json.dumps(e) for e in self.events("listening")))
            if port is not None:
                return f"http://127.0.0.1:{port}"
            time.sleep(0.2)
        raise AssertionError(f"rank 0 never listened:\n{self.text()[-4000:]}")

    def rank_pid(self, rank: int) -> int:
        (e,) = [e for e in self.events("fake_rank") if e["rank"] == rank]
        return int(e["pid"])

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job hung for {timeout} s:\n{self.text()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session mpirun leads: mpirun and both ranks
            self.proc.wait()


def test_leader_serves_worker_follows_and_sigterm_drains_both(engines, tmp_path):
    """The SIGTERM comes from the pods' preStop hook itself (deploy/k8s/base/scripts/prestop.sh), which signals the
    pid `serve --pid-file` wrote (rank 0's) and waits for that process to end."""
    pid_file = tmp_path / "run" / "serve.pid"
    job = Job(engines, tmp_path / "mpi.log", "--pid-file", str(pid_file))
    prestop = None
    try:
        assert httpx.get(job.url + "/ready", timeout=10).status_code == 200
        got = httpx.post(job.url + "/generate", json={"input_ids": [5, 6, 7], "max_tokens": 9}, timeout=120)
        assert got.status_code == 200 and len(got.json()["token_ids"]) == 9
        # rank 1 reached serve_worker (its iterations answered the request's) and only rank 0 serves HTTP
        assert sorted(e["rank"] for e in job.events("fake_rank")) == [0, 1]
        assert len(job.events("tensor_parallel_worker")) == 1 and len(job.events("listening")) == 1
        with httpx.stream("POST", job.url + "/generate", json=LONG, timeout=300) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            assert int(pid_file.read_text()) == job.rank_pid(0)  # rank 0, not mpirun (which would end both)
            prestop = subprocess.Popen(
                ["bash", str(ROOT / "deploy/k8s/base/scripts/prestop.sh")],
                env={**os.environ, "DFLASH_PID_FILE": str(pid_file)},
            )
            end = time.monotonic() + 60
            while httpx.get(job.url + "/ready", timeout=10).status_code != 503:
                assert time.monotonic() < end, "rank 0 never started draining"
                time.sleep(0.05)
            events = sse_events(lines)
        final = events[-1]
        assert final["type"] == "final" and final["finish_reason"] == "length"  # the in-flight stream finished
        assert len(final["token_ids"]) == LONG["max_tokens"]
        assert job.wait(120) == 0
        assert prestop.wait(30) == 0  # it waited for rank 0 to end
    finally:
        job.kill()
        if prestop is not None and prestop.poll() is None:
            prestop.kill()
    assert not pid_file.exists()  # removed by rank 0 on its way out
    (leader,) = job.events("fake_leader_shutdown")
    (worker,) = job.events("fake_worker_shutdown")
    # rank 1 took part in every iteration rank 0 ran, and ended only at the leader's shutdown
    assert worker["iterations"] == leader["iterations"] > LONG["max_tokens"] // 4
    assert sorted((e["rank"], e["code"]) for e in job.events("fake_rank_exit")) == [(0, 0), (1, 0)]
    assert "Traceback" not in job.text()


def test_a_dead_worker_fails_ready_and_ends_the_job_non_zero(engines, tmp_path):
    job = Job(engines, tmp_path / "mpi.log")
    try:
        assert httpx.post(job.url + "/generate", json={"input_ids": [1], "max_tokens": 3}, timeout=120).is_success
        os.kill(job.rank_pid(1), signal.SIGKILL)
        try:  # a request now may fail (500) or the connection may drop as the job ends: either way, no hang
            httpx.post(job.url + "/generate", json={"input_ids": [1], "max_tokens": 3}, timeout=60)
        except httpx.TransportError:
            pass
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(job.url + "/ready", timeout=5).status_code != 200:
                    break
            except httpx.TransportError:  # rank 0 is gone: the probe fails too
                break
            assert time.monotonic() < end, "rank 0 stayed ready without its worker"
            time.sleep(0.1)
        code = job.wait(90)
        assert code != 0, job.text()[-3000:]
    finally:
        job.kill()


def test_an_engine_recording_fewer_gpus_per_node_than_the_nodes_ranks_is_refused(tmp_path):
    """Two ranks on one node, an engine recording gpus_per_node 1: TensorRT-LLM 1.2 would run both on GPU 0
    (rank % 1; nothing lowered, worldConfig.cpp WorldConfig::mpi). dflash-trt's own check (check_node_ranks, from
    Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE) refuses it by name on both ranks; the job ends non-zero, no hang."""
    engines = fake_trtllm_engines(tmp_path / "one-gpu-per-node", "tp = 2\ngpus_per_node = 1\n", node_gpus=2)
    log = tmp_path / "mpi.log"
    job = None
    try:
        try:
            job = Job(engines, log)
        except AssertionError:  # mpirun ended before rank 0 listened
            pass
        else:
            got = httpx.post(job.url + "/generate", json={"input_ids": [1], "max_tokens": 3}, timeout=120)
            assert not got.is_success
            assert job.wait(90) != 0
    finally:
        if job is not None:
            job.kill()
    text = log.read_text(errors="replace")
    assert text.count("2 MPI ranks run on this node but the engine's gpus_per_node is 1") >= 2, text[-3000:]
    assert not json_events(text, "fake_rank_device")  # refused before either rank built its executor
