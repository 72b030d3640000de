#!/usr/bin/env bash
# Download, on a machine with network, what an air-gapped CUDA node needs to build and run
# hvd_lm (`make setup`, `make test`, scripts/gpu_check.sh) beside its own CUDA torch: the Horovod
# 0.28.1 source distribution and every other requirement that is not part of such an image
# (assumed there, as on the H100 image of ../shared/README.md: torch with numpy and triton, the
# NCCL wheel, mpi4py + MPI, h5py, scikit-learn, pytest, pip/setuptools):
#   - Horovod's build and runtime: cffi, pycparser, cloudpickle, psutil, PyYAML, packaging;
#   - hvd_lm's own (pyproject.toml): orjson, tqdm, matplotlib (and its dependencies),
#     pytorch-optimizer, psutil, and the test extra mktestdocs;
#   - Cython and wheel, for building mpi4py from source when the image has none.
# Wheels are fetched without their dependencies (listed here instead), so that nothing pulls a
# second torch or numpy; pip on the node resolves them against what is installed.
#
#   bash scripts/fetch_offline_wheels.sh .whl            # CPython 3.12, x86_64 manylinux
#   PY_VERSION=3.11 bash scripts/fetch_offline_wheels.sh .whl
#
# Then carry the folder to the node and run scripts/gpu_check.sh .whl (or scripts/setup.sh with
# PIP_FIND_LINKS=.whl PIP_NO_INDEX=1). Keep the folder out of git (e.g. .git/info/exclude).
set -euo pipefail
DEST=${1:?usage: fetch_offline_wheels.sh DIR}
PY_VERSION=${PY_VERSION:-3.12}
PIP=(python3 -m pip --disable-pip-version-check -q)
mkdir -p "$DEST"
"${PIP[@]}" download --no-deps --no-binary :all: horovod==0.28.1 -d "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
"${PIP[@]}" download --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${platforms[@]}" -d "$DEST" \
    cffi pycparser cloudpickle psutil pyyaml packaging \
    orjson tqdm pytorch-optimizer mktestdocs \
    matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six tzdata \
    cython wheel
ls -l "$DEST"
