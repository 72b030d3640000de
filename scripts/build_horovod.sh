#!/usr/bin/env bash
# Build (or take from the wheel cache) Horovod 0.28.1 for the given venv's python, and install it.
#
# Why a patch: Horovod 0.28.1, the last release, sets CMAKE_CXX_STANDARD 14 in both CMakeLists.txt
# and horovod/torch/CMakeLists.txt, but PyTorch >= 2.1 headers need C++17 (upstream issue #3996,
# fixed on master by PR #3998, never released). Changing only the torch one fails at link time
# (duplicate gloo::rendezvous::Store::kDefaultTimeout), so both lines go to 17. That is the whole
# patch. For gcc >= 13 the issue also asks to check upstream PR #3957: gcc 13 stopped including
# <cstdint> transitively (gcc.gnu.org/gcc-13/porting_to.html), so there we force-include it with
# CXXFLAGS rather than editing sources.
#
# Cache: ${HVD_LM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_lm/wheels}/<key>/ where the key names
# Horovod, torch (with its CUDA build), Python and MPI versions; a second setup installs the wheel in
# seconds instead of ~8 minutes of compiling. Set HVD_LM_REBUILD=1 to ignore the cache.
#
# Usage: scripts/build_horovod.sh PYTHON     (the venv's interpreter)
set -euo pipefail
PY=${1:?usage: build_horovod.sh PYTHON}
HVD_VERSION=0.28.1
# Horovod 0.28.1's own runtime requirements (its setup.py install_requires), installed beside the
# wheel, which is installed with --no-deps so that pip never swaps the torch build.
HVD_DEPS=(cffi cloudpickle psutil pyyaml packaging)
say() { printf '[horovod] %s\n' "$*"; }

if [ "${HVD_LM_REBUILD:-0}" != 1 ] && "$PY" - "$HVD_VERSION" <<'PYEOF' 2>/dev/null
import sys, horovod, horovod.torch  # noqa: F401  (import fails when the extension is missing)
sys.exit(0 if horovod.__version__ == sys.argv[1] else 1)
PYEOF
then
    say "horovod $HVD_VERSION already installed"
    exit 0
fi

mpi_version=$(mpirun --version 2>&1 | head -n 1 | tr -c 'A-Za-z0-9.\n' '-' | tr -s '-' | sed 's/-$//')
key=$("$PY" - "$HVD_VERSION" "$mpi_version" <<'PYEOF'
import sys, torch
cuda = torch.version.cuda or "cpu"
print(f"horovod-{sys.argv[1]}_torch-{torch.__version__.replace('+', '-')}_cuda-{cuda}"
      f"_py{sys.version_info[0]}{sys.version_info[1]}_{sys.argv[2]}")
PYEOF
)
cache=${HVD_LM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_lm/wheels}/$key
shopt -s nullglob
wheels=("$cache"/horovod-"$HVD_VERSION"-*.whl)
if [ "${HVD_LM_REBUILD:-0}" != 1 ] && ((${#wheels[@]})); then
    say "installing cached wheel ${wheels[0]}"
    "$PY" -m pip --disable-pip-version-check -q install --force-reinstall --no-deps "${wheels[0]}"
    "$PY" -m pip --disable-pip-version-check -q install "${HVD_DEPS[@]}"
    exit 0
fi

say "building horovod $HVD_VERSION from source (about 8 minutes on 2 cores); cache key $key"
work=$(mktemp -d "${TMPDIR:-/tmp}/hvd_lm-horovod.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$PY" -m pip --disable-pip-version-check -q install setuptools wheel "${HVD_DEPS[@]}"
command -v cmake >/dev/null 2>&1 || "$PY" -m pip --disable-pip-version-check -q install cmake
"$PY" -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
    "horovod==$HVD_VERSION" -d "$work"
tar -xzf "$work/horovod-$HVD_VERSION.tar.gz" -C "$work"
src="$work/horovod-$HVD_VERSION"

# The C++17 patch (issue #3996 / PR #3998): exactly two lines.
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f" || { say "ERROR: C++17 patch did not apply to $f"; exit 1; }
done
gcc_major=$(${CXX:-g++} -dumpversion 2>/dev/null | cut -d. -f1 || echo 0)
if [ "${gcc_major:-0}" -ge 13 ]; then
    say "g++ $gcc_major >= 13: adding -include cstdint (cf. upstream PR #3957)"
    export CXXFLAGS="${CXXFLAGS:-} -include cstdint"
fi

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
    say "CUDA torch found: building with HOROVOD_GPU_OPERATIONS=NCCL"
    export HOROVOD_GPU_OPERATIONS=NCCL
fi
export MAKEFLAGS=${MAKEFLAGS:--j$(($(nproc) + 1))}
"$PY" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps -w "$work/dist" "$src" \
    >"$work/build.log" 2>&1 || { tail -n 60 "$work/build.log" >&2; say "ERROR: horovod build failed"; exit 1; }
built=("$work"/dist/horovod-*.whl)
mkdir -p "$cache"
# Atomic: copy to a temporary name in the cache, then rename.
cp "${built[0]}" "$cache/.tmp.$$" && mv "$cache/.tmp.$$" "$cache/$(basename "${built[0]}")"
say "cached $cache/$(basename "${built[0]}")"
"$PY" -m pip --disable-pip-version-check -q install --force-reinstall --no-deps "$cache/$(basename "${built[0]}")"
