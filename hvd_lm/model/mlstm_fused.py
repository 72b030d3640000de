"""The fused mLSTM recurrence: one ``torch.autograd.Function`` over a whole TBPTT window.

The reference path (:class:`hvd_lm.model.lm.MLSTM` with ``rnn_impl="reference"``) builds the
window out of ~15 autograd ops per step; its backward then accumulates each recurrent weight's
gradient once per step (T GEMMs with K = B and T full-size ``add_``\\ s) and, under autocast,
re-casts both recurrent weights at every step. This module does what cuDNN's RNN and
lmnt-com/haste's LSTM do (``haste/lib/lstm_backward_gpu.cu.cc``: per-step data gradients,
weight gradients as single GEMMs over all steps after the loop):

forward (per window): cast ``W_mh`` [H, H] and ``W_h`` [4H, H] to the compute dtype once (the
caller applies weight norm once, before); the input projections ``xg = x W_x^T + b`` [T, B, 4H]
and ``xm = x W_mx^T`` [T, B, H] arrive precomputed (one GEMM each over T*B rows). Per step t::

    a_t   = hprev_t @ W_mh^T                      GEMM 1            [B, H]
    m_t   = xm_t * a_t                            (the multiplicative input, between the GEMMs)
    g_t   = xg_t + m_t @ W_h^T                    GEMM 2 (addmm)    [B, 4H]
    cell  : gates, c_t, h_t, mask, next reset     one fused kernel  (hvd_lm.model.mlstm_kernels)

saving the gate activations, tanh(c_t), c_{t-1}, a_t, m_t, xm_t and hprev_t. Backward, per step
(t = T-1..0)::

    cell backward                                 one fused kernel -> dg_t [B, 4H]
    dm_t  = dg_t @ W_h                            GEMM 1            [B, H]
    da_t  = dm_t * xm_t
    dhprev = dhold + da_t @ W_mh                  GEMM 2 (addmm)    [B, H]

then, over all T*B rows at once: ``dW_h = dG^T M`` [4H, H], ``dW_mh = dA^T Hprev`` [H, H],
``dxm = dM * A``; ``dxg = dG`` flows back into the input projection's own single GEMM.

FLOPs per step and row (multiply-adds x 2): forward 2 (H^2 + 4H^2) = 10 H^2; backward data
gradients 10 H^2, weight gradients 10 H^2 (same as the reference; what changes is their shape:
K = T*B instead of K = B, and no per-step read-modify-write of the 4H x H gradient, 16 B x 5 H^2
per step in fp32). Bytes saved per step and row: 6H S (activations 4H, tanh(c) H, c_{t-1} H) +
4H C (hprev, a, m, xm): :func:`saved_bytes`.

Layout (:func:`default_layout`, :func:`steps_empty`): every per-step buffer is [n, B, F]; on
CUDA (and on a one-thread CPU) it is stored ``rows`` (contiguous, as cuDNN and haste do); on a
multi-threaded CPU ``features``: storage [F, n*B], each step's [B, F] matrix column-major, so
that MKL runs each per-step GEMM as ``W X^T`` with the large dimension first (1.5x faster on
two threads at B = 32) while the weight gradients stay single GEMMs over the [F, n*B] rows
(the input projections are computed straight into it by :func:`project`). ``hs`` and the
returned state are contiguous in both.

Semantics kept exactly from the reference: ``reset`` [T, B] zeroes a row's (h, c) before that
step (done inside the Function as a multiply by ``rk = 1 - reset``, instead of splitting the
window into segments); ``mask`` [T, B] False holds the row's state through that step. The cell
state is kept in the state dtype (fp32) whatever the compute dtype; the outputs hs are in the
compute dtype, the final (h, c) in the state dtype.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Callable

import torch

from hvd_lm.model.mlstm_kernels import Kernels

State = tuple[torch.Tensor, torch.Tensor]


def _no_autocast(device: torch.device):
    """Autocast off inside the Function: every dtype is chosen explicitly."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


