"""Triton kernels for the fused mLSTM cell (the ``triton`` kernels of
:mod:`hvd_lm.model.mlstm_kernels`, same signatures and semantics as its ``cell_forward`` /
``cell_backward``).

One program handles ``BLOCK`` consecutive elements of the [B, H] state: it loads that element's
four gate values (columns j, H+j, 2H+j, 3H+j of its row), the row's mask and reset flags, and
writes every output of the step, so each step costs one kernel launch forward and one backward
(haste's ``PointwiseOperations`` kernels, written in Triton: Tillet et al. 2019, "Triton: an
intermediate language and compiler for tiled neural network computations"). Arithmetic is fp32
whatever the storage dtype of ``g``/``hs``/``dg`` (bf16/fp16 under autocast); the state tensors
must be fp32 and contiguous.

Triton compiles for GPUs; with ``TRITON_INTERPRET=1`` set before this module is imported, its
interpreter runs the same kernels on CPU tensors (numpy), which is how the tests check them on a
machine without a GPU. ``tanh`` is written out (:func:`_tanh`) because the interpreter has no
libdevice: an odd Taylor polynomial below |x| = 0.25 and ``(1 - e^{-2|x|}) / (1 + e^{-2|x|})``
above it; measured within 1.1e-7 absolute and 2.9e-7 relative error of the exact tanh over
[-20, 20] (torch's fp32 tanh: 3.1e-8 absolute).

The ahead-of-time builds of these kernels for a GPU (``hvd-lm kernels``):
:mod:`hvd_lm.perf.kernels_aot`.

Raises (from the wrappers):
    ValueError: a state tensor that is not fp32, or a non-contiguous tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements of [B, H] per program
NUM_WARPS = 4  # warps per program (Triton's default, stated so ahead-of-time builds match)


@triton.jit
def _tanh(x):
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    t = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _elements(N, H, BLOCK: tl.constexpr):
    """This program's BLOCK element offsets in [B, H] (row-major), which are live (< N), their
    rows and the offset of their i gate in [B, 4H] (f, u, o follow at +H, +2H, +3H)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = offs // H
    return offs, offs < N, row, row * 4 * H + offs % H


@triton.jit
def _cell_forward_kernel(g_ptr, cprev_ptr, hstate_ptr, keep_ptr, rk_ptr, act_ptr, tc_ptr,
                         hs_ptr, cnext_ptr, hnext_ptr, hcnext_ptr, N, H,
                         HAS_KEEP: tl.constexpr, HAS_RK: tl.constexpr, BLOCK: tl.constexpr):
    offs, live, row, gate = _elements(N, H, BLOCK)
    si = tl.sigmoid(tl.load(g_ptr + gate, mask=live, other=0.0).to(tl.float32))
    sf = tl.sigmoid(tl.load(g_ptr + gate + H, mask=live, other=0.0).to(tl.float32))
    tu = _tanh(tl.load(g_ptr + gate + 2 * H, mask=live, other=0.0).to(tl.float32))
    so = tl.sigmoid(tl.load(g_ptr + gate + 3 * H, mask=live, other=0.0).to(tl.float32))
    cp = tl.load(cprev_ptr + offs, mask=live, other=0.0)
    c = sf * cp + si * tu
    tanh_c = _tanh(c)
    h = so * tanh_c
    if HAS_KEEP:
        k = tl.load(keep_ptr + row, mask=live, other=0) != 0
        c = tl.where(k, c, cp)
        h = tl.where(k, h, tl.load(hstate_ptr + offs, mask=live, other=0.0))
    tl.store(act_ptr + gate, si, mask=live)
    tl.store(act_ptr + gate + H, sf, mask=live)
    tl.store(act_ptr + gate + 2 * H, tu, mask=live)
    tl.store(act_ptr + gate + 3 * H, so, mask=live)
    tl.store(tc_ptr + offs, tanh_c, mask=live)
    tl.store(hs_ptr + offs, h.to(hs_ptr.dtype.element_ty), mask=live)
    if HAS_RK:
        r = tl.load(rk_ptr + row, mask=live, other=0.0)
        c = c * r
        h = h * r
    tl.store(cnext_ptr + offs, c, mask=live)
    tl.store(hnext_ptr + offs, h, mask=live)
    tl.store(hcnext_ptr + offs, h.to(hcnext_ptr.dtype.element_ty), mask=live)


