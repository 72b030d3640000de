"""The fused mLSTM recurrence: one ``torch.autograd.Function`` over a whole TBPTT window.

The reference path (:class:`hvd_lm.model.lm.MLSTM` with ``rnn_impl="reference"``) builds the
window out of ~15 autograd ops per step; its backward then accumulates each recurrent weight's
gradient once per step (T GEMMs with K = B and T full-size ``add_``\\ s) and, under autocast,
re-casts both recurrent weights at every step. This module does what cuDNN's RNN and
lmnt-com/haste's LSTM do (``haste/lib/lstm_backward_gpu.cu.cc``: per-step data gradients,
weight gradients as single GEMMs over all steps after the loop):

forward (per window): cast ``W_mh`` [H, H] and ``W_h`` [4H, H] to the compute dtype once (the
caller applies weight norm once, before); the input projections ``xg = x W_x^T + b`` [T, B, 4H]
and ``xm = x W_mx^T`` [T, B, H] arrive precomputed (one GEMM each over T*B rows, the bias in
that GEMM). Per step t, four kernels::

    a_t   = hprev_t @ W_mh^T                      GEMM 1            [B, H]
    m_t   = xm_t * a_t                            (the multiplicative input, between the GEMMs)
    g_t   = xg_t + m_t @ W_h^T                    GEMM 2, accumulating into xg_t in place
                                                  (the GEMM's epilogue adds: no copy, no add)
    cell  : gates, c_t, h_t, mask, next reset     one fused kernel  (hvd_lm.model.mlstm_kernels)

saving tanh(c_t)'s inputs and what the GEMMs' gradients need: c_{t-1}, a_t, m_t, xm_t and
hprev_t, and either the gate activations and tanh(c_t) in the state dtype (fp32 compute) or,
when the compute dtype is narrower (bf16/fp16 under autocast), the gate pre-activations g_t in
it (the xg buffer itself, after the GEMM), from which the backward's cell kernel recomputes the
activations with the forward's own fp32 expressions. Backward, per step (t = T-1..0), four
kernels::

    cell backward                                 one fused kernel -> dg_t [B, 4H] (written
                                                  over g_t when g_t was saved)
    dm_t  = dg_t @ W_h                            GEMM 1            [B, H]
    da_t  = dm_t * xm_t
    dhprev = dhold + da_t @ W_mh                  GEMM 2, written in the state dtype
                                                  (:func:`state_grad_mm`)

then, over all T*B rows at once: ``dW_h = dG^T M`` [4H, H], ``dW_mh = dA^T Hprev`` [H, H],
``dxm = dM * A``; ``dxg = dG`` flows back into the input projection's own single GEMM.

FLOPs per step and row (multiply-adds x 2): forward 2 (H^2 + 4H^2) = 10 H^2; backward data
gradients 10 H^2, weight gradients 10 H^2 (same as the reference; what changes is their shape:
K = T*B instead of K = B, and no per-step read-modify-write of the 4H x H gradient, 16 B x 5 H^2
per step in fp32). Bytes saved per step and row: :func:`saved_bytes`.

Layout: :func:`default_layout` (``rows`` on CUDA, ``features`` on a multi-threaded
CPU). The cell kernels are bound once per window (:meth:`Kernels.bind_forward`: Triton's
arguments checked and launches prepared once, not per step).

Semantics kept exactly from the reference: ``reset`` [T, B] zeroes a row's (h, c) before that
step (done inside the Function as a multiply by ``rk = 1 - reset``, instead of splitting the
window into segments); ``mask`` [T, B] False holds the row's state through that step. The cell
state is kept in the state dtype (fp32) whatever the compute dtype; the outputs hs are in the
compute dtype, the final (h, c) in the state dtype.
"""

from __future__ import annotations

import contextlib

import torch

from hvd_lm.model.mlstm_graphs import WindowGraphs
from hvd_lm.model.mlstm_kernels import Kernels

State = tuple[torch.Tensor, torch.Tensor]


