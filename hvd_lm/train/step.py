"""One training step, written once: ``hvd-lm train`` (:mod:`hvd_lm.train.loop`) and every benchmark
that times a step (``python -m benchmarks train``, ``bench gpu``, ``bench multinode``, ``bench
checkpoint``) call :func:`train_step`::

    r = train_step(model, optimizer, scaler, windows, state, StepSpec(device, k=2, ...))

with the settings in a frozen :class:`StepSpec` and ``windows`` a list or an iterator of the
step's k batches (the step only reads it: the loop moves its own position after the step).

Per rank, for the ``k`` windows of one optimizer step (``backward_passes_per_step``):

1. forward with the carried (detached) recurrent state and the loss: mean next-byte NLL over the
   window's real targets / k, in fp32 (:func:`window_nll`); backward through the loss scaler
   (fp16: dynamic loss scaling; bf16/fp32: a disabled ``GradScaler`` that passes through).
   Horovod's hooks start each gradient's fused, fp16-compressed allreduce as soon as it is ready.
2. ``engine.synchronize(optimizer)``: wait for those allreduces (Horovod docs, "Gradient
   clipping"); on CUDA the stream is drained first, so the wait measured is the allreduce's alone.
3. unscale (fp16) and clip the global L2 norm (:func:`grad_norm`);
4. step inside ``engine.skip_synchronize(optimizer)``, or skip a step whose gradients are not
   finite (every rank decides alike, from the same allreduced norm); zero the gradients.

The two Horovod calls go through :mod:`hvd_lm.comm.engine` (:func:`~hvd_lm.comm.engine.
synchronize`, :func:`~hvd_lm.comm.engine.skip_synchronize`): on a distributed optimizer
(Horovod's, the torch engine's, the 1-bit ones: a
:class:`SynchronizingOptimizer`) they are its own ``synchronize()`` and
``skip_synchronize()``; a plain torch optimizer (one process without Horovod, or DDP, whose
allreduce happens inside backward) takes the same path without the wait.

The skip is decided **on the device** when the optimizer can take the decision as a tensor
(:func:`decides_on_device`: torch's fused Adam, AdamW and SGD, which skip their update and undo
their step count where ``found_inf`` is 1, as ``GradScaler`` drives them): the step then reads
nothing back to the host; the norm travels to the host on its own (a non-blocking copy into
pinned memory, :class:`DeviceOutcome`) and is read when the loop needs it
(:meth:`StepResult.read`). A skipped step whose recurrent state is not finite returns it zeroed,
also decided on the device. Other optimizers (the 1-bit ones, whose ranks agree on a norm
through a collective) read the norm on the host (:func:`unscale_and_clip`, :func:`step_or_skip`).
On CUDA the stream is drained before Horovod's wait only when there is one (the wait measured
is then the allreduce's alone); without Horovod the step queues its work and returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, ContextManager, Iterable, Protocol

import torch
import torch.nn.functional as F

from hvd_lm.comm import engine
from hvd_lm.model import device as devices
from hvd_lm.train.data import IGNORE, Batch

State = tuple[torch.Tensor, torch.Tensor]


class StepOptimizer(Protocol):
    """What the step calls on any optimizer: a plain ``torch.optim`` one (one process; the torch
    engine's, under DDP, whose allreduce runs inside backward) has these; a distributed one is
    also a :class:`SynchronizingOptimizer`."""

    param_groups: list[dict[str, Any]]

    def step(self, closure=None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class SynchronizingOptimizer(StepOptimizer, Protocol):
    """An optimizer whose gradient allreduce the step waits for explicitly (Horovod docs,
    "Gradient clipping"; :func:`hvd_lm.comm.engine.synchronizes` tells one): Horovod's
    ``hvd.DistributedOptimizer`` and the 1-bit optimizers'
    (:class:`hvd_lm.train.optim.OnebitDistributedOptimizer`)."""

    def synchronize(self) -> None: ...

    def skip_synchronize(self) -> ContextManager[None]: ...


def window_nll(model, batch: Batch, state: State | None, device: torch.device, precision: str,
               dtype: torch.dtype = torch.float32):
    """Forward one TBPTT window: (sum of -ln p over its real targets, a 0-d ``dtype`` tensor
    with grad; the new state). The incoming state is detached (truncated BPTT; None: zeros); the
    logits are upcast so the softmax and loss are fp32 (``dtype``: evaluation's fp64) whatever
    the autocast precision (as the reference requires).

    Args:
        model: a :class:`hvd_lm.model.lm.LanguageModel` (or a wrapper that calls one).
        batch: inputs/targets [B, T] (targets ``IGNORE`` where padded), reset flags [B, T].
        state: (h, c), each [B, H].
    """
    if state is not None:
        state = (state[0].detach(), state[1].detach())
    # non_blocking: a no-op on CPU; from pinned memory (train.data.Prefetcher) an async copy
    x = batch.inputs.to(device, non_blocking=True)
    y = batch.targets.to(device, non_blocking=True)
    with devices.autocast(device, precision):
        logits, state = model(x, state, reset=batch.reset.to(device, non_blocking=True),
                              time_major=True)
    # logits [T, B, 256], contiguous as the decoder wrote them; the targets [B, T] transposed
    # to match (a [B, T] int64 copy instead of one of the [T, B, 256] logits)
    nats = F.cross_entropy(logits.to(dtype).reshape(-1, logits.shape[-1]), y.t().reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return nats, state


def grad_norm(optimizer, params: list[torch.Tensor], max_norm: float,
              scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Unscale the gradients (fp16; a disabled scaler does nothing) and clip their global L2 norm
    to ``max_norm``, reading nothing back to the host; call it after the gradients are complete
    (Horovod: after ``optimizer.synchronize()``). torch.amp docs, "Working with unscaled
    gradients"; Horovod docs, "Gradient clipping".

    Args:
        params: the parameters (tensors with ``.grad``); max_norm: 0 = measure, do not clip.

    Returns:
        The norm before clipping, a 0-d tensor on the gradients' device (inf or NaN when a
        gradient is not finite).
    """
    scaler.unscale_(optimizer)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm(
        [p.grad.detach() for p in params if p.grad is not None], foreach=True)


def unscale_and_clip(optimizer, params: list[torch.Tensor], max_norm: float,
                     scaler: torch.amp.GradScaler) -> float:
    """:func:`grad_norm`, read on the host (a sync): the path of an optimizer that cannot take
    the skip decision as a tensor. An optimiser whose gradients stay local (a 1-bit optimiser's
    compressed phase) agrees on one norm through its ``agree_grad_norm``
    (:meth:`hvd_lm.train.optim.OnebitDistributedOptimizer.agree_grad_norm`).

    Returns:
        The norm before clipping (inf or NaN when a gradient is not finite).
    """
    norm = float(grad_norm(optimizer, params, max_norm, scaler))
    agree = getattr(optimizer, "agree_grad_norm", None)
    return agree(norm) if agree is not None else norm  # collective: a 1-bit optimizer's allreduce


def step_or_skip(optimizer, scaler: torch.amp.GradScaler, grad_norm: float,
                 check_finite: bool = True) -> bool:
    """The optimiser step, or none when the gradients are not finite, decided on the host;
    returns whether it was applied. fp16 (an enabled scaler): ``scaler.step`` skips on inf/NaN
    by itself and ``scaler.update`` lowers the scale; the norm, taken after ``unscale_``, is
    non-finite exactly then, so applied = the norm is finite (no ``get_scale()``: each is a
    host sync). Otherwise the step is skipped when ``check_finite`` and ``grad_norm``
    (:func:`unscale_and_clip`, the same on every rank) is not finite. Under Horovod call it
    inside ``optimizer.skip_synchronize()``."""
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        return math.isfinite(grad_norm)
    if check_finite and not math.isfinite(grad_norm):
        return False
    optimizer.step()
    return True


#: torch optimizers whose fused implementation takes ``found_inf`` (skips its update, and undoes
#: its step count, on the device where it is 1): what ``GradScaler`` drives them with.
FOUND_INF_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def decides_on_device(optimizer) -> bool:
    """Whether :func:`train_step` decides the skip on the device for ``optimizer``: one of
    :data:`FOUND_INF_OPTIMIZERS` (or Horovod's ``DistributedOptimizer`` of one, a subclass)
    whose every parameter group is fused, and no ``agree_grad_norm`` (the 1-bit optimisers
    agree on a norm on the host)."""
    return (isinstance(optimizer, FOUND_INF_OPTIMIZERS)
            and getattr(optimizer, "agree_grad_norm", None) is None
            and all(g.get("fused") for g in optimizer.param_groups))


def step_or_skip_on_device(optimizer, scaler: torch.amp.GradScaler, norm: torch.Tensor,
                           check_finite: bool = True) -> torch.Tensor | bool:
    """:func:`step_or_skip` decided on the device, for an optimizer that
    :func:`decides_on_device`: it gets ``found_inf`` = 1.0 where ``norm`` is not finite and
    leaves its parameters and state as they are there (torch.optim's fused kernels; the same
    tensor ``GradScaler.step`` hands them); fp16's scaler then updates its scale from the inf
    check its ``unscale_`` recorded, on the device too. Under Horovod call it inside
    ``optimizer.skip_synchronize()``.

    Returns:
        whether the step was applied: a 0-d bool tensor on the norm's device (True, a bool,
        when nothing is checked: ``check_finite`` off without loss scaling).
    """
    if not (check_finite or scaler.is_enabled()):
        optimizer.step()
        return True
    finite = torch.isfinite(norm)
    optimizer.found_inf = (~finite).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    if scaler.is_enabled():
        scaler.update()
    return finite


class DeviceOutcome:
    """A step's gradient norm as the device computed it, sent to the host as soon as it is
    made: one non-blocking copy into pinned memory and a CUDA event after it, so that
    :meth:`read` waits for the norm alone, not for the work queued after it (the next step's
    forward and backward). On the CPU the tensor is read as it is. The skip decision is the
    norm's finiteness (:func:`step_or_skip_on_device`), so the host derives it from the copy.

    Args:
        norm: 0-d float tensor; checked: whether a non-finite norm skipped the step.
    """

    def __init__(self, norm: torch.Tensor, checked: bool):
        self.checked, self.event = checked, None
        if norm.device.type == "cuda":
            self.host = torch.empty((), dtype=norm.dtype, pin_memory=True)
            self.host.copy_(norm.detach(), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = norm.detach()

    def read(self) -> tuple[bool, float]:
        """(applied, the norm as a float)."""
        if self.event is not None:
            self.event.synchronize()
        norm = self.host.tolist()
        return (math.isfinite(norm) or not self.checked), norm


def _zero_lost_state(state: State, applied: torch.Tensor) -> State:
    """(h, c) [B, H], zeroed when the step was skipped and the state is not finite (a NaN
    state would poison every later window), decided on the device: what the loop did on the
    host after a skipped step before the decision moved to the device. The state is finite iff
    the sum of its elements is: |h| <= 1 and |c_t| <= |c_{t-1}| + 1, so no finite state's sum
    comes near fp32's overflow."""
    h, c = (s.detach() for s in state)
    keep = applied | torch.isfinite(h.sum() + c.sum())
    return torch.where(keep, h, 0.0), torch.where(keep, c, 0.0)


@dataclasses.dataclass
class StepResult:
    """What one :func:`train_step` did.

    Attributes:
        applied: the optimizer step was taken (False: skipped, gradients not finite): a bool, or,
            when decided on the device, a 0-d bool tensor there (:meth:`read` gives the bool).
        grad_norm: the gradients' global L2 norm before clipping: a float, or a 0-d tensor
            on the device (:meth:`read`).
        nats: summed -ln p over the step's targets, a 0-d fp64 tensor on the device (read it
            when logging: reading it here would be a host sync per step).
        chars: targets (bytes) predicted.
        wait_s: seconds the host waited for the gradient allreduce (0 without Horovod).
        state: the recurrent state (h, c) after the last window, each [B, H].
        outcome: the device decision's way to the host (:class:`DeviceOutcome`), or None.
    """

    applied: bool | torch.Tensor
    grad_norm: float | torch.Tensor
    nats: torch.Tensor
    chars: int
    wait_s: float
    state: State
    outcome: DeviceOutcome | None = None

    def read(self) -> "StepResult":
        """This result with ``applied`` (bool) and ``grad_norm`` (float) on the host: itself
        when they are already; else read from :attr:`outcome` (waits for the step's decision,
        not for the work queued after it)."""
        if self.outcome is None:
            return self
        applied, norm = self.outcome.read()
        return dataclasses.replace(self, applied=applied, grad_norm=norm, outcome=None)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """How :func:`train_step` runs: the settings of a run (or a benchmark), made once.

    Attributes:
        device: where the model and its state are; the windows are copied there.
        precision: ``fp32``, ``bf16`` or ``fp16`` (:func:`hvd_lm.model.device.autocast`).
        grad_clip: max global L2 norm of the gradients (0: measure only).
        check_finite: skip a step whose norm is not finite (``--nan-check``).
        k: TBPTT windows per optimizer step (``backward_passes_per_step``): each window's loss
            is divided by k, so the k backward passes sum to the mean over the step.
        loss_hook: applied to each window's loss before backward (tests' fault injection:
            :mod:`hvd_lm.train.faults`).
        clock: called with ``"forward"``, ``"backward"`` (each window), ``"synchronized"`` and
            ``"updated"`` as each part ends (``bench multinode`` times the parts; default: none).
    """

    device: torch.device
    precision: str = "fp32"
    grad_clip: float = 0.0
    check_finite: bool = True
    k: int = 1
    loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
    clock: Callable[[str], None] = lambda part: None


@dataclasses.dataclass
class Gradients:
    """What :func:`backward` leaves for :func:`update`: the step's gradients are in ``.grad``
    (averaged over the ranks); the loss and counts of its windows.

    Attributes:
        nats: summed -ln p over the step's targets, a 0-d fp64 tensor on the device.
        chars: targets (bytes) predicted.
        wait_s: seconds the host waited for the gradient allreduce (0 when there was no wait:
            one process, or DDP, whose allreduce ends inside backward).
        state: the recurrent state (h, c) after the last window, each [B, H].
    """

    nats: torch.Tensor
    chars: int
    wait_s: float
    state: State


def backward(model, optimizer: StepOptimizer, scaler: torch.amp.GradScaler,
             windows: Iterable[Batch], state: State, spec: StepSpec) -> Gradients:
    """The first half of a step: forward and backward over ``spec.k`` TBPTT windows, then the
    wait for the gradient allreduce (steps 1-2 of the module docstring).

    Args:
        model: the module to call: the model, or its DDP wrapper
            (:func:`hvd_lm.comm.engine.wrap_model`).
        optimizer: a Horovod ``DistributedOptimizer``, a 1-bit optimizer (each a
            :class:`SynchronizingOptimizer`) or a plain torch optimizer
            (one process; the torch engine's, under DDP).
        scaler: :func:`hvd_lm.model.device.make_scaler`'s.
        windows: the step's k batches, each [B, T]: a list, or an iterator read as the step goes
            (the loop's fetches each window from its read-ahead thread); the step only reads it.
        state: the recurrent state (h, c) carried in, each [B, H].
        spec: the settings (:class:`StepSpec`).

    Raises:
        ValueError: ``windows`` did not hold ``spec.k`` batches.
    """
    device, k = spec.device, spec.k
    nats_step, chars, seen = torch.zeros((), dtype=torch.float64, device=device), 0, 0
    for batch in windows:
        # the windows before the last only accumulate (DDP: no_sync; Horovod counts them)
        with engine.no_sync(model) if seen + 1 < k else contextlib.nullcontext():
            nats, state = window_nll(model, batch, state, device, spec.precision)  # fp32, sum
            spec.clock("forward")
            loss = nats / max(1, batch.chars) / k
            if spec.loss_hook is not None:
                loss = spec.loss_hook(loss)
            # collective: each gradient's allreduce starts from its hook once it is ready
            scaler.scale(loss).backward()
        spec.clock("backward")
        nats_step += nats.detach().double()  # on the device: no host sync
        chars += batch.chars
        seen += 1
    if seen != k:
        raise ValueError(f"train_step: {seen} window(s) for a step of k={k}")

    wait = 0.0
    if engine.synchronizes(optimizer):
        if device.type == "cuda":  # the backward drained first, so the wait is the allreduce's
            torch.cuda.current_stream(device).synchronize()
        t_wait = time.perf_counter()
        # collective: wait for the fused allreduce of every gradient (fp16 on the wire with
        # --compression fp16)
        engine.synchronize(optimizer)
        wait = time.perf_counter() - t_wait
    spec.clock("synchronized")
    return Gradients(nats_step, chars, wait, state)


def update(optimizer: StepOptimizer, scaler: torch.amp.GradScaler, g: Gradients,
           spec: StepSpec) -> StepResult:
    """The second half of a step: unscale and clip, then step or skip a step whose gradients are
    not finite, and zero the gradients (steps 3-4 of the module docstring). The loop counts the
    previous step between :func:`backward` and this (:meth:`hvd_lm.train.counting.StepCounter.
    settle`), so this update's learning rate follows every skip.

    Returns:
        :class:`StepResult` (``applied`` and ``grad_norm`` as device tensors when the skip was
        decided on the device: :meth:`StepResult.read`).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    on_device = decides_on_device(optimizer)
    # unscale (fp16) and clip: on the device, the norm a tensor; else read on the host (the
    # step's sync)
    norm = (grad_norm if on_device else unscale_and_clip)(optimizer, params, spec.grad_clip, scaler)
    # step, or skip a step whose gradients are not finite (every rank decides alike, from the
    # norm of the allreduced gradients): on the device, the decision a tensor
    with engine.skip_synchronize(optimizer):  # collective: synchronized in backward()
        applied = (step_or_skip_on_device if on_device else step_or_skip)(
            optimizer, scaler, norm, spec.check_finite)
    optimizer.zero_grad()
    spec.clock("updated")
    if not on_device:
        return StepResult(applied, norm, g.nats, g.chars, g.wait_s, g.state)
    checked = not isinstance(applied, bool)  # else nothing was checked: applied
    state = _zero_lost_state(g.state, applied) if checked else g.state
    return StepResult(applied, norm, g.nats, g.chars, g.wait_s, state, DeviceOutcome(norm, checked))


def train_step(model, optimizer: StepOptimizer, scaler: torch.amp.GradScaler,
               windows: Iterable[Batch], state: State, spec: StepSpec) -> StepResult:
    """One optimizer step over ``spec.k`` TBPTT windows: :func:`backward` then :func:`update`
    (the benchmarks' step; the loop calls the two itself, counting the previous step between
    them). Arguments, result and errors: theirs."""
    return update(optimizer, scaler, backward(model, optimizer, scaler, windows, state, spec), spec)
