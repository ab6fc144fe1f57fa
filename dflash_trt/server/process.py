"""Start `dflash-trt serve` as a child process and wait until it answers (tests and the benchmark scripts).

The child binds `--port 0` itself and reports the port it got in its listening line, so there is
no window in which another process can take a port picked in advance. Its stdout and stderr go
to a log file: a pipe nobody reads would block the server once its request log fills the pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .serving import LISTENING_EVENT


class ServerFailed(RuntimeError):
    """The child exited, or did not come up in time; the message ends with its log."""


def serve_command() -> list[str]:
    """`dflash-trt` next to this interpreter (the venv's entry point), else `python -c` on the CLI."""
    exe = Path(sys.executable).parent / "dflash-trt"
    if exe.is_file():
        return [str(exe)]
    return [sys.executable, "-m", "dflash_trt.cli"]


def listening_port(log_text: str) -> int | None:
    """The port from the child's `{"event": "listening", ...}` line, once it is there."""
    for line in log_text.splitlines():
        if LISTENING_EVENT not in line or not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == LISTENING_EVENT:
            return int(event["port"])
    return None


def start_serve(
    serve_args: list[str], log_path: Path, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Run `dflash-trt serve --host 127.0.0.1 --port 0 *serve_args`; return (process, base url) once
    GET /health answers 200. Output goes to log_path. Raises ServerFailed (the child is killed)."""
    import httpx

    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*serve_command(), "serve", "--host", "127.0.0.1", "--port", "0", *serve_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + timeout_s
    url = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerFailed(f"the server exited with code {proc.returncode}:\n{_tail(log_path)}")
            if url is None:
                port = listening_port(log_path.read_text(errors="replace"))
                url = None if port is None else f"http://127.0.0.1:{port}"
            if url is not None:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        return proc, url
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        raise ServerFailed(f"the server did not come up in {timeout_s:.0f} s:\n{_tail(log_path)}")
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
