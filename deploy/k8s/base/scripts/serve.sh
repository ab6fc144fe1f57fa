#!/usr/bin/env bash
# dflash-trt in a pod; DFLASH_ROLE picks what this pod runs (NOT RUN on a cluster by this project):
#   single  a Deployment replica: tp ranks on this pod's GPUs (tp = GPUs per pod; tp 1: no MPI at all)
#   leader  pod 0 of a LeaderWorkerSet group: rank 0 (the loop, the drafter, HTTP) plus `mpirun --hostfile`,
#           which starts ranks 1.. on this pod's other GPUs and on the worker pods through ssh
#   worker  the group's other pods: sshd only; the leader's mpirun starts their ranks (TensorRT-LLM executors)
# Rank 0 writes its pid to /run/dflash/serve.pid: preStop (prestop.sh) signals it, so that it drains and then
# shuts the executor down, which releases every other rank; signalling mpirun would end every rank at once.
set -euo pipefail
ROLE="${DFLASH_ROLE:-single}"
CONFIG="${ENGINES_CONFIG:-/config/engines.toml}"
ENGINES="${DFLASH_ENGINES:-/engines}"
TP=$(python3 -c "import sys, tomllib; print(int(tomllib.load(open(sys.argv[1], 'rb')).get('tp', 1)))" "$CONFIG")
SERVE=(dflash-trt serve --engines "$ENGINES" --host 0.0.0.0 --port "${PORT:-8000}"
       --drain-timeout "${DRAIN_TIMEOUT:-120}" --pid-file /run/dflash/serve.pid ${DFLASH_SERVE_ARGS:-})
MPI=(mpirun --allow-run-as-root --bind-to none -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x DFLASH_TRT_API_KEY)

case "$ROLE" in
  single)
    if [ "$TP" -gt 1 ]; then exec "${MPI[@]}" -n "$TP" "${SERVE[@]}"; fi
    exec "${SERVE[@]}" ;;
  leader)
    # LWS_LEADER_ADDRESS is <lws>-<group>.<lws>.<namespace>; worker i is <lws>-<group>-<i>.<lws>.<namespace>
    GPUS="${DFLASH_GPUS_PER_POD:?set DFLASH_GPUS_PER_POD}"
    SIZE="${LWS_GROUP_SIZE:?not in a LeaderWorkerSet}"
    if [ "$((GPUS * SIZE))" -ne "$TP" ]; then
      echo "engines.toml tp=$TP but the group has $SIZE pods x $GPUS GPUs" >&2; exit 2
    fi
    HOSTFILE=/run/dflash/hostfile
    echo "$LWS_LEADER_ADDRESS slots=$GPUS" > "$HOSTFILE"
    for i in $(seq 1 $((SIZE - 1))); do
      host="${LWS_LEADER_ADDRESS/./-$i.}"
      echo "$host slots=$GPUS" >> "$HOSTFILE"
      until ssh -p 2222 -o StrictHostKeyChecking=no -o ConnectTimeout=5 "$host" true 2>/dev/null; do
        echo "waiting for worker $host" >&2; sleep 5
      done
    done
    exec "${MPI[@]}" -n "$TP" --hostfile "$HOSTFILE" --map-by "ppr:$GPUS:node" \
      --mca plm_rsh_args "-p 2222 -o StrictHostKeyChecking=no" "${SERVE[@]}" ;;
  worker)
    ssh-keygen -A && exec /usr/sbin/sshd -D -e -p 2222 ;;
  *)
    echo "DFLASH_ROLE must be single, leader or worker, got $ROLE" >&2; exit 2 ;;
esac
