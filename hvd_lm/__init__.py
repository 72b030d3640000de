"""hvd_lm: Horovod/MPI data-parallel training of byte-level mLSTM language models.

A rebuild, on today's stack, of the system in Puri et al. 2018, "Large Scale Language Modeling:
Converging on 40GB of Text in Four Hours" (code: NVIDIA/sentiment-discovery).

Layers, each importing only those below it: ``core`` (tokenizer, shard format, model, atomic
writes, configuration machinery) < ``comm`` (launcher environment, Horovod, MPI) < ``train`` <
``transfer`` < ``jobs`` (launch, demo, download) < ``perf`` (benchmarks, scaling model) < ``cli``.
``data_prep`` (beside this package) builds on ``core`` and ``comm.launcher``.
"""
from pathlib import Path

__version__ = "0.1.0"

#: The source checkout this package runs from (holds ``launch/``, ``configs/``, ``docs/``).
REPO_ROOT = Path(__file__).resolve().parents[1]
