#!/usr/bin/env bash
# hvd_lm with OpenMPI's mpirun: NP ranks (one per GPU) on this machine, HOSTS or a HOSTFILE.
#
#   bash launch/mpirun.sh                                             # 2 ranks here
#   NP=16 HOSTS=node1:8,node2:8 TRAIN_ARGS="--shards data/amazon" bash launch/mpirun.sh
#   hvd-lm launch --scheduler mpirun --gpus 16 --gpus-per-node 8 --out job.sh -- ...
#
# Flags as Horovod's docs recommend ("Running Horovod", "Horovod with MPI"):
#   -bind-to none -map-by slot   no core binding (each rank runs data loading + NCCL threads),
#                                ranks fill each host's slots in order (local rank = GPU index);
#   -x NAME                      forward NCCL_*, HOROVOD_*, OMP_*, PATH, LD_LIBRARY_PATH, ...;
#   -mca pml ob1 -mca btl ^openib   TCP/shared memory for MPI itself, avoiding "the
#                                multiprocessing issues Open MPI has with RDMA" (segfaults); the
#                                gradients still use InfiniBand through NCCL.
# Across machines `hvd-lm doctor` (PREFLIGHT=1) first checks the hosts and exports
# OMPI_MCA_btl_tcp_if_include / oob_tcp_if_include (OpenMPI forwards OMPI_MCA_* itself) and
# NCCL_SOCKET_IFNAME for the interface they share: with docker0 on the nodes, OpenMPI 4.1 would
# otherwise try it and hang.
#
# Other MPIs (not tested here):
#   MPICH / MVAPICH2: mpiexec -n "$NP" -f hostfile -genvlist PATH,LD_LIBRARY_PATH,NCCL_DEBUG,... \
#       "${HVD_LM_CMD[@]}"     (-genvlist forwards the named variables; -ppn 8 = ranks per node)
#   Intel MPI: mpirun -n "$NP" -ppn 8 -hostfile hostfile -genvall "${HVD_LM_CMD[@]}"
#       (I_MPI_FABRICS, I_MPI_PIN=0 to leave binding off)

# ---- knobs: every one can be overridden from the environment -----------------------------------
NP="${NP:-2}"                          # total ranks = GPUs (world size)
HOSTS="${HOSTS:-}"                     # host:slots list, e.g. node1:8,node2:8 or node[1-2]:8 ('' = HOSTFILE, else this machine)
HOSTFILE="${HOSTFILE:-}"               # OpenMPI hostfile, lines "node1 slots=8" ('' = HOSTS, else this machine)
MPIRUN="${MPIRUN:-mpirun}"             # OpenMPI's mpirun (4.x)
MPIRUN_ARGS="${MPIRUN_ARGS:-}"         # extra mpirun flags, space-separated (e.g. -mca btl_tcp_if_include ib0)
ENGINE="${ENGINE:-horovod}"            # horovod, or torch (--backend torch: torch.distributed, NCCL/Gloo; MPI tells the ranks where rank 0 is)
NETWORK_INTERFACE="${NETWORK_INTERFACE:-}"  # NIC(s) for MPI/NCCL traffic across nodes, e.g. ib0 ('' = the preflight's pick)
PREFLIGHT="${PREFLIGHT:-1}"            # with HOSTS/HOSTFILE: 1 = `hvd-lm doctor` checks the hosts first and picks the NIC; 0 = skip
BIND_GPU="${BIND_GPU:-0}"              # 1 = CUDA_VISIBLE_DEVICES=<local rank> per rank; 0 = torch uses cuda:<local rank>
LAUNCH_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"  # this repository's launch/ directory
PYTHON="${PYTHON:-python3}"            # interpreter that has hvd_lm and horovod (same path on every node)
CONFIG="${CONFIG:-}"                   # YAML file for `hvd-lm train --config` ('' = flags only)
SHARDS="${SHARDS:-data/amazon}"        # shard folder (manifest.json) when neither TRAIN_ARGS nor CONFIG names one
OUT_DIR="${OUT_DIR:-runs/mpirun-np$NP}"  # run dir (shared filesystem for multi-node runs)
TRAIN_ARGS="${TRAIN_ARGS:-}"           # more `hvd-lm train` flags, space-separated (e.g. --shards DIR --max-steps N)
# ---- end of knobs ------------------------------------------------------------------------------

set -euo pipefail
# shellcheck source=launch/env.sh
source "$LAUNCH_DIR/env.sh"
# shellcheck source=launch/lib.sh
source "$LAUNCH_DIR/lib.sh"

hvd_lm_hosts  # SLURM's n[001-004,7]:8 in HOSTS or HOSTFILE -> HOSTS, expanded
launch=("$MPIRUN" -np "$NP")
if [ -n "$HOSTS" ]; then
  launch+=(-H "$HOSTS")
elif [ -n "$HOSTFILE" ]; then
  if [ ! -f "$HOSTFILE" ]; then
    echo "HOSTFILE='$HOSTFILE' does not exist: write one line per node ('node1 slots=8')" \
      "or set HOSTS=node1:8,node2:8" >&2
    exit 2
  fi
  launch+=(-hostfile "$HOSTFILE")
fi
hvd_lm_train_cmd
if [ -n "$HOSTS$HOSTFILE" ]; then
  # several machines: check them and export the interface every host reaches the others through
  # (OMPI_MCA_btl_tcp_if_include/oob_tcp_if_include, NCCL_SOCKET_IFNAME...), or stop here
  hvd_lm_preflight "$HOSTS" "$HOSTFILE"
fi
hvd_lm_mpirun_env_flags
launch+=(-bind-to none -map-by slot -mca pml ob1 -mca btl ^openib "${HVD_LM_MPI_X[@]}")
read -r -a extra_mpirun <<< "$MPIRUN_ARGS"
launch+=("${extra_mpirun[@]}")
hvd_lm_bind_prefix
hvd_lm_banner "mpirun, $NP ranks on ${HOSTS:-${HOSTFILE:-this machine}}" \
  "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}"
# Not exec'd: a SIGTERM (kill, Ctrl-C's SIGINT goes to every process anyway) to this script
# becomes a SIGUSR1 to mpirun, which forwards it to every rank at once; OpenMPI 4.1's own SIGTERM
# handling tears the job down instead (its daemons signal the ranks only after
# odls_base_sigkill_timeout, while the ranks' output is no longer read), so the ranks could not
# checkpoint. They checkpoint at the same step and exit 0, and so does this script.
# A failed job ends with its cause (rank, host, checkpoint, how to resume) as the last lines.
rc=0
hvd_lm_run_preemptible "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}" || rc=$?
hvd_lm_failure_summary "$rc"
exit "$rc"
