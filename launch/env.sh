# shellcheck shell=bash
# Environment knobs for every hvd_lm launch template (sourced by horovodrun_local.sh,
# horovodrun_multinode.sh, mpirun.sh, slurm.sbatch and pbs.qsub).
#
# Each knob keeps a value already in the environment, so `NCCL_DEBUG=INFO sbatch ...` works
# without editing this file. An empty value means "not set": the library's own default applies
# and the variable is not exported at all (an empty NCCL_SOCKET_IFNAME is not the same as unset).
# mpirun.sh / slurm.sbatch / pbs.qsub forward every NCCL_*, HOROVOD_*, OMP_*, TORCH_*, GLOO_*
# variable to the ranks with `mpirun -x` (srun, horovodrun and torchrun forward the whole
# environment themselves).
#
# Sources: NCCL "Environment Variables" docs; Horovod docs "Running Horovod", "Tensor Fusion",
# "Timeline", "Horovod with MPI" (hierarchical allreduce).

# ---- threads -----------------------------------------------------------------------------------
# OpenMP/MKL threads per rank. One rank per GPU needs few CPU threads; on CPU-only runs
# `hvd-lm train --threads N` sets torch's intra-op threads explicitly anyway.
: "${OMP_NUM_THREADS:=1}"

# ---- NCCL (GPU allreduce transport; ignored on CPU-only runs) ----------------------------------
# Log level: WARN (quiet), INFO (prints the chosen transport: look for "NET/IB" vs "NET/Socket"
# to confirm InfiniBand is really used), TRACE (very verbose).
: "${NCCL_DEBUG:=WARN}"
# InfiniBand HCAs NCCL may use, e.g. "mlx5_0,mlx5_1" ('' = NCCL picks all it finds).
# The reference's 128-GPU run scaled 109x with InfiniBand and 92.6x without (Puri et al. 2018).
: "${NCCL_IB_HCA:=}"
# 1 = never use InfiniBand (TCP sockets only): reproduces the talk's "w/o I.band" column.
: "${NCCL_IB_DISABLE:=}"
# Network interface(s) for NCCL's socket transport and bootstrap, e.g. "ib0" or "eth0" or
# "^docker0,lo" (exclude). Set it when nodes have several NICs and NCCL picks the wrong one.
: "${NCCL_SOCKET_IFNAME:=}"

# ---- Horovod (read by hvd.init(); `hvd-lm train --fusion-threshold-mb/--cycle-time-ms` win) ----
# Tensor Fusion buffer in BYTES ('' = Horovod's default, 128 MiB since 0.21; 0 disables fusion).
# Small gradients are batched into one allreduce up to this size.
: "${HOROVOD_FUSION_THRESHOLD:=}"
# Milliseconds Horovod's background thread waits to collect tensors before each fused allreduce
# ('' = Horovod's default, 1 ms since 0.21). Larger = fewer, bigger allreduces.
: "${HOROVOD_CYCLE_TIME:=}"
# 1 = hierarchical allreduce: NCCL reduce within each node, MPI allreduce between nodes, NCCL
# broadcast back. Can help when inter-node bandwidth is the bottleneck (no InfiniBand).
: "${HOROVOD_HIERARCHICAL_ALLREDUCE:=}"
# Path of a Horovod Timeline (Chrome trace JSON, open in chrome://tracing) written by rank 0,
# e.g. "runs/timeline.json" ('' = off). Shows negotiation, fusion and allreduce per tensor.
: "${HOROVOD_TIMELINE:=}"
# Horovod's own log level: trace, debug, info, warning (default), error, fatal.
: "${HOROVOD_LOG_LEVEL:=}"

# ---- the torch engine (`hvd-lm train --backend torch`; Horovod ignores it) ---------------------
# What PyTorch's NCCL watchdog does once a collective has waited --gloo-timeout-s: '' = PyTorch's
# default (3: end the rank's process without cleanup; torchrun sets 1: abort the communicators,
# then end the process); 2 = abort the communicators and keep the process (docs/training.md).
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=}"

# ---- OpenMPI ------------------------------------------------------------------------------------
# Seconds mpirun waits after forwarding SIGTERM (a `kill`, PBS/SLURM cancel) before it SIGKILLs
# the ranks (OpenMPI's default is 1 s, short for a checkpoint write; the templates send mpirun
# SIGUSR1 instead, which is never followed by a kill). mpirun also sleeps this long after a rank
# failed, before it exits: at 120 s a failed job looked hung for two minutes.
: "${OMPI_MCA_odls_base_sigkill_timeout:=10}"
# OpenMPI refuses to start as root ("mpirun has detected an attempt to run as root") unless both
# are set. Root is what a container or the cluster in a box runs as, so the templates set them
# for root ('' = leave OpenMPI's refusal in place, e.g. OMPI_ALLOW_RUN_AS_ROOT= bash mpirun.sh).
if [ "$(id -u)" = 0 ]; then
  : "${OMPI_ALLOW_RUN_AS_ROOT=1}"
  : "${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1}"
fi

# ---- export the non-empty ones, unset the empty ones --------------------------------------------
for _hvd_lm_knob in OMP_NUM_THREADS NCCL_DEBUG NCCL_IB_HCA NCCL_IB_DISABLE NCCL_SOCKET_IFNAME \
    HOROVOD_FUSION_THRESHOLD HOROVOD_CYCLE_TIME HOROVOD_HIERARCHICAL_ALLREDUCE HOROVOD_TIMELINE \
    HOROVOD_LOG_LEVEL TORCH_NCCL_ASYNC_ERROR_HANDLING OMPI_MCA_odls_base_sigkill_timeout \
    OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM; do
  if [ -n "${!_hvd_lm_knob}" ]; then
    export "${_hvd_lm_knob?}"
  else
    unset "$_hvd_lm_knob"
  fi
done
unset _hvd_lm_knob
