# shellcheck shell=bash disable=SC2034  # the HVD_LM_* globals set here are read by the templates
# Helpers shared by the hvd_lm launch templates (sourced after env.sh). No knobs live here: every
# setting is in the knobs block at the top of each template or in env.sh.
#
# Functions fill UPPER_CASE global arrays (bash functions cannot return arrays):
#   hvd_lm_train_cmd          -> HVD_LM_CMD      the `python -m hvd_lm train ...` command
#   hvd_lm_bind_prefix        -> HVD_LM_BIND     optional per-rank GPU binding wrapper
#   hvd_lm_mpirun_env_flags   -> HVD_LM_MPI_X    `-x NAME` for the variables ranks need
#   hvd_lm_run_preemptible    runs a launcher, turning scheduler signals into a checkpoint
#   hvd_lm_failure_summary    the closing block of a failed launch: its cause, last
#   hvd_lm_hosts              SLURM's compressed names in HOSTS or HOSTFILE -> HOSTS, expanded
#   hvd_lm_preflight          `hvd-lm doctor` on the job's hosts; exports the interface to use
#   hvd_lm_gate_discovery     elastic: a returning host listed only once a worker can start there

# Build HVD_LM_CMD from the knobs PYTHON, CONFIG, SHARDS, OUT_DIR, ENGINE and TRAIN_ARGS:
#   $PYTHON -m hvd_lm train [--config $CONFIG] [--shards $SHARDS] --out-dir $OUT_DIR
#           [--backend torch] [--resume auto] $TRAIN_ARGS
# ENGINE is horovod (the default: Horovod) or torch (`--backend torch`: torch.distributed, NCCL on
# GPUs, Gloo on CPUs; docs/training.md); anything else stops the job here (exit 2).
# The shards come from the first of: `--shards DIR` in TRAIN_ARGS, `data.shards` in CONFIG, the
# SHARDS knob (`--shards $SHARDS` is added only in that last case). A shard folder without a
# manifest.json stops the job here with one line, before any rank starts (exit 2).
# `--resume auto` is added only when $OUT_DIR already holds a checkpoint (`latest` or a step file),
# so a requeued or resubmitted job continues from it and a fresh job starts at step 0 (`hvd-lm
# train` refuses a fresh run over another run's checkpoints). TRAIN_ARGS is split on
# whitespace (values with spaces belong in the YAML config). Sets HVD_LM_SHARDS (the folder, ''
# when unknown) and HVD_LM_DEVICE (TRAIN_ARGS' --device, '' when not given) for the preflight.
hvd_lm_train_cmd() {
  local extra=() shards="" from="" i
  HVD_LM_DEVICE=""
  read -r -a extra <<< "${TRAIN_ARGS:-}"
  for ((i = 0; i < ${#extra[@]}; i++)); do
    case "${extra[i]}" in
      --shards) shards="${extra[i + 1]:-}"; from="TRAIN_ARGS" ;;
      --shards=*) shards="${extra[i]#--shards=}"; from="TRAIN_ARGS" ;;
      --device) HVD_LM_DEVICE="${extra[i + 1]:-}" ;;
      --device=*) HVD_LM_DEVICE="${extra[i]#--device=}" ;;
    esac
  done
  if [ -z "$from" ] && [ -n "${CONFIG:-}" ]; then
    shards="$("${PYTHON:-python3}" -c 'import sys
