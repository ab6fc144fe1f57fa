"""STAND-IN for the MPI world the multi-node launcher's processes share: a TCP rendezvous at WORLD_PORT on the leader
(rank 0's node). The leader (mgmn_leader_node, rank 0) holds it; each worker rank (mgmn_worker_node) connects and
stays until the leader shuts the world down, as mpi4py's MPICommExecutor on COMM_WORLD returns on the workers once
rank 0's comm server stops. Where the world's node is:
- started by Open MPI's mpirun (a LeaderWorkerSet group's leader; OMPI_COMM_WORLD_SIZE set), the ranks are a real
  MPI world (mpi4py, as NVIDIA's image has it): rank 0 broadcasts its node's address (its hostname's, as the
  kubelet's /etc/hosts gives it) over COMM_WORLD and every rank takes it;
- otherwise (srun's tasks, separate containers with no MPI job here) the first node, PODS_MGMN_LEADER;
- the launcher's `--action stop`, run on rank 0 with every MPI variable unset, reaches its own node."""

import os
import socket

WORLD_PORT = int(os.environ.get("PODS_MGMN_WORLD_PORT", "29311"))
LEADER_HOST = os.environ.get("PODS_MGMN_LEADER", "127.0.0.1")
if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    from mpi4py import MPI

    here = socket.gethostbyname(socket.gethostname()) if MPI.COMM_WORLD.Get_rank() == 0 else None
    LEADER_HOST = MPI.COMM_WORLD.bcast(here, root=0)
