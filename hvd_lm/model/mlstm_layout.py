"""How the fused mLSTM window (:mod:`hvd_lm.model.mlstm_fused`) stores its per-step matrices.

Every per-step buffer is [n, B, F]; on CUDA (and on a one-thread CPU) it is stored ``rows``
(contiguous, as cuDNN and haste do); on a multi-threaded CPU ``features``: storage [F, n*B], each
step's [B, F] matrix column-major, so that MKL runs each per-step GEMM as ``W X^T`` with the large
dimension first (docs/mlstm_fused.md section 5 has the measurement) while the weight gradients
stay single GEMMs over the [F, n*B] rows (the input projections are computed straight into it by
:func:`project`). ``hs`` and the returned state are contiguous in both.
"""

from __future__ import annotations

import torch

from hvd_lm.model.mlstm_kernels import Kernels

LAYOUTS = ("rows", "features")


def default_layout(device: torch.device | str, kernels: Kernels, threads: int | None = None) -> str:
    """How the fused window stores its per-step [B, F] matrices (:func:`steps_empty`):
    ``features`` on a CPU running torch on two or more threads (``threads``, default
    ``torch.get_num_threads()``) when the kernels take strided tensors
    (:attr:`Kernels.strided`), else ``rows``.

    Why (the measurements are in ``docs/mlstm_fused.md`` section 5): on two or more threads MKL
    computes a per-step product ``Y [B, N] = X [B, K] W^T`` faster when Y and X are stored
    transposed (``Y^T = W X^T``: the large N becomes the GEMM's row dimension, which MKL splits
    across threads) and the weight operand is row-major in that form (the backward keeps a
    transposed copy of each weight). On one thread the GEMMs run at the same rate either way
    and the layout's extra copies cost time, so one thread keeps ``rows``. On CUDA the rows
    layout of cuDNN and haste is kept (the Triton kernels index contiguous rows)."""
    threads = torch.get_num_threads() if threads is None else threads
    cpu = torch.device(device).type == "cpu"
    return "features" if cpu and threads > 1 and kernels.strided else "rows"


def steps_empty(n: int, B: int, F: int, dtype: torch.dtype, device: torch.device | str,
                layout: str) -> torch.Tensor:
    """An uninitialised [n, B, F] tensor of ``n`` per-step [B, F] matrices.

    ``rows``: contiguous. ``features``: storage [F, n*B] (strides (B, 1, n*B)), step t's
    matrix being columns t*B .. t*B+B-1: each step is one column-major [B, F] matrix (what the
    per-step GEMMs write and read) and all steps together one row-major [F, n*B] matrix (the
    operand of the weight-gradient GEMMs over n*B rows).

    Raises:
        ValueError: an unknown layout.
    """
    if layout == "rows":
        return torch.empty(n, B, F, dtype=dtype, device=device)
    if layout == "features":
        return torch.empty(F, n * B, dtype=dtype, device=device).t().view(n, B, F)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` [T, B, F] stored as :func:`steps_empty` lays out ``layout``: ``x`` itself when it
    already is, else one (differentiable) copy."""
    if layout == "rows":
        return x.contiguous()
    if layout != "features":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return x if x.permute(2, 0, 1).is_contiguous() else \
        x.permute(2, 0, 1).contiguous().permute(1, 2, 0)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            layout: str) -> torch.Tensor:
    """The input projection ``x W^T (+ b)`` of all T*B positions in one GEMM, stored in
    ``layout`` (:func:`steps_empty`), so the window reads it without a copy.

    ``x`` is contiguous [T, B, E] on the training path (:meth:`LanguageModel.encode` embeds
    the tokens in [T, B] order): ``F.linear`` on a contiguous 3-d input is one GEMM with the
    bias added in its epilogue, where a strided one falls back to a matmul and a separate add
    over the whole [T, B, F] output (two kernels; docs/mlstm_fused.md section 8 has its cost).

    Args:
        x: [T, B, E]; weight: [F, E]; bias: [F] or None.

    Returns:
        [T, B, F] (autocast's dtype when autocast is on, as ``F.linear``).
    """
    if layout == "rows":
        return torch.nn.functional.linear(x, weight, bias)
    T, B, E = x.shape
    xt = x.reshape(T * B, E).t()  # [E, T*B]
    y = torch.mm(weight, xt) if bias is None else torch.addmm(bias.unsqueeze(1), weight, xt)
    return y.t().view(T, B, -1)  # [F, T*B] storage: features layout


def uniform_steps(*buffers: torch.Tensor | None) -> bool:
    """Whether step t's [B, F] slice of every [n, B, F] buffer (None: absent) starts at step 0's
    alignment modulo 16 bytes (each buffer's step stride is a multiple of 16 bytes): then every
    step's launch of a Triton kernel specialises as the first one does, and one binding serves
    the window (:class:`hvd_lm.model.mlstm_triton.Launch`)."""
    return all(b is None or b.stride(0) * b.element_size() % 16 == 0 for b in buffers)
