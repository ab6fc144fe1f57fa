#!/usr/bin/env bash
# The same server without Slurm: one MPI world over the hosts in a hostfile (NOT RUN by this project). Every host
# must see the same engines folder (a shared file system) and the same Python env, and reach the others over
# ssh without a password. Build the engines once first (hash-checked; a rerun rebuilds nothing):
#   dflash-trt engines --config engines.toml          # tp = hosts x GPUs per host, gpus_per_node = GPUs per host
# hostfile, one line per node, slots = GPUs:
#   node-a slots=4
#   node-b slots=4
# Then, on node-a (rank 0 runs there: the loop, the drafter and HTTP on :8000):
#   deploy/slurm/mpirun-hostfile.sh hostfile 8
# The API key: put it in a file only rank 0's host reads (DFLASH_TRT_API_KEY_FILE=/path, `serve --api-key-file`); it is
# not handed to the other ranks with -x, which serve no HTTP. The drain waits as long as a request may run.
# SIGTERM to rank 0's process (not to mpirun, which would end every rank at once) drains and ends all ranks:
#   kill -TERM "$(cat /tmp/dflash-serve.pid)"
set -euo pipefail
HOSTFILE="${1:?usage: mpirun-hostfile.sh HOSTFILE NP [serve args...]}"
NP="${2:?usage: mpirun-hostfile.sh HOSTFILE NP [serve args...]}"
shift 2
MPI_PREFIX="${DFLASH_MPI_PREFIX:-$(cat /etc/dflash-mpi-prefix 2>/dev/null || echo /opt/hpcx/ompi)}"
# by absolute path with --prefix: the ssh sessions on the other hosts then find orted outside their PATH;
# keep_fqdn: Open MPI 4.1 cuts hostfile names at the first dot otherwise
exec "$MPI_PREFIX/bin/mpirun" --prefix "$MPI_PREFIX" --mca orte_keep_fqdn_hostnames 1 -np "$NP" --hostfile "$HOSTFILE" --map-by ppr:"$(awk -F'slots=' 'NR==1{print $2+0}' "$HOSTFILE")":node \
  --bind-to none -x PATH -x LD_LIBRARY_PATH \
  dflash-trt serve --engines "${DFLASH_ENGINES:-engines}" --host 0.0.0.0 --port "${DFLASH_PORT:-8000}" \
    --request-timeout "${DFLASH_REQUEST_TIMEOUT:-300}" --drain-timeout "${DFLASH_DRAIN_TIMEOUT:-300}" --pid-file /tmp/dflash-serve.pid "$@"
