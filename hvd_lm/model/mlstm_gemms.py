"""GEMMs of the fused mLSTM window (:mod:`hvd_lm.model.mlstm_fused`) whose output dtype is not
their operands': the weight gradients, summed over a whole window, and the per-step gradient of
the recurrent state, both written in fp32 from half-precision operands under autocast.

Where the device has it, the GEMM writes fp32 itself (cuBLAS accumulates in fp32 and writes fp32:
``torch.mm(a, b, out_dtype=torch.float32)``, the ``aten::mm.dtype`` / ``mm.dtype_out`` overloads
of PyTorch >= 2.8, pytorch/pytorch#150812, CUDA only): one kernel, no rounding to the operands'
dtype and no cast kernel after it. Elsewhere (the CPU, whose torch has no such kernel, or an
older torch) the weight gradients are computed from fp32 operands and the state gradient is the
half-precision product cast to fp32.
"""

from __future__ import annotations

import torch


def out_dtype_gemm(device_type: str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32[, out=...])`` runs on ``device_type``
    for fp16/bf16 operands (CUDA with PyTorch >= 2.8)."""
    return device_type == "cuda" and hasattr(torch.ops.aten.mm, "dtype_out")


def weight_grad_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` summed and returned in fp32 (or fp64 for fp64 operands) whatever the operands'
    dtype: a weight gradient over all T*B rows of a window (``a`` [F1, T*B], ``b`` [T*B, F2]).

    Why: under fp16 autocast a half-precision output would round, and can overflow (65504), a
    sum of 32-65k rows of loss-scaled products that the per-step reference accumulates into an
    fp32 ``.grad`` step by step.

    How: fp32/fp64 operands: the GEMM's own dtype; fp16/bf16 operands on CUDA with PyTorch >=
    2.8: cuBLAS accumulates in fp32 and writes fp32 (:func:`out_dtype_gemm`); otherwise (CPU,
    or a torch without that overload) the operands are cast to fp32 first.

    Returns:
        [F1, F2] in fp32 (fp64 for fp64 operands).
    """
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if out_dtype_gemm(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def state_grad_mm(device_type: str, compute: torch.dtype, state: torch.dtype, held: bool):
    """The per-step GEMM of the backward ``dh_{t-1} = da_t W_mh (+ dhold_t)`` written into the
    state-dtype buffer ``out`` [B, H]: ``fn(da [B, H], w [H, H], out, dhold)`` (``dhold`` [B, H]
    in the state dtype, the gradient that bypassed the cell on held rows, or None).

    One kernel per step where it can be: the state's dtype itself (``compute == state``:
    ``mm`` / ``addmm`` with ``out=``), or an fp32-output GEMM (:func:`out_dtype_gemm`);
    otherwise the product in ``compute`` is cast into ``out`` (two kernels). With ``held`` (a
    window with padding: never in training) the fp32-output GEMM is followed by an add.

    Args:
        device_type: where the window runs; compute / state: its compute and state dtypes.
        held: whether ``dhold`` is given.
    """
    if compute == state:
        if held:
            return lambda da, w, out, dhold: torch.addmm(dhold, da, w, out=out)
        return lambda da, w, out, dhold: torch.mm(da, w, out=out)
    if out_dtype_gemm(device_type):
        if held:
            return lambda da, w, out, dhold: torch.mm(da, w, out_dtype=state, out=out).add_(dhold)
        return lambda da, w, out, dhold: torch.mm(da, w, out_dtype=state, out=out)
    if held:
        return lambda da, w, out, dhold: torch.add(dhold, torch.mm(da, w), out=out)
    return lambda da, w, out, dhold: out.copy_(torch.mm(da, w))
