#!/usr/bin/env bash
# dflash-trt in a pod; DFLASH_ROLE picks what this pod runs (tests/deploy/test_netns_launch.py runs the leader and
# worker roles across two network namespaces with real sshd and mpirun; NOT RUN on a cluster by this project):
#   single  a Deployment replica: tp ranks on this pod's GPUs (tp = GPUs per pod; tp 1: no MPI at all)
#   leader  pod 0 of a LeaderWorkerSet group: rank 0 (the loop, the drafter, HTTP) plus `mpirun --hostfile`,
#           which starts ranks 1.. on this pod's other GPUs and on the worker pods through ssh
#   worker  the group's other pods: sshd only; the leader's mpirun starts their ranks (TensorRT-LLM executors)
# Rank 0 writes its pid to DFLASH_PID_FILE: preStop (prestop.sh) signals it, so that it drains and then shuts the
# executor down, which releases every other rank; signalling mpirun would end every rank at once.
#
# The launcher is ssh + Open MPI, as kubeflow/mpi-operator runs it (caa3c47, pkg/controller/mpi_job_controller.go:
# sshd -De on the workers, keys from a Secret, OMPI_MCA_orte_keep_fqdn_hostnames and plm_rsh_args; build/base/
# Dockerfile: openssh-server, /var/run/sshd). Unlike its images (StrictModes no), the worker copies authorized_keys
# out of the Secret's mount (symlinks into a folder sshd's StrictModes refuses) into a root-owned 0700 folder and
# runs its own sshd_config there with StrictModes on. mpirun is called by absolute path with --prefix, so the ssh
# session on a worker finds orted (Open MPI lives in /opt/hpcx/ompi in NVIDIA's images, outside a non-login PATH).
# Every wait is bounded: WORKER_WAIT_S for the workers' sshd (default 600 s).
set -euo pipefail
ROLE="${DFLASH_ROLE:-single}"
CONFIG="${ENGINES_CONFIG:-/config/engines.toml}"
RUN="${DFLASH_RUN_DIR:-/run/dflash}"
# the init step (build-engines.sh) writes the folder of this engine identity there
ENGINES="${DFLASH_ENGINES:-$(cat "$RUN/engines-dir" 2>/dev/null || echo /engines)}"
# tp and the GPUs per node the engine records (gpus_per_node; 0 or absent: tp, as dflash_trt/builders/engines.py)
PARALLEL=$(python3 -c "import sys, tomllib; c = tomllib.load(open(sys.argv[1], 'rb')); tp = int(c.get('tp', 1))
print(tp, int(c.get('gpus_per_node', 0)) or tp)" "$CONFIG")
read -r TP NODE_GPUS <<< "$PARALLEL"
read -r -a EXE <<< "${DFLASH_SERVE_EXE:-dflash-trt}"   # the test runs its rank wrapper here
read -r -a EXTRA <<< "${DFLASH_SERVE_ARGS:-}"
SERVE=("${EXE[@]}" serve --engines "$ENGINES" --host 0.0.0.0 --port "${PORT:-8000}"
       --request-timeout "${REQUEST_TIMEOUT:-300}" --drain-timeout "${DRAIN_TIMEOUT:-300}"
       --health-stall-seconds "${HEALTH_STALL_S:-300}"
       --pid-file "${DFLASH_PID_FILE:-$RUN/serve.pid}" "${EXTRA[@]}")
# where the image's Open MPI lives (the Dockerfile records it; NVIDIA's images: /opt/hpcx/ompi)
MPI_PREFIX="${DFLASH_MPI_PREFIX:-$(cat /etc/dflash-mpi-prefix 2>/dev/null || echo /opt/hpcx/ompi)}"
SSH_PORT="${DFLASH_SSH_PORT:-2222}"
SSH_SECRET="${DFLASH_SSH_SECRET:-/etc/dflash-ssh}"   # the Secret's mount: id_ed25519, authorized_keys
SSHD_DIR="${DFLASH_SSHD_DIR:-/run/dflash-sshd}"      # every parent root-owned, not group/world writable
MPI=("$MPI_PREFIX/bin/mpirun" --prefix "$MPI_PREFIX" --allow-run-as-root --bind-to none)
# every rank gets this pod's PATH, LD_LIBRARY_PATH and PYTHONPATH where set (`-x NAME` of an unset one only makes
# mpirun warn at every start), and NCCL's and UCX's settings (IB HCAs, socket interface)
for name in $(compgen -e); do
  case "$name" in PATH|LD_LIBRARY_PATH|PYTHONPATH|NCCL_*|UCX_*) MPI+=(-x "$name") ;; esac
done
read -r -a MPI_EXTRA <<< "${DFLASH_MPI_ARGS:-}"

# The API key reaches rank 0 as a file (DFLASH_TRT_API_KEY_FILE, the mounted Secret; rank 0 reads it, `serve
# --api-key-file`), never through the environment mpirun hands to every rank. A file that is named but empty or
# missing stops the pod here, before the engines load, never "no authentication".
if [ "$ROLE" != worker ] && [ -n "${DFLASH_TRT_API_KEY_FILE:-}" ] && ! grep -q '[^[:space:]]' \
    "$DFLASH_TRT_API_KEY_FILE" 2>/dev/null; then
  echo "DFLASH_TRT_API_KEY_FILE=$DFLASH_TRT_API_KEY_FILE is missing or empty: put the key in the Secret" >&2; exit 2
