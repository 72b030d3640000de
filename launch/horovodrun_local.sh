#!/usr/bin/env bash
# hvd_lm on ONE machine with horovodrun: NP ranks (one per GPU, or CPU ranks without GPUs).
#
#   bash launch/horovodrun_local.sh                                   # 2 ranks, defaults below
#   NP=8 TRAIN_ARGS="--hidden-size 1024 --max-steps 1000" bash launch/horovodrun_local.sh  # SHARDS=data/amazon
#   hvd-lm launch --scheduler horovodrun --gpus 8 --out job.sh -- --shards data/amazon
#
# horovodrun starts every rank itself (Horovod docs, "Running Horovod": `horovodrun -np 4 -H
# localhost:4 python train.py`) and passes this environment to them; each rank uses
# cuda:<local rank> (or CUDA_VISIBLE_DEVICES=<local rank> with BIND_GPU=1).

# ---- knobs: every one can be overridden from the environment -----------------------------------
NP="${NP:-2}"                          # ranks on this machine = GPUs (world size)
CONTROLLER="${CONTROLLER:-gloo}"       # gloo (needs no MPI) or mpi (Horovod built with MPI)
BIND_GPU="${BIND_GPU:-0}"              # 1 = CUDA_VISIBLE_DEVICES=<local rank> per rank; 0 = torch uses cuda:<local rank>
LAUNCH_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"  # this repository's launch/ directory
HOROVODRUN="${HOROVODRUN:-horovodrun}" # horovodrun executable (e.g. /path/to/.venv/bin/horovodrun)
PYTHON="${PYTHON:-python3}"            # interpreter that has hvd_lm and horovod
CONFIG="${CONFIG:-}"                   # YAML file for `hvd-lm train --config` ('' = flags only)
SHARDS="${SHARDS:-data/amazon}"        # shard folder (manifest.json) when neither TRAIN_ARGS nor CONFIG names one
OUT_DIR="${OUT_DIR:-runs/horovodrun-np$NP}"  # run dir: metrics.jsonl, checkpoints (resumed when it has one)
TRAIN_ARGS="${TRAIN_ARGS:-}"           # more `hvd-lm train` flags, space-separated (e.g. --shards DIR --max-steps N)
# ---- end of knobs ------------------------------------------------------------------------------

set -euo pipefail
# shellcheck source=launch/env.sh
source "$LAUNCH_DIR/env.sh"
# shellcheck source=launch/lib.sh
source "$LAUNCH_DIR/lib.sh"

case "$CONTROLLER" in
  gloo | mpi) ;;
  *) echo "CONTROLLER must be gloo or mpi, got '$CONTROLLER'" >&2; exit 2 ;;
esac
hvd_lm_train_cmd
hvd_lm_bind_prefix
launch=("$HOROVODRUN" -np "$NP" -H "localhost:$NP" "--$CONTROLLER")
hvd_lm_banner "horovodrun, $NP ranks on this machine ($CONTROLLER controller)" \
  "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}"
# Not exec'd: a SIGTERM/SIGINT to this script is passed on to horovodrun as SIGTERM (every rank
# checkpoints at the same step), and a failed job ends with its cause as the last lines.
rc=0
hvd_lm_run_preemptible --forward TERM "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}" || rc=$?
hvd_lm_failure_summary "$rc"
exit "$rc"
