"""Pointwise kernels of the fused mLSTM recurrence (:mod:`hvd_lm.model.mlstm_fused`).

Per time step the fused recurrence runs two recurrent GEMMs and, after the second, one *cell*
kernel that does all of the step's elementwise work; its backward runs one cell-backward kernel
before the two data-gradient GEMMs (the layout of cuDNN's and lmnt-com/haste's LSTM kernels:
``haste/lib/lstm_forward_gpu.cu.cc`` / ``lstm_backward_gpu.cu.cc``, one pointwise kernel per step).
Shapes, for B rows and width H (state dtype ``S``: fp32, or fp64 for gradcheck; compute dtype
``C``: the GEMMs' dtype, bf16/fp16 under autocast, else ``S``):

cell forward, step t: ``g`` [B, 4H] (C, gate pre-activations ``x W_x^T + b + m W_h^T`` in the
reference's order i, f, u, o), ``cprev`` [B, H] (S, c_{t-1} after any reset), ``hstate``
[B, H] (S, h_{t-1} after any reset), ``keep`` [B, 1] bool or None (False: padding, the state is
held), ``rk_next`` [B, 1] (S, 0.0 where step t+1 starts a stream: the state is zeroed) or None.
Writes ``act`` [B, 4H] (S: sigmoid i, sigmoid f, tanh u, sigmoid o, saved for the backward),
``hs_t`` [B, H] (output dtype: h_t), ``c_next`` / ``h_next`` [B, H] (S: c_t, h_t times
``rk_next``) and ``hc_next`` [B, H] (C: ``h_next`` for the next step's GEMM). Outputs may alias
inputs of the same role (``h_next`` is ``hstate``): every element is read before it is written.

``act`` and ``tc`` may be None: the window does not save them (a compute dtype narrower than
the state's: the backward recomputes them from ``g``), and the kernels write neither.

cell backward, step t: ``dhs_t`` [B, H] (grad of hs[t]), ``dhp`` / ``dcp`` [B, H] (S: grads of
the state entering step t+1), ``rk_next``, ``keep``, ``act``, ``cprev`` as saved, or, with
``act`` and ``tc`` None, ``g`` [B, 4H] (C: the step's saved gate pre-activations) from which
the activations and tanh(c_t) are recomputed (the same fp32 expressions as the forward's).
Writes ``dg`` [B, 4H] (C: grads of the gate pre-activations; may be ``g`` itself: every gate
value is read before its gradient is written), ``dcp_out`` [B, H] (S: grad of ``cprev``; may be
``dcp``) and ``dhold`` [B, H] (S: the part of the grad of ``hstate`` that bypasses the cell on
held rows; the GEMM part is added by the caller; only written when ``keep`` is given, else
all zero and the caller passes None).

Three implementations of the same two functions, picked by :func:`get_kernels`:

* ``torch``: :func:`cell_forward` / :func:`cell_backward` in plain torch ops (any device and
  dtype; the CPU path, needing neither Triton nor a compiler);
* ``compile``: the same two functions through ``torch.compile`` (Inductor fuses each into one
  kernel: C++/OpenMP on CPU, Triton on CUDA). Only the cell is compiled, never the time loop:
  compiling an RNN loop unrolls it (pytorch/pytorch#97155);
* ``triton``: hand-written Triton kernels (:mod:`hvd_lm.model.mlstm_triton`), one program per
  BLOCK elements of [B, H]; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from hvd_lm.model.config import KERNELS


def cell_forward(g: Tensor, cprev: Tensor, hstate: Tensor, keep: Tensor | None,
                 rk_next: Tensor | None, act: Tensor | None, tc: Tensor | None, hs_t: Tensor,
                 c_next: Tensor, h_next: Tensor, hc_next: Tensor) -> None:
    """One step's elementwise forward, as pure tensor expressions copied into the outputs (the
    specification of the cell kernels, and what ``torch.compile`` fuses; shapes and dtypes in
    the module docstring). The equations are :class:`hvd_lm.model.lm.MLSTM`'s:
    ``c = sigmoid(f) c_prev + sigmoid(i) tanh(u)``, ``h = sigmoid(o) tanh(c)``, then the mask
    (padding holds the state) and the next step's reset. ``tc`` [B, H] (S) receives tanh(c) of
    the cell's candidate, saved for the backward (``act`` and ``tc`` None: not saved)."""
    si, sf, tu, so, c, tanh_c = _activations(g, cprev)
    h = so * tanh_c
    if keep is not None:
        c = torch.where(keep, c, cprev)
        h = torch.where(keep, h, hstate)
    c_out, h_out = (c, h) if rk_next is None else (c * rk_next, h * rk_next)
    if act is not None:
        act.copy_(torch.cat((si, sf, tu, so), dim=1))
        tc.copy_(tanh_c)
    hs_t.copy_(h)
    c_next.copy_(c_out)
    hc_next.copy_(h_out)
    h_next.copy_(h_out)


