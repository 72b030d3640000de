#!/usr/bin/env bash
# hvd_lm with elastic Horovod: the job keeps training when workers are lost or added.
#
#   DISCOVERY=launch/discover_hosts.sh NP=16 MIN_NP=8 MAX_NP=16 bash launch/horovodrun_elastic.sh
#   HOSTS_FILE=hosts.txt NP=2 MIN_NP=1 bash launch/horovodrun_elastic.sh   # static list, editable
#   hvd-lm launch --scheduler horovodrun-elastic --gpus 16 --gpus-per-node 8 -- --shards ...
#
# Horovod docs, "Elastic Horovod": `horovodrun -np 8 --min-np 4 --max-np 12
# --host-discovery-script discover_hosts.sh python train.py`. The discovery script prints one
# "host:slots" line per usable host and is re-run every second: hosts it stops listing are
# removed, new ones are added (up to MAX_NP ranks). Elastic jobs use the Gloo controller.
# Horovod blacklists a host whose worker failed; with BLACKLIST_COOLDOWN="MIN MAX" it may come back
# after MIN*2^k (at most MAX) seconds, when discovery lists it again (--blacklist-cooldown-range).
# Horovod 0.28.1 detects the common network interface between hosts and so waits for two hosts
# before it starts (runner/gloo_run.py, _get_min_start_hosts): on a single host, set
# NETWORK_INTERFACE (e.g. lo) and it starts at once.
# GLOO_TIMEOUT: when a host is added, Horovod starts its worker only after the running ones have
# entered the new rendezvous, and they wait for it GLOO_TIMEOUT seconds (Horovod's one Gloo
# timeout, also a collective's wait for a silent peer: a pulled cable stalls the job that long).
# A worker not there by then (ssh, Python and the torch/Horovod imports on a busy node, or a
# worker that died starting) ends the whole job: every worker aborts and Horovod stops
# ("failure count == N -> stop running"). Hence 300 s here, not Horovod's 30; a training flag
# --gloo-timeout-s overrides it (docs/reliability.md "Elastic: a host that comes back").
# `hvd-lm train --elastic` commits its state in memory every --commit-every steps; a lost worker
# rolls every rank back to the last commit, the world re-forms, and training continues (see
# docs/launch.md "Elastic training").

# ---- knobs: every one can be overridden from the environment -----------------------------------
NP="${NP:-2}"                          # ranks to start with
MIN_NP="${MIN_NP:-1}"                  # fewest ranks the job continues with (fewer: it stops)
MAX_NP="${MAX_NP:-$NP}"                # most ranks it grows to when hosts are added
DISCOVERY="${DISCOVERY:-}"             # host discovery script ('' = print HOSTS_FILE's lines)
HOSTS_FILE="${HOSTS_FILE:-}"           # with DISCOVERY='': a file of "host:slots" lines you may edit while the job runs
SLOTS="${SLOTS:-}"                     # slots per host for launch/discover_hosts.sh ('' = SLURM's tasks per node)
ELASTIC_TIMEOUT="${ELASTIC_TIMEOUT:-600}"  # seconds to wait for MIN_NP ranks after a failure
GLOO_TIMEOUT="${GLOO_TIMEOUT:-300}"    # seconds a worker waits for the others: at a rendezvous (a returning host's new worker starting) and in a collective (a silent peer); HOROVOD_GLOO_TIMEOUT_SECONDS, see above
RESET_LIMIT="${RESET_LIMIT:-}"         # most resets (worker losses/additions) before giving up ('' = no limit)
BLACKLIST_COOLDOWN="${BLACKLIST_COOLDOWN:-}"  # "MIN MAX" seconds a host whose worker failed stays out before discovery may add it back ('' = out for good)
NETWORK_INTERFACE="${NETWORK_INTERFACE:-}"  # NIC(s) for Horovod traffic, e.g. ib0 ('' = the preflight's pick; on ONE host set it, e.g. lo)
PREFLIGHT="${PREFLIGHT:-1}"            # 1 = `hvd-lm doctor` checks the hosts discovery lists at start and picks the NIC; 0 = skip
LAUNCH_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"  # this repository's launch/ directory
HOROVODRUN="${HOROVODRUN:-horovodrun}" # horovodrun executable (e.g. /path/to/.venv/bin/horovodrun)
PYTHON="${PYTHON:-python3}"            # interpreter that has hvd_lm and horovod (same path on every host)
CONFIG="${CONFIG:-}"                   # YAML file for `hvd-lm train --config` ('' = flags only)
SHARDS="${SHARDS:-data/amazon}"        # shard folder (manifest.json) when neither TRAIN_ARGS nor CONFIG names one
OUT_DIR="${OUT_DIR:-runs/elastic-np$NP}"  # run dir on a shared filesystem (rank 0 writes it)
TRAIN_ARGS="${TRAIN_ARGS:-}"           # more `hvd-lm train` flags (e.g. --shards DIR --max-steps N --commit-every 20)
# ---- end of knobs ------------------------------------------------------------------------------