from hvd_lm.options.tree import read_yaml  # within its size and alias budget
d = read_yaml(sys.argv[1]) or {}
s = (d.get("data") or {}).get("shards") or ""
print(s if isinstance(s, str) else "")' "$CONFIG" 2>/dev/null)" || shards=""
    [ -n "$shards" ] && from="CONFIG ($CONFIG)"
  fi
  HVD_LM_CMD=("${PYTHON:-python3}" -m hvd_lm train)
  if [ -n "${CONFIG:-}" ]; then
    HVD_LM_CMD+=(--config "$CONFIG")
  fi
  if [ -z "$from" ] && [ -n "${SHARDS:-}" ]; then
    shards="$SHARDS"; from="SHARDS"
    HVD_LM_CMD+=(--shards "$shards")
  fi
  if [ -n "$from" ] && [ ! -f "$shards/manifest.json" ]; then
    echo "launch: ERROR: $shards/manifest.json not found (shards from $from): prepare them" \
      "first (\`python -m data_prep prepare FILES... --out $shards\`) or set SHARDS=DIR" >&2
    exit 2
  fi
  HVD_LM_SHARDS="$shards"
  HVD_LM_CMD+=(--out-dir "$OUT_DIR")
  case "${ENGINE:-horovod}" in
    horovod) ;;
    torch) HVD_LM_CMD+=(--backend torch) ;;
    *) echo "launch: ERROR: ENGINE must be horovod or torch, got '$ENGINE'" >&2; exit 2 ;;
  esac
  # (not with --overwrite in TRAIN_ARGS: the user asked to start over, and train refuses both)
  local overwrite=0 a
  for a in "${extra[@]}"; do
    case "$a" in --overwrite | --overwrite=true) overwrite=1 ;; esac
  done
  if [ "$overwrite" = 0 ] && { [ -f "$OUT_DIR/checkpoints/latest" ] ||
    compgen -G "$OUT_DIR/checkpoints/step_*.pt" >/dev/null; }; then
    HVD_LM_CMD+=(--resume auto)
  fi
  HVD_LM_CMD+=("${extra[@]}")
}

# HVD_LM_BIND = (bash $LAUNCH_DIR/bind_gpu.sh) when BIND_GPU=1, else empty: with it each rank sees
# only the GPU of its local rank (CUDA_VISIBLE_DEVICES); without it every rank sees all GPUs of
# its node and `hvd-lm train --device auto` picks cuda:<local rank>. Both give one GPU per rank.
hvd_lm_bind_prefix() {
  HVD_LM_BIND=()
  if [ "${BIND_GPU:-0}" = 1 ]; then
    HVD_LM_BIND=(bash "$LAUNCH_DIR/bind_gpu.sh")
  fi
}

# HVD_LM_MPI_X = (-x NAME ...) for OpenMPI's mpirun: PATH, LD_LIBRARY_PATH, PYTHONPATH,
# VIRTUAL_ENV and every exported NCCL_*, HOROVOD_*, OMP_* variable (Horovod docs, "Running
# Horovod": `mpirun ... -x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH`), and for the torch engine
# GLOO_*, TORCH_*, MASTER_ADDR and MASTER_PORT. OMPI_MCA_* variables are forwarded by OpenMPI
# itself.
hvd_lm_mpirun_env_flags() {
  HVD_LM_MPI_X=()
  local name
  while IFS= read -r name; do
    case "$name" in
      PATH | LD_LIBRARY_PATH | PYTHONPATH | VIRTUAL_ENV | NCCL_* | HOROVOD_* | OMP_* | GLOO_* | \
        TORCH_* | MASTER_ADDR | MASTER_PORT)
        HVD_LM_MPI_X+=(-x "$name") ;;
    esac
  done < <(compgen -e)
}

# hvd_lm_hosts: SLURM's compressed node names (n[001-004,7]:8, what $SLURM_JOB_NODELIST holds;
# the slots apply to each name of their item) in HOSTS, or in the lines of HOSTFILE when HOSTS is
# '', expanded into HOSTS (n001:8,...,n004:8,n7:8; HOSTFILE then '') by the parser `hvd-lm doctor`
# reads host lists with (hvd_lm.comm.hosts.parse_hosts): horovodrun's and mpirun's -H and
# -hostfile do not read them. A list it cannot read stops the launch with one line naming HOSTS
# or HOSTFILE (exit 2). A list without brackets is left as it is.
hvd_lm_hosts() {
  local from=HOSTS
  if [ -z "${HOSTS:-}" ] && [ -f "${HOSTFILE:-}" ] && grep -q '\[' "$HOSTFILE"; then
    from=HOSTFILE
  elif [[ "${HOSTS:-}" != *"["* ]]; then
    return 0
  fi
  HOSTS="$("${PYTHON:-python3}" -c 'import sys
from hvd_lm.comm.hosts import parse_hostfile, parse_hosts
what, value = sys.argv[1:]
try:
    hosts = parse_hosts(value, what=what) if what == "HOSTS" else parse_hostfile(value, what)
except ValueError as e:
    sys.exit(f"launch: ERROR: {e}")
print(",".join(f"{h}:{n}" for h, n in hosts))' "$from" "${!from}")" || exit 2
  HOSTFILE=""
}

