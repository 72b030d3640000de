#!/usr/bin/env bash
# The one command that checks hvd_lm on a CUDA node, offline:
#
#   bash scripts/gpu_check.sh [WHEELHOUSE] [OUT]        (defaults: .whl and gpu_check/)
#
# 1. setup (scripts/setup.sh): a venv on top of the machine's Python (--system-site-packages, so
#    its CUDA torch, NCCL wheel, mpi4py, h5py... are used as they are), hvd_lm installed into it,
#    Horovod 0.28.1 built with NCCL + MPI + Gloo from WHEELHOUSE (the sdist and the wheels
#    scripts/fetch_offline_wheels.sh downloads; PIP_NO_INDEX: nothing is fetched);
# 2. `pytest -m cuda` (GPU vs CPU reference tests, tests/test_cuda.py), then the whole suite;
# 3. `hvd-lm bench gpu` (ceilings; fused and reference mLSTM, CUDA graphs off/on, vs cuDNN LSTM:
#    chars/s and TFLOP/s per precision);
# 4. OUT/summary.json and OUT/summary.md: what passed, failed and skipped, and the figures.
#
# Sized to finish well inside 10 minutes on a 16-core H100 node (Horovod builds in about 2).
# Environment: PYTHON (default python3), MAKEFLAGS (default -j<cores>), BENCH_ARGS (extra
# `hvd-lm bench gpu` flags), SUITE_TIMEOUT (seconds for the whole suite, default 330; at the
# limit the suite is stopped and the summary reports the tests that ran; `make test` runs it all).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
WHEELS=$(realpath "${1:-.whl}")
OUT=${2:-gpu_check}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
say() { printf '[gpu_check] %s\n' "$*"; }
[ -d "$WHEELS" ] || { say "ERROR: no wheelhouse at $WHEELS (scripts/fetch_offline_wheels.sh)"; exit 2; }

export PIP_FIND_LINKS="$WHEELS" PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
if [ -f "$WHEELS/horovod-0.28.1.tar.gz" ]; then
    export HVD_LM_HOROVOD_SDIST="$WHEELS/horovod-0.28.1.tar.gz"
fi
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

t0=$(date +%s)
say "1/3 setup (log: $OUT/setup.log)"
PYTHON=${PYTHON:-python3} VENV=.venv VENV_SYSTEM_SITE=1 bash scripts/setup.sh >"$OUT/setup.log" 2>&1
setup_rc=$?
tail -n 3 "$OUT/setup.log"
setup_s=$(($(date +%s) - t0))
PY=.venv/bin/python

cuda_rc=99 suite_rc=99 bench_rc=99
if [ "$setup_rc" = 0 ]; then
    say "2/3 pytest -m cuda, then the whole suite"
    $PY -m pytest -q -p no:cacheprovider -m cuda --junitxml="$OUT/cuda.xml" >"$OUT/cuda.log" 2>&1
    cuda_rc=$?
    tail -n 3 "$OUT/cuda.log"
    # SIGINT at the limit: pytest stops and still writes suite.xml for the tests that ran
    timeout -s INT -k 30 "${SUITE_TIMEOUT:-330}" $PY -m pytest -q -p no:cacheprovider -m "not cuda" \
        --junitxml="$OUT/suite.xml" >"$OUT/suite.log" 2>&1
    suite_rc=$?
    tail -n 3 "$OUT/suite.log"
    say "3/3 hvd-lm bench gpu"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    $PY -m hvd_lm bench gpu --steps 3 --repeats 1 --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} \
        >"$OUT/bench_gpu.log" 2>&1
    bench_rc=$?
    cat "$OUT/bench_gpu.log"
fi
summary_py=$PY
[ -x "$PY" ] || summary_py=${PYTHON:-python3}
$summary_py - "$OUT" "$setup_rc" "$cuda_rc" "$suite_rc" "$bench_rc" "$setup_s" "$(($(date +%s) - t0))" <<'PYEOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
rc = dict(zip(["setup", "cuda_tests", "suite", "bench_gpu"], map(int, sys.argv[2:6])))
summary = {"exit_status": rc, "setup_s": int(sys.argv[6]), "total_s": int(sys.argv[7])}
for name in ("cuda", "suite"):
    f = out / f"{name}.xml"
    if f.exists():
        s = ET.parse(f).getroot()
        s = s if s.tag == "testsuite" else s.find("testsuite")
        failed = [c.get("classname", "") + "::" + c.get("name", "") for c in s.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        summary[name] = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        summary[name].update(seconds=float(s.get("time", 0)), failed=failed)
        summary[name]["stopped_at_time_limit"] = name == "suite" and rc["suite"] == 124
bench = out / "bench_gpu.json"
if bench.exists():
    summary["bench_gpu"] = json.loads(bench.read_text())
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
md = ["# scripts/gpu_check.sh", "", f"exit status: {rc}; setup {summary['setup_s']} s, total "
      f"{summary['total_s']} s", ""]
for name in ("cuda", "suite"):
    if name in summary:
        r = summary[name]
        md.append(f"- {name}: {r['tests']} tests, {r['failures'] + r['errors']} failed, "
                  f"{r['skipped']} skipped, {r['seconds']:.0f} s"
                  + (" (stopped at SUITE_TIMEOUT: the tests that ran)"
                     if r.get("stopped_at_time_limit") else "")
                  + ("".join(f"\n  - FAILED {x}" for x in r["failed"])))
if "bench_gpu" in summary:
    b = summary["bench_gpu"]
    md += ["", f"## hvd-lm bench gpu ({b['device']}, torch {b['torch']})", "",
           "| matmul | shape | TFLOP/s |", "|---|---|---:|"]
    md += [f"| {r['precision']} | {'x'.join(map(str, r['shape']))} | {r['tflops']:.1f} |"
           for r in b["matmul"]]
    md += ["", f"device-to-device copy: {b['copy_GBps']:.0f} GB/s", "",
           "| cell | impl | B | precision | chars/s | TFLOP/s | of peak | peak GiB "
           "| mLSTM/cuDNN per FLOP | vs reference |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in b["train"]:
        head = f"| {r['cell']} | {r.get('impl', '-')} | {r['batch_size']} | {r['precision']} |"
        if "error" in r:
            md.append(f"{head} {r['error']} | | | | | |")
            continue
        ratio, vs_ref = r.get("vs_cudnn_lstm_per_flop"), r.get("vs_reference")
        md.append(f"{head} {r['chars_per_s']:,.0f} | {r['tflops']:.1f} | "
                  f"{r['fraction_of_peak']:.1%} | {r['peak_memory_gib'] or 0:.1f} | "
                  f"{'-' if r['cell'] == 'lstm' or ratio is None else f'{ratio:.3f}'} | "
                  f"{'-' if vs_ref is None else f'{vs_ref:.2f}x'} |")
(out / "summary.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PYEOF
[ "$setup_rc" = 0 ] && [ "$cuda_rc" = 0 ] && [ "$suite_rc" = 0 ] && [ "$bench_rc" = 0 ]
