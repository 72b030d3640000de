#!/usr/bin/env bash
# Build (or take from the wheel cache) Horovod 0.28.1 for the given venv's python, and install it.
#
# Horovod 0.28.1, the last release, needs patches and settings on today's stack; the decisions
# live in scripts/horovod_build.py (tested in tests/test_build_horovod.py) and this script acts on
# them:
#   * C++17 in both CMakeLists.txt (upstream issue #3996 / PR #3998) and CMAKE_CUDA_STANDARD 17;
#   * <cstdint>, <string>, <stdexcept> added to group_table.h and common.h (g++ >= 13; PR #3957);
#   * CMAKE_POLICY_VERSION_MINIMUM=3.5 with CMake >= 4;
#   * CUDA torch: HOROVOD_GPU_OPERATIONS=NCCL with NCCL from HOROVOD_NCCL_HOME, the
#     nvidia-nccl-cu* wheel beside torch (a private libnccl.so link; the wheel has only .so.2) or
#     the system, and HOROVOD_BUILD_CUDA_CC_LIST from TORCH_CUDA_ARCH_LIST or the local GPU.
#
# Offline / air-gapped nodes: put the Horovod sdist (horovod-0.28.1.tar.gz) and the wheels the
# build needs (cffi, pycparser; scripts/fetch_offline_wheels.sh downloads them) in one folder and
# run with PIP_FIND_LINKS=that/folder PIP_NO_INDEX=1 (pip reads both), or HVD_LM_HOROVOD_SDIST=
# path/to/horovod-0.28.1.tar.gz.
#
# Cache: ${HVD_LM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_lm/wheels}/<key>/ where the key names
# Horovod, torch (with its CUDA build), NCCL, Python and MPI versions; a second setup installs the
# wheel in seconds instead of minutes. Set HVD_LM_REBUILD=1 to ignore the cache.
#
# Usage: scripts/build_horovod.sh PYTHON     (the venv's interpreter; hvd_lm already installed)
set -euo pipefail
PY=${1:?usage: build_horovod.sh PYTHON}
HVD_VERSION=0.28.1
# Horovod 0.28.1's build and runtime requirements (setup.py setup_requires/install_requires),
# installed first (offline, its setup.py would try to fetch cffi), and beside the wheel, which is
# installed with --no-deps so that pip never swaps the torch build.
HVD_DEPS=(cffi pycparser cloudpickle psutil pyyaml packaging)
PIP=("$PY" -m pip --disable-pip-version-check -q)
say() { printf '[horovod] %s\n' "$*"; }

if [ "${HVD_LM_REBUILD:-0}" != 1 ] && "$PY" - "$HVD_VERSION" <<'PYEOF' 2>/dev/null
import sys, horovod, horovod.torch  # noqa: F401  (import fails when the extension is missing)
sys.exit(0 if horovod.__version__ == sys.argv[1] else 1)
PYEOF
then
    say "horovod $HVD_VERSION already installed"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/hvd_lm-horovod.XXXXXX")
trap 'rm -rf "$work"' EXIT
# The decisions (and the errors that name what to install): see scripts/horovod_build.py.
build_env=$("$PY" "$(dirname "$0")/horovod_build.py" env "$work") || exit 1
eval "$build_env"
say "cache key $HVD_LM_CACHE_KEY${HOROVOD_GPU_OPERATIONS:+; GPU ops $HOROVOD_GPU_OPERATIONS (NCCL in ${HOROVOD_NCCL_INCLUDE%/include}, CUDA archs ${HOROVOD_BUILD_CUDA_CC_LIST:-all})}"

cache=${HVD_LM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_lm/wheels}/$HVD_LM_CACHE_KEY
shopt -s nullglob
wheels=("$cache"/horovod-"$HVD_VERSION"-*.whl)
if [ "${HVD_LM_REBUILD:-0}" != 1 ] && ((${#wheels[@]})); then
    say "installing cached wheel ${wheels[0]}"
    "${PIP[@]}" install --force-reinstall --no-deps "${wheels[0]}"
    "${PIP[@]}" install "${HVD_DEPS[@]}"
    exit 0
fi

say "building horovod $HVD_VERSION from source (about 8 minutes on 2 cores, 2 on 16)"
if ! "${PIP[@]}" install setuptools wheel "${HVD_DEPS[@]}"; then
    say "ERROR: could not install the build requirements (${HVD_DEPS[*]}); offline, put their"
    say "  wheels in a folder and set PIP_FIND_LINKS=that/folder PIP_NO_INDEX=1"
    exit 1
fi
command -v cmake >/dev/null 2>&1 || "${PIP[@]}" install cmake
if [ -n "${HVD_LM_HOROVOD_SDIST:-}" ]; then
    cp "$HVD_LM_HOROVOD_SDIST" "$work/"
elif ! "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"; then
    say "ERROR: could not get the horovod==$HVD_VERSION source distribution; offline, set"
    say "  HVD_LM_HOROVOD_SDIST=/path/to/horovod-$HVD_VERSION.tar.gz (or PIP_FIND_LINKS to its folder)"
    exit 1
fi
tar -xzf "$work/horovod-$HVD_VERSION.tar.gz" -C "$work"
src="$work/horovod-$HVD_VERSION"
"$PY" "$(dirname "$0")/horovod_build.py" patch "$src"

export MAKEFLAGS=${MAKEFLAGS:--j$(($(nproc) + 1))}
"${PIP[@]}" wheel --no-build-isolation --no-deps -w "$work/dist" "$src" \
    >"$work/build.log" 2>&1 || { tail -n 60 "$work/build.log" >&2; say "ERROR: horovod build failed (log above)"; exit 1; }
built=("$work"/dist/horovod-*.whl)
mkdir -p "$cache"
# Atomic: copy to a temporary name in the cache, then rename.
cp "${built[0]}" "$cache/.tmp.$$" && mv "$cache/.tmp.$$" "$cache/$(basename "${built[0]}")"
say "cached $cache/$(basename "${built[0]}")"
"${PIP[@]}" install --force-reinstall --no-deps "$cache/$(basename "${built[0]}")"
