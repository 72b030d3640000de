#!/usr/bin/env bash
# hvd_lm with torchrun on the torch engine (`hvd-lm train --backend torch`: torch.distributed,
# NCCL on GPUs, Gloo on CPUs; no Horovod needed): NPROC_PER_NODE ranks (one per GPU) on this
# machine, or on each of NNODES machines that meet at a rendezvous endpoint.
#
#   bash launch/torchrun.sh                                          # 2 ranks here
#   NPROC_PER_NODE=8 TRAIN_ARGS="--shards data/amazon" bash launch/torchrun.sh
#   # two machines: the same command on each (torchrun's c10d rendezvous at node1:29500)
#   NNODES=2 NPROC_PER_NODE=8 HOSTS=node1:8,node2:8 bash launch/torchrun.sh
#   hvd-lm launch --scheduler torchrun --gpus 8 --out job.sh -- --shards data/amazon
#
# PyTorch docs, "torchrun (Elastic Launch)": one node is `torchrun --standalone --nproc-per-node
# N`; several are `torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint
# HOST:PORT --rdzv-id ID` started on every node (the node whose address is HOST hosts the
# rendezvous store; the others wait for it up to torchrun's join timeout, 600 s). torchrun sets
# RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each rank; `--max-restarts 0`:
# a failed rank ends the job (elastic training is Horovod's: launch/horovodrun_elastic.sh), and
# torchrun stops the other ranks (SIGTERM, SIGKILL 30 s later). On the first host of HOSTS the
# preflight (`hvd-lm doctor`, PREFLIGHT=1) checks the hosts and exports the interface for Gloo
# and NCCL first; the rendezvous port itself is checked by hand before the nodes start: `hvd-lm
# doctor --hosts node1:8,node2:8 --rendezvous-port 29500` (docs/launch.md).

# ---- knobs: every one can be overridden from the environment -----------------------------------
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"  # ranks per node = GPUs per node
NNODES="${NNODES:-1}"                  # nodes; each runs this script (1 = this machine, --standalone)
HOSTS="${HOSTS:-}"                     # several nodes: host:slots list, e.g. node1:8,node2:8 or node[1-2]:8 (the first hosts the rendezvous)
RDZV_ENDPOINT="${RDZV_ENDPOINT:-}"     # several nodes: host:port of the rendezvous ('' = the first host of HOSTS, port 29500)
RDZV_ID="${RDZV_ID:-}"                 # several nodes: the job's id, the same on every node ('' = $SLURM_JOB_ID, else $PBS_JOBID, else one made from HOSTS, RDZV_ENDPOINT, the working folder and OUT_DIR)
NETWORK_INTERFACE="${NETWORK_INTERFACE:-}"  # NIC across nodes for Gloo/NCCL, e.g. ib0 ('' = the preflight's pick)
PREFLIGHT="${PREFLIGHT:-1}"            # with HOSTS, on its first host: 1 = `hvd-lm doctor` checks the hosts first; 0 = skip
BIND_GPU="${BIND_GPU:-0}"              # 1 = CUDA_VISIBLE_DEVICES=<local rank> per rank; 0 = torch uses cuda:<local rank>
LAUNCH_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"  # this repository's launch/ directory
PYTHON="${PYTHON:-python3}"            # interpreter that has hvd_lm and torch (same path on every node); torchrun is `$PYTHON -m torch.distributed.run`
CONFIG="${CONFIG:-}"                   # YAML file for `hvd-lm train --config` ('' = flags only)
SHARDS="${SHARDS:-data/amazon}"        # shard folder (manifest.json) when neither TRAIN_ARGS nor CONFIG names one
OUT_DIR="${OUT_DIR:-runs/torchrun-n$NNODES-x$NPROC_PER_NODE}"  # run dir (shared filesystem for several nodes)
TRAIN_ARGS="${TRAIN_ARGS:-}"           # more `hvd-lm train` flags, space-separated (e.g. --shards DIR --max-steps N)
# ---- end of knobs ------------------------------------------------------------------------------

set -euo pipefail
# shellcheck source=launch/env.sh
source "$LAUNCH_DIR/env.sh"
# shellcheck source=launch/lib.sh
source "$LAUNCH_DIR/lib.sh"

ENGINE=torch   # read by hvd_lm_train_cmd: the ranks train with --backend torch
hvd_lm_train_cmd
launch=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE" --max-restarts 0)
if [ "$NNODES" = 1 ]; then
  launch+=(--standalone)
  where="this machine"
else
  hvd_lm_hosts  # SLURM's n[001-004,7]:8 in HOSTS -> n001:8,...: the first is a name
  first="${HOSTS%%,*}"
  first="${first%%:*}"
  endpoint="${RDZV_ENDPOINT:-${first:+$first:29500}}"
  if [ -z "$endpoint" ]; then
    echo "launch: ERROR: NNODES=$NNODES needs HOSTS (node1:8,node2:8; the first hosts the" \
      "rendezvous) or RDZV_ENDPOINT=host:port" >&2
    exit 2
  fi
  if [ -n "$HOSTS" ] && "$PYTHON" -c 'import sys
from hvd_lm.comm.hosts import is_local
sys.exit(0 if is_local(sys.argv[1]) else 1)' "$first"; then
    # the first host: ssh, versions, shards and the interface the nodes share, before its ranks
    # start (exports NETWORK_INTERFACE, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) or one line
    hvd_lm_preflight "$HOSTS" ""
  else
    PREFLIGHT=0 hvd_lm_preflight "" ""  # a NETWORK_INTERFACE set becomes Gloo's and NCCL's
  fi
  # one id per job, the same on every node: two jobs meeting at one endpoint under one id would
  # join one rendezvous
  if [ -z "$RDZV_ID" ]; then
    RDZV_ID="${SLURM_JOB_ID:-${PBS_JOBID:-hvd-lm-$(printf '%s\n' "$HOSTS" "$RDZV_ENDPOINT" "$PWD" \
      "$OUT_DIR" | cksum | cut -d ' ' -f 1)}}"
  fi
  launch+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "$RDZV_ID")
  where="$NNODES nodes, rendezvous $endpoint"
fi
hvd_lm_bind_prefix
hvd_lm_banner "torchrun, $NPROC_PER_NODE rank(s) per node on $where (torch engine)" \
  "${launch[@]}" --no-python "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}"
# Not exec'd: a SIGTERM/SIGINT to this script is passed on to torchrun as SIGTERM, which sends it
# to every rank (they checkpoint at the same step and exit 0), and a failed job ends with its
# cause as the last lines.
rc=0
hvd_lm_run_preemptible --forward TERM "${launch[@]}" --no-python "${HVD_LM_BIND[@]}" \
  "${HVD_LM_CMD[@]}" || rc=$?
hvd_lm_failure_summary "$rc"
exit "$rc"
