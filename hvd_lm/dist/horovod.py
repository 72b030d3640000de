"""Everything Horovod, in one place: the training loop calls only this module for collectives.

Follows Horovod's ``examples/pytorch`` scripts and its docs ("Horovod with PyTorch", "Tensor
Fusion", "Adasum"):

* :func:`init` maps our fusion/cycle-time settings onto ``HOROVOD_FUSION_THRESHOLD`` (bytes) and
  ``HOROVOD_CYCLE_TIME`` (ms), which Horovod reads at ``hvd.init()``, then calls it. Works under
  ``horovodrun`` (Gloo or MPI controller), plain ``mpirun``, and as one process with no launcher.
* :func:`distributed_optimizer` wraps the optimiser in ``hvd.DistributedOptimizer`` with fp16
  compression, ``backward_passes_per_step`` and Average or Adasum.
* :func:`broadcast_state` broadcasts parameters and optimiser state from rank 0.
* :func:`clip_and_step` is the documented way to clip with Horovod: ``synchronize()`` (wait for the
  allreduce), unscale (mixed precision), clip, then ``step()`` inside ``skip_synchronize()``.
* :func:`allreduce_sum` / :func:`allgather` for metrics and checkpointed per-rank state.
"""

from __future__ import annotations

import os
import time

import torch

from hvd_lm.core.units import MIB
from hvd_lm.dist.launcher import RankContext

#: Horovod 0.28.1's defaults (horovod/common/operations.cc): fusion threshold, bytes; cycle, ms.
HOROVOD_DEFAULT_FUSION_BYTES = 128 * MIB
HOROVOD_DEFAULT_CYCLE_MS = 1.0


def _hvd():
    # Imported on first use: `hvd-lm --help`, prepare, launch rendering and the CPU-only tools run
    # without loading Horovod's extension (and its MPI/Gloo libraries).
    import horovod.torch as hvd

    return hvd


