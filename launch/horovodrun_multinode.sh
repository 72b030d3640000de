#!/usr/bin/env bash
# hvd_lm on several machines with horovodrun: NP ranks (one per GPU) over HOSTS or HOSTFILE.
# Run it on one of the machines; horovodrun starts the ranks on all of them over ssh (passwordless
# ssh between the nodes, the same paths and Python environment on every node).
#
#   HOSTS=node1:8,node2:8 NP=16 bash launch/horovodrun_multinode.sh
#   HOSTFILE=hosts.txt NP=16 NETWORK_INTERFACE=ib0 bash launch/horovodrun_multinode.sh
#   hvd-lm launch --scheduler horovodrun-multinode --gpus 16 --hosts node1,node2 --out job.sh -- ...
#
# Horovod docs, "Running Horovod": `horovodrun -np 16 -H server1:4,server2:4,... python train.py`
# or `-hostfile FILE` with lines "server1 slots=4"; `--network-interface` picks the NIC used for
# Horovod's own traffic; `--gloo`/`--mpi` picks the controller. Before any rank starts,
# `hvd-lm doctor` (PREFLIGHT=1) checks ssh both ways, the same Python/hvd_lm everywhere and the
# interface every host reaches the others through, and sets NETWORK_INTERFACE from it.

# ---- knobs: every one can be overridden from the environment -----------------------------------
NP="${NP:-2}"                          # total ranks = GPUs (world size)
HOSTS="${HOSTS:-}"                     # host:slots list, e.g. node1:8,node2:8 or node[1-2]:8 ('' = HOSTFILE, else localhost:2)
HOSTFILE="${HOSTFILE:-}"               # file with one "hostname slots=N" line per node (used when HOSTS is '')
CONTROLLER="${CONTROLLER:-gloo}"       # gloo (needs no MPI) or mpi (horovodrun then calls mpirun)
NETWORK_INTERFACE="${NETWORK_INTERFACE:-}"  # NIC(s) for Horovod traffic, e.g. ib0 or eth0,eth1 ('' = the preflight's pick)
SSH_PORT="${SSH_PORT:-}"               # ssh port of the other nodes ('' = 22)
PREFLIGHT="${PREFLIGHT:-1}"            # 1 = `hvd-lm doctor` checks the hosts first and picks NETWORK_INTERFACE; 0 = skip
BIND_GPU="${BIND_GPU:-0}"              # 1 = CUDA_VISIBLE_DEVICES=<local rank> per rank; 0 = torch uses cuda:<local rank>
LAUNCH_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"  # this repository's launch/ directory
HOROVODRUN="${HOROVODRUN:-horovodrun}" # horovodrun executable (e.g. /path/to/.venv/bin/horovodrun)
PYTHON="${PYTHON:-python3}"            # interpreter that has hvd_lm and horovod (same path on every node)
CONFIG="${CONFIG:-}"                   # YAML file for `hvd-lm train --config` ('' = flags only)
SHARDS="${SHARDS:-data/amazon}"        # shard folder (manifest.json) when neither TRAIN_ARGS nor CONFIG names one
OUT_DIR="${OUT_DIR:-runs/horovodrun-np$NP}"  # run dir on a shared filesystem (rank 0 writes it)
TRAIN_ARGS="${TRAIN_ARGS:-}"           # more `hvd-lm train` flags, space-separated (e.g. --shards DIR --max-steps N)
# ---- end of knobs ------------------------------------------------------------------------------

set -euo pipefail
# shellcheck source=launch/env.sh
source "$LAUNCH_DIR/env.sh"
# shellcheck source=launch/lib.sh
source "$LAUNCH_DIR/lib.sh"

[ -n "$HOSTS$HOSTFILE" ] || HOSTS="localhost:2"  # neither given: this machine
hvd_lm_hosts  # SLURM's n[001-004,7]:8 in HOSTS or HOSTFILE -> HOSTS, expanded
launch=("$HOROVODRUN" -np "$NP")
if [ -n "$HOSTS" ]; then
  launch+=(-H "$HOSTS")
elif [ -n "$HOSTFILE" ] && [ -f "$HOSTFILE" ]; then
  launch+=(-hostfile "$HOSTFILE")
else
  echo "set HOSTS (node1:8,node2:8) or HOSTFILE (a file with lines 'node1 slots=8');" \
    "HOSTFILE='$HOSTFILE' does not exist" >&2
  exit 2
fi
hvd_lm_train_cmd
# ssh, versions, shards and the interface every host reaches the others through, before any rank
# starts: sets NETWORK_INTERFACE (and NCCL/Gloo/OpenMPI's) or stops here with one line.
hvd_lm_preflight "$HOSTS" "$HOSTFILE"
case "$CONTROLLER" in
  gloo | mpi) launch+=("--$CONTROLLER") ;;
  *) echo "CONTROLLER must be gloo or mpi, got '$CONTROLLER'" >&2; exit 2 ;;
esac
if [ -n "$NETWORK_INTERFACE" ]; then
  launch+=(--network-interface "$NETWORK_INTERFACE")
fi
if [ -n "$SSH_PORT" ]; then
  launch+=(-p "$SSH_PORT")
fi
hvd_lm_bind_prefix
hvd_lm_banner "horovodrun, $NP ranks on ${HOSTS:-$HOSTFILE} ($CONTROLLER controller)" \
  "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}"
# Not exec'd: a SIGTERM/SIGINT to this script is passed on to horovodrun as SIGTERM (every rank
# checkpoints at the same step), and a failed job ends with its cause as the last lines.
rc=0
hvd_lm_run_preemptible --forward TERM "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}" || rc=$?
hvd_lm_failure_summary "$rc"
exit "$rc"
