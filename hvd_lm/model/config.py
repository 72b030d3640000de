"""The model's architecture settings (:class:`ModelConfig`), without torch: the one source of
truth that ``hvd-lm train``'s settings, checkpoints and ``hvd-lm launch`` read (launch plans a
job without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

from hvd_lm.formats.tokenizer import VOCAB_SIZE
from hvd_lm.options import option

#: The fused mLSTM's cell kernels (``--rnn-kernels``, :mod:`hvd_lm.model.mlstm_kernels`).
KERNELS = ("auto", "torch", "compile", "triton")


@dataclass
class ModelConfig:
    """Architecture of a :class:`LanguageModel`.

    Attributes:
        cell: ``"mlstm"`` (the reference's) or ``"lstm"`` (torch.nn.LSTM, for comparison).
        embed_dim: byte embedding width E (reference: 64).
        hidden_size: recurrent width H (reference: 4096; 256 to 8192 supported).
        weight_norm: weight-normalise the recurrent and gate weights (mLSTM only).
        vocab_size: number of byte values (256).
        rnn_impl: ``fused`` (one autograd Function per window, :mod:`hvd_lm.model.mlstm_fused`)
            or ``reference`` (step-by-step autograd, the oracle); mLSTM only.
        rnn_kernels: the fused path's cell kernels: ``auto`` (triton on CUDA when installed,
            else torch), ``torch``, ``compile`` (torch.compile of the cell only) or ``triton``.
        cuda_graphs: on CUDA, capture the fused window (forward + backward) as a CUDA graph and
            replay it while the window's shape stays the same (eager otherwise).
    """

    cell: str = option("mlstm", "recurrent cell: mlstm (reference) or lstm",
                       choices=("mlstm", "lstm"))
    embed_dim: int = option(64, "byte embedding width", ge=1)
    hidden_size: int = option(4096, "recurrent state width H (reference 4096)", ge=1, le=16384)
    weight_norm: bool = option(False, "weight-normalise recurrent and gate weights (as the "
                               "reference)")
    vocab_size: int = option(VOCAB_SIZE, "output classes (256 byte values)", ge=1)
    rnn_impl: str = option("fused", "mLSTM recurrence: fused (one autograd Function per window) "
                           "or reference (step-by-step autograd, the oracle)",
                           choices=("fused", "reference"))
    rnn_kernels: str = option("auto", "fused path's pointwise cell kernels (auto: triton on "
                              "CUDA when installed, else torch)", choices=KERNELS)
    cuda_graphs: bool = option(False, "on CUDA, replay the fused window (forward + backward) "
                               "from a CUDA graph while its shape stays the same")
