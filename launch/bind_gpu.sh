#!/usr/bin/env bash
# Per-rank GPU binding wrapper: `bind_gpu.sh CMD...` runs CMD with CUDA_VISIBLE_DEVICES set to this
# rank's local rank (its index among the ranks on its node), so each rank sees exactly one GPU and
# uses it as cuda:0. Used by the templates when BIND_GPU=1.
#
# The local rank comes from whichever launcher started the rank:
#   srun: SLURM_LOCALID; OpenMPI mpirun: OMPI_COMM_WORLD_LOCAL_RANK; MPICH/Intel MPI: MPI_LOCALRANKID;
#   horovodrun (Gloo): HOROVOD_LOCAL_RANK; torchrun: LOCAL_RANK.
# GPU_IDS (optional, comma-separated, e.g. "0,2,4,6") maps local rank i to the i-th listed GPU.
set -euo pipefail

local_rank="${SLURM_LOCALID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${HOROVOD_LOCAL_RANK:-${LOCAL_RANK:-}}}}}"
if [ -z "$local_rank" ]; then
  echo "bind_gpu.sh: no local rank in the environment (SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK," \
    "MPI_LOCALRANKID, HOROVOD_LOCAL_RANK, LOCAL_RANK): start it under srun, mpirun, horovodrun" \
    "or torchrun" >&2
  exit 2
fi
if [ -n "${GPU_IDS:-}" ]; then
  IFS=, read -r -a ids <<< "$GPU_IDS"
  if [ "$local_rank" -ge "${#ids[@]}" ]; then
    echo "bind_gpu.sh: local rank $local_rank but GPU_IDS lists only ${#ids[@]} GPUs" >&2
    exit 2
  fi
  export CUDA_VISIBLE_DEVICES="${ids[$local_rank]}"
else
  export CUDA_VISIBLE_DEVICES="$local_rank"
fi
exec "$@"