# hvd_lm_preflight HOSTS [HOSTFILE [START]]: `hvd-lm doctor` on the job's hosts (host:slots,...
# or a hostfile) before any rank starts, when PREFLIGHT=1 (the templates' default): the same
# Python and hvd_lm on every host, the network interface every host reaches every other one
# through, ports, the shards (HVD_LM_SHARDS), OUT_DIR and CONFIG at the same path on every host,
# GPUs per slot; with ENGINE=torch and MASTER_PORT set, the torch engine's rendezvous port on
# the first host. START is how its agents start (`hvd-lm doctor --launcher`): ssh (the default:
# from here to every host, and passwordless ssh both ways is checked, as horovodrun and OpenMPI
# without a scheduler need it), srun (one task per node of a SLURM job) or mpirun (one process
# per host, as a PBS job's ranks start): the last two need no ssh between the nodes. It exports
# what it picked (NETWORK_INTERFACE, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME,
# OMPI_MCA_btl_tcp_if_include, OMPI_MCA_oob_tcp_if_include; values already set are kept, and
# checked), so that a node with docker0 or a management NIC cannot make Horovod or OpenMPI hang;
# or it stops the job with the doctor's one line (exit 2). Bounded: PREFLIGHT_TIMEOUT seconds
# (45). With PREFLIGHT=0 only the last step runs: a NETWORK_INTERFACE you set becomes those
# variables' default.
hvd_lm_preflight() {
  if [ "${PREFLIGHT:-1}" = 1 ]; then
    _hvd_lm_doctor "$@"
  fi
  # NETWORK_INTERFACE (set, or picked by the doctor) is the default of every library's knob
  if [ -n "${NETWORK_INTERFACE:-}" ]; then
    : "${NCCL_SOCKET_IFNAME:=$NETWORK_INTERFACE}" "${GLOO_SOCKET_IFNAME:=$NETWORK_INTERFACE}"
    : "${OMPI_MCA_btl_tcp_if_include:=$NETWORK_INTERFACE}"
    : "${OMPI_MCA_oob_tcp_if_include:=$NETWORK_INTERFACE}"
    export NETWORK_INTERFACE NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME OMPI_MCA_btl_tcp_if_include \
      OMPI_MCA_oob_tcp_if_include
  fi
}

_hvd_lm_doctor() {
  local args=() out
  if [ -n "${1:-}" ]; then
    args+=(--hosts "$1")
  else
    args+=(--hostfile "$2")
  fi
  if [ -n "${NETWORK_INTERFACE:-}" ]; then
    args+=(--network-interface "$NETWORK_INTERFACE")
  fi
  if [ -n "${HVD_LM_SHARDS:-}" ]; then
    args+=(--shards "$HVD_LM_SHARDS")
  fi
  # the run folder (its parent until made) and the config: every host at the same path
  args+=(--paths "${OUT_DIR:-.}${CONFIG:+,$CONFIG}")
  case "${HVD_LM_DEVICE:-}" in
    cpu | cuda) args+=(--device "$HVD_LM_DEVICE") ;;
    cuda:*) args+=(--device cuda) ;;
  esac
  if [ -n "${SSH_PORT:-}" ]; then
    args+=(--ssh-port "$SSH_PORT")
  fi
  args+=(--launcher "${3:-ssh}")
  # the torch engine with a fixed rendezvous port (SLURM sets one): the first host opens it,
  # every other host reaches it (exports MASTER_ADDR/MASTER_PORT when not set)
  if [ "${ENGINE:-horovod}" = torch ] && [ -n "${MASTER_PORT:-}" ]; then
    args+=(--rendezvous-port "$MASTER_PORT")
  fi
  out="$("${PYTHON:-python3}" -m hvd_lm doctor "${args[@]}" --timeout "${PREFLIGHT_TIMEOUT:-45}" \
    --format shell)" || exit 2
  eval "$out"
}

# Print what is about to run (to the job log): time, host, description, command line.
hvd_lm_banner() {
  echo "$(date '+%F %T') $(hostname): $1"
  shift
  printf 'command:'
  printf ' %q' "$@"
  printf '\n'
}