@triton.jit
def _cell_backward_kernel(dhs_ptr, dhp_ptr, dcp_ptr, rk_ptr, keep_ptr, act_ptr, tc_ptr,
                          cprev_ptr, dg_ptr, dcpout_ptr, dhold_ptr, N, H,
                          HAS_KEEP: tl.constexpr, HAS_RK: tl.constexpr, BLOCK: tl.constexpr):
    offs, live, row, gate = _elements(N, H, BLOCK)
    dh = tl.load(dhs_ptr + offs, mask=live, other=0.0).to(tl.float32)
    dhp = tl.load(dhp_ptr + offs, mask=live, other=0.0)
    dc = tl.load(dcp_ptr + offs, mask=live, other=0.0)
    if HAS_RK:
        r = tl.load(rk_ptr + row, mask=live, other=0.0)
        dh = dh + dhp * r
        dc = dc * r
    else:
        dh = dh + dhp
    hold_h = tl.zeros_like(dh)
    hold_c = tl.zeros_like(dc)
    if HAS_KEEP:
        k = tl.load(keep_ptr + row, mask=live, other=0) != 0
        hold_h = tl.where(k, 0.0, dh)
        hold_c = tl.where(k, 0.0, dc)
        dh = tl.where(k, dh, 0.0)
        dc = tl.where(k, dc, 0.0)
    si = tl.load(act_ptr + gate, mask=live, other=0.0)
    sf = tl.load(act_ptr + gate + H, mask=live, other=0.0)
    tu = tl.load(act_ptr + gate + 2 * H, mask=live, other=0.0)
    so = tl.load(act_ptr + gate + 3 * H, mask=live, other=0.0)
    tanh_c = tl.load(tc_ptr + offs, mask=live, other=0.0)
    cp = tl.load(cprev_ptr + offs, mask=live, other=0.0)
    dct = dc + dh * so * (1.0 - tanh_c * tanh_c)
    out_ty = dg_ptr.dtype.element_ty
    tl.store(dg_ptr + gate, (dct * tu * si * (1.0 - si)).to(out_ty), mask=live)
    tl.store(dg_ptr + gate + H, (dct * cp * sf * (1.0 - sf)).to(out_ty), mask=live)
    tl.store(dg_ptr + gate + 2 * H, (dct * si * (1.0 - tu * tu)).to(out_ty), mask=live)
    tl.store(dg_ptr + gate + 3 * H, (dh * tanh_c * so * (1.0 - so)).to(out_ty), mask=live)
    tl.store(dcpout_ptr + offs, dct * sf + hold_c, mask=live)
    if HAS_KEEP:
        tl.store(dhold_ptr + offs, hold_h, mask=live)


def _check(state: list[torch.Tensor], others: list[torch.Tensor | None]) -> None:
    for t in state:
        if t.dtype != torch.float32:
            raise ValueError(f"triton mLSTM kernels keep the state in fp32, got {t.dtype}")
    for t in state + [t for t in others if t is not None]:
        if not t.is_contiguous():
            raise ValueError("triton mLSTM kernels need contiguous tensors")


def cell_forward(g, cprev, hstate, keep, rk_next, act, tc, hs_t, c_next, h_next, hc_next):
    """The cell forward (:func:`hvd_lm.model.mlstm_kernels.cell_forward`) as one Triton kernel."""
    _check([cprev, hstate, act, tc, c_next, h_next], [g, keep, rk_next, hs_t, hc_next])
    N, H = cprev.numel(), cprev.shape[1]
    _cell_forward_kernel[(triton.cdiv(N, BLOCK),)](
        g, cprev, hstate, keep if keep is not None else cprev,
        rk_next if rk_next is not None else cprev, act, tc, hs_t, c_next, h_next, hc_next, N, H,
        HAS_KEEP=keep is not None, HAS_RK=rk_next is not None, BLOCK=BLOCK,
        num_warps=NUM_WARPS)


def cell_backward(dhs_t, dhp, dcp, rk_next, keep, act, tc, cprev, dg, dcp_out, dhold):
    """The cell backward (:func:`hvd_lm.model.mlstm_kernels.cell_backward`) as one Triton
    kernel."""
    _check([dhp, dcp, act, tc, cprev, dcp_out], [dhs_t, rk_next, keep, dg, dhold])
    N, H = cprev.numel(), cprev.shape[1]
    _cell_backward_kernel[(triton.cdiv(N, BLOCK),)](
        dhs_t, dhp, dcp, rk_next if rk_next is not None else dhp,
        keep if keep is not None else dhp, act, tc, cprev, dg, dcp_out,
        dhold if dhold is not None else dhp, N, H,
        HAS_KEEP=keep is not None, HAS_RK=rk_next is not None, BLOCK=BLOCK,
        num_warps=NUM_WARPS)


# ---- ahead-of-time builds (no GPU needed) --------------------------------------------------------

#: Triton's pointer type names of the compute dtypes the CUDA path launches the kernels with.
COMPUTE_TYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def launch_signatures(compute: str, has_keep: bool, has_rk: bool) -> dict[str, dict]:
    """The argument types both kernels are launched with by :func:`cell_forward` /
    :func:`cell_backward` for one compute dtype (``g``, ``hs``, ``dg`` and the GEMM copy of h;
    every state tensor is fp32) and mask/reset case (absent flags are passed as an fp32 state
    pointer, never read).

    Returns:
        {kernel name: Triton signature dict (argument -> type; constexprs -> "constexpr")}.
    """
    c, f32 = COMPUTE_TYPES[compute], "*fp32"
    keep = "*i1" if has_keep else f32
    const = {"N": "i32", "H": "i32", "HAS_KEEP": "constexpr", "HAS_RK": "constexpr",
             "BLOCK": "constexpr"}
    return {
        "_cell_forward_kernel": {"g_ptr": c, "cprev_ptr": f32, "hstate_ptr": f32,
                                 "keep_ptr": keep, "rk_ptr": f32, "act_ptr": f32, "tc_ptr": f32,
                                 "hs_ptr": c, "cnext_ptr": f32, "hnext_ptr": f32,
                                 "hcnext_ptr": c, **const},
        "_cell_backward_kernel": {"dhs_ptr": c, "dhp_ptr": f32, "dcp_ptr": f32, "rk_ptr": f32,
                                  "keep_ptr": keep, "act_ptr": f32, "tc_ptr": f32,
                                  "cprev_ptr": f32, "dg_ptr": c, "dcpout_ptr": f32,
                                  "dhold_ptr": f32, **const}}
