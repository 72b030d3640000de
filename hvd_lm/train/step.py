"""One training step, written once: ``hvd-lm train`` (:mod:`hvd_lm.train.loop`) and every benchmark
that times a step (``hvd-lm bench train``, ``bench gpu``, ``bench multinode``) call
:func:`train_step`.

Per rank, for the ``k`` windows of one optimizer step (``backward_passes_per_step``):

1. forward with the carried (detached) recurrent state and the loss: mean next-byte NLL over the
   window's real targets / k, in fp32 (:func:`window_nll`); backward through the loss scaler
   (fp16: dynamic loss scaling; bf16/fp32: a disabled ``GradScaler`` that passes through).
   Horovod's hooks start each gradient's fused, fp16-compressed allreduce as soon as it is ready.
2. ``optimizer.synchronize()``: wait for those allreduces (Horovod docs, "Gradient clipping");
   on CUDA the stream is drained first, so the wait measured is the allreduce's alone.
3. unscale (fp16) and clip the global L2 norm (:func:`unscale_and_clip`); the norm read on the
   host is the step's one sync (fp16 adds ``GradScaler.step``'s inf check).
4. step inside ``optimizer.skip_synchronize()``, or skip a step whose gradients are not finite
   (:func:`step_or_skip`: every rank decides alike, from the same allreduced norm); zero the
   gradients.

An optimizer without Horovod's ``synchronize`` (a plain torch optimizer on one process, or DDP,
whose allreduce happens inside backward) takes the same path without the wait.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from hvd_lm.model import device as devices
from hvd_lm.train.data import IGNORE, Batch

State = tuple[torch.Tensor, torch.Tensor]


def window_nll(model, batch: Batch, state: State, device: torch.device, precision: str):
    """Forward one TBPTT window: (sum of -ln p over its real targets, a 0-d fp32 tensor with
    grad; the new state). The incoming state is detached (truncated BPTT); the logits are upcast
    so the softmax and loss are fp32 whatever the autocast precision (as the reference requires).

    Args:
        model: a :class:`hvd_lm.model.lm.LanguageModel` (or a wrapper that calls one).
        batch: inputs/targets [B, T] (targets ``IGNORE`` where padded), reset flags [B, T].
        state: (h, c), each [B, H].
    """
    state = (state[0].detach(), state[1].detach())
    # non_blocking: a no-op on CPU; from pinned memory (train.data.Prefetcher) an async copy
    x = batch.inputs.to(device, non_blocking=True)
    y = batch.targets.to(device, non_blocking=True)
    with devices.autocast(device, precision):
        logits, state = model(x, state, reset=batch.reset.to(device, non_blocking=True),
                              time_major=True)
    # logits [T, B, 256], contiguous as the decoder wrote them; the targets [B, T] transposed
    # to match (a [B, T] int64 copy instead of one of the [T, B, 256] logits)
    nats = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.t().reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return nats, state


def unscale_and_clip(optimizer, params: list[torch.Tensor], max_norm: float,
                     scaler: torch.amp.GradScaler) -> float:
    """Unscale the gradients (fp16; a disabled scaler does nothing) and clip their global L2 norm
    to ``max_norm``; call it after the gradients are complete (Horovod: after
    ``optimizer.synchronize()``). torch.amp docs, "Working with unscaled gradients"; Horovod
    docs, "Gradient clipping".

    The norm is one multi-tensor kernel (``foreach``) and is read on the host: the step's one
    sync, so every rank can take the same skip decision. An optimiser whose gradients stay local
    (a 1-bit optimiser's compressed phase) agrees on one norm through its ``agree_grad_norm``
    (:meth:`hvd_lm.train.onebit_optimizers.OnebitDistributedOptimizer.agree_grad_norm`).

    Args:
        params: the parameters (tensors with ``.grad``); max_norm: 0 = measure, do not clip.

    Returns:
        The norm before clipping (inf or NaN when a gradient is not finite).
    """
    scaler.unscale_(optimizer)
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm(
            [p.grad.detach() for p in params if p.grad is not None], foreach=True)
    agree = getattr(optimizer, "agree_grad_norm", None)
    return agree(float(norm)) if agree is not None else float(norm)


def step_or_skip(optimizer, scaler: torch.amp.GradScaler, grad_norm: float,
                 check_finite: bool = True) -> bool:
    """The optimiser step, or none when the gradients are not finite; returns whether it was
    applied. fp16 (an enabled scaler): ``scaler.step`` skips on inf/NaN by itself and
    ``scaler.update`` lowers the scale; the norm, taken after ``unscale_``, is non-finite exactly
    then, so applied = the norm is finite (no ``get_scale()``: each is a host sync). Otherwise
    the step is skipped when ``check_finite`` and ``grad_norm`` (:func:`unscale_and_clip`, the
    same on every rank) is not finite. Under Horovod call it inside
    ``optimizer.skip_synchronize()``."""
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        return math.isfinite(grad_norm)
    if check_finite and not math.isfinite(grad_norm):
        return False
    optimizer.step()
    return True


@dataclass
class StepResult:
    """What one :func:`train_step` did.

    Attributes:
        applied: the optimizer step was taken (False: skipped, gradients not finite).
        grad_norm: the gradients' global L2 norm before clipping.
        nats: summed -ln p over the step's targets, a 0-d fp64 tensor on the device (read it
            when logging: reading it here would be a host sync per step).
        chars: targets (bytes) predicted.
        wait_s: seconds the host waited for the gradient allreduce (0 without Horovod).
        state: the recurrent state (h, c) after the last window, each [B, H].
    """

    applied: bool
    grad_norm: float
    nats: torch.Tensor
    chars: int
    wait_s: float
    state: State


def train_step(model, optimizer, scaler: torch.amp.GradScaler, params: list[torch.Tensor],
               windows: Iterable[Batch], k: int, state: State, device: torch.device,
               precision: str, grad_clip: float, check_finite: bool = True,
               loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
               clock: Callable[[str], None] | None = None) -> StepResult:
    """One optimizer step over ``k`` TBPTT windows (the module docstring, top to bottom).

    Args:
        model: the model to call (a DDP wrapper for the DDP baseline); params: its trainable
            parameters. optimizer: a Horovod ``DistributedOptimizer``, a 1-bit optimizer or a
            plain torch optimizer. scaler: :func:`hvd_lm.model.device.make_scaler`'s.
        windows: the step's k batches, each [B, T] (an iterator: the loop's reads the next window
            ahead on a thread while one trains). k: how many.
        state: the recurrent state (h, c) carried in, each [B, H].
        grad_clip: max global L2 norm (0: measure only). check_finite: skip a step whose norm is
            not finite (``--nan-check``).
        loss_hook: applied to each window's loss before backward (tests' fault injection:
            :mod:`hvd_lm.train.faults`).
        clock: called with ``"forward"``, ``"backward"`` (each window), ``"synchronized"`` and
            ``"updated"`` as each part ends (``bench multinode`` times the parts).

    Returns:
        :class:`StepResult`.
    """
    mark = clock or (lambda _: None)
    nats_step, chars = torch.zeros((), dtype=torch.float64, device=device), 0
    for batch in windows:
        nats, state = window_nll(model, batch, state, device, precision)  # fp32, summed
        mark("forward")
        loss = nats / max(1, batch.chars) / k
        if loss_hook is not None:
            loss = loss_hook(loss)
        # Horovod: each gradient's allreduce starts from its hook as soon as it is ready
        scaler.scale(loss).backward()
        mark("backward")
        nats_step += nats.detach().double()  # on the device: no host sync
        chars += batch.chars

    # Horovod: wait for the fused allreduce of every gradient (fp16 on the wire with
    # --compression fp16); on CUDA the backward drained first, so the wait is the allreduce's
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    t_wait = time.perf_counter()
    synchronize = getattr(optimizer, "synchronize", None)
    if synchronize is not None:
        synchronize()
    wait = time.perf_counter() - t_wait
    mark("synchronized")
    # unscale (fp16) and clip; the norm read on the host is the step's sync
    grad_norm = unscale_and_clip(optimizer, params, grad_clip, scaler)
    # step, or skip a step whose gradients are not finite (every rank decides alike)
    with getattr(optimizer, "skip_synchronize", contextlib.nullcontext)():  # Horovod: done
        applied = step_or_skip(optimizer, scaler, grad_norm, check_finite)
    optimizer.zero_grad()
    mark("updated")
    return StepResult(applied, grad_norm, nats_step, chars, wait, state)