# hvd_lm_run_preemptible [--forward SIG] CMD...: run CMD (the launcher: srun/mpirun/horovodrun +
# training) in the background and wait for it. On SIGUSR1 (SLURM `--signal=B:USR1@120`,
# `scancel --signal=USR1 --batch`), SIGTERM (PBS preemption, SLURM cancel, `kill`) or SIGINT,
# send SIG to CMD (default USR1): srun and OpenMPI's mpirun forward SIGUSR1 to every rank, and
# `hvd-lm train` then writes a checkpoint on all ranks at the same step and exits 0 (summary
# stop=signal). (OpenMPI's mpirun forwards SIGTERM but then kills the ranks at once, before they
# can checkpoint, hence the translation; horovodrun passes SIGTERM on itself: --forward TERM.)
# Its stdout and stderr pass through unchanged; every line holding "ERROR:" is also kept for
# hvd_lm_failure_summary. Returns CMD's exit status; HVD_LM_SIGNALLED=1 when a signal was
# forwarded, HVD_LM_SIGNAL its name (USR1, TERM, INT).
hvd_lm_run_preemptible() {
  HVD_LM_FORWARD=USR1
  if [ "${1:-}" = --forward ]; then
    HVD_LM_FORWARD="$2"
    shift 2
  fi
  HVD_LM_SIGNALLED=0
  HVD_LM_SIGNAL=""
  HVD_LM_REQUEUED=0
  HVD_LM_INTERRUPTED=0
  HVD_LM_T0="$(date +%s)"
  HVD_LM_ERRORS="$(mktemp "${TMPDIR:-/tmp}/hvd-lm-errors.XXXXXX")"
  HVD_LM_FIFOS="$(mktemp -d "${TMPDIR:-/tmp}/hvd-lm-out.XXXXXX")"
  mkfifo "$HVD_LM_FIFOS/out" "$HVD_LM_FIFOS/err"
  # the filters outlive a signal to this script (they end at the launcher's last line)
  # exec: each filter's PID is awk's own, so that _hvd_lm_wait_filters' SIGKILL ends the
  # process that holds this script's stdout (a subshell killed would leave its awk running)
  (trap '' INT TERM USR1; exec "${HVD_LM_AWK[@]}" -v errors="$HVD_LM_ERRORS" \
    "$HVD_LM_KEEP_ERRORS" <"$HVD_LM_FIFOS/out") &
  HVD_LM_FILTERS=($!)
  (trap '' INT TERM USR1; exec "${HVD_LM_AWK[@]}" -v errors="$HVD_LM_ERRORS" \
    "$HVD_LM_KEEP_ERRORS" <"$HVD_LM_FIFOS/err" >&2) &
  HVD_LM_FILTERS+=($!)
  # unbuffered: horovodrun (Python) would hold its ranks' lines back in a pipe's buffer
  PYTHONUNBUFFERED=1 "$@" >"$HVD_LM_FIFOS/out" 2>"$HVD_LM_FIFOS/err" &
  HVD_LM_PID=$!
  trap '_hvd_lm_forward USR1' USR1
  trap '_hvd_lm_forward TERM' TERM
  trap '_hvd_lm_forward INT' INT
  local rc
  while :; do
    rc=0
    wait "$HVD_LM_PID" || rc=$?
    # A trapped signal interrupts `wait` (status > 128) while CMD still runs: wait again.
    if [ "$rc" -gt 128 ] && [ "$HVD_LM_INTERRUPTED" = 1 ]; then
      HVD_LM_INTERRUPTED=0
      continue
    fi
    break
  done
  # a signal from now on finds the training ended: one line, and the script goes on to report
  # what the training did (the default action would end it: SLURM's warning, which may come up
  # to 60 s early, made a finished job "killed by SIGUSR1, exit status 138", JobState=FAILED)
  trap '_hvd_lm_late USR1' USR1
  trap '_hvd_lm_late TERM' TERM
  trap - INT
  _hvd_lm_wait_filters
  # srun can exit 0 after a step whose tasks never started ("srun: error: task 0 launch failed":
  # seen with PMIx): that is a failure, whatever the status says
  if [ "$rc" = 0 ] && grep -q "^srun: error: task [0-9]* launch failed" "$HVD_LM_ERRORS" 2>/dev/null; then
    echo "launch: ERROR: srun exited 0, but its tasks failed to launch (its lines above): the" \
      "training did not run" >&2
    echo "launch: ERROR: srun's tasks failed to launch" >>"$HVD_LM_ERRORS"
    rc=1
  fi
  # every rank checkpointed on a signal: a clean stop, whatever the launcher's exit status
  # (horovodrun across hosts exits 255 or 0 after its ranks stopped cleanly, from one run to the
  # next; the requeue logic and the closing block must see a clean stop, not a crash, and the
  # user the same line either way)
  if [ "$rc" != 0 ] || [ "$HVD_LM_SIGNALLED" = 1 ]; then
    local clean=0  # 3: a clean stop (its line printed); 0: not one (the closing block says)
    "${PYTHON:-python3}" -m hvd_lm.jobs.failure_summary "$OUT_DIR" --rc "$rc" \
      --since "$HVD_LM_T0" --clean-only >&2 || clean=$?
    if [ "$clean" = 3 ]; then rc=0; fi
  fi
  return "$rc"
}

