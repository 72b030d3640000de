"""Triton kernels for the fused mLSTM cell (the ``triton`` kernels of
:mod:`hvd_lm.model.mlstm_kernels`, same signatures and semantics as its ``cell_forward`` /
``cell_backward``).

One program handles ``BLOCK`` consecutive elements of the [B, H] state: it loads that element's
four gate values (columns j, H+j, 2H+j, 3H+j of its row), the row's mask and reset flags, and
writes every output of the step, so each step costs one kernel launch forward and one backward
(haste's ``PointwiseOperations`` kernels, written in Triton: Tillet et al. 2019, "Triton: an
intermediate language and compiler for tiled neural network computations"). Arithmetic is fp32
whatever the storage dtype of ``g``/``hs``/``dg`` (bf16/fp16 under autocast); the state tensors
must be fp32 and contiguous. With a compute dtype narrower than the state's the forward writes
no activations (``SAVE`` off) and the backward recomputes them from the saved pre-activations
``g`` (``RECOMPUTE``), writing the gate gradients over them.

Per window, :func:`bind_forward` / :func:`bind_backward` check the arguments once and bind the
launches (:class:`Launch`): after a window's first launch each step's costs the compiled
kernel's launcher alone, not Triton's JIT dispatch (argument specialisation, cache lookup) nor
this module's checks; eager B=128 at H=4096 launches 512 cell kernels a window.

Triton compiles for GPUs; with ``TRITON_INTERPRET=1`` set before this module is imported, its
interpreter runs the same kernels on CPU tensors (numpy), which is how the tests check them on a
machine without a GPU. ``tanh`` is written out (:func:`_tanh`) because the interpreter has no
libdevice: an odd Taylor polynomial below |x| = 0.25 and ``(1 - e^{-2|x|}) / (1 + e^{-2|x|})``
above it (its error against the exact tanh: docs/mlstm_fused.md section 3).

The ahead-of-time builds of these kernels for a GPU (``hvd-lm kernels``):
:mod:`hvd_lm.model.kernels_aot`.

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
def _gates(g_ptr, gate, live, H):
    """sigmoid i, sigmoid f, tanh u, sigmoid o in fp32 from the pre-activations at ``gate``."""
    si = tl.sigmoid(tl.load(g_ptr + gate, mask=live, other=0.0).to(tl.float32))
    sf = tl.sigmoid(tl.load(g_ptr + gate + H, mask=live, other=0.0).to(tl.float32))
    tu = _tanh(tl.load(g_ptr + gate + 2 * H, mask=live, other=0.0).to(tl.float32))
    so = tl.sigmoid(tl.load(g_ptr + gate + 3 * H, mask=live, other=0.0).to(tl.float32))
    return si, sf, tu, so


@triton.jit
def _cell_forward_kernel(g_ptr, cprev_ptr, hstate_ptr, keep_ptr, rk_ptr, act_ptr, tc_ptr, hs_ptr,
                         cnext_ptr, hnext_ptr, hcnext_ptr, N, H, HAS_KEEP: tl.constexpr,
                         HAS_RK: tl.constexpr, SAVE: tl.constexpr, BLOCK: tl.constexpr):
    offs, live, row, gate = _elements(N, H, BLOCK)
    si, sf, tu, so = _gates(g_ptr, gate, live, H)
    cp = tl.load(cprev_ptr + offs, mask=live, other=0.0)
    c = sf * cp + si * tu
    tanh_c = _tanh(c)
    h = so * tanh_c
    if HAS_KEEP:
        k = tl.load(keep_ptr + row, mask=live, other=0) != 0
        c = tl.where(k, c, cp)
        h = tl.where(k, h, tl.load(hstate_ptr + offs, mask=live, other=0.0))
    if SAVE:  # else the backward recomputes them from the saved pre-activations
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
def _cell_backward_kernel(dhs_ptr, dhp_ptr, dcp_ptr, rk_ptr, keep_ptr, act_ptr, tc_ptr, cprev_ptr,
                          dg_ptr, dcpout_ptr, dhold_ptr, g_ptr, N, H, HAS_KEEP: tl.constexpr,
                          HAS_RK: tl.constexpr, RECOMPUTE: tl.constexpr, BLOCK: tl.constexpr):
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
    cp = tl.load(cprev_ptr + offs, mask=live, other=0.0)
    if RECOMPUTE:  # the forward's expressions on the saved pre-activations (dg may alias g)
        si, sf, tu, so = _gates(g_ptr, gate, live, H)
        tanh_c = _tanh(sf * cp + si * tu)
    else:
        si = tl.load(act_ptr + gate, mask=live, other=0.0)
        sf = tl.load(act_ptr + gate + H, mask=live, other=0.0)
        tu = tl.load(act_ptr + gate + 2 * H, mask=live, other=0.0)
        so = tl.load(act_ptr + gate + 3 * H, mask=live, other=0.0)
        tanh_c = tl.load(tc_ptr + offs, mask=live, other=0.0)
    dct = dc + dh * so * (1.0 - tanh_c * tanh_c)
    out_ty = dg_ptr.dtype.element_ty
    tl.store(dg_ptr + gate, (dct * tu * si * (1.0 - si)).to(out_ty), mask=live)
    tl.store(dg_ptr + gate + H, (dct * cp * sf * (1.0 - sf)).to(out_ty), mask=live)
    tl.store(dg_ptr + gate + 2 * H, (dct * si * (1.0 - tu * tu)).to(out_ty), mask=live)
    tl.store(dg_ptr + gate + 3 * H, (dh * tanh_c * so * (1.0 - so)).to(out_ty), mask=live)
    tl.store(dcpout_ptr + offs, dct * sf + hold_c, mask=live)
    if HAS_KEEP:
        tl.store(dhold_ptr + offs, hold_h, mask=live)


def _check(state: list[torch.Tensor | None], others: list[torch.Tensor | None]) -> None:
    for t in state:
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"triton mLSTM kernels keep the state in fp32, got {t.dtype}")
    for t in state + others:
        if t is not None and not t.is_contiguous():
            raise ValueError("triton mLSTM kernels need contiguous tensors")


#: Whether this Triton's compiled kernels are launched as :func:`_bind` launches them: from
#: Triton 3.3 the JIT passes ``kernel.run`` every argument, constexprs included, in the
#: kernel's order (before, the non-constexpr ones only), and its hooks live in ``triton.knobs``.
BINDABLE = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 3) \
    and hasattr(triton, "knobs")


class Launch:
    """One kernel's launches for one window: the arguments were checked once (by the binder),
    and after the first launch, which goes through Triton's JIT (specialisation, cache lookup,
    compilation the first time), every later one calls the compiled kernel's launcher directly
    with the stream, grid and metadata bound once, skipping the JIT's per-call argument
    specialisation and cache lookup: each call then costs the launcher's own argument packing.

    Binding is only valid on a Triton whose launcher it knows (:data:`BINDABLE`) and while
    every launch would specialise alike: ``uniform`` (the caller vouches that every step's
    tensors have step 0's 16-byte alignment; Triton specialises pointers on it) and no launch
    hook set (``triton.knobs.runtime.launch_enter_hook``: a profiler's; they are honoured on
    the JIT path: the bound launcher passes none). Under Triton's interpreter
    (``TRITON_INTERPRET=1``), or when the first launch returns no compiled kernel, every call
    takes the JIT path.

    Args:
        fn: the ``@triton.jit`` kernel; grid: its launch grid (1-d); tail: the trailing
            arguments of every launch (sizes and constexprs, in the kernel's order).
        uniform: whether the launches may be bound (above).
    """

    def __init__(self, fn, grid: int, tail: tuple, uniform: bool):
        self.fn, self.grid, self.tail = fn, grid, tail
        self.uniform = uniform and BINDABLE and not any(
            # a hook is None, or (newer Triton) a HookChain, idle while it holds no call
            h is not None and getattr(h, "calls", True)
            for h in (triton.knobs.runtime.launch_enter_hook,
                      triton.knobs.runtime.launch_exit_hook))
        self.bound = None

    def __call__(self, *args) -> None:
        if self.bound is not None:
            self.bound(*args, *self.tail)
            return
        kernel = self.fn[(self.grid,)](*args, *self.tail, num_warps=NUM_WARPS)
        if self.uniform and kernel is not None and hasattr(kernel, "function"):
            self.bound = _bind(kernel, self.grid)


def _bind(kernel, grid: int):
    """The compiled ``kernel``'s launcher with grid, current stream and metadata bound
    (``triton.compiler.CompiledKernel.__getitem__``'s runner, less its per-call device and
    stream queries and launch metadata, which is None without a launch hook)."""
    run, function, meta = kernel.run, kernel.function, kernel.packed_metadata
    stream = torch.cuda.current_stream().cuda_stream

    def launch(*args):
        run(grid, 1, 1, stream, function, meta, None, None, None, *args)

    return launch


def bind_forward(uniform: bool, g, cprev, hstate, keep, rk_next, act, tc, hs_t, c_next,
                 h_next, hc_next):
    """The cell forward (:func:`hvd_lm.model.mlstm_kernels.cell_forward`) bound for one window
    from its first step's tensors (:class:`Launch`): checked here once, then each step's call
    is one launch. Raises ValueError as :func:`cell_forward`."""
    _check([cprev, hstate, act, tc, c_next, h_next], [g, keep, rk_next, hs_t, hc_next])
    N, H = cprev.numel(), cprev.shape[1]
    has_keep, has_rk, save = keep is not None, rk_next is not None, act is not None
    launch = Launch(_cell_forward_kernel, triton.cdiv(N, BLOCK),
                    (N, H, has_keep, has_rk, save, BLOCK), uniform)

    def forward(g, cprev, hstate, keep, rk_next, act, tc, hs_t, c_next, h_next, hc_next):
        launch(g, cprev, hstate, keep if has_keep else cprev, rk_next if has_rk else cprev,
               act if save else cprev, tc if save else cprev, hs_t, c_next, h_next, hc_next)

    return forward


def bind_backward(uniform: bool, dhs_t, dhp, dcp, rk_next, keep, act, tc, cprev, dg, dcp_out,
                  dhold, g=None):
    """The cell backward (:func:`hvd_lm.model.mlstm_kernels.cell_backward`) bound for one
    window, as :func:`bind_forward`."""
    _check([dhp, dcp, act, tc, cprev, dcp_out], [dhs_t, rk_next, keep, dg, dhold, g])
    N, H = cprev.numel(), cprev.shape[1]
    has_keep, has_rk, recompute = keep is not None, rk_next is not None, act is None
    launch = Launch(_cell_backward_kernel, triton.cdiv(N, BLOCK),
                    (N, H, has_keep, has_rk, recompute, BLOCK), uniform)

    def backward(dhs_t, dhp, dcp, rk_next, keep, act, tc, cprev, dg, dcp_out, dhold, g=None):
        launch(dhs_t, dhp, dcp, rk_next if has_rk else dhp, keep if has_keep else dhp,
               dhp if recompute else act, dhp if recompute else tc, cprev, dg, dcp_out,
               dhold if has_keep else dhp, g if recompute else dhp)

    return backward


def cell_forward(*args) -> None:
    """The cell forward (:func:`hvd_lm.model.mlstm_kernels.cell_forward`, the same positional
    arguments) as one Triton kernel (checked and launched through the JIT on every call:
    :func:`bind_forward` binds a window)."""
    bind_forward(False, *args)(*args)


def cell_backward(*args) -> None:
    """The cell backward (:func:`hvd_lm.model.mlstm_kernels.cell_backward`, the same positional
    arguments, ``g`` optional) as one Triton kernel (:func:`bind_backward` binds a window)."""
    bind_backward(False, *args)(*args)


# ---- ahead-of-time builds (no GPU needed) --------------------------------------------------------

#: Triton's pointer type names of the compute dtypes the CUDA path launches the kernels with.
COMPUTE_TYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
#: The kernels' arguments in the compute dtype (the rest are fp32 state tensors, the keep flag
#: a bool when there is one, N and H int32).
COMPUTE_ARGS = ("g_ptr", "hs_ptr", "hcnext_ptr", "dhs_ptr", "dg_ptr")


def launch_signatures(compute: str, has_keep: bool, has_rk: bool) -> dict[str, dict]:
    """The argument types both kernels are launched with by :func:`bind_forward` /
    :func:`bind_backward` for one compute dtype (``g``, ``hs``, ``dg`` and the GEMM copy of h;
    every state tensor is fp32) and mask/reset case (absent flags, and the activations a
    window does not save, are passed as an fp32 state pointer, never read). A compute dtype
    narrower than the fp32 state (not ``fp32``) saves the gate pre-activations and recomputes
    the activations in the backward (``SAVE`` False, ``RECOMPUTE`` True), as
    :class:`hvd_lm.model.mlstm_fused.MLSTMWindow` does.

    Returns:
        {kernel name: Triton signature dict (argument -> type; constexprs -> "constexpr")}.
    """
    c, consts = COMPUTE_TYPES[compute], launch_constexprs(compute, has_keep, has_rk)
    return {fn.__name__: {a: "constexpr" if a in consts[fn.__name__] else "i32" if a in ("N", "H")
                          else "*i1" if a == "keep_ptr" and has_keep
                          else c if a in COMPUTE_ARGS else "*fp32" for a in fn.arg_names}
            for fn in (_cell_forward_kernel, _cell_backward_kernel)}


def launch_constexprs(compute: str, has_keep: bool, has_rk: bool) -> dict[str, dict]:
    """The constexpr values of both kernels' launches for one compute dtype and mask/reset
    case (as :func:`launch_signatures`)."""
    flags = {"HAS_KEEP": has_keep, "HAS_RK": has_rk, "BLOCK": BLOCK}
    return {"_cell_forward_kernel": {**flags, "SAVE": compute == "fp32"},
            "_cell_backward_kernel": {**flags, "RECOMPUTE": compute != "fp32"}}
