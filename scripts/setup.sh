#!/usr/bin/env bash
# One setup path for `make test` and `make demo`: idempotent, and fast when nothing changed.
#
#   1. MPI: the MPI whose `mpicc` is on PATH (clusters: `module load openmpi` first); where none is
#      installed and this is Debian/Ubuntu as root, OpenMPI from apt-get; otherwise stop and say what
#      to install.
#   2. A virtual environment in .venv with torch (TORCH_SPEC, default the CPU wheel torch==2.13.0; a
#      torch already in .venv is kept, so CUDA clusters install their own build first, see README;
#      VENV_SYSTEM_SITE=1 makes the venv see the system's packages, e.g. a GPU image's CUDA torch).
#   3. This package (editable) and its Python dependencies, mpi4py built against that MPI.
#   4. Horovod 0.28.1 built by scripts/build_horovod.sh (cached wheel, keyed by versions).
#   5. `hvd-lm check-build`: PyTorch, MPI and Gloo (and NCCL on CUDA hosts) must be built in.
#
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# VENV_SYSTEM_SITE (1: --system-site-packages), TORCH_SPEC (default torch==2.13.0), HVD_LM_CACHE
# (wheel cache, default ${XDG_CACHE_HOME:-$HOME/.cache}/hvd_lm/wheels). Offline (air-gapped
# nodes): PIP_FIND_LINKS=DIR PIP_NO_INDEX=1 with the wheels and the Horovod sdist in DIR
# (scripts/fetch_offline_wheels.sh), see scripts/build_horovod.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
say() { printf '[setup] %s\n' "$*"; }

# ---- 1. MPI -------------------------------------------------------------------------------------
need_debs=()
command -v mpicc >/dev/null 2>&1 || need_debs+=(libopenmpi-dev openmpi-bin)
# hdf5-tools (h5ls/h5dump) are the independent readers the shard tests use (optional: skipped
# without them); time (/usr/bin/time -v) measures prepare's memory in a test (optional too).
command -v h5dump >/dev/null 2>&1 || need_debs+=(hdf5-tools)
[ -x /usr/bin/time ] || need_debs+=(time)
# The linter of the project's shell scripts, shellcheck, runs in a test (optional: skipped without).
command -v shellcheck >/dev/null 2>&1 || need_debs+=(shellcheck)
if ((${#need_debs[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing ${need_debs[*]} with apt-get"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq "${need_debs[@]}" >/dev/null; }; then
            command -v mpicc >/dev/null 2>&1 || { say "ERROR: apt-get could not install" \
                "OpenMPI (libopenmpi-dev openmpi-bin); install an MPI and run this again"; exit 1; }
            say "warning: apt-get failed (offline?); tests needing h5dump or /usr/bin/time skip"
        fi
    elif ! command -v mpicc >/dev/null 2>&1; then
        cat >&2 <<'MSG'
[setup] ERROR: no MPI compiler wrapper `mpicc` on PATH.
  Install an MPI with its development files, then run this again:
    Debian/Ubuntu:   sudo apt-get install libopenmpi-dev openmpi-bin
    RHEL/Rocky:      sudo dnf install openmpi-devel && module load mpi/openmpi-x86_64
    HPC cluster:     module load openmpi   (or your site's MPI module)
MSG
        exit 1
    else
        say "warning: h5dump not found (apt-get install hdf5-tools); its tests will be skipped"
    fi
fi
say "MPI: $(mpirun --version 2>&1 | head -n 1)"

# ---- 2. virtual environment ---------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    # Debian/Ubuntu split venv's pip bootstrap (ensurepip) into python3.X-venv: without it
    # `python3 -m venv` fails after leaving a venv with no pip behind. Say so before, in one line.
    if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
        say "ERROR: $PYTHON cannot create a virtual environment (no ensurepip): install" \
            "python${pyver:-3}-venv (Debian/Ubuntu: apt-get install python${pyver:-3}-venv)," \
            "or set PYTHON to an interpreter that has it"
        exit 1
    fi
    say "creating $VENV"
    if [ "${VENV_SYSTEM_SITE:-0}" = 1 ]; then
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)
if ! "$PY" -m pip --version >/dev/null 2>&1; then
    say "ERROR: $VENV has no pip (made by a Python without ensurepip?): remove it (rm -rf $VENV)" \
        "and run this again"
    exit 1
fi
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    say "installing $TORCH_SPEC"
    "${PIP[@]}" install "$TORCH_SPEC"
fi

# ---- 3. project + dependencies ------------------------------------------------------------------
# The stamp is the hash of pyproject.toml: reinstall only when the dependencies changed.
stamp="$VENV/.hvd_lm-deps"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    say "installing hvd_lm and its dependencies (mpi4py built against $(command -v mpicc))"
    # mpi4py from source so that it links the MPI on PATH, the one Horovod is built against (an
    # mpi4py already there, e.g. a GPU image's, is kept); no build isolation, so offline works,
    # and so its build requirements come first: mpi4py >= 4.1's sdist generates its C sources
    # with Cython at build time ("missing build requirement 'Cython >= 3.0.1'" without it).
    build_reqs=(setuptools wheel)
    "$PY" -c 'import mpi4py' >/dev/null 2>&1 || build_reqs+=('cython>=3.0.1')
    "${PIP[@]}" install "${build_reqs[@]}"
    "${PIP[@]}" install --no-build-isolation --no-binary mpi4py -e '.[test]'
    echo "$want" >"$stamp"
fi

# ---- 4. Horovod ---------------------------------------------------------------------------------
bash scripts/build_horovod.sh "$PY"

# ---- 5. verify ----------------------------------------------------------------------------------
"$VENV/bin/hvd-lm" check-build
say "ready: source $VENV/bin/activate"