# The filters' awk program: stdin to stdout unchanged, each line holding "ERROR:" (or the
# launcher's own word on a lost rank or a refused start: srun's "srun: error:", OpenMPI's
# "mpirun noticed that process rank" and its root refusal, horovodrun's "Process N exit with
# status code", torchrun's root-cause block and its host/rank/exitcode fields) also appended to the file `errors`
# ($HVD_LM_ERRORS), which the closing block reads. awk, not a `read` loop: bash reads a pipe a
# byte per system call, which a verbose job's output (NCCL_DEBUG=INFO on many ranks) would back
# up behind.
HVD_LM_KEEP_ERRORS='{ print; fflush() } /ERROR:|srun: error:|mpirun noticed that process rank|mpirun has detected an attempt to run as root|^Process [0-9]+ exit with status code|Root Cause \(first observed failure\)|^(\[[0-9,]+\]<std(out|err)>:)? *(host|rank|exitcode) *: / { print >> errors; fflush(errors) }'
# mawk (Debian's and Ubuntu's awk) reads a pipe a block at a time, holding a line back until the
# block fills, unless -W interactive; gawk and busybox pass each line on as it comes
HVD_LM_AWK=(awk)
if awk -W version 2>/dev/null | grep -q mawk; then HVD_LM_AWK=(awk -W interactive); fi

# Wait (5 s at most: a rank left behind may hold the pipe) until the filters printed the
# launcher's last line, so that nothing follows the summary.
_hvd_lm_wait_filters() {
  local i pid
  for ((i = 0; i < 50; i++)); do
    for pid in "${HVD_LM_FILTERS[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then
        sleep 0.1
        continue 2
      fi
    done
    break
  done
  # SIGKILL: the filters ignore TERM (they must outlive a signal to this script), and one still
  # running holds this script's stdout open after it exits (its reader, e.g. a test, would wait
  # for an end of file that never comes) when a process the launcher left behind (an ssh to a
  # host whose link went down) still holds the FIFO's write end
  for pid in "${HVD_LM_FILTERS[@]}"; do
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$HVD_LM_FIFOS"
}

_hvd_lm_forward() {
  HVD_LM_INTERRUPTED=1
  HVD_LM_SIGNALLED=1
  HVD_LM_SIGNAL="$1"
  local sig="$HVD_LM_FORWARD"
  if [ -n "${SLURM_JOB_ID:-}" ] && [ "$1" = TERM ] && _hvd_lm_slurm_requeued; then
    # `scontrol requeue JOB` (an admin, a preemption): SLURM counts the restart before its
    # SIGTERM, so the job's Restarts is above this allocation's SLURM_RESTART_COUNT
    HVD_LM_REQUEUED=1
    echo "$(date '+%F %T') launch: got SIGTERM: SLURM is requeueing job $SLURM_JOB_ID" \
      "(scontrol requeue): asking the ranks to checkpoint before SLURM's kill; the job starts" \
      "again after its BeginTime (about 2 minutes; \`scontrol update JobId=$SLURM_JOB_ID" \
      "StartTime=now\` sooner) and continues with --resume auto" >&2
  elif [ -n "${SLURM_JOB_ID:-}" ] && [ "$1" = TERM ]; then
    # `scancel JOB` (no --signal) or a node going down: SLURM sends SIGTERM to every process of
    # the job at once and SIGKILL KillWait seconds later, whatever they are doing.
    local kill_wait
    kill_wait="$(timeout 5 scontrol show config 2>/dev/null | awk '$1 == "KillWait" {print $3}')"
    echo "$(date '+%F %T') launch: got SIGTERM (scancel, or the node going down): asking the" \
      "ranks to checkpoint, but SLURM kills the job ${kill_wait:-KillWait} s after this" \
      "signal, so a checkpoint is written only if it fits; to stop with a checkpoint use" \
      "\`scancel --signal=USR1 --batch $SLURM_JOB_ID\` (checkpoint, then requeue) or" \
      "\`scancel --signal=TERM $SLURM_JOB_ID\` (checkpoint, then end)" >&2
  else
    echo "$(date '+%F %T') launch: got SIG$1; sending SIG$sig to the training (pid" \
      "$HVD_LM_PID): checkpoint on all ranks, then stop" >&2
  fi
  kill "-$sig" "$HVD_LM_PID" 2>/dev/null || true
}