def _activations(g: Tensor, cprev: Tensor) -> tuple[Tensor, ...]:
    """sigmoid(i), sigmoid(f), tanh(u), sigmoid(o), the candidate c and tanh(c) of one step, in
    the state dtype, from the gate pre-activations ``g`` [B, 4H] and ``cprev`` [B, H] (the
specification's form)."""
    i, f, u, o = g.to(cprev.dtype).split(cprev.shape[1], dim=1)
    si, sf, tu, so = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(u), torch.sigmoid(o)
    c = sf * cprev + si * tu
    return si, sf, tu, so, c, torch.tanh(c)


def cell_backward(dhs_t: Tensor, dhp: Tensor, dcp: Tensor, rk_next: Tensor | None,
                  keep: Tensor | None, act: Tensor | None, tc: Tensor | None, cprev: Tensor,
                  dg: Tensor, dcp_out: Tensor, dhold: Tensor | None,
                  g: Tensor | None = None) -> None:
    """One step's elementwise backward (the derivative of :func:`cell_forward`), as pure tensor
    expressions copied into ``dg``, ``dcp_out`` and ``dhold`` (module docstring); with ``act``
    None the activations are recomputed from ``g``."""
    H = cprev.shape[1]
    if act is None:
        si, sf, tu, so, _, tc = _activations(g, cprev)
    else:
        si, sf, tu, so = act.split(H, dim=1)
    dh = dhs_t.to(dhp.dtype) + (dhp if rk_next is None else dhp * rk_next)
    dc = dcp if rk_next is None else dcp * rk_next
    if keep is not None:
        zero = torch.zeros((), dtype=dh.dtype, device=dh.device)
        hold_h, hold_c = torch.where(keep, zero, dh), torch.where(keep, zero, dc)
        dh, dc = torch.where(keep, dh, zero), torch.where(keep, dc, zero)
    dct = dc + dh * so * (1 - tc * tc)
    dgi = dct * tu * si * (1 - si)
    dgf = dct * cprev * sf * (1 - sf)
    dgu = dct * si * (1 - tu * tu)
    dgo = dh * tc * so * (1 - so)
    dg.copy_(torch.cat((dgi, dgf, dgu, dgo), dim=1))
    if keep is None:
        dcp_out.copy_(dct * sf)
    else:
        dcp_out.copy_(dct * sf + hold_c)
        dhold.copy_(hold_h)


def _torch_activations(g: Tensor, cprev: Tensor, act: Tensor, c: Tensor, tc: Tensor) -> Tensor:
    """The torch kernels' activations: sigmoid i, f, o and tanh u of ``g`` into ``act``, the
    candidate c_t into ``c`` and tanh(c_t) into
    ``tc``, with out= ops in one fixed order (the forward and the backward's recomputation give
    the same bits). ``c`` may be ``cprev`` (each element is read before it is written).
    Returns ``c``."""
    H = cprev.shape[1]
    g = g.to(cprev.dtype)
    torch.sigmoid(g, out=act)  # i, f, o (the u block is overwritten next)
    torch.tanh(g[:, 2 * H:3 * H], out=act[:, 2 * H:3 * H])
    torch.mul(act[:, H:2 * H], cprev, out=c).addcmul_(act[:, :H], act[:, 2 * H:3 * H])
    torch.tanh(c, out=tc)
    return c


