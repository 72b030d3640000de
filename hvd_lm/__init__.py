"""hvd_lm: Horovod/MPI data-parallel training of byte-level mLSTM language models.

A rebuild, on today's stack, of the system in Puri et al. 2018, "Large Scale Language Modeling:
Converging on 40GB of Text in Four Hours" (code: NVIDIA/sentiment-discovery).
"""

__version__ = "0.1.0"
