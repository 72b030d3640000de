#!/usr/bin/env bash
# Download, on a machine with network, what an air-gapped CUDA node needs to build and run
# hvd_lm (`make setup`, `make test`, scripts/gpu_check.sh) beside its own CUDA torch: the Horovod
# 0.28.1 source distribution and every other requirement that is not part of such an image
# (assumed there, as on the H100 image of ../shared/README.md: torch with numpy and triton, the
# NCCL wheel, mpi4py + MPI, h5py, scikit-learn, pytest, pip/setuptools):
#   - Horovod's build and runtime: cffi, pycparser, cloudpickle, psutil, PyYAML, packaging;
#   - hvd_lm's own (pyproject.toml): orjson, tqdm, matplotlib (and its dependencies),
#     pytorch-optimizer, psutil, safetensors, and the test extra's mktestdocs and pytest-xdist
#     (with execnet);
#   - setuptools, Cython and wheel: the editable install of hvd_lm and the Horovod build run
#     without build isolation, and mpi4py is built from source when the image has none.
# Wheels are fetched without their dependencies (listed here instead), so that nothing pulls a
# second torch or numpy; pip on the node resolves them against what is installed. The last line
# states the total: a node that reaches no index gets it carried with the working tree, 64 MiB
# at most in all on this workplace's GPU machines (the script fails above MAX_MIB, default 48).
#
#   bash scripts/fetch_offline_wheels.sh .whl            # CPython 3.12, x86_64 manylinux
#   PY_VERSION=3.11 bash scripts/fetch_offline_wheels.sh .whl
#
# Then carry the folder to the node and run scripts/gpu_check.sh .whl (or scripts/setup.sh with
# PIP_FIND_LINKS=.whl PIP_NO_INDEX=1). Keep the folder out of git (e.g. .git/info/exclude).
# tests/test_gpu_node.py rehearses that node here with the folder this script makes.
set -euo pipefail
DEST=${1:?usage: fetch_offline_wheels.sh DIR}
PY_VERSION=${PY_VERSION:-3.12}
MAX_MIB=${MAX_MIB:-48}
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
    orjson tqdm pytorch-optimizer mktestdocs safetensors pytest-xdist execnet \
    matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six tzdata \
    cython wheel setuptools
ls -l "$DEST"
kib=$(du -sk "$DEST" | cut -f1)
echo "$(find "$DEST" -maxdepth 1 -type f | wc -l) files, $((kib / 1024)) MiB in $DEST" \
     "(carried with the working tree: at most 64 MiB in all)"
if ((kib > MAX_MIB * 1024)); then
    echo "ERROR: $DEST holds $((kib / 1024)) MiB, over MAX_MIB=$MAX_MIB" >&2
    exit 1
fi
