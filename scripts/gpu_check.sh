#!/usr/bin/env bash
# The one command that checks hvd_lm on a CUDA node, offline, in stages that each fit one
# 10-minute run on a 16-core H100 node:
#
#   bash scripts/gpu_check.sh [--stage all|setup|cuda|bench|suite] [WHEELHOUSE] [OUT]
#                                                   (defaults: all, .whl and gpu_check/)
#
#   setup  scripts/setup.sh: a venv on top of the machine's Python (--system-site-packages, so
#          its CUDA torch, NCCL wheel, mpi4py, h5py... are used as they are), hvd_lm installed
#          into it, Horovod 0.28.1 built with NCCL + MPI + Gloo from WHEELHOUSE (the sdist and
#          the wheels scripts/fetch_offline_wheels.sh downloads; PIP_NO_INDEX: nothing is
#          fetched). About 3 minutes (Horovod builds in about 2 with -j16).
#   cuda   `pytest -m cuda`: the GPU paths against CPU references (tests/test_cuda.py, the cuda
#          tests of tests/test_mlstm_fused.py). About 2 minutes.
#   bench  `hvd-lm bench gpu` (ceilings, every GEMM of the step and the GEMM ceiling; fused and
#          reference mLSTM, CUDA graphs off/on, vs cuDNN LSTM), stopped with SIGINT at
#          BENCH_TIMEOUT (540 s): its JSON keeps every figure taken before.
#   suite  the whole suite but the cuda tests, stopped with SIGINT at SUITE_TIMEOUT (540 s);
#          the summary reports the tests that ran (`make test` runs them all).
#
# Every stage but setup first runs setup again (idempotent: seconds once done), so the stages
# resume each other in any order and a later run reuses the venv and the Horovod build. Each
# stage leaves OUT/<stage>.json (exit status, seconds) and its logs; OUT/summary.json and
# OUT/summary.md merge every stage run so far (scripts/gpu_check_summary.py).
#
# Environment: PYTHON (default python3), MAKEFLAGS (default -j<cores>), BENCH_ARGS (extra
# `hvd-lm bench gpu` flags, e.g. --device cpu on a machine without a GPU), BENCH_TIMEOUT,
# SUITE_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
say() { printf '[gpu_check] %s\n' "$*"; }

stage=all
args=()
while (($#)); do
    case $1 in
        --stage) stage=${2:-}; shift; (($#)) && shift ;;
        --stage=*) stage=${1#--stage=}; shift ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
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

export PIP_FIND_LINKS="$WHEELS" PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
if [ -f "$WHEELS/horovod-0.28.1.tar.gz" ]; then
    export HVD_LM_HOROVOD_SDIST="$WHEELS/horovod-0.28.1.tar.gz"
fi
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=.venv/bin/python

# record NAME RC SECONDS: OUT/NAME.json, what the summary merges
record() {
    printf '{"stage": "%s", "exit_status": %d, "seconds": %d, "finished": "%s"}\n' \
        "$1" "$2" "$3" "$(date -u +%FT%TZ)" >"$OUT/$1.json"
}

# run_stage NAME LOG SHOWN COMMAND...: run COMMAND with its output in OUT/LOG, show its last SHOWN
# lines, record its exit status and seconds
run_stage() {
    local name=$1 log=$2 shown=$3 t0 rc
    shift 3
    say "$name (log: $OUT/$log)"
    t0=$(date +%s)
    "$@" >"$OUT/$log" 2>&1
    rc=$?
    tail -n "$shown" "$OUT/$log"
    record "$name" "$rc" $(($(date +%s) - t0))
    return "$rc"
}

status=0
# every stage: setup first (idempotent, seconds once done)
run_stage setup setup.log 3 env PYTHON="${PYTHON:-python3}" VENV=.venv VENV_SYSTEM_SITE=1 \
    bash scripts/setup.sh || status=1
if [ "$status" = 0 ]; then
    if [ "$stage" = cuda ] || [ "$stage" = all ]; then
        run_stage cuda cuda.log 3 $PY -m pytest -q -p no:cacheprovider -m cuda \
            --junitxml="$OUT/cuda.xml"
    fi
    if [ "$stage" = bench ] || [ "$stage" = all ]; then
        # SIGINT at the limit: the bench's JSON keeps every figure measured before
        # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
        run_stage bench bench_gpu.log 40 timeout -s INT -k 30 "${BENCH_TIMEOUT:-540}" \
            $PY -m hvd_lm bench gpu --steps 3 --repeats 1 --json "$OUT/bench_gpu.json" \
            ${BENCH_ARGS:-}
    fi
    if [ "$stage" = suite ] || [ "$stage" = all ]; then
        # SIGINT at the limit: pytest stops and still writes suite.xml for the tests that ran
        run_stage suite suite.log 3 timeout -s INT -k 30 "${SUITE_TIMEOUT:-540}" \
            $PY -m pytest -q -p no:cacheprovider -m "not cuda" --junitxml="$OUT/suite.xml"
    fi
fi
summary_py=$PY
[ -x "$PY" ] || summary_py=${PYTHON:-python3}
# merges every stage recorded in OUT so far; exits 1 when one of them failed
$summary_py scripts/gpu_check_summary.py "$OUT" || status=1
exit "$status"
