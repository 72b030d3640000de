"""Benchmarks and studies, run from a checkout and not installed with the package, as Horovod
keeps ``examples/pytorch/pytorch_synthetic_benchmark.py`` and PyTorch its ``benchmarks/`` outside
their packages: ``python -m benchmarks NAME [flags]`` (``python -m benchmarks --help`` lists
them; :data:`BENCHMARKS`). Each prints ratios measured side by side in one run and can write its
figures as JSON (docs/performance.md, docs/launch.md). ``python -m benchmarks.control_plane``
is the control-plane rehearsal of docs/launch.md.

Importing the package puts the checkout on ``PYTHONPATH``, so the ranks a benchmark starts
(``mpirun``/``horovodrun`` ``python -m benchmarks.bench_train``) import it from any folder.
"""

from __future__ import annotations

import os
from pathlib import Path

_CHECKOUT = str(Path(__file__).resolve().parent.parent)
if _CHECKOUT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_CHECKOUT, os.environ.get("PYTHONPATH")) if p)

#: benchmark -> (module, Command attribute, one-line help), as :data:`hvd_lm.cli.COMMANDS`.
BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "train": ("benchmarks.bench_train", "BENCH_TRAIN",
              "training throughput: 1 vs N ranks, Horovod and the torch engine vs DDP, "
              "fraction of matmul peak"),
    "allreduce": ("benchmarks.bench_allreduce", "BENCH_ALLREDUCE",
                  "allreduce latency/bandwidth: Horovod (MPI, Gloo controllers; fp16; fusion, "
                  "cycle time) vs mpi4py vs torch gloo"),
    "fusion": ("benchmarks.bench_fusion", "BENCH_FUSION", "training step time vs "
               "HOROVOD_FUSION_THRESHOLD / HOROVOD_CYCLE_TIME, and HOROVOD_AUTOTUNE's choice"),
    "transfer": ("benchmarks.bench_transfer", "BENCH_TRANSFER", "classifier fit seconds per "
                 "solver (liblinear, saga, torch) and size, synthetic and real features"),
    "prepare": ("benchmarks.bench_prepare", "BENCH_PREPARE",
                "measure prepare's MB/s against the raw read rate"),
    "elastic": ("benchmarks.bench_elastic", "BENCH_ELASTIC", "elastic training: the cost of a "
                "commit and of losing a worker, on this machine"),
    "multinode": ("benchmarks.bench_multinode", "BENCH_MULTINODE", "across hosts: allreduce "
                  "alpha-beta fit per node count and the scaling model's predicted training "
                  "step vs the measured one"),
    "checkpoint": ("benchmarks.bench_checkpoint", "BENCH_CHECKPOINT", "the step time around "
                   "a checkpoint, written synchronously and in the background, side by side"),
    "gpu": ("benchmarks.bench_gpu", "BENCH_GPU", "one GPU: matmul and copy ceilings, mLSTM and "
            "cuDNN-LSTM training chars/s, TFLOP/s and fraction of peak per precision"),
    "scaling-report": ("benchmarks.scaling_report", "SCALING_REPORT",
                       "s/iter, speedup and efficiency vs GPUs from a sweep's metrics.jsonl"),
    "scaling-model": ("benchmarks.scaling_study", "SCALING_MODEL", "alpha-beta model of "
                      "s/iter, speedup and efficiency on 1-128 GPUs; validation against the "
                      "reference"),
}


DESCRIPTION = ("hvd_lm's benchmarks and scaling study: ratios measured side by side in one run "
               "(docs/performance.md).")


def build_parser(argv: list[str] | None = None):
    """The ``python -m benchmarks`` parser: :func:`hvd_lm.cli.build_parser` on
    :data:`BENCHMARKS` (only the one ``argv`` names, all when None, is imported)."""
    from hvd_lm import cli
    return cli.build_parser(argv, BENCHMARKS, "python -m benchmarks", DESCRIPTION)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks NAME``; returns the exit status."""
    from hvd_lm import cli
    return cli.main(argv, BENCHMARKS, "python -m benchmarks", DESCRIPTION)
