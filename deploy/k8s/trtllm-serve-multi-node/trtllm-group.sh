#!/usr/bin/env bash
# One trtllm-serve across the pods of a LeaderWorkerSet group (NOT RUN on a cluster by this project). TensorRT-LLM
# documents multi-node trtllm-serve as one MPI world with one rank per GPU, every rank running
# `trtllm-llmapi-launch trtllm-serve MODEL --tp_size WORLD ...`: rank 0 serves HTTP, the others are the LLM API's MPI
# workers (NVIDIA/TensorRT-LLM examples/llm-api/llm_mgmn_trtllm_serve.sh at 0bd88711, under srun --mpi=pmix).
# Kubernetes has no srun: the leader starts the world with mpirun over ssh, as deploy/k8s/base/scripts/serve.sh does
# for this project's server (the same keys Secret, sshd settings and bounded waits; read it for the reasons).
#   leader  wait for every worker's sshd (WORKER_WAIT_S), write the hostfile from LWS_LEADER_ADDRESS, then
#           mpirun -n TP --hostfile ... trtllm-llmapi-launch trtllm-serve ...
#   worker  sshd only (port 2222, key from the Secret, this pod's user only, nothing forwarded)
# `trtllm-group.sh prestop` is each container's preStop (the kubelet runs it before it signals the first process,
# within terminationGracePeriodSeconds), as deploy/k8s/base/scripts/prestop.sh is for this project's server:
#   leader  keep serving PRESTOP_DELAY_S (endpoints drop the pod some seconds after deletion starts), then SIGTERM
#           to trtllm-serve alone (rank 0's command, its pid in TRTLLM_PID_FILE) and wait while it drains: it exits
#           0, trtllm-llmapi-launch then stops the MPI comm server (`mgmn_leader_node --action stop`), which
#           releases every worker rank, and mpirun exits 0; then wait for mpirun as well (the container's first
#           process: the hook ends with it). SIGTERM to mpirun instead would end every rank at once, in-flight
#           requests with them, and the kubelet's SIGTERM, which follows the hook at once, reaching mpirun while it
#           tears the job down makes Open MPI 4 abort it with exit 1 (see base/scripts/prestop.sh).
#   worker  sshd is the first process and the ranks (orted's children) end with it: wait until they have ended,
#           which the leader's drain takes (deleting a group signals its pods at once; lws 060ab4d, pkg/controllers/
#           pod_controller.go handleRestartPolicy deletes the leader when a worker goes).
# The image needs sshd and Open MPI's mpirun (NVIDIA's images: /opt/hpcx/ompi): ./Dockerfile builds it FROM the
# release image adding openssh-server, since no public source says the release image ships sshd.
set -euo pipefail
ROLE="${TRTLLM_ROLE:?set TRTLLM_ROLE to leader or worker}"
SSH_PORT="${DFLASH_SSH_PORT:-2222}"
SSH_SECRET="${DFLASH_SSH_SECRET:-/etc/dflash-ssh}"
SSHD_DIR="${DFLASH_SSHD_DIR:-/run/dflash-sshd}"
MPI_PREFIX="${DFLASH_MPI_PREFIX:-/opt/hpcx/ompi}"
PID_FILE="${TRTLLM_PID_FILE:-$SSHD_DIR/trtllm-serve.pid}"
PROC="${DFLASH_PROC:-/proc}"

if [ "${1:-}" = prestop ]; then
  if [ "$ROLE" = worker ]; then   # an Open MPI daemon (orted: Open MPI 4; prted: Open MPI 5) still runs here
    while grep -qsxE 'orted|prted' "$PROC"/[0-9]*/comm; do sleep 1; done
    exit 0
  fi
  [ -f "$PID_FILE" ] || exit 0
  sleep "${PRESTOP_DELAY_S:-15}"
  pid=$(cat "$PID_FILE")
  kill -TERM "$pid" 2>/dev/null || exit 0
  while kill -0 "$pid" 2>/dev/null; do sleep 1; done
  while grep -qsxE 'mpirun|mpiexec|orterun|prterun' "$PROC/1/comm"; do sleep 1; done
  exit 0