# True when SLURM is requeueing this job (`scontrol show job`'s Restarts above the allocation's
# SLURM_RESTART_COUNT: SLURM counts the restart before it signals the job).
_hvd_lm_slurm_requeued() {
  local restarts
  restarts="$(timeout 5 scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' |
    awk -F= '$1 == "Restarts" {print $2; exit}')"
  [ -n "$restarts" ] && [ "$restarts" -gt "${SLURM_RESTART_COUNT:-0}" ] 2>/dev/null
}

_hvd_lm_late() {
  echo "$(date '+%F %T') launch: got SIG$1 after the training had ended: nothing left to stop" >&2
}

# hvd_lm_trained_a_step: true when the last training run in $OUT_DIR trained at least one step
# (summary.json "step" above its "start_step"): requeueing one that trained none would only
# repeat it, allocation after allocation.
hvd_lm_trained_a_step() {
  "${PYTHON:-python3}" -c 'import json, sys; s = json.load(open(sys.argv[1])); sys.exit(not s["step"] > s.get("start_step", -1))' \
    "$OUT_DIR/summary.json" 2>/dev/null
}

# hvd_lm_failure_summary RC [RESUME]: when RC != 0, the closing block of a failed launch as the
# last lines, on stderr (python -m hvd_lm.jobs.failure_summary): the failure a rank recorded in
# $OUT_DIR/metrics.jsonl since the launch started (rank 0's when it wrote one: rank, host,
# step, the one-line cause, the newest complete checkpoint), else the first ERROR line the
# launch printed, and RESUME: how to run it again (default: this template, the same OUT_DIR).
hvd_lm_failure_summary() {
  local rc="$1" resume="${2:-run the same launch again with OUT_DIR=$OUT_DIR: it continues with --resume auto}"
  if [ "$rc" != 0 ]; then
    "${PYTHON:-python3}" -m hvd_lm.jobs.failure_summary "$OUT_DIR" --rc "$rc" \
      --since "${HVD_LM_T0:-0}" --errors "${HVD_LM_ERRORS:-}" --resume "$resume" >&2 ||
      echo "launch: the job failed (exit status $rc)" >&2
  fi
  if [ -n "${HVD_LM_ERRORS:-}" ]; then
    rm -f "$HVD_LM_ERRORS"
  fi
}

# hvd_lm_stopped_for REASON: true when the last training run in $OUT_DIR stopped for REASON
# after checkpointing (summary.json "stop"): "signal" (SIGUSR1/SIGTERM) or "time-limit" (the
# allocation's --time-limit came before the --time-budget was spent), i.e. requeueing it makes
# sense.
hvd_lm_stopped_for() {
  "${PYTHON:-python3}" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["stop"] != sys.argv[2])' \
    "$OUT_DIR/summary.json" "$1" 2>/dev/null
}

# hvd_lm_gate_discovery: wrap the host discovery script DISCOVERY so that a host returning to an
# elastic job is listed to horovodrun only once a worker can start there (launch/gate_hosts.sh: a
# worker that fails to start ends the whole job in Horovod 0.28.1). The wrapper and the gate's
# state (emptied here: the first call lists the job's start hosts) go beside the run, in OUT_DIR;
# DISCOVERY becomes the wrapper.
hvd_lm_gate_discovery() {
  local out
  mkdir -p "$OUT_DIR"
  out="$(cd "$OUT_DIR" && pwd)"
  rm -rf "$out/.host_gate"
  printf '#!/usr/bin/env bash\nexec bash %q %q %q %q\n' "$LAUNCH_DIR/gate_hosts.sh" \
    "$out/.host_gate" "$PYTHON" "$DISCOVERY" > "$out/discover_gated.sh"
  chmod +x "$out/discover_gated.sh"
  DISCOVERY="$out/discover_gated.sh"
}