class MLSTMWindow(torch.autograd.Function):
    """The whole window's recurrence as one autograd node (see the module docstring).

    ``apply(xg, xm, h0, c0, w_mh, w_h, keep, rk, kernels, save, layout)``:

    Args:
        xg: [T, B, 4H] gate input projections incl. bias (compute dtype C = ``xg.dtype``).
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
        with _no_autocast(dev):
            wmh_t = w_mh.to(C).t()  # [H, H]: a = hprev @ W_mh^T; cast once per window
            wh_t = w_h.to(C).t()    # [H, 4H]
            act, tc = steps(n, H4, S), steps(n, H, S)
            cprev, hprev_c = steps(n + 1, H, S), steps(n + 1, H, C)
            a, m = steps(n, H, C), steps(n, H, C)
            g = steps(1, H4, C)[0]
            hs = torch.empty(T, B, H, dtype=C, device=dev)  # rows in both: the decoder's input
            h0s, c0s = h0, c0
            if rk is not None:
                h0s, c0s = h0s * rk[0], c0s * rk[0]
            hstate = steps(1, H, S)[0].copy_(h0s)
            cprev[0].copy_(c0s)
            hprev_c[0].copy_(h0s)
            # Per-step views made once in C++ (unbind), not by T x 13 Python indexing calls.
            xg_t, xm_t, hs_t = xg.unbind(0), xm.unbind(0), hs.unbind(0)
            act_t, tc_t, a_t, m_t = act.unbind(0), tc.unbind(0), a.unbind(0), m.unbind(0)
            cp_t, hp_t = cprev.unbind(0), hprev_c.unbind(0)
            keep_t, rk_next = _steps(keep, rk, T)
            for t in range(T):
                s, s1 = (t, t + 1) if save else (0, 0)
                torch.mm(hp_t[s], wmh_t, out=a_t[s])
                torch.mul(xm_t[t], a_t[s], out=m_t[s])
                torch.addmm(xg_t[t], m_t[s], wh_t, out=g)
                kernels.forward(g, cp_t[s], hstate, keep_t[t], rk_next[t], act_t[s], tc_t[s],
                                hs_t[t], cp_t[s1], hstate, hp_t[s1])
            c_T = cprev[n if save else 0].clone(memory_format=torch.contiguous_format)
        if save:
            ctx.save_for_backward(xm, w_mh, w_h, keep, rk, act, tc, cprev, hprev_c, a, m)
            ctx.kernels, ctx.layout = kernels, layout
        return hs, hstate.contiguous(), c_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dhs, dh_T, dc_T):
        xm, w_mh, w_h, keep, rk, act, tc, cprev, hprev_c, a, m = ctx.saved_tensors
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
            dG, dM, dA = steps(T, 4 * H, C), steps(T, H, C), steps(T, H, C)
            dhp, dcp = state(dh_T, S), state(dc_T, S)
            # without padding nothing bypasses the cell: dhold is zero and not materialised
            dhold = steps(1, H, S)[0] if keep is not None else None
            if dhs is None:
                dhs = torch.zeros(T, B, H, dtype=C, device=dev)
            # the grad of hs (e.g. of hs.transpose(0, 1)): rows dense for the row kernels; the
            # strided kernels read it as it comes (one copy saved)
            dhs = dhs.contiguous() if layout == "rows" else dhs
            dhs_t, dG_t, dM_t, dA_t = dhs.unbind(0), dG.unbind(0), dM.unbind(0), dA.unbind(0)
            act_t, tc_t, cp_t, xm_t = act.unbind(0), tc.unbind(0), cprev.unbind(0), xm.unbind(0)
            keep_t, rk_next = _steps(keep, rk, T)
            for t in range(T - 1, -1, -1):
                kernels.backward(dhs_t[t], dhp, dcp, rk_next[t], keep_t[t], act_t[t], tc_t[t],
                                 cp_t[t], dG_t[t], dcp, dhold)
                torch.mm(dG_t[t], w_h_c, out=dM_t[t])
                torch.mul(dM_t[t], xm_t[t], out=dA_t[t])
                if dhold is None:
                    dhp = torch.mm(dA_t[t], w_mh_c, out=dhp) if C == S else \
                        torch.mm(dA_t[t], w_mh_c).to(S)
                elif C == S:
                    torch.addmm(dhold, dA_t[t], w_mh_c, out=dhp)
                else:
                    torch.add(dhold, torch.mm(dA_t[t], w_mh_c), out=dhp)
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


LAYOUTS = ("rows", "features")


def weight_grad_path(device_type: str, dtype: torch.dtype) -> str:
    """How :func:`weight_grad_mm` computes a weight gradient from ``dtype`` operands on
    ``device_type``: ``native`` (fp32/fp64 operands: the GEMM's own dtype), ``out_dtype``
    (CUDA with fp16/bf16 operands: cuBLAS accumulates in fp32 and writes fp32, the
    ``aten::mm.dtype`` overload of PyTorch >= 2.8, pytorch/pytorch#150812) or ``fp32`` (the
    operands cast to fp32 first: CPU, or a torch without that overload)."""
    if dtype in (torch.float32, torch.float64):
        return "native"
    if device_type == "cuda" and hasattr(torch.ops.aten.mm, "dtype"):
        return "out_dtype"
    return "fp32"


def weight_grad_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` summed and returned in fp32 (or fp64 for fp64 operands) whatever the operands'
    dtype: a weight gradient over all T*B rows of a window (``a`` [F1, T*B], ``b`` [T*B, F2]).

    Why: under fp16 autocast a half-precision output would round, and can overflow (65504), a
    sum of 32-65k rows of loss-scaled products that the per-step reference accumulates into an
    fp32 ``.grad`` step by step (:func:`weight_grad_path` says how).

    Returns:
        [F1, F2] in fp32 (fp64 for fp64 operands).
    """
    path = weight_grad_path(a.device.type, a.dtype)
    if path == "native":
        return a @ b
    if path == "out_dtype":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def saved_bytes(T: int, B: int, H: int, state_dtype: torch.dtype = torch.float32,
                compute_dtype: torch.dtype = torch.float32, mask: bool = False,
                reset: bool = False) -> int:
    """Bytes of activations one training window of :class:`MLSTMWindow` keeps for its
    backward (the recurrent weights, which it saves too, are the parameters' own storage and
    not counted). Per (step, row), with S and C the state and compute dtypes' sizes::

        act 4H S + tanh(c) H S + c_{t-1} H S          (state dtype)
        hprev H C + a H C + m H C + xm H C             (compute dtype)
        = H (6 S + 4 C)  bytes: 128 KiB at H = 4096 with S = fp32, C = bf16

    plus one more row of c_{t-1} and hprev (the state after the last step), and the mask
    (1 B) and reset multiplier (S) per (step, row) when given. At B = 256, T = 256, H = 4096
    that is 8.6 GB (docs/mlstm_fused.md section 2; tests/test_mlstm_fused.py checks it against
    torch's saved-tensor hooks).

    Args:
        T: window length (steps); B: rows; H: hidden size.
        mask, reset: whether the window has padding / stream starts (their per-step flags).

    Returns:
        bytes (int).
    """
    s, c = torch.finfo(state_dtype).bits // 8, torch.finfo(compute_dtype).bits // 8
    per_step_row = H * (6 * s + 4 * c) + (1 if mask else 0) + (s if reset else 0)
    return T * B * per_step_row + B * H * (s + c)


def default_layout(device: torch.device | str, kernels: Kernels,
                   threads: int | None = None) -> str:
    """How the fused window stores its per-step [B, F] matrices (:func:`steps_empty`):
    ``features`` on a CPU running torch on two or more threads (``threads``, default
    ``torch.get_num_threads()``) when the kernels take strided tensors
    (:attr:`Kernels.strided`), else ``rows``.

    Why (measured here, ``docs/mlstm_fused.md`` section 5; H=1024, B=32, T=64): MKL computes a
    per-step product ``Y [B, N] = X [B, K] W^T`` ~1.5x faster on two threads when Y and X are
    stored transposed (``Y^T = W X^T``: the large N becomes the GEMM's row dimension, which MKL
    splits across threads) and the weight operand is row-major in that form (the backward keeps
    a transposed copy of each weight): the fused step takes 453 ms instead of 581 ms. On one
    thread the GEMMs run at the same rate either way and the layout's extra copies make it ~5%
    slower (874 vs 830 ms), so one thread keeps ``rows``. On CUDA the rows layout of cuDNN and
    haste is kept (the Triton kernels index contiguous rows)."""
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


def _allocator(B: int, device: torch.device, layout: str):
    """``steps(n, F, dtype)``: :func:`steps_empty` for one window's B, device and layout."""
    return lambda n, F, dtype: steps_empty(n, B, F, dtype, device, layout)


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


def _steps(keep: torch.Tensor | None, rk: torch.Tensor | None, T: int) -> tuple[list, list]:
    """Per-step views: ``keep[t]`` and the *next* step's reset multiplier ``rk[t + 1]`` (None
    after the last step), or Nones."""
    keep_t = list(keep.unbind(0)) if keep is not None else [None] * T
    rk_next = list(rk.unbind(0))[1:] + [None] if rk is not None else [None] * T
    return keep_t, rk_next


def mlstm_window(xg: torch.Tensor, xm: torch.Tensor, state: State, w_mh: torch.Tensor,
                 w_h: torch.Tensor, kernels: Kernels, mask: torch.Tensor | None = None,
                 reset: torch.Tensor | None = None, graphs: "WindowGraphs | None" = None,
                 layout: str | None = None) -> tuple[torch.Tensor, State]:
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
    # The flags normalised once per window to contiguous [T, B, 1] (the caller may pass views:
    # LanguageModel.encode gives mask.t() / reset.t()): each step's [B, 1] slice is then dense,
    # as the row kernels (Triton) index it.
    keep = None if mask is None else mask.to(torch.bool).reshape(T, B, 1).contiguous()
    rk = None if reset is None else \
        (~reset.to(torch.bool)).to(c0.dtype).reshape(T, B, 1).contiguous()
    if c0.dtype != h0.dtype:
        raise ValueError(f"mlstm_window: h0 is {h0.dtype} but c0 is {c0.dtype}")
    save = torch.is_grad_enabled() and any(
        t.requires_grad for t in (xg, xm, h0, c0, w_mh, w_h))
    layout = layout or default_layout(xg.device, kernels)
    xg, xm = to_layout(xg, layout), to_layout(xm, layout)
    args = (xg, xm, h0, c0, w_mh, w_h, keep, rk)

    def run(*a):
        return MLSTMWindow.apply(*a, kernels, save, layout)

    if graphs is not None and save:
        hs, h, c = graphs(run, args)
    else:
        hs, h, c = run(*args)
    return hs, (h, c)


def signature(args: tuple) -> tuple:
    """What a captured CUDA graph depends on: for every argument its shape, dtype, device and
    ``requires_grad`` (None stays None)."""
    return tuple(None if a is None else (tuple(a.shape), a.dtype, a.device, a.requires_grad)
                 for a in args)


class _FreshGrad(torch.autograd.Function):
    """Identity whose backward hands on a copy of the incoming gradient (one [F1, F2] copy
    per leaf and window): what reaches a leaf's ``.grad`` is then never a CUDA graph's static
    buffer (:meth:`WindowGraphs.__call__`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return grad.clone()


class WindowGraphs:
    """CUDA-graph capture of the fused window (forward + backward), one signature at a time.

    The first eligible call with a new signature (shapes, dtypes, devices, requires_grad of the
    window's arguments; :func:`signature`) captures ``fn`` with
    ``torch.cuda.make_graphed_callables`` (PyTorch docs, "CUDA Graphs: partial-network capture";
    its own warm-up iterations run first) on clones of the arguments, then replays it for every
    call with that signature; other calls run eagerly: a different shape (an eval batch, a
    shorter last window, text generation), grad disabled, tensors not on ``device_type``, or a
    capture that failed (reported once on stderr, never retried). Up to ``max_graphs``
    signatures are kept (each holds its window's saved tensors in a private memory pool).

    Args:
        device_type: where graphs apply (``cuda``; tests use ``cpu`` with a fake ``capture``).
        capture: ``capture(fn, sample_args) -> graphed fn`` (default
            ``torch.cuda.make_graphed_callables``).
        max_graphs: signatures captured at most.

    Attributes:
        stats: Counter of ``graphed``, ``eager`` and ``captures`` calls (read by tests/bench).
    """

    def __init__(self, device_type: str = "cuda", capture: Callable | None = None,
                 max_graphs: int = 1):
        self.device_type = device_type
        self.capture = capture or torch.cuda.make_graphed_callables
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, Callable] = {}
        self.failed: set[tuple] = set()
        self.stats: Counter = Counter()

    def eligible(self, args: tuple) -> bool:
        """Grad on, every tensor on ``device_type``, not inside another capture."""
        tensors = [a for a in args if a is not None]
        if not torch.is_grad_enabled() or not any(a.requires_grad for a in tensors):
            return False
        if any(a.device.type != self.device_type for a in tensors):
            return False
        return not (self.device_type == "cuda" and torch.cuda.is_current_stream_capturing())

    def __call__(self, fn: Callable, args: tuple):
        """``fn(*args)``, from a CUDA graph when one is (or can now be) captured for ``args``'s
        signature, else eagerly."""
        if not self.eligible(args):
            self.stats["eager"] += 1
            return fn(*args)
        key = signature(args)
        if key not in self.graphs and key not in self.failed \
                and len(self.graphs) < self.max_graphs:
            self._capture(fn, args, key)
        graphed = self.graphs.get(key)
        if graphed is None:
            self.stats["eager"] += 1
            return fn(*args)
        self.stats["graphed"] += 1
        # A replayed backward returns views of the graph's static gradient buffers, which
        # autograd may adopt as a leaf's .grad (pytorch/pytorch#181723): the next replay would
        # then overwrite it, and gradient accumulation (several backward passes per step) would
        # sum a buffer into itself. Leaves get their gradient as a fresh tensor instead.
        present = [_FreshGrad.apply(a) if a.requires_grad and a.is_leaf else a
                   for a in args if a is not None]
        return graphed(*present)

    def _capture(self, fn: Callable, args: tuple, key: tuple) -> None:
        where, n = [i for i, a in enumerate(args) if a is not None], len(args)
        sample = tuple(args[i].detach().clone().requires_grad_(args[i].requires_grad)
                       for i in where)

        def dense(*present):  # make_graphed_callables takes tensors only: re-insert the Nones
            full: list = [None] * n
            for i, p in zip(where, present):
                full[i] = p
            return fn(*full)

        try:
            # Autocast must be off (or uncached) while capturing; the Function sets its dtypes.
            with torch.autocast(device_type=self.device_type, enabled=False):
                self.graphs[key] = self.capture(dense, sample)
            self.stats["captures"] += 1
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
            self.failed.add(key)
            print(f"warning: CUDA graph capture of the mLSTM window failed, running it eagerly "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
