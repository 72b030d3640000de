"""The torch engine's distributed optimizer: gradients packed into buckets whose allreduce starts
from backward hooks, so that communication overlaps the rest of the backward pass.

The interface is Horovod's ``hvd.DistributedOptimizer`` (``horovod/torch/optimizer.py`` 0.28.1),
which the training step, the 1-bit optimizers and the benchmarks already use: an instance of a
subclass of the wrapped optimizer's own class (so ``isinstance``, ``param_groups``,
``state_dict`` and the LR schedulers work unchanged), with ``synchronize()``,
``skip_synchronize()``, ``backward_passes_per_step`` and ``set_backward_passes_per_step``, and
``step()`` that synchronizes unless inside ``skip_synchronize()``. The reduction is DDP's
(PyTorch "DistributedDataParallel" design notes, ``torch/csrc/distributed/c10d/reducer.cpp``):

* the trainable parameters, in reverse registration order (roughly the order backward produces
  their gradients), are cut into buckets of at most ``bucket_bytes`` bytes of parameters, the
  first of at most 1 MiB so that communication starts early (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``;
  one device and dtype per bucket; a larger parameter is a bucket of its own; 0: one per
  parameter);
* a ``register_post_accumulate_grad_hook`` on every parameter counts down
  ``backward_passes_per_step`` (local accumulation, as Horovod's hooks); when a bucket's last
  gradient is complete its gradients are flattened into one buffer, cast to the wire dtype
  (:class:`Compression`: fp16 or bf16 halve the bytes) and its sum-allreduce started
  asynchronously; buckets start strictly in index order (a bucket ready early waits for the ones
  before it), so every rank issues the same collectives in the same order whatever order its
  hooks fire in;
* ``synchronize()`` starts the buckets not started yet (parameters that got no gradient are
  reduced as zeros, as Horovod does), waits for every one, and writes the average (the sum
  decompressed to the parameter's dtype, then divided by the world size) back into each
  ``.grad``.

With one rank no hook is registered and ``synchronize()`` has nothing to do (as Horovod's
wrapper, which registers hooks only when ``size() > 1``). The collectives themselves are not
called here: the engine (:mod:`hvd_lm.comm.torch_engine`) passes the function that starts a
sum-allreduce, so this module has no collective library of its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch


class Work(Protocol):
    """A started collective: ``wait()`` blocks until it is done (``torch.distributed.Work``)."""

    def wait(self): ...


#: Starts the in-place sum-allreduce of a flat tensor and returns its handle.
AllreduceAsync = Callable[[torch.Tensor], Work]


@dataclass(frozen=True)
class WireCast:
    """A gradient compression: cast to ``dtype`` for the wire (None: as is), back after.

    Attributes:
        name: ``"none"``, ``"fp16"`` or ``"bf16"``.
        dtype: the dtype on the wire, or None for the parameter's own.
    """

    name: str
    dtype: torch.dtype | None

    def compress(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` in the wire dtype (the tensor itself when already so)."""
        return flat if self.dtype is None else flat.to(self.dtype)

    def bytes_per_value(self, dtype: torch.dtype) -> int:
        """Bytes one gradient value of ``dtype`` takes on the wire."""
        return torch.empty((), dtype=self.dtype or dtype).element_size()


class Compression:
    """``hvd.Compression``'s names, plus bfloat16 (which Horovod 0.28.1's PyTorch adapter lacks).
    fp16 keeps 11 significant bits and overflows above 65504; bf16 keeps 8 and has fp32's range."""

    none = WireCast("none", None)
    fp16 = WireCast("fp16", torch.float16)
    bf16 = WireCast("bf16", torch.bfloat16)


@dataclass
class Bucket:
    """Parameters whose gradients travel in one allreduce.

    Attributes:
        params: the parameters, in bucket order.
        waiting: how many of them have not completed their gradient of this step.
        buffer: the flat wire buffer being reduced (None until started).
        work: the started allreduce (None until started).
    """

    params: list[torch.Tensor]
    waiting: int = 0
    buffer: torch.Tensor | None = None
    work: Work | None = None
    nbytes: int = field(default=0)


#: The first bucket's cap, bytes (DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB).
FIRST_BUCKET_BYTES = 1 << 20