def torch_cell_forward(g: Tensor, cprev: Tensor, hstate: Tensor, keep: Tensor | None,
                       rk_next: Tensor | None, act: Tensor | None, tc: Tensor | None, hs_t: Tensor,
                       c_next: Tensor, h_next: Tensor, hc_next: Tensor) -> None:
    """:func:`cell_forward` in eager torch ops writing straight into the outputs (``out=`` and
    in-place ops: no concatenation; ``act`` / ``tc`` None: written to scratch tensors instead):
    the ``torch`` kernels."""
    H = cprev.shape[1]
    if act is None:
        act, tc = cprev.new_empty(cprev.shape[0], 4 * H), torch.empty_like(cprev)
    so = act[:, 3 * H:]
    if keep is None:  # no padding: c and h are written where they go (c_next may be cprev)
        c = _torch_activations(g, cprev, act, c_next, tc)
        h = torch.mul(so, tc, out=h_next)
    else:
        c = _torch_activations(g, cprev, act, torch.empty_like(cprev), tc)
        h = torch.mul(so, tc)
        c = torch.where(keep, c, cprev, out=c_next)
        h = torch.where(keep, h, hstate, out=h_next)
    hs_t.copy_(h)
    if rk_next is not None:
        c.mul_(rk_next)
        h.mul_(rk_next)
    hc_next.copy_(h)


def torch_cell_backward(dhs_t: Tensor, dhp: Tensor, dcp: Tensor, rk_next: Tensor | None,
                        keep: Tensor | None, act: Tensor | None, tc: Tensor | None, cprev: Tensor,
                        dg: Tensor, dcp_out: Tensor, dhold: Tensor | None,
                        g: Tensor | None = None) -> None:
    """:func:`cell_backward` in eager torch ops writing straight into the outputs: the
    ``torch`` kernels (``act`` None: the activations recomputed from ``g`` into scratch
    tensors first, so ``dg`` may be ``g``)."""
    H = cprev.shape[1]
    if act is None:
        act, tc = cprev.new_empty(cprev.shape[0], 4 * H), torch.empty_like(cprev)
        _torch_activations(g, cprev, act, torch.empty_like(cprev), tc)
    dh = dhs_t.to(dhp.dtype)
    if rk_next is None:
        dh, dc = dh + dhp, dcp
    else:
        dh, dc = torch.addcmul(dh, dhp, rk_next), torch.mul(dcp, rk_next)
    if keep is not None:  # held rows: the gradient bypasses the cell
        zero = torch.zeros((), dtype=dh.dtype, device=dh.device)
        torch.where(keep, zero, dh, out=dhold)
        hold_c = torch.where(keep, zero, dc)
        dh.masked_fill_(~keep, 0.0)
        dc = torch.where(keep, dc, zero)
    si, sf, tu, so = act.split(H, dim=1)
    one = torch.ones((), dtype=act.dtype, device=act.device)
    # local derivatives of the four activations: s (1 - s) for the sigmoids, 1 - tanh^2 for u
    deriv = torch.addcmul(act, act, act, value=-1.0)
    torch.addcmul(one, tu, tu, value=-1.0, out=deriv[:, 2 * H:3 * H])
    dct = torch.addcmul(dc, dh, torch.addcmul(one, tc, tc, value=-1.0).mul_(so))  # grad of c_t
    full = dg if dg.dtype == act.dtype else torch.empty_like(act)
    gi, gf, gu, go = full.split(H, dim=1)
    torch.mul(dct, tu, out=gi)
    torch.mul(dct, cprev, out=gf)
    torch.mul(dct, si, out=gu)
    torch.mul(dh, tc, out=go)
    full.mul_(deriv)
    if full is not dg:
        dg.copy_(full)
    torch.mul(dct, sf, out=dcp_out)
    if keep is not None:
        dcp_out.add_(hold_c)


