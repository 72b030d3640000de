#!/usr/bin/env bash
# Host discovery for elastic Horovod inside a SLURM allocation: one "host:slots" line per node
# of the job that SLURM still considers usable (Horovod docs, "Elastic Horovod": the script is
# re-run every second; hosts it stops printing are removed from the job).
#
# Nodes come from `scontrol show hostnames $SLURM_JOB_NODELIST`; a node whose state
# (`scontrol show node`) is DOWN, DRAIN(ED/ING), FAIL(ING) or NOT_RESPONDING is left out, and so
# is every name listed in EXCLUDE_FILE (one per line: drop a node by hand). SLOTS = ranks per
# node ('' = SLURM_NTASKS_PER_NODE, else SLURM_GPUS_ON_NODE, else 1).
set -euo pipefail
: "${SLURM_JOB_NODELIST:?run inside a SLURM job (sbatch/salloc)}"
slots="${SLOTS:-${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}}"
slots="${slots%%(*}"                   # "8(x2)" -> "8"
excluded=""
if [ -n "${EXCLUDE_FILE:-}" ] && [ -f "$EXCLUDE_FILE" ]; then
  excluded="$(cat "$EXCLUDE_FILE")"
fi
while IFS= read -r node; do
  [ -n "$node" ] || continue
  if printf '%s\n' "$excluded" | grep -qxF "$node"; then
    continue
  fi
  state="$(scontrol show node "$node" -o 2>/dev/null | sed -n 's/.* State=\([^ ]*\).*/\1/p')"
  case "$state" in
    *DOWN* | *DRAIN* | *FAIL* | *NOT_RESPONDING* | "") continue ;;
  esac
  echo "$node:$slots"
done < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
