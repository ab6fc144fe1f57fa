"""STAND-IN for `python3 -m tensorrt_llm.llmapi.mgmn_leader_node` (NVIDIA/TensorRT-LLM c40f1157: rank 0's MPI comm
server, RemoteMpiCommSessionServer over the world's other ranks, serving until it is stopped); `--action stop`,
as trtllm-llmapi-launch at 020c89e6 calls it once the served command exits, stops it. Here the world is the
rendezvous of _world.py: the server holds it, stop releases every worker and ends the server with 0."""

import argparse
import socket
import sys
import threading
import time

from tensorrt_llm.llmapi._world import LEADER_HOST, WORLD_PORT

p = argparse.ArgumentParser(prog="mgmn_leader_node (STAND-IN)")
p.add_argument("--action", choices=["start", "stop"], default="start")
args = p.parse_args()

if args.action == "stop":  # the server may still be starting (the launcher starts both at once)
    for _ in range(60):
        try:
            with socket.create_connection((LEADER_HOST, WORLD_PORT), timeout=10) as s:
                s.sendall(b"stop\n")
            sys.exit(0)
        except OSError:
            time.sleep(0.5)
    sys.exit(f"mgmn_leader_node --action stop: no server on {LEADER_HOST}:{WORLD_PORT}")

server = socket.create_server(("0.0.0.0", WORLD_PORT), reuse_port=False)
workers: list[socket.socket] = []
stopped = threading.Event()
print(f"MPI Comm Server (STAND-IN) started on port {WORLD_PORT}", file=sys.stderr, flush=True)
while not stopped.is_set():
    conn, _ = server.accept()
    what = conn.makefile("rb").readline().strip()
    if what == b"worker":
        workers.append(conn)
    elif what == b"stop":
        conn.close()
        stopped.set()
for w in workers:
    w.sendall(b"stop\n")
    w.close()
print("MPI Comm Server (STAND-IN) stopped", file=sys.stderr, flush=True)