# ---- the per-step buffers' layout ------------------------------------------------------------
# How the window stores its per-step matrices.
#
# Every per-step buffer is [n, B, F]; on CUDA (and on a one-thread CPU) it is stored ``rows``
# (contiguous, as cuDNN and haste do); on a multi-threaded CPU ``features``: storage [F, n*B], each
# step's [B, F] matrix column-major, so that MKL runs each per-step GEMM as ``W X^T`` with the large
# dimension first (docs/mlstm_fused.md section 5 has the measurement) while the weight gradients
# stay single GEMMs over the [F, n*B] rows (the input projections are computed straight into it by
# :func:`project`). ``hs`` and the returned state are contiguous in both.

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


# ---- GEMMs written in fp32 -------------------------------------------------------------------
# GEMMs of the window whose output dtype is not their operands': the weight gradients, summed over
# a whole window, and the per-step gradient of the recurrent state, both written in fp32 from
# half-precision operands under autocast.
#
# Where the device has it, the GEMM writes fp32 itself (cuBLAS accumulates in fp32 and writes fp32:
# ``torch.mm(a, b, out_dtype=torch.float32)``, the ``aten::mm.dtype`` / ``mm.dtype_out`` overloads
# of PyTorch >= 2.8, pytorch/pytorch#150812, CUDA only): one kernel, no rounding to the operands'
# dtype and no cast kernel after it. Elsewhere (the CPU, whose torch has no such kernel, or an
# older torch) the weight gradients are computed from fp32 operands and the state gradient is the
# half-precision product cast to fp32.


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


def _no_autocast(device: torch.device):
    """Autocast off inside the Function: every dtype is chosen explicitly."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _allocator(B: int, device: torch.device, layout: str):
    """``steps(n, F, dtype)``: :func:`steps_empty` for one window's B, device and layout."""
    return lambda n, F, dtype: steps_empty(n, B, F, dtype, device, layout)


def _unbind(x: torch.Tensor | None, n: int) -> tuple | list:
    """The per-step views ``x[0] .. x[n-1]`` of ``x`` [n, ...] (made once in C++ by unbind, not
    by Python indexing at every step), or ``n`` Nones for an absent ``x``."""
    return [None] * n if x is None else x.unbind(0)


def _steps(keep: torch.Tensor | None, rk: torch.Tensor | None, T: int) -> tuple:
    """Per-step views: ``keep[t]`` and the *next* step's reset multiplier ``rk[t + 1]`` (ones
    after the last step: a multiply by 1.0 changes nothing and every step's cell kernel takes
    the same arguments), or Nones."""
    rk_next = None if rk is None else torch.cat((rk[1:], torch.ones_like(rk[:1])))
    return _unbind(keep, T), _unbind(rk_next, T)