def make_buckets(params: list[torch.Tensor], bucket_bytes: int,
                 first_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """Cut ``params`` (in the order given) into buckets of at most ``bucket_bytes`` parameter
    bytes (the first at most ``min(first_bytes, bucket_bytes)``), one device and dtype per
    bucket; a parameter larger than that is a bucket of its own; ``bucket_bytes`` 0: one bucket
    per parameter."""
    buckets: list[Bucket] = []
    for p in params:
        size = p.numel() * p.element_size()
        b = buckets[-1] if buckets else None
        cap = min(first_bytes, bucket_bytes) if len(buckets) == 1 else bucket_bytes
        if (b is None or bucket_bytes <= 0 or b.nbytes + size > cap
                or b.params[0].device != p.device or b.params[0].dtype != p.dtype):
            b = Bucket([])
            buckets.append(b)
        b.params.append(p)
        b.nbytes += size
    for b in buckets:
        b.waiting = len(b.params)
    return buckets


class _BucketedOptimizer(torch.optim.Optimizer):
    """The methods grafted onto the wrapped optimizer's class (see :func:`distributed_optimizer`;
    ``super(self.__class__, self)`` is the wrapped class, as in Horovod's wrapper)."""

    def __init__(self, params, named_parameters, compression: WireCast,
                 backward_passes_per_step: int, allreduce_async: AllreduceAsync, size: int,
                 bucket_bytes: int):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._allreduce_async = allreduce_async
        self._size = size
        self.backward_passes_per_step = backward_passes_per_step
        named = list(named_parameters) if named_parameters is not None else []
        self._names = {p: n for n, p in named}
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        # reverse registration order: the order backward roughly produces the gradients in
        mine = set(trainable)
        order = [p for _, p in named if p in mine] if named else trainable
        order = list(dict.fromkeys(reversed(order)))
        seen = set(order)
        order += [p for p in trainable if p not in seen]
        self._buckets = make_buckets(order, bucket_bytes)
        self._bucket_of = {p: i for i, b in enumerate(self._buckets) for p in b.params}
        self._delay = {p: backward_passes_per_step for p in order}
        self._next = 0  # the first bucket not started yet
        self._should_synchronize = True
        self._synchronized = False
        self._hooks = []
        if size > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in order]

    # -- hooks ------------------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            b = self._buckets[self._bucket_of[p]]
            b.waiting -= 1
            if b.waiting == 0:
                self._start_ready()

    def _start_ready(self) -> None:
        """Start every ready bucket from the first one not started, in order."""
        while self._next < len(self._buckets) and self._buckets[self._next].waiting == 0:
            self._start(self._buckets[self._next])
            self._next += 1

    def _start(self, b: Bucket) -> None:
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                 for p in b.params]
        cast = self._compression.dtype
        # cast piece by piece: no full-precision copy of the bucket first
        b.buffer = torch.cat([g if cast is None else g.to(cast) for g in grads])
        b.work = self._allreduce_async(b.buffer)

    # -- Horovod's interface ----------------------------------------------------------------------
    def set_backward_passes_per_step(self, passes: int) -> None:
        """Local accumulation passes per allreduce from now on (resets every count)."""
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def synchronize(self) -> None:
        """Start what has not started, wait for every bucket, and write the averaged gradients
        into ``.grad`` (see the module docstring)."""
        if not self._hooks:
            self._synchronized = True
            return
        for b in self._buckets[self._next:]:
            b.waiting = 0
        self._start_ready()
        for b in self._buckets:
            b.work.wait()
            flat = b.buffer.to(b.params[0].dtype).div_(self._size)
            offset = 0
            for p in b.params:
                piece = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
                self._delay[p] = self.backward_passes_per_step
            b.buffer, b.work, b.waiting = None, None, len(b.params)
        self._next = 0
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside it does not synchronize (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize`), then the wrapped step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): the gradients are "
                              "reduced twice", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; refused while an allreduce started by the hooks is in flight
        (its buffer would be reduced into gradients already cleared: Horovod refuses it too)."""
        if any(b.work is not None for b in self._buckets):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(): this is "
                                 "prohibited as it can cause a race condition")
        return super(self.__class__, self).zero_grad(set_to_none)

    def bucket_sizes(self) -> list[int]:
        """Parameter bytes of each bucket, in the order they are reduced."""
        return [b.nbytes for b in self._buckets]


def distributed_optimizer(optimizer: torch.optim.Optimizer, named_parameters,
                          compression: WireCast, backward_passes_per_step: int,
                          allreduce_async: AllreduceAsync, size: int,
                          bucket_bytes: int) -> torch.optim.Optimizer:
    """``optimizer`` rebuilt as a subclass of its own class that reduces its gradients over
    ``size`` ranks in buckets (see the module docstring). Like Horovod's wrapper it is built
    from the optimizer's param groups (its state starts empty: wrap before loading a state).

    Args:
        named_parameters: ``model.named_parameters()`` (the bucket order), or None for the
            param groups' order.
        compression: :class:`Compression`'s ``none``, ``fp16`` or ``bf16``.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        allreduce_async: starts the in-place sum-allreduce of a flat tensor over all ranks.
        size: the world size (1: no hooks, nothing reduced).
        bucket_bytes: largest bucket, bytes of parameters (0: one bucket per parameter).

    Raises:
        ValueError: ``backward_passes_per_step`` < 1.
    """
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _BucketedOptimizer.__dict__.items()
                if k not in ("__dict__", "__weakref__")})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               allreduce_async, size, bucket_bytes)
