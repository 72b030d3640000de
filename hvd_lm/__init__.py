"""hvd_lm: Horovod/MPI data-parallel training of byte-level mLSTM language models.

A rebuild, on today's stack, of the system in Puri et al. 2018, "Large Scale Language Modeling:
Converging on 40GB of Text in Four Hours" (code: NVIDIA/sentiment-discovery).

Layers, each importing only those below it (tests/test_architecture.py checks it):
``util`` (atomic writes, locks, digests, units) < ``options`` (the config framework) <
``formats`` (tokenizer, shards + manifest, checkpoint files) < ``model`` (the LM, its kernels,
devices, loading a trained model) < ``comm`` (launcher environment, Horovod, MPI) < ``install``
(building and checking Horovod) < ``train`` < ``transfer`` < ``jobs`` (demo, doctor, download,
job scripts) < ``perf`` (benchmarks, scaling model) < ``cli``. ``data_prep`` (beside this package)
builds on ``util``, ``options``, ``formats`` and ``comm.world`` / ``comm.mpi``.
"""
from pathlib import Path

__version__ = "0.1.0"

#: The source checkout this package runs from (holds ``launch/``, ``configs/``, ``docs/``).
REPO_ROOT = Path(__file__).resolve().parents[1]