fi
if [ "${1:-}" = serve ]; then   # rank 0's command under trtllm-llmapi-launch: trtllm-serve, its pid recorded
  shift
  echo $$ > "$PID_FILE"
  # SIGTERM ignored across the exec: uvicorn installs its own handler while it serves, drains on the preStop's
  # SIGTERM, then restores the inherited disposition and raises the signal again (uvicorn >= 0.29,
  # Server.capture_signals). At its default that would end trtllm-serve by SIGTERM (143) after a complete drain,
  # and trtllm-llmapi-launch's `set -e` subshell would then never run `mgmn_leader_node --action stop`: the comm
  # server, the worker ranks and mpirun would wait for the kubelet's SIGKILL. Ignored, the raise does nothing and
  # trtllm-serve exits 0 (deploy/slurm/trtllm-serve.sbatch's task wrapper does the same for its ranks).
  trap '' TERM
  exec trtllm-serve "$@"
fi
install -d -m 700 "$SSHD_DIR"

case "$ROLE" in
  leader)
    GPUS="${DFLASH_GPUS_PER_POD:?set DFLASH_GPUS_PER_POD}"
    SIZE="${LWS_GROUP_SIZE:?not in a LeaderWorkerSet}"
    TP=$((GPUS * SIZE))   # the world: every GPU of the group, as the example's --tp_size
    install -m 600 "$SSH_SECRET/id_ed25519" "$SSHD_DIR/id_ed25519"
    SSH_ARGS="-p $SSH_PORT -i $SSHD_DIR/id_ed25519 -o BatchMode=yes -o StrictHostKeyChecking=no"
    SSH_ARGS+=" -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=5"
    HOSTFILE="$SSHD_DIR/hostfile"
    echo "$LWS_LEADER_ADDRESS slots=$GPUS" > "$HOSTFILE"
    end=$(( $(date +%s) + ${WORKER_WAIT_S:-600} ))
    for i in $(seq 1 $((SIZE - 1))); do
      host="${LWS_LEADER_ADDRESS/./-$i.}"   # worker i: <lws>-<group>-<i>.<lws>.<namespace>
      echo "$host slots=$GPUS" >> "$HOSTFILE"
      # shellcheck disable=SC2086  # SSH_ARGS is a list of words
      until ssh $SSH_ARGS "$host" true; do
        if [ "$(date +%s)" -ge "$end" ]; then
          echo "worker $host: no sshd on port $SSH_PORT after ${WORKER_WAIT_S:-600} s" >&2; exit 1
        fi
        echo "waiting for worker $host" >&2; sleep 2
      done
    done
    MPI=("$MPI_PREFIX/bin/mpirun" --prefix "$MPI_PREFIX" --allow-run-as-root --bind-to none)
    # what is set of these reaches every rank (`-x NAME` of an unset one only makes mpirun warn at every start)
    for name in $(compgen -e); do
      case "$name" in PATH|LD_LIBRARY_PATH|PYTHONPATH|HOME|HF_HUB_OFFLINE|NCCL_*|UCX_*) MPI+=(-x "$name") ;; esac
    done
    # tensorrt_llm/commands/serve.py (00209af1): --tp_size aliases --tensor_parallel_size, --extra_llm_api_options
    # aliases --config, --host defaults to localhost
    exec "${MPI[@]}" -n "$TP" --hostfile "$HOSTFILE" --map-by "ppr:$GPUS:node" \
      --mca plm_rsh_agent ssh --mca plm_rsh_args "$SSH_ARGS" --mca orte_keep_fqdn_hostnames 1 \
      trtllm-llmapi-launch bash "$0" serve /checkpoints/target --backend pytorch --host 0.0.0.0 --port "${PORT:-8000}" \
        --tp_size "$TP" --extra_llm_api_options /config/trtllm-serve.yaml ;;
  worker)
    install -m 600 "$SSH_SECRET/authorized_keys" "$SSHD_DIR/authorized_keys"
    [ -f "$SSHD_DIR/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$SSHD_DIR/host_ed25519"
    cat > "$SSHD_DIR/sshd_config" <<CFG
Port $SSH_PORT
HostKey $SSHD_DIR/host_ed25519
AuthorizedKeysFile $SSHD_DIR/authorized_keys
PidFile $SSHD_DIR/sshd.pid
PermitRootLogin prohibit-password
AllowUsers $(id -un)
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes yes
UsePAM no
DisableForwarding yes
AllowTcpForwarding no
AllowAgentForwarding no
X11Forwarding no
PermitTunnel no
PermitTTY no
PermitUserEnvironment no
CFG
    install -d -m 755 /run/sshd
    exec /usr/sbin/sshd -D -e -f "$SSHD_DIR/sshd_config" ;;
  *)
    echo "TRTLLM_ROLE must be leader or worker, got $ROLE" >&2; exit 2 ;;
esac