fi

private_copy() {  # private_copy SRC DEST: a 0600 copy, owned by this pod's user, that ssh and StrictModes accept
  install -d -m 700 "$SSHD_DIR" && install -m 600 "$1" "$2"
}

case "$ROLE" in
  single)
    if [ "$TP" -gt 1 ]; then exec "${MPI[@]}" "${MPI_EXTRA[@]}" -n "$TP" "${SERVE[@]}"; fi
    exec "${SERVE[@]}" ;;
  leader)
    # LWS_LEADER_ADDRESS is <lws>-<group>.<subdomain>.<namespace> (lws pkg/utils/pod/pod_utils.go
    # AddLWSVariables; the subdomain is the headless Service, <lws> under the default Shared subdomainPolicy);
    # worker i is <lws>-<group>-<i>.<subdomain>.<namespace> (deploy/README.md, "Names")
    GPUS="${DFLASH_GPUS_PER_POD:?set DFLASH_GPUS_PER_POD}"
    SIZE="${LWS_GROUP_SIZE:?not in a LeaderWorkerSet}"
    if [ "$((GPUS * SIZE))" -ne "$TP" ]; then
      echo "engines.toml tp=$TP but the group has $SIZE pods x $GPUS GPUs" >&2; exit 2
    fi
    # the engine records gpus_per_node and the Executor runs rank r on GPU r % gpus_per_node of its pod: a smaller
    # value puts two ranks on one GPU, a larger one TensorRT-LLM 1.2 lowers to the pod's GPUs with a warning
    # (worldConfig.cpp, WorldConfig::mpi); the engine is to say what the pod has
    if [ "$NODE_GPUS" -ne "$GPUS" ]; then
      echo "engines.toml gpus_per_node=$NODE_GPUS but each pod has $GPUS GPUs: set gpus_per_node = $GPUS and rebuild" \
        "(rank r runs on GPU r % gpus_per_node of its pod)" >&2
      exit 2
    fi
    private_copy "$SSH_SECRET/id_ed25519" "$SSHD_DIR/id_ed25519"
    SSH_ARGS="-p $SSH_PORT -i $SSHD_DIR/id_ed25519 -o BatchMode=yes -o StrictHostKeyChecking=no"
    SSH_ARGS+=" -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=5"
    HOSTFILE="$RUN/hostfile"
    mkdir -p "$RUN"
    echo "$LWS_LEADER_ADDRESS slots=$GPUS" > "$HOSTFILE"
    end=$(( $(date +%s) + ${WORKER_WAIT_S:-600} ))
    for i in $(seq 1 $((SIZE - 1))); do
      host="${LWS_LEADER_ADDRESS/./-$i.}"
      echo "$host slots=$GPUS" >> "$HOSTFILE"
      # shellcheck disable=SC2086  # SSH_ARGS is a list of words
      until ssh $SSH_ARGS "$host" true; do
        if [ "$(date +%s)" -ge "$end" ]; then
          echo "worker $host: no sshd on port $SSH_PORT after ${WORKER_WAIT_S:-600} s" >&2; exit 1
        fi
        echo "waiting for worker $host" >&2; sleep 2
      done
    done
    # keep_fqdn: Open MPI 4.1 cuts hostfile names at the first dot, and a pod's short name does not resolve
    exec "${MPI[@]}" "${MPI_EXTRA[@]}" -n "$TP" --hostfile "$HOSTFILE" --map-by "ppr:$GPUS:node" \
      --mca plm_rsh_agent ssh --mca plm_rsh_args "$SSH_ARGS" --mca orte_keep_fqdn_hostnames 1 "${SERVE[@]}" ;;
  worker)
    # Only the user this pod runs as may log in, by key only, with no forwarding, tunnel or terminal (sshd_config(5):
    # DisableForwarding overrides every forwarding option; they are also named one by one, so that `sshd -T` shows
    # them off): mpirun needs a command channel and nothing else. Root logs in only where the
    # pods run as root (the multi-node overlay, for IPC_LOCK), and then by key only.
    if [ "$(id -u)" -eq 0 ]; then ROOT_LOGIN=prohibit-password; else ROOT_LOGIN=no; fi
    private_copy "$SSH_SECRET/authorized_keys" "$SSHD_DIR/authorized_keys"
    [ -f "$SSHD_DIR/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$SSHD_DIR/host_ed25519"
    cat > "$SSHD_DIR/sshd_config" <<EOF
Port $SSH_PORT
HostKey $SSHD_DIR/host_ed25519
AuthorizedKeysFile $SSHD_DIR/authorized_keys
PidFile $SSHD_DIR/sshd.pid
PermitRootLogin $ROOT_LOGIN
AllowUsers $(id -un)
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes yes
UsePAM no
DisableForwarding yes
AllowTcpForwarding no
AllowStreamLocalForwarding no
AllowAgentForwarding no
X11Forwarding no
PermitTunnel no
PermitTTY no
PermitUserEnvironment no
EOF
    # sshd's privilege separation folder (Debian's openssh-server): root's sshd only
    if [ "$(id -u)" -eq 0 ]; then install -d -m 755 /run/sshd; fi
    exec /usr/sbin/sshd -D -e -f "$SSHD_DIR/sshd_config" ;;
  *)
    echo "DFLASH_ROLE must be single, leader or worker, got $ROLE" >&2; exit 2 ;;
esac
