#!/usr/bin/env bash
# Download, on a machine with network, what an air-gapped CUDA node needs to build and run
# hvd_lm beside its own CUDA torch: the Horovod 0.28.1 source distribution and the wheels such
# an image usually lacks (cffi and pycparser for Horovod's build, orjson for data_prep).
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
    --implementation cp "${platforms[@]}" -d "$DEST" cffi pycparser orjson
ls -l "$DEST"
