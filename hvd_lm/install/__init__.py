"""How Horovod is built and checked on this machine (the tool beside the library).

* :mod:`~hvd_lm.install.horovod_build`: the decisions ``scripts/build_horovod.sh`` acts on
  (C++17 and g++ 13 patches, NCCL from the pip wheel, CUDA architectures, the wheel-cache key).
* :mod:`~hvd_lm.install.check_build`: ``hvd-lm check-build``, ``horovodrun --check-build``
  parsed and checked against what a training host needs.
"""