class Kernels:
    """A pair of cell kernels with the signatures of :func:`cell_forward` and
    :func:`cell_backward`.

    Attributes:
        name: ``torch``, ``compile`` or ``triton``.
        forward / backward: the two kernels.
        strided: the kernels take [B, F] tensors of any strides (torch ops do; the Triton
            kernels index rows of contiguous tensors), so the fused window may keep its
            per-step matrices feature-major (:func:`hvd_lm.model.mlstm_fused.default_layout`).
        binders: (bind_forward, bind_backward) making each kernel's per-window form
            (:meth:`bind_forward`), or None: the kernels are used as they are.
    """

    def __init__(self, name: str, forward, backward, strided: bool = True, binders=None):
        self.name, self.forward, self.backward = name, forward, backward
        self.strided, self.binders = strided, binders

    def bind_forward(self, uniform: bool, *step0):
        """The forward kernel for one window, made from its first step's arguments ``step0``
        (those of :func:`cell_forward`): the Triton kernels check them once here and then
        launch each step without the JIT's per-call work
        (:class:`hvd_lm.model.mlstm_triton.Launch`); the other kernels are returned as they
        are. ``uniform``: every step's tensors have step 0's 16-byte alignment.

        Raises:
            ValueError: arguments the kernels cannot take (Triton: a non-fp32 state, a
                non-contiguous tensor).
        """
        return self.forward if self.binders is None else self.binders[0](uniform, *step0)

    def bind_backward(self, uniform: bool, *step0):
        """The backward kernel for one window (as :meth:`bind_forward`, with the arguments of
        :func:`cell_backward`)."""
        return self.backward if self.binders is None else self.binders[1](uniform, *step0)

    def __repr__(self) -> str:
        return f"Kernels({self.name!r})"


def triton_available() -> bool:
    """Whether ``import triton`` works (the package is an optional, GPU-path dependency)."""
    try:
        import triton  # noqa: F401  # optional dependency: only the triton kernels need it
    except ImportError:
        return False
    return True


def resolve(name: str, device: torch.device | str) -> str:
    """The kernels ``auto`` means on ``device``: ``triton`` on CUDA when Triton imports
    (one hand-written kernel per step, capturable in a CUDA graph), else ``torch`` (CPU:
    ``docs/performance.md`` has the measurement of ``compile`` against ``torch`` there).
    Any other name is returned as is.

    Raises:
        ValueError: an unknown name.
    """
    if name not in KERNELS:
        raise ValueError(f"rnn kernels must be one of {KERNELS}, got {name!r}")
    if name != "auto":
        return name
    return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"


def get_kernels(name: str, device: torch.device | str = "cpu") -> Kernels:
    """The cell kernels ``name`` (one of :data:`KERNELS`) for tensors on ``device``.

    Raises:
        ValueError: an unknown name; ``triton`` on a CPU device without ``TRITON_INTERPRET=1``
            (compiled Triton kernels run on GPUs only).
        ImportError: ``triton`` asked for but not installed (``pip install hvd_lm[gpu]``).
    """
    name = resolve(name, device)
    if name == "triton" and torch.device(device).type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("triton kernels need a CUDA device (or TRITON_INTERPRET=1, Triton's "
                         "CPU interpreter, for tests)")
    return _make(name)


@functools.cache
def _make(name: str) -> Kernels:
    """The kernels ``name`` (``torch``, ``compile`` or ``triton``), made once per process."""
    if name == "torch":
        return Kernels("torch", torch_cell_forward, torch_cell_backward)
    if name == "compile":
        # dynamic=None: the first shape compiles static, a second one recompiles with dynamic
        # shapes (transfer feeds shrinking batches) instead of once per shape.
        return Kernels("compile", torch.compile(cell_forward, fullgraph=True),
                       torch.compile(cell_backward, fullgraph=True), strided=False)
    from hvd_lm.model import mlstm_triton  # optional dependency (triton): GPU path only

    return Kernels("triton", mlstm_triton.cell_forward, mlstm_triton.cell_backward,
                   strided=False, binders=(mlstm_triton.bind_forward, mlstm_triton.bind_backward))
