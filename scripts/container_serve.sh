#!/usr/bin/env bash
# The gpu image's start command: build what engines.toml asks for (keyed by its inputs and the GPU architecture: a
# restart rebuilds nothing), then serve. A tensor-parallel TensorRT-LLM target (tp > 1) runs one process per GPU under MPI; rank 0 serves
# HTTP, the other ranks only run the engine (TensorRT-LLM leader mode). NOT RUN in this project (no GPU/Docker).
set -euo pipefail
CONFIG="${ENGINES_CONFIG:-engines.toml}"
TP=$(python3 -c "import sys, tomllib; print(int(tomllib.load(open(sys.argv[1], 'rb')).get('tp', 1)))" "$CONFIG")
dflash-trt engines --config "$CONFIG"
SERVE=(dflash-trt serve --engines engines --host 0.0.0.0 --port "${PORT:-8000}" "$@")
if [ "$TP" -gt 1 ]; then
    MPI_PREFIX="${DFLASH_MPI_PREFIX:-$(cat /etc/dflash-mpi-prefix 2>/dev/null || echo /opt/hpcx/ompi)}"
    exec "$MPI_PREFIX/bin/mpirun" --prefix "$MPI_PREFIX" -n "$TP" --allow-run-as-root "${SERVE[@]}"
fi
exec "${SERVE[@]}"
