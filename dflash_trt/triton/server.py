"""Start a real `tritonserver` on this machine: the binary and python backend that PyPI's
nvidia-pytriton bundles, run from the server venv (`make triton-env`, default `.venv-triton`).

Why a separate venv: the python-backend stub shipped there reads tensors wrongly under numpy 2
(an INT64 [1, 2, 3] arrives as [1, 1, 1]), so the server side pins numpy < 2, while the main venv
keeps numpy 2. The catches this module handles:
  * the stub embeds libpython: LD_LIBRARY_PATH must start with the server interpreter's own lib
    folder, or the system libpython is loaded (`'_thread.RLock' object has no attribute '_recursion_count'`);
  * the stub ignores PYTHONPATH; it finds its site-packages from the first `python3` on PATH, so
    PATH starts with the venv's bin (dflash_trt and torch/onnxruntime come from there);
  * the stub for the interpreter's Python version is copied beside libtriton_python.so.
In production, serve the same repository with NVIDIA's Triton container instead (docs/deployment.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-triton"
PROBE = (
    "import json, sys, sysconfig, pathlib, pytriton; root = pathlib.Path(pytriton.__file__).parent; "
    "print(json.dumps({'libdir': sysconfig.get_config_var('LIBDIR'), 'version': '%d.%d' % sys.version_info[:2], "
    "'dist': str(root / 'tritonserver'), 'libs': str(root.parent / 'nvidia_pytriton.libs')}))"
)


class TritonUnavailable(RuntimeError):
    """No usable tritonserver here (server venv missing, or the binary cannot start)."""


@dataclass
class ServerEnv:
    venv: Path
    binary: Path
    backends: Path  # prepared backend directory (python backend + the right stub)
    env: dict[str, str] = field(repr=False, default_factory=dict)


def server_env(venv: str | Path | None = None, work: str | Path | None = None) -> ServerEnv:
    """Locate the bundled tritonserver in the server venv and prepare a backend directory under `work`."""
    venv = Path(venv or os.environ.get("DFLASH_TRITON_VENV") or DEFAULT_VENV).absolute()
    python = venv / "bin" / "python3"
    if not python.exists():
        raise TritonUnavailable(f"no Triton server venv at {venv}: create it with `make triton-env`")
    probe = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True)
    if probe.returncode != 0:
        raise TritonUnavailable(f"{venv} has no nvidia-pytriton (make triton-env): {probe.stderr.strip()[-300:]}")
    info = json.loads(probe.stdout)
    dist = Path(info["dist"])
    stub = dist / "python_backend_stubs" / info["version"] / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonUnavailable(f"nvidia-pytriton has no python-backend stub for Python {info['version']}")
    work = Path(work) if work else venv / "tritonserver-backends"
    python_backend = work / "python"
    if not (python_backend / "triton_python_backend_stub").is_file():
        shutil.rmtree(python_backend, ignore_errors=True)
        shutil.copytree(dist / "backends" / "python", python_backend, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, python_backend / "triton_python_backend_stub")
    env = dict(os.environ)
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (info["libdir"], info["libs"], env.get("LD_LIBRARY_PATH")) if p)
    env.pop("PYTHONHOME", None)
    env.setdefault("OMP_NUM_THREADS", "1")  # each model instance is its own process: don't oversubscribe
    return ServerEnv(venv, dist / "bin" / "tritonserver", work, env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class TritonServer:
    """A running tritonserver on loopback ports; use as a context manager (always stopped)."""

    def __init__(
        self,
        repo: str | Path,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        venv: str | Path | None = None,
        log_path: str | Path | None = None,
        host: str = "127.0.0.1",
        verbose: bool = False,
    ):
        self.repo = Path(repo).absolute()
        self.host = host
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.senv = server_env(venv)
        self.log_path = Path(log_path) if log_path else self.repo.parent / f"tritonserver-{self.http_port}.log"
        self.verbose = verbose
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def command(self) -> list[str]:
        return [
            str(self.senv.binary),
            f"--model-repository={self.repo}",
            f"--backend-directory={self.senv.backends}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-cpu-metrics=false",
            "--allow-gpu-metrics=false",
            "--disable-auto-complete-config",  # configs are complete; skips one stub start per model
            "--exit-timeout-secs=5",
            "--log-verbose=1" if self.verbose else "--log-verbose=0",
        ]

    def start(self, timeout_s: float = 180) -> TritonServer:
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.senv.env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.process = None
                raise TritonUnavailable(f"tritonserver exited during start-up:\n{tail}")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise TritonUnavailable(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        p, self.process = self.process, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:  # the server's own process group (start_new_session): it and any python-backend stub left over
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)

    def __enter__(self) -> TritonServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