class MLSTMWindow(torch.autograd.Function):
    """The whole window's recurrence as one autograd node (see the module docstring).

    ``apply(xg, xm, h0, c0, w_mh, w_h, keep, rk, kernels, save, layout)``:

    Args:
        xg: [T, B, 4H] gate input projections incl. bias (compute dtype C = ``xg.dtype``),
            owned by the window: the gate GEMM accumulates into it in place (it holds the
            pre-activations g_t afterwards), so a caller's tensor must be passed as a copy
            (:func:`mlstm_window` makes one unless told it is ``owned``).
        xm: [T, B, H] multiplicative input projections (C).
        h0, c0: [B, H] incoming state (state dtype S = ``c0.dtype``).
        w_mh: [H, H], w_h: [4H, H]: the recurrent weights (any float dtype; cast to C once).
        keep: bool [T, B, 1] or None: False where the step is padding (state held).
        rk: [T, B, 1] (S) or None: 0.0 where the state is zeroed before the step.
        kernels: the cell kernels (:func:`hvd_lm.model.mlstm_kernels.get_kernels`).
        save: keep what the backward needs (False: inference, O(1) buffers in T).
        layout: ``rows`` or ``features``: how every per-step buffer is stored
            (:func:`steps_empty`; hs is rows in both); ``xg``/``xm`` must already be in it
            (:func:`to_layout`).

    Returns:
        (hs [T, B, H] in C, h_T [B, H] in S, c_T [B, H] in S).
    """

    @staticmethod
    def forward(ctx, xg, xm, h0, c0, w_mh, w_h, keep, rk, kernels: Kernels, save: bool,
                layout: str):
        T, B, H4 = xg.shape
        H = H4 // 4
        S, C, dev = c0.dtype, xg.dtype, xg.device
        steps = _allocator(B, dev, layout)
        n = T if save else 1
        xg = xg.detach()  # written in place below: its steps are plain views of a plain tensor
        # a narrower compute dtype saves the pre-activations (xg, C) instead of act and tanh(c)
        # in S: the backward recomputes them (4H C in place of 5H S per step and row)
        save_act = save and C == S
        with _no_autocast(dev):
            wmh_t = w_mh.to(C).t()  # [H, H]: a = hprev @ W_mh^T; cast once per window
            wh_t = w_h.to(C).t()    # [H, 4H]
            act = steps(n, H4, S) if save_act else None
            tc = steps(n, H, S) if save_act else None
            cprev, hprev_c = steps(n + 1, H, S), steps(n + 1, H, C)
            a, m = steps(n, H, C), steps(n, H, C)
            hs = torch.empty(T, B, H, dtype=C, device=dev)  # rows in both: the decoder's input
            r0 = 1.0 if rk is None else rk[0]  # a stream starting at step 0: zero state
            hstate = steps(1, H, S)[0].copy_(h0 * r0)
            cprev[0].copy_(c0 * r0)
            hprev_c[0].copy_(hstate)
            # Per-step views made once in C++ (unbind), not by T x 13 Python indexing calls.
            xg_t, xm_t, hs_t = xg.unbind(0), xm.unbind(0), hs.unbind(0)
            act_t, tc_t = _unbind(act, n), _unbind(tc, n)  # Nones unless save_act
            a_t, m_t, cp_t, hp_t = a.unbind(0), m.unbind(0), cprev.unbind(0), hprev_c.unbind(0)
            keep_t, rk_next = _steps(keep, rk, T)
            s1 = 1 if save else 0
            cell = kernels.bind_forward(
                uniform_steps(xg, hs, act, tc, cprev, hprev_c, keep, rk),
                xg_t[0], cp_t[0], hstate, keep_t[0], rk_next[0], act_t[0], tc_t[0], hs_t[0],
                cp_t[s1], hstate, hp_t[s1])
            for t in range(T):
                s, s1 = (t, t + 1) if save else (0, 0)
                torch.mm(hp_t[s], wmh_t, out=a_t[s])
                torch.mul(xm_t[t], a_t[s], out=m_t[s])
                xg_t[t].addmm_(m_t[s], wh_t)  # g_t = x_t W_x^T + b + m_t W_h^T, in place
                cell(xg_t[t], cp_t[s], hstate, keep_t[t], rk_next[t], act_t[s], tc_t[s],
                     hs_t[t], cp_t[s1], hstate, hp_t[s1])
            c_T = cprev[n if save else 0].clone(memory_format=torch.contiguous_format)
        if save:
            ctx.save_for_backward(xm, w_mh, w_h, keep, rk, act, tc, cprev, hprev_c, a, m,
                                  None if save_act else xg)
            ctx.kernels, ctx.layout = kernels, layout
        return hs, hstate.contiguous(), c_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dhs, dh_T, dc_T):
        xm, w_mh, w_h, keep, rk, act, tc, cprev, hprev_c, a, m, g = ctx.saved_tensors
        kernels, layout = ctx.kernels, ctx.layout
        T, B, H = xm.shape
        S, C, dev = cprev.dtype, xm.dtype, xm.device
        steps = _allocator(B, dev, layout)

        def state(init, dtype):  # a [B, H] gradient of the state, zero or ``init``
            out = steps(1, H, dtype)[0]
            return out.zero_() if init is None else out.copy_(init)

        with _no_autocast(dev):
            w_mh_c, w_h_c = w_mh.to(C), w_h.to(C)  # cast once per window
            if layout == "features":  # dM^T = W_h^T dG^T needs W_h^T row-major: one copy
                w_mh_c, w_h_c = w_mh_c.t().contiguous().t(), w_h_c.t().contiguous().t()
            # the gate gradients overwrite the saved pre-activations when there are some
            dG = g if g is not None else steps(T, 4 * H, C)
            dM, dA = steps(T, H, C), steps(T, H, C)
            dhp, dcp = state(dh_T, S), state(dc_T, S)
            # without padding nothing bypasses the cell: dhold is zero and not materialised
            dhold = steps(1, H, S)[0] if keep is not None else None
            if dhs is None:
                dhs = torch.zeros(T, B, H, dtype=C, device=dev)
            # the grad of hs: contiguous when the decoder read hs as it is (LanguageModel keeps
            # [T, B] order end to end); rows dense for the row kernels, the strided kernels read
            # it as it comes
            dhs = dhs.contiguous() if layout == "rows" else dhs
            dhs_t, dM_t, dA_t = dhs.unbind(0), dM.unbind(0), dA.unbind(0)
            cp_t, xm_t = cprev.unbind(0), xm.unbind(0)
            act_t, tc_t, g_t = _unbind(act, T), _unbind(tc, T), _unbind(g, T)
            # over the pre-activations: the very same views (torch.compile's kernels take two
            # views of one memory as one input only when they are one object)
            dG_t = g_t if g is not None else dG.unbind(0)
            keep_t, rk_next = _steps(keep, rk, T)
            dh_mm = state_grad_mm(dev.type, C, S, keep is not None)
            last = T - 1
            cell = kernels.bind_backward(
                uniform_steps(dhs, dG, act, tc, cprev, keep, rk), dhs_t[last], dhp, dcp,
                rk_next[last], keep_t[last], act_t[last], tc_t[last], cp_t[last], dG_t[last],
                dcp, dhold, g_t[last])
            for t in range(last, -1, -1):
                cell(dhs_t[t], dhp, dcp, rk_next[t], keep_t[t], act_t[t], tc_t[t], cp_t[t],
                     dG_t[t], dcp, dhold, g_t[t])
                torch.mm(dG_t[t], w_h_c, out=dM_t[t])
                torch.mul(dM_t[t], xm_t[t], out=dA_t[t])
                dh_mm(dA_t[t], w_mh_c, dhp, dhold)
            if rk is not None:
                dhp, dcp = dhp * rk[0], dcp * rk[0]
            dhp, dcp = dhp.contiguous(), dcp.contiguous()
            # Weight and input-projection gradients: one GEMM / one kernel over T*B rows each,
            # summed and written in fp32 (weight_grad_mm) whatever C is.
            d_wh = weight_grad_mm(dG.view(T * B, 4 * H).t(), m.view(T * B, H)).to(w_h.dtype)
            d_wmh = weight_grad_mm(dA.view(T * B, H).t(),
                                   hprev_c[:T].view(T * B, H)).to(w_mh.dtype)
            dxm = dM * a
        return dG, dxm, dhp, dcp, d_wmh, d_wh, None, None, None, None, None


