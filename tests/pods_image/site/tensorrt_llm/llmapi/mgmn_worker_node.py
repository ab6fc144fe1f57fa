"""STAND-IN for `python3 -m tensorrt_llm.llmapi.mgmn_worker_node` (NVIDIA/TensorRT-LLM 8f91cff2: a worker rank runs
mpi4py's MPICommExecutor on COMM_WORLD, taking rank 0's tasks, and returns once rank 0's comm server stops). Here:
joins the world of _world.py (retrying while the leader starts) and exits 0 when the leader stops it, 1 if the
leader goes away without stopping it (a world broken under the worker)."""

import socket
import sys
import time

from tensorrt_llm.llmapi._world import LEADER_HOST, WORLD_PORT

deadline = time.monotonic() + 300
while True:
    try:
        conn = socket.create_connection((LEADER_HOST, WORLD_PORT), timeout=10)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"worker: no leader on {LEADER_HOST}:{WORLD_PORT}")
        time.sleep(0.5)
conn.settimeout(None)
conn.sendall(b"worker\n")
line = conn.makefile("rb").readline()
if line.strip() != b"stop":
    sys.exit("worker: the leader went away without stopping the world")
print("worker quit (STAND-IN)", file=sys.stderr, flush=True)
