#!/usr/bin/env bash
# preStop, run by the kubelet before it signals the container's first process; bounded by
# terminationGracePeriodSeconds (Kubernetes docs, "Container Lifecycle Hooks" and "Pod Lifecycle", termination).
#
# single / leader: first keep serving for PRESTOP_DELAY_S (the manifests set 15 s; default 0). The pod's endpoint is marked terminating
# when deletion starts, but kube-proxy, ingress controllers and load balancers drop it some seconds later; a
# request they route in that window would meet a server already refusing new work (503). Then SIGTERM to rank 0
# only (its pid file) and wait while it drains: in-flight requests end (DRAIN_TIMEOUT, at least the request
# timeout), new ones get 503, /ready fails. Its exit shuts the TensorRT-LLM executor down, which releases the
# other ranks, and mpirun exits 0. Where mpirun is the container's first process (tp > 1), the hook then waits for
# it too: the kubelet's SIGTERM follows the hook at once, and an Open MPI 4 mpirun that takes a SIGTERM while it
# tears the job down aborts it, exiting 1 without a word after a complete drain (open-mpi/ompi v4.1.8
# orte/mca/ess/hnp/ess_hnp_module.c: SIGTERM -> clean_abort, ORTE_ERROR_DEFAULT_EXIT_CODE). The hook ends with the
# container when mpirun exits (the kubelet may log that as a failed hook; the container's exit code is mpirun's).
#
# worker (a LeaderWorkerSet group's other pods): sshd is the first process, and the ranks (orted and its
# children, which mpirun started through ssh) end with it. Deleting or evicting a worker makes LWS delete the
# group's leader, whose preStop drains the group (lws 060ab4d, pkg/controllers/pod_controller.go
# handleRestartPolicy); this waits until this pod's ranks have exited, so in-flight requests finish.
ROLE="${DFLASH_ROLE:-single}"
PROC="${DFLASH_PROC:-/proc}"

launcher_is_first() {  # the container's first process is Open MPI's launcher (serve.sh execs it for tp > 1)
  case "$(cat "$PROC/1/comm" 2>/dev/null)" in mpirun|mpiexec|orterun|prterun) return 0 ;; esac
  return 1
}

ranks_running() {  # an Open MPI daemon (orted: Open MPI 4; prted: Open MPI 5) still runs in this container
  local comm
  for comm in "$PROC"/[0-9]*/comm; do
    case "$(cat "$comm" 2>/dev/null)" in orted|prted) return 0 ;; esac
  done
  return 1
}

if [ "$ROLE" = worker ]; then
  while ranks_running; do sleep 1; done
  exit 0
fi
PID_FILE="${DFLASH_PID_FILE:-/run/dflash/serve.pid}"
[ -f "$PID_FILE" ] || exit 0
sleep "${PRESTOP_DELAY_S:-0}"
pid=$(cat "$PID_FILE")
kill -TERM "$pid" 2>/dev/null || exit 0
while kill -0 "$pid" 2>/dev/null; do sleep 1; done
while launcher_is_first; do sleep 1; done
