"""CUDA graphs of the fused mLSTM window (:mod:`hvd_lm.model.mlstm_fused`): capture once per
signature, replay, and fall back to eager (``--cuda-graphs``; docs/mlstm_fused.md section 4)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Callable

import torch


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
    capture that failed (reported once on stderr, never retried). One signature is kept (it
    holds its window's saved tensors in a private memory pool).

    Args:
        device_type: where graphs apply (``cuda``; tests use ``cpu`` with a fake ``capture``).
        capture: ``capture(fn, sample_args) -> graphed fn`` (default
            ``torch.cuda.make_graphed_callables``).

    Attributes:
        stats: Counter of ``graphed``, ``eager`` and ``captures`` calls (read by tests/bench).
    """

    def __init__(self, device_type: str = "cuda", capture: Callable | None = None):
        self.device_type = device_type
        self.capture = capture or torch.cuda.make_graphed_callables
        self.graphs: dict[tuple, Callable] = {}
        self.failed: set[tuple] = set()
        self.stats: Counter = Counter()

    def __call__(self, fn: Callable, args: tuple):
        """``fn(*args)``, from a CUDA graph when one is (or can now be) captured for ``args``'s
        signature, else eagerly."""
        tensors = [a for a in args if a is not None]
        # eligible: grad on, every tensor on device_type, not inside another capture
        eligible = torch.is_grad_enabled() and any(a.requires_grad for a in tensors) \
            and all(a.device.type == self.device_type for a in tensors) \
            and not (self.device_type == "cuda" and torch.cuda.is_current_stream_capturing())
        key = signature(args) if eligible else None
        if key is not None and not self.graphs and key not in self.failed:
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
        return graphed(*[_FreshGrad.apply(a) if a.requires_grad and a.is_leaf else a
                         for a in tensors])

    def _capture(self, fn: Callable, args: tuple, key: tuple) -> None:
        absent = [a is None for a in args]
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad)
                       for a in args if a is not None)

        def dense(*present):  # make_graphed_callables takes tensors only: re-insert the Nones
            given = iter(present)
            return fn(*[None if gone else next(given) for gone in absent])

        try:
            # Autocast must be off (or uncached) while capturing; the Function sets its dtypes.
            with torch.autocast(device_type=self.device_type, enabled=False):
                self.graphs[key] = self.capture(dense, sample)
            self.stats["captures"] += 1
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
            self.failed.add(key)
            print(f"warning: CUDA graph capture of the mLSTM window failed, running it eagerly "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