def saved_bytes(T: int, B: int, H: int, state_dtype: torch.dtype = torch.float32,
                compute_dtype: torch.dtype = torch.float32, mask: bool = False,
                reset: bool = False) -> int:
    """Bytes of activations one training window of :class:`MLSTMWindow` keeps for its
    backward (the recurrent weights, which it saves too, are the parameters' own storage and
    not counted). Per (step, row), with S and C the state and compute dtypes' sizes::

        c_{t-1} H S + hprev H C + a H C + m H C + xm H C
        + act 4H S + tanh(c) H S      when C = S (fp32): H (6 S + 4 C)
        + g 4H C                      when C < S (bf16/fp16 autocast): H (S + 8 C)

    that is 20 H bytes in bf16, plus one more row of c_{t-1} and hprev (the state after the
    last step), and the mask (1 B) and reset multiplier (S) per (step, row) when given
    (docs/mlstm_fused.md section 2 works it out for the GPU runs' shapes;
    tests/test_mlstm_fused.py checks it against torch's saved-tensor hooks).

    Args:
        T: window length (steps); B: rows; H: hidden size.
        mask, reset: whether the window has padding / stream starts (their per-step flags).

    Returns:
        bytes (int).
    """
    s, c = torch.finfo(state_dtype).bits // 8, torch.finfo(compute_dtype).bits // 8
    per_row = H * (6 * s + 4 * c) if c == s else H * (s + 8 * c)
    per_step_row = per_row + (1 if mask else 0) + (s if reset else 0)
    return T * B * per_step_row + B * H * (s + c)


