#!/usr/bin/env bash
# The one command that checks hvd_lm on a CUDA node, offline, in stages that each end within one
# 10-minute run on a 16-core H100 node, setup included:
#
#   bash scripts/gpu_check.sh [--stage all|setup|cuda|bench|suite] [WHEELHOUSE] [OUT]
#                                                   (defaults: all, .whl and gpu_check/)
#
#   setup  scripts/setup.sh: a venv on top of the machine's Python (--system-site-packages, and
#          the outer venv's site-packages when that Python is itself a venv, as on the H100
#          image), hvd_lm installed into it, Horovod 0.28.1 built with NCCL + MPI + Gloo from
#          WHEELHOUSE (the sdist and the wheels scripts/fetch_offline_wheels.sh downloads;
#          PIP_NO_INDEX, no apt-get: nothing is fetched). About 3 minutes the first time
#          (Horovod builds in about 2 with -j16); a stamp makes every later setup seconds.
#   cuda   `pytest -m cuda`: the GPU paths against CPU references (tests/test_cuda.py, the cuda
#          tests of tests/test_mlstm_fused*.py). About 2 minutes.
#   bench  `python -m benchmarks gpu` (ceilings, every GEMM of the step and the GEMM ceiling; fused and
#          reference mLSTM, CUDA graphs off/on, vs cuDNN LSTM), stopped with SIGINT before the
#          stage's budget ends: its JSON keeps every figure taken before.
#   suite  the whole suite but the cuda tests, in parts: each run of the stage starts no test
#          once its budget is spent and leaves the rest to the next run (OUT/suite_done.txt
#          lists the tests done; OUT/suite-<k>.xml is part k). Run it again until the summary
#          says no test is left.
#
# Budget: every stage runs setup first (seconds once done), then its own work, and the whole
# invocation ends within STAGE_BUDGET seconds (default 510, under 9 minutes): the work gets what
# setup left less RESERVE seconds (default 25: the kill grace and the summary), so the summary
# is always written. `--stage all` gives each stage its own budget. Each stage leaves
# OUT/<stage>.json (exit status, seconds) and its logs; OUT/summary.json and OUT/summary.md merge
# every stage run so far (scripts/gpu_check_summary.py).
#
# Environment: PYTHON (default python3), VENV (default .venv), MAKEFLAGS (default -j<cores>),
# STAGE_BUDGET, RESERVE, BENCH_ARGS (extra `python -m benchmarks gpu` flags, e.g. --device cpu on a
# machine without a GPU), SUITE_ARGS (extra pytest arguments for cuda and suite, e.g. a test
# file), SUITE_BUDGET (seconds after which the suite starts no test; default: what the stage's
# budget leaves).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
say() { printf '[gpu_check] %s\n' "$*"; }

stage=all
args=()
while (($#)); do
    case $1 in
        --stage) stage=${2:-}; shift; (($#)) && shift ;;
        --stage=*) stage=${1#--stage=}; shift ;;
        -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
case $stage in
    all|setup|cuda|bench|suite) ;;
    *) say "ERROR: --stage must be one of all, setup, cuda, bench, suite (got '$stage')"; exit 2 ;;
esac
WHEELS=$(realpath -m "${args[0]:-.whl}")
OUT=${args[1]:-gpu_check}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
[ -d "$WHEELS" ] || { say "ERROR: no wheelhouse at $WHEELS (scripts/fetch_offline_wheels.sh)"; exit 2; }

# Offline: the wheelhouse is the only package source, and apt-get is never tried.
export PIP_FIND_LINKS="$WHEELS" PIP_NO_INDEX=1 HVD_LM_NO_APT=1 PYTHONUNBUFFERED=1
if [ -f "$WHEELS/horovod-0.28.1.tar.gz" ]; then
    export HVD_LM_HOROVOD_SDIST="$WHEELS/horovod-0.28.1.tar.gz"
fi
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
VENV=${VENV:-.venv}
PY=$VENV/bin/python
BUDGET=${STAGE_BUDGET:-510}
RESERVE=${RESERVE:-25}
# BENCH_ARGS and SUITE_ARGS are lists of arguments
read -r -a bench_args <<<"${BENCH_ARGS:-}"
read -r -a suite_args <<<"${SUITE_ARGS:-}"

# record NAME RC SECONDS: OUT/NAME.json, what the summary merges
record() {
    printf '{"stage": "%s", "exit_status": %d, "seconds": %d, "finished": "%s"}\n' \
        "$1" "$2" "$3" "$(date -u +%FT%TZ)" >"$OUT/$1.json"
}

# left: seconds this stage's budget leaves for work, the reserve kept (at least 10)
left() {
    local l=$((deadline - $(date +%s) - RESERVE))
    ((l < 10)) && l=10
    echo "$l"
}

# run_stage NAME LOG SHOWN COMMAND...: run COMMAND under the stage's budget (SIGINT when it
# ends, SIGKILL 10 s later) with its output in OUT/LOG, show its last SHOWN lines, record its
# exit status and seconds
run_stage() {
    local name=$1 log=$2 shown=$3 t0 rc
    shift 3
    say "$name (log: $OUT/$log; at most $(left) s)"
    t0=$(date +%s)
    timeout -s INT -k 10 "$(left)" "$@" >"$OUT/$log" 2>&1
    rc=$?
    tail -n "$shown" "$OUT/$log"
    record "$name" "$rc" $(($(date +%s) - t0))
    return "$rc"
}

# pytest_part NAME MARKER: one part of a pytest stage within the budget (tests/_budget.py: no
# test starts after --time-budget, a minute before the stage's end so that the test running
# then can finish; the ones done are listed in OUT/NAME_done.txt and skipped by the next part)
pytest_part() {
    local name=$1 marker=$2 part
    part=$(($(find "$OUT" -maxdepth 1 -name "$name-*.xml" | wc -l) + 1))
    run_stage "$name" "$name-$part.log" 3 "$PY" -m pytest -q -p no:cacheprovider -m "$marker" \
        --time-budget "${SUITE_BUDGET:-$(($(left) - 60))}" --done-file "$OUT/${name}_done.txt" \
        --budget-report "$OUT/$name-$part.budget.json" --junitxml="$OUT/$name-$part.xml" \
        "${suite_args[@]}"
}

status=0
for s in setup cuda bench suite; do
    [ "$stage" = all ] || [ "$stage" = "$s" ] || [ "$s" = setup ] || continue
    if [ "$s" = setup ] || [ "$stage" = all ]; then
        deadline=$(($(date +%s) + BUDGET))  # a stage's budget counts its setup too
    fi
    case $s in
        setup) run_stage setup setup.log 3 env PYTHON="${PYTHON:-python3}" VENV="$VENV" \
                   VENV_SYSTEM_SITE=1 bash scripts/setup.sh || { status=1; break; } ;;
        cuda) pytest_part cuda cuda || status=1 ;;
        bench) run_stage bench bench_gpu.log 40 "$PY" -m benchmarks gpu --steps 3 --repeats 1 \
                   --json "$OUT/bench_gpu.json" "${bench_args[@]}" || status=1 ;;
        suite) pytest_part suite "not cuda" || status=1 ;;
    esac
done
summary_py=$PY
[ -x "$PY" ] || summary_py=${PYTHON:-python3}
# merges every stage recorded in OUT so far; exits 1 when one of them failed
"$summary_py" scripts/gpu_check_summary.py "$OUT" || status=1
exit "$status"
