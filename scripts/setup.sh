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
# A finished setup leaves a stamp ($VENV/.hvd_lm-ready: the hash of the files that decide it);
# while the stamp matches and the venv still imports hvd_lm and Horovod, setup ends in seconds.
#
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# VENV_SYSTEM_SITE (1: --system-site-packages; when PYTHON is itself a virtual environment, as
# on GPU images whose python3 is /opt/torch/.venv/bin/python3, its site-packages are added by a
# .pth file: a venv made from a venv sees only the *base* interpreter's packages), TORCH_SPEC
# (default torch==2.13.0), HVD_LM_CACHE (wheel cache, default
# ${XDG_CACHE_HOME:-$HOME/.cache}/hvd_lm/wheels), HVD_LM_NO_APT (1: never run apt-get; implied
# by PIP_NO_INDEX). Offline (air-gapped nodes): PIP_FIND_LINKS=DIR PIP_NO_INDEX=1 with the
# wheels and the Horovod sdist in DIR (scripts/fetch_offline_wheels.sh), see
# scripts/build_horovod.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
say() { printf '[setup] %s\n' "$*"; }

# A venv keeps the kind it was made with: VENV_SYSTEM_SITE=1 cannot change one made without.
if [ "${VENV_SYSTEM_SITE:-0}" = 1 ] && grep -qs "include-system-site-packages = false" \
        "$VENV/pyvenv.cfg"; then
    say "warning: $VENV was made without --system-site-packages, so VENV_SYSTEM_SITE=1 has no" \
        "effect on it (the machine's torch and NCCL stay invisible): rm -rf $VENV to remake it"
fi

# ---- 0. a finished setup: seconds ------------------------------------------------------------
# The stamp is the hash of everything that decides what setup installs; a venv that no longer
# imports hvd_lm or Horovod (removed by hand) is set up again.
ready="$VENV/.hvd_lm-ready"
ready_key=$(cat pyproject.toml scripts/setup.sh scripts/build_horovod.sh \
                scripts/horovod_build.py 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ "$(cat "$ready" 2>/dev/null)" = "$ready_key" ] && [ -x "$VENV/bin/hvd-lm" ] \
        && "$VENV/bin/python" -c 'import hvd_lm, horovod.torch' >/dev/null 2>&1; then
    say "ready (stamp $ready matches; rm it to set up again): source $VENV/bin/activate"
    exit 0
fi

# Offline (no package index) there is no Debian mirror either: never try apt-get there.
no_apt=${HVD_LM_NO_APT:-0}
case ${PIP_NO_INDEX:-} in 1|true|yes|on) no_apt=1 ;; esac

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
    if [ "$no_apt" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
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
if [ "${VENV_SYSTEM_SITE:-0}" = 1 ]; then
    # PYTHON may itself be a venv (a GPU image's /opt/torch/.venv/bin/python3): --system-site-packages
    # then reaches only its base interpreter, not the torch, NCCL, mpi4py, h5py installed in it.
    # A .pth file in the new venv adds the outer venv's site-packages (after the venv's own).
    outer=$("$PYTHON" -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))')
    if [ -n "$outer" ]; then
        pth=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_hvd_lm_outer_venv.pth
        if [ "$(cat "$pth" 2>/dev/null)" != "$outer" ]; then
            say "$PYTHON is a virtual environment: its site-packages are visible in $VENV ($pth)"
            printf '%s\n' "$outer" >"$pth"
        fi
    fi
fi
# The checkout's root at the end of the venv's sys.path (a .pth file: appended, so it never
# shadows an installed package): `python -m tests.cluster`, the cluster in a box, then runs from
# any folder, as `hvd-lm` does.
checkout_pth=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_hvd_lm_checkout.pth
if [ "$(cat "$checkout_pth" 2>/dev/null)" != "$PWD" ]; then
    printf '%s\n' "$PWD" >"$checkout_pth"
fi
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
echo "$ready_key" >"$ready"
say "ready: source $VENV/bin/activate"