def mlstm_window(xg: torch.Tensor, xm: torch.Tensor, state: State, w_mh: torch.Tensor,
                 w_h: torch.Tensor, kernels: Kernels, mask: torch.Tensor | None = None,
                 reset: torch.Tensor | None = None, graphs: WindowGraphs | None = None,
                 layout: str | None = None, owned: bool = False) -> tuple[torch.Tensor, State]:
    """Run the fused recurrence over a window (see the module docstring).

    Args:
        xg: [T, B, 4H] input gate projections incl. bias; xm: [T, B, H].
        state: (h0, c0), each [B, H] (state dtype, normally fp32).
        w_mh: [H, H]; w_h: [4H, H] (weight norm already applied).
        kernels: cell kernels (:func:`hvd_lm.model.mlstm_kernels.get_kernels`).
        mask: bool [T, B] or None; False = padding (state held).
        reset: bool [T, B] or None; True = zero the row's state before that step.
        graphs: a :class:`WindowGraphs` to replay a captured CUDA graph when the window's
            signature matches (None: always eager).
        layout: ``rows`` or ``features`` (:func:`steps_empty`); None: :func:`default_layout`.
            ``xg``/``xm`` are copied into it unless they already are (:func:`project`).
        owned: ``xg`` is the caller's to give away (a fresh projection nothing else reads,
            as :class:`hvd_lm.model.lm.MLSTM` passes): the window accumulates the gate GEMMs
            into it in place; otherwise it works on a copy (one per window).

    Returns:
        (hs [T, B, H] contiguous in xg's dtype, (h_T, c_T) each [B, H] contiguous in c0's
        dtype).

    Raises:
        ValueError: shapes that do not fit together; an unknown layout.
    """
    T, B, H4 = xg.shape
    h0, c0 = state
    H = H4 // 4
    if xm.shape != (T, B, H) or h0.shape != (B, H) or c0.shape != (B, H) \
            or w_mh.shape != (H, H) or w_h.shape != (H4, H) or H4 != 4 * H:
        raise ValueError(f"mlstm_window: shapes do not fit: xg {tuple(xg.shape)}, xm "
                         f"{tuple(xm.shape)}, h0 {tuple(h0.shape)}, c0 {tuple(c0.shape)}, "
                         f"w_mh {tuple(w_mh.shape)}, w_h {tuple(w_h.shape)}")
    if reset is not None and reset.device.type == "cpu" and not bool(reset.any()):
        reset = None  # most windows have no stream start: skip the multiplies (no sync on CPU)
    # The flags normalised once per window to contiguous [T, B, 1] (the caller may pass views):
    # each step's [B, 1] slice is then dense, as the row kernels (Triton) index it.
    keep = None if mask is None else mask.to(torch.bool).reshape(T, B, 1).contiguous()
    rk = None if reset is None else \
        (~reset.to(torch.bool)).to(c0.dtype).reshape(T, B, 1).contiguous()
    if c0.dtype != h0.dtype:
        raise ValueError(f"mlstm_window: h0 is {h0.dtype} but c0 is {c0.dtype}")
    save = torch.is_grad_enabled() and any(
        t.requires_grad for t in (xg, xm, h0, c0, w_mh, w_h))
    layout = layout or default_layout(xg.device, kernels)
    xg_in, xg, xm = xg, to_layout(xg, layout), to_layout(xm, layout)
    if xg is xg_in and not owned:
        xg = xg.clone()  # the window writes into it (strides kept: same layout)
    args = (xg, xm, h0, c0, w_mh, w_h, keep, rk)

    def run(*a):
        return MLSTMWindow.apply(*a, kernels, save, layout)

    hs, h, c = graphs(run, args) if graphs is not None and save else run(*args)
    return hs, (h, c)