set -euo pipefail
# shellcheck source=launch/env.sh
source "$LAUNCH_DIR/env.sh"
# shellcheck source=launch/lib.sh
source "$LAUNCH_DIR/lib.sh"

if [ -z "$DISCOVERY" ]; then
  if [ -z "$HOSTS_FILE" ] || [ ! -f "$HOSTS_FILE" ]; then
    echo "set DISCOVERY (a host discovery script, e.g. $LAUNCH_DIR/discover_hosts.sh inside a" \
      "SLURM job) or HOSTS_FILE (a file of host:slots lines); HOSTS_FILE='$HOSTS_FILE'" >&2
    exit 2
  fi
  mkdir -p "$OUT_DIR"
  DISCOVERY="$(cd "$OUT_DIR" && pwd)/discover_hosts.sh"  # kept beside the run: it is re-run all along
  printf '#!/bin/sh\ncat %q\n' "$(cd "$(dirname "$HOSTS_FILE")" && pwd)/$(basename "$HOSTS_FILE")" >"$DISCOVERY"
  chmod +x "$DISCOVERY"
fi
export SLOTS
hvd_lm_gate_discovery                  # a returning host: listed once a worker can start there
TRAIN_ARGS="--elastic true $TRAIN_ARGS"
hvd_lm_train_cmd
start_hosts="$("$DISCOVERY" | paste -sd, -)"
if [ "$(tr ',' '\n' <<< "$start_hosts" | grep -c .)" -gt 1 ]; then
  hvd_lm_preflight "$start_hosts"      # ssh, versions, shards, the shared NIC (or one line, exit 2)
fi
launch=("$HOROVODRUN" -np "$NP" --min-np "$MIN_NP" --max-np "$MAX_NP"
  --host-discovery-script "$DISCOVERY" --elastic-timeout "$ELASTIC_TIMEOUT"
  --gloo-timeout-seconds "$GLOO_TIMEOUT")
if [ -n "$RESET_LIMIT" ]; then
  launch+=(--reset-limit "$RESET_LIMIT")
fi
if [ -n "$BLACKLIST_COOLDOWN" ]; then
  read -r -a cooldown <<< "$BLACKLIST_COOLDOWN"
  launch+=(--blacklist-cooldown-range "${cooldown[@]}")
fi
if [ -n "$NETWORK_INTERFACE" ]; then
  launch+=(--network-interface "$NETWORK_INTERFACE")
fi
hvd_lm_bind_prefix
hvd_lm_banner "elastic horovodrun, $NP ranks ($MIN_NP..$MAX_NP), hosts from $DISCOVERY" \
  "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}"
# Not exec'd: a SIGTERM/SIGINT to this script is passed on to horovodrun as SIGTERM (every rank
# checkpoints at the same step), and a failed job ends with its cause as the last lines.
rc=0
hvd_lm_run_preemptible --forward TERM "${launch[@]}" "${HVD_LM_BIND[@]}" "${HVD_LM_CMD[@]}" || rc=$?
hvd_lm_failure_summary "$rc"
exit "$rc"
