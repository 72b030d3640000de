"""How Horovod is checked on this machine (the tool beside the library).

* :mod:`~hvd_lm.install.check_build`: ``hvd-lm check-build``, ``horovodrun --check-build``
  parsed and checked against what a training host needs.

How Horovod is built (C++17 and g++ 13 patches, NCCL from the pip wheel, CUDA architectures, the
wheel-cache key) is not part of the installed package: ``scripts/horovod_build.py`` holds the
decisions ``scripts/build_horovod.sh`` acts on.
"""