def init(fusion_threshold_mb: float | None = None, cycle_time_ms: float | None = None
         ) -> RankContext:
    """Set Horovod's tensor-fusion knobs, then ``hvd.init()``.

    Args:
        fusion_threshold_mb: fusion buffer size in MiB -> ``HOROVOD_FUSION_THRESHOLD`` in bytes
            (Horovod's default is 128 MiB; 0 disables fusion). None keeps the environment's value.
        cycle_time_ms: how long Horovod's background thread waits to batch tensors, in ms ->
            ``HOROVOD_CYCLE_TIME`` (default 1 ms in 0.28). None keeps the environment's value.
    """
    if fusion_threshold_mb is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_threshold_mb * MIB))
    if cycle_time_ms is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = str(cycle_time_ms)
    hvd = _hvd()
    hvd.init()
    return RankContext(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "horovod")


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                          compression: str = "fp16", backward_passes_per_step: int = 1,
                          allreduce_op: str = "average") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` in ``hvd.DistributedOptimizer``.

    Args:
        compression: ``"fp16"`` (gradients cast to fp16 for the allreduce, as the reference) or
            ``"none"``.
        backward_passes_per_step: local accumulation steps per allreduce.
        allreduce_op: ``"average"`` or ``"adasum"`` (Maleki et al. 2020; Horovod docs "AdaSum").

    Raises:
        ValueError: unknown compression or op.
    """
    hvd = _hvd()
    comps = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
    ops = {"average": hvd.Average, "adasum": hvd.Adasum}
    if compression not in comps:
        raise ValueError(f"dist.compression must be one of {list(comps)}, got {compression!r}")
    if allreduce_op not in ops:
        raise ValueError(f"dist.allreduce_op must be one of {list(ops)}, got {allreduce_op!r}")
    return hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=comps[compression],
        backward_passes_per_step=backward_passes_per_step, op=ops[allreduce_op])


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    root_rank: int = 0) -> None:
    """Make every rank start from rank ``root_rank``'s parameters and optimiser state."""
    hvd = _hvd()
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    if optimizer is not None:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Rank ``root_rank``'s ``obj`` (any picklable value) on every rank."""
    return _hvd().broadcast_object(obj, root_rank=root_rank, name=name)


def clip_and_step(optimizer, params, max_norm: float, scaler=None, check_finite: bool = True
                  ) -> tuple[bool, float, float]:
    """Finish one optimiser step the Horovod way, skipping it when gradients are not finite.

    Order (Horovod docs, "Gradient clipping"; torch.amp docs, "Working with unscaled gradients"):
    ``optimizer.synchronize()`` waits for the gradient allreduce; ``scaler.unscale_`` (fp16);
    ``clip_grad_norm_`` (foreach: multi-tensor kernels); ``step()`` inside
    ``optimizer.skip_synchronize()``; ``scaler.update()``.
    Every rank holds the same averaged gradients, so every rank takes the same skip decision.

    Args:
        params: the parameters to clip (list of tensors).
        max_norm: clip threshold for the global L2 norm (0 = no clipping).
        scaler: a ``torch.amp.GradScaler`` (fp16 on CUDA) or None.
        check_finite: without a scaler, skip the step when the gradient norm is inf/NaN.

    Returns:
        (applied, grad_norm, seconds spent waiting in ``synchronize()`` for the allreduce).
    """
    t0 = time.perf_counter()
    optimizer.synchronize()
    wait = time.perf_counter() - t0
    if scaler is not None:
        scaler.unscale_(optimizer)
    # foreach: the norms of all gradients in one multi-tensor kernel (and one scaling kernel),
    # not one kernel per parameter (torch.nn.utils docs, clip_grad_norm_ / get_total_norm).
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm(
            [p.grad.detach() for p in params if p.grad is not None], foreach=True)
    norm_f = float(norm)  # the step's one host sync: every rank must take the same skip decision
    with optimizer.skip_synchronize():
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)  # skips internally on inf/NaN gradients
            scaler.update()
            applied = scaler.get_scale() >= before
        elif check_finite and not torch.isfinite(norm):
            applied = False
        else:
            optimizer.step()
            applied = True
    return applied, norm_f, wait


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64), e.g. NLL bits and char counts."""
    t = torch.tensor(values, dtype=torch.float64)
    return _hvd().allreduce(t, op=_hvd().Sum, name=name).tolist()


def allgather(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Concatenation over ranks along dim 0 (rank order) of each rank's ``tensor``."""
    return _hvd().allgather(tensor.contiguous(), name=name)


def barrier() -> None:
    """Wait for every rank (a tiny allreduce: works with every controller)."""
    allreduce_sum([0.0], name="barrier")


def shutdown() -> None:
    """``hvd.shutdown()``."""
    _hvd().shutdown()


# ---- raw collectives for the benchmarks (hvd_lm.perf.bench_allreduce) -------------------------

def controller() -> str:
    """The controller Horovod runs with after :func:`init`: ``"mpi"`` or ``"gloo"``."""
    return "mpi" if _hvd().mpi_enabled() else "gloo"


def allreduce_inplace(tensor: torch.Tensor, name: str, op: str = "sum",
                      compression: str = "none") -> None:
    """``hvd.allreduce_`` of ``tensor`` in place (op ``sum`` or ``average``); with
    ``compression="fp16"`` the tensor is cast to float16 around the allreduce, as
    ``hvd.Compression.fp16`` does inside ``DistributedOptimizer``."""
    hvd = _hvd()
    hop = {"sum": hvd.Sum, "average": hvd.Average}[op]
    if compression == "fp16":
        c = tensor.to(torch.float16)
        hvd.allreduce_(c, op=hop, name=name)
        tensor.copy_(c)
    else:
        hvd.allreduce_(tensor, op=hop, name=name)


def allreduce_group(tensors: list[torch.Tensor], prefix: str, op: str = "average") -> None:
    """Allreduce a list of tensors in place the way ``DistributedOptimizer`` does: an
    ``allreduce_async_`` on each (Horovod's background thread fuses what is ready together), then
    ``synchronize`` on each."""
    hvd = _hvd()
    hop = {"sum": hvd.Sum, "average": hvd.Average}[op]
    handles = [hvd.allreduce_async_(t, op=hop, name=f"{prefix}.{i}")
               for i, t in enumerate(tensors)]
    for h in handles:
        hvd.synchronize(h)


def allreduce_max(value: float, name: str) -> float:
    """Maximum of ``value`` over all ranks."""
    hvd = _hvd()
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max,
                               name=name)[0])
