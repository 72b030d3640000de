"""Inputs and comparisons for the fused-mLSTM tests, shared by tests/test_mlstm_fused.py and the
Triton-interpreter check (tests/scripts/triton_interpreted.py, a separate process)."""
from __future__ import annotations

import torch

from hvd_lm.model import mlstm_kernels as K
from hvd_lm.model.mlstm_fused import mlstm_window

SPEC = K.Kernels("spec", K.cell_forward, K.cell_backward)


def window_inputs(T, B, H, dtype=torch.float64, seed=0, reset_p=0.0, mask_p=1.0, scale=0.5):
    """Random (xg, xm, h0, c0, w_mh, w_h) requiring grad, and (mask, reset) [T, B] or None."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (scale * torch.randn(*shape, generator=g, dtype=dtype)).requires_grad_()

    tensors = (r(T, B, 4 * H), r(T, B, H), r(B, H), r(B, H), r(H, H), r(4 * H, H))
    mask = torch.rand(T, B, generator=g) < mask_p if mask_p < 1 else None
    reset = torch.rand(T, B, generator=g) < reset_p if reset_p > 0 else None
    return tensors, mask, reset


def cell_case(B, H, keep, rk, g_dtype=torch.float32, seed=0):
    """Random inputs of one cell step: (g, cprev, hstate, keep, rk_next) for the forward and
    (dhs, dhp, dcp) for the backward; ``g``/``dhs`` in ``g_dtype`` as under autocast."""
    g = torch.Generator().manual_seed(seed)
    fwd_in = ((2 * torch.randn(B, 4 * H, generator=g)).to(g_dtype),
              torch.randn(B, H, generator=g), torch.randn(B, H, generator=g),
              (torch.rand(B, 1, generator=g) < 0.6) if keep else None,
              (torch.rand(B, 1, generator=g) < 0.6).float() if rk else None)
    bwd_in = (torch.randn(B, H, generator=g).to(g_dtype), torch.randn(B, H, generator=g),
              torch.randn(B, H, generator=g))
    return fwd_in, bwd_in


def run_cell(kernels: K.Kernels, fwd_in, bwd_in, out_dtype=torch.float32,
             recompute: bool = False) -> list[torch.Tensor]:
    """Both kernels on one case: the forward's six outputs, then the backward's three (fed the
    specification's forward activations, so a forward error cannot hide a backward one).

    ``recompute``: as a window with a narrower compute dtype runs them: the forward saves no
    activations (``act``, ``tc`` None: its four other outputs are returned) and the backward
    recomputes them from the pre-activations ``g``, writing the gate gradients over ``g``."""
    g, cprev, hstate, keep, rk = fwd_in
    B, H = cprev.shape
    shapes = [(4 * H, torch.float32), (H, torch.float32), (H, out_dtype), (H, torch.float32),
              (H, torch.float32), (H, out_dtype)]
    fwd = [torch.empty(B, n, dtype=d) for n, d in shapes]
    if recompute:
        kernels.forward(g.clone(), cprev, hstate, keep, rk, None, None, *fwd[2:])
        fwd = fwd[2:]
    else:
        kernels.forward(g.clone(), cprev, hstate, keep, rk, *fwd)
    spec = [torch.empty_like(x) for x in (torch.empty(B, 4 * H), torch.empty(B, H))]
    K.cell_forward(g.clone(), cprev, hstate, keep, rk, *spec,
                   *[torch.empty(B, n, dtype=d) for n, d in shapes[2:]])
    dhs, dhp, dcp = bwd_in
    bwd = [torch.empty(B, 4 * H, dtype=out_dtype), torch.empty(B, H), torch.zeros(B, H)]
    dhold = bwd[2] if keep is not None else None  # dhold: only with a mask
    if recompute:
        bwd[0] = g.to(out_dtype).clone()  # the saved pre-activations, overwritten in place
        kernels.backward(dhs, dhp, dcp.clone(), rk, keep, None, None, cprev, bwd[0], bwd[1],
                         dhold, bwd[0])
    else:
        kernels.backward(dhs, dhp, dcp.clone(), rk, keep, spec[0], spec[1], cprev, *bwd[:2],
                         dhold)
    return fwd + bwd


def cell_diff(kernels: K.Kernels, fwd_in, bwd_in, out_dtype=torch.float32,
              recompute: bool = False) -> float:
    """Max of |kernels - specification| / max(1, |specification|) over every element of every
    output of :func:`run_cell` (relative beyond 1: a bf16 output of 3.0 has a step of 2^-6);
    ``recompute`` as there (the specification computes the saved activations' way)."""
    got = run_cell(kernels, fwd_in, bwd_in, out_dtype, recompute)
    want = run_cell(SPEC, fwd_in, bwd_in, out_dtype)
    if recompute:
        want = want[2:]
    return max(float(((a.float() - b.float()).abs() / b.float().abs().clamp(min=1.0)).max())
               for a, b in zip(got, want))


def window_diff(kernels: K.Kernels, seed: int = 5, compute=torch.float32) -> float:
    """Max |difference| between the fused window run with ``kernels`` and with the torch
    kernels (fp32 state, resets and padding): outputs and the gradients of all six inputs.
    ``compute`` bf16: the input projections in bf16 (the window saves the pre-activations and
    its backward recomputes the activations) against the torch kernels' fp32 window: the
    largest relative (Frobenius) error of any of those tensors (bf16 rounds every per-step
    output, so two kernels whose fp32 arithmetic differs in the last bit differ by whole bf16
    rounding steps in places: what is compared is the accuracy both reach, ~1e-2)."""
    results = []
    for k, dtype in ((kernels, compute), (K.get_kernels("torch"), torch.float32)):
        tensors, mask, reset = window_inputs(9, 4, 8, dtype=torch.float32, reset_p=0.2,
                                             mask_p=0.8, seed=seed)
        xg, xm = (t.detach().to(dtype).requires_grad_() for t in tensors[:2])
        hs, (h, c) = mlstm_window(xg, xm, tensors[2:4], *tensors[4:], k, mask, reset)
        (hs.float().sum() + h.sum() + c.sum()).backward()
        results.append([hs, h, c, xg.grad, xm.grad] + [t.grad for t in tensors[2:]])
    if compute == torch.float32:
        return max(float((a - b).detach().abs().max()) for a, b in zip(*results))
    return max(float((a.float() - b.float()).norm() / b.float().norm())
               for a, b in zip(*results))


def model_diff(kernels: str, seed: int = 6) -> float:
    """Max |difference| between :meth:`LanguageModel.encode` with the fused mLSTM on ``kernels``
    and on the torch kernels, same weights, fp32: hs, (h, c) and every parameter gradient, on a
    batch with resets inside the window and padding. ``mask`` and ``reset`` are [B, T] as the
    model's callers give them, so the window receives their transposed views: the production
    path, which the window-level cases (contiguous [T, B] flags) do not take. Differences are
    relative beyond 1 (:func:`cell_diff`)."""
    from hvd_lm.model.lm import LanguageModel, ModelConfig

    g = torch.Generator().manual_seed(seed)
    B, T = 3, 17
    tokens = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    reset = torch.rand(B, T, generator=g) < 0.15
    reset[1, 6] = True
    w_out = torch.randn(B, T, 12, generator=g)
    results = []
    for name in (kernels, "torch"):
        torch.manual_seed(seed)
        model = LanguageModel(ModelConfig(hidden_size=12, embed_dim=5, rnn_kernels=name))
        hs, (h, c) = model.encode(tokens, mask=mask, reset=reset)
        ((hs * w_out).sum() + h.sum() - c.sum()).backward()
        results.append([hs, h, c] + [p.grad for p in model.rnn.parameters()]
                       + [model.embed.weight.grad])
    # relative beyond 1, as cell_diff: gradients of ~10 carry fp32 rounding of ~1e-6
    return max(float((a - b).detach().abs().max()) / max(1.0, float(b.detach().abs().max()))
               for a, b in zip(*results))


class StaticBufferCapture:
    """``make_graphed_callables(fn, sample)`` on the CPU: the same autograd surface as the
    real one (``torch/cuda/graphs.py``), with an eager re-run standing in for each replay.

    Forward: the arguments are copied into static input buffers, ``fn`` runs on those, and
    its outputs are copied into static output buffers and returned as detached views of them.
    Backward: the incoming gradients are copied into static buffers, the stored graph is
    differentiated, the input gradients are copied into static gradient buffers and returned
    as detached views of them, which the next replay overwrites, exactly what the CUDA graph's
    private memory pool does.
    """

    def __init__(self):
        self.captures = 0

    def __call__(self, fn, sample):
        self.captures += 1
        static_in = [s.detach().clone().requires_grad_(s.requires_grad) for s in sample]
        grad_in = [torch.zeros_like(s) if s.requires_grad else None for s in sample]
        static_out: list[torch.Tensor] = []
        graph: dict = {}

        class Replayed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                for buf, x in zip(static_in, inputs):
                    buf.detach().copy_(x)
                with torch.enable_grad():
                    outs = fn(*static_in)
                if not static_out:
                    static_out.extend(torch.empty_like(o) for o in outs)
                for buf, o in zip(static_out, outs):
                    buf.copy_(o.detach())
                graph["outs"] = outs
                return tuple(o.detach() for o in static_out)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                needs = [s for s in static_in if s.requires_grad]
                got = iter(torch.autograd.grad(graph.pop("outs"), needs, grads,
                                               allow_unused=True))
                for buf in grad_in:
                    if buf is not None:
                        g = next(got)
                        buf.copy_(g if g is not None else torch.zeros_like(buf))
                return tuple(b.detach() if b is not None else None for b in grad_in)

        return lambda *args: Replayed.apply(*args)


def train_windows(model, tokens: torch.Tensor, reset: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Training windows without zero_grad, the state carried (detached, TBPTT) and ``reset``
    applied in each: ``tokens`` [W, B, T + 1] (window w's inputs and next-byte targets), ``reset``
    [B, T]; the cross-entropy of each window backpropagated, so ``model``'s ``.grad`` hold the sum
    over the W windows. Returns the final state (h, c), cloned. The accumulation the CUDA-graph
    tests compare, graphed against eager (tests/test_gpu_emulated.py on CPU,
    tests/test_mlstm_fused.py on CUDA)."""
    W, B = tokens.shape[:2]
    state = model.init_state(B, tokens.device)
    for w in range(W):
        logits, state = model(tokens[w, :, :-1], (state[0].detach(), state[1].detach()),
                              reset=reset)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          tokens[w, :, 1:].reshape(-1)).backward()
    return tuple(s.clone() for s in state)
