"""The engine facade: every collective of the project goes through this module, on the engine
chosen once per process (``--backend``, :func:`use_backend`): Horovod (``horovod.torch``, the
default; Horovod's ``examples/pytorch`` and docs "Horovod with PyTorch", "Tensor Fusion",
"Adasum") or the torch engine (:mod:`hvd_lm.comm.torch_engine`: torch.distributed and DDP),
which also runs one process where Horovod is not installed (a world of one). What only
Horovod has (Adasum, elastic training) says so when asked of the torch engine.

* :func:`init`: fusion and cycle time to ``HOROVOD_FUSION_THRESHOLD`` (bytes) and
  ``HOROVOD_CYCLE_TIME`` (ms), read at ``hvd.init()``; the torch engine's bucket and timeout.
* :func:`wrap_model`, :func:`no_sync`, :func:`distributed_optimizer`: the model the step calls
  (DDP on the torch engine), the windows that only accumulate, and ``hvd.DistributedOptimizer``
  (compression, ``backward_passes_per_step``, Average or Adasum).
* :func:`synchronize` / :func:`skip_synchronize`: the step's two calls on a distributed
  optimizer (Horovod docs, "Gradient clipping"); nothing for a plain one.
* :func:`broadcast_state`, :func:`allreduce_sum`, :func:`allreduce_max_each`,
  :func:`allgather`, :func:`gather`: rank 0's start, metrics, per-rank state gathered to the
  checkpoint's writer.
* :func:`alltoall`: what the 1-bit allreduce
  (:func:`hvd_lm.comm.onebit_compression.compressed_allreduce`) sends.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel

from hvd_lm.comm import world
from hvd_lm.comm.world import (  # noqa: F401 - BACKENDS, BACKEND_HELP: here too
    BACKEND_HELP,
    BACKENDS,
    RankContext,
    env_seconds,
    from_environment,
    world_size,
)
from hvd_lm.formats.checkpoint import to_host
from hvd_lm.util.units import MIB

#: Horovod 0.28.1's defaults (horovod/common/operations.cc): fusion threshold, bytes; cycle, ms.
HOROVOD_DEFAULT_FUSION_BYTES = 128 * MIB
HOROVOD_DEFAULT_CYCLE_MS = 1.0


class HorovodMissing(RuntimeError):
    """Horovod is not installed and the launcher announces more than one rank."""


_backend = "horovod"


def use_backend(name: str) -> None:
    """Run this process's collectives on ``name`` (one of :data:`BACKENDS`); call it before
    :func:`init` (which takes it as ``backend=``).

    Raises:
        ValueError: an unknown name.
    """
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name != _backend:
        _backend = name
        _hvd.cache_clear()


@functools.cache
def _hvd():
    # Resolved once per process (every collective calls this; a failing import would otherwise
    # search sys.path again at each one). Imported on first use: `hvd-lm --help`, prepare,
    # launch rendering and the CPU-only tools run
    # without loading Horovod's extension (and its MPI/Gloo libraries). Without Horovod, one
    # process runs on the torch engine, as the one rank of its world.
    if _backend != "torch":
        try:
            import horovod.torch as hvd
            return hvd
        except ImportError as e:
            if _backend == "horovod" and (n := world_size()) > 1:
                raise HorovodMissing(f"Horovod is not installed ({e}), and the launcher started "
                                     f"{n} ranks: build it with `make setup` (docs/install.md), "
                                     "run with --backend torch, or run one process") from None
    from hvd_lm.comm import torch_engine as hvd
    return hvd


def engine_name() -> str:
    """The engine this process's collectives run on: ``"horovod"`` or ``"torch"`` (also one
    process without Horovod installed)."""
    return "torch" if _hvd().__name__ == "hvd_lm.comm.torch_engine" else "horovod"


#: Horovod 0.28.1's default for HOROVOD_GLOO_TIMEOUT_SECONDS (horovod/common/gloo/gloo_context.cc)
HOROVOD_DEFAULT_GLOO_TIMEOUT_S = 30


def init(fusion_threshold_mb: float | None = None, cycle_time_ms: float | None = None,
         gloo_timeout_s: float | None = None, backend: str | None = None) -> RankContext:
    """Set Horovod's tensor-fusion knobs and Gloo's timeout, then ``hvd.init()``.

    Args:
        fusion_threshold_mb: fusion buffer, MiB -> ``HOROVOD_FUSION_THRESHOLD`` in bytes
            (default 128 MiB; 0: no fusion); the torch engine: DDP's ``bucket_cap_mb`` (25).
        cycle_time_ms: Horovod's batching wait, ms -> ``HOROVOD_CYCLE_TIME`` (default 1 ms).
        gloo_timeout_s: seconds a Gloo operation (rendezvous, every collective of the Gloo
            controller) waits for a peer -> ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (whole seconds,
            rounded up; default 30). None keeps the environment's value. The torch engine: the
            timeout of every Gloo and NCCL collective once :func:`begin_steps` is called (the
            same default).
        backend: the engine (:func:`use_backend`); None keeps the one chosen.

    Raises:
        HorovodMissing: Horovod is asked for, not installed, and there are several ranks.
        hvd_lm.comm.world.LauncherEnvError: a launcher variable holds what no launcher writes
            (``RANK=-1``, ``WORLD_SIZE=0``), naming it.
        hvd_lm.comm.torch_engine.RendezvousError: the torch engine's ranks cannot meet.
    """
    if backend is not None:
        use_backend(backend)
    from_environment()  # the launcher's variables read strictly first (LauncherEnvError)
    if fusion_threshold_mb is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_threshold_mb * MIB))
    if cycle_time_ms is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = str(cycle_time_ms)
    if gloo_timeout_s is not None:
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(math.ceil(gloo_timeout_s))
    hvd = _hvd()
    if hasattr(hvd, "configure"):  # the torch engine's knobs
        hvd.configure(gloo_timeout_s if gloo_timeout_s is not None else
                      env_seconds("HOROVOD_GLOO_TIMEOUT_SECONDS", None), fusion_threshold_mb)
    hvd.init()  # Horovod
    return rank_context()


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                          compression: str = "fp16", backward_passes_per_step: int = 1,
                          allreduce_op: str = "average") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` in ``hvd.DistributedOptimizer`` (its gradient hooks start the allreduce
    of each gradient as soon as it is ready; tensor fusion batches them). The 1-bit optimisers
    are wrapped by :class:`hvd_lm.train.optim.OnebitDistributedOptimizer`, which calls
    this for its warmup.

    Args:
        compression: ``"fp16"`` (gradients cast to fp16 for the allreduce, as the reference),
            ``"bf16"`` (the torch engine only: Horovod 0.28.1's PyTorch adapter has no bfloat16)
            or ``"none"``.
        backward_passes_per_step: local accumulation steps per allreduce.
        allreduce_op: ``"average"`` or ``"adasum"`` (Maleki et al. 2020; Horovod docs "AdaSum";
            Horovod only).

    Returns:
        The wrapped optimiser; ``hvd_lm_wire_bytes`` on it holds the bytes one rank sends per
        step (ring allreduce of every gradient: 2(n-1)/n of their bytes, 2 bytes per value with
        fp16 or bf16).

    Raises:
        ValueError: unknown compression or op, or one the engine does not have (naming it).
    """
    hvd = _hvd()
    comps = {c: getattr(hvd.Compression, c, None) for c in ("none", "fp16", "bf16")}
    ops = {"average": hvd.Average, "adasum": hvd.Adasum}
    if compression not in comps:
        raise ValueError(f"dist.compression must be one of {list(comps)}, got {compression!r}")
    if comps[compression] is None:
        raise ValueError("dist.compression bf16 needs --backend torch: Horovod 0.28.1's PyTorch "
                         "adapter has no bfloat16 (horovod#4049, unmerged)")
    if allreduce_op not in ops:
        raise ValueError(f"dist.allreduce_op must be one of {list(ops)}, got {allreduce_op!r}")
    if allreduce_op == "adasum" and engine_name() == "torch":
        raise ValueError("dist.allreduce_op adasum is Horovod's: run it with --backend horovod")
    wrapped = hvd.DistributedOptimizer(  # Horovod
        optimizer, named_parameters=model.named_parameters(), compression=comps[compression],
        backward_passes_per_step=backward_passes_per_step, op=ops[allreduce_op])
    # bytes one rank sends per step: every gradient, 2 bytes per value with fp16 or bf16
    nbytes = sum(p.numel() * (2 if compression in ("fp16", "bf16") else p.element_size())
                 for p in model.parameters() if p.requires_grad)
    wrapped.hvd_lm_wire_bytes = ring_allreduce_wire_bytes(nbytes, hvd.size())
    return wrapped


def wrap_model(model: torch.nn.Module, compression: str = "fp16") -> torch.nn.Module:
    """The module the training step calls: under the torch engine with several ranks the model
    in ``DistributedDataParallel`` with ``compression``'s hook
    (:func:`hvd_lm.comm.torch_engine.wrap_model`); else ``model`` itself (Horovod reduces
    through its ``DistributedOptimizer``'s hooks). Parameters and state dicts stay the
    model's: keep ``model`` for them.

    Raises:
        ValueError: an unknown compression.
    """
    wrap = getattr(_hvd(), "wrap_model", None)
    return model if wrap is None else wrap(model, compression)


def no_sync(model: torch.nn.Module) -> ContextManager[None]:
    """The context of a backward pass that only accumulates (the windows before a step's last):
    DDP's ``no_sync()`` for a :func:`wrap_model` wrapper; nothing for any other model (Horovod's
    ``DistributedOptimizer`` counts ``backward_passes_per_step`` itself; one rank: nothing to
    hold back)."""
    ddp = isinstance(model, DistributedDataParallel)
    return model.no_sync() if ddp else contextlib.nullcontext()


def keep_gradients_local(optimizer) -> None:
    """From the next backward pass on, no gradient allreduce: for an optimizer that reduces
    something else itself (a 1-bit optimizer's compressed phase, until its model is wrapped
    again): Horovod's hooks silenced by a ``backward_passes_per_step`` beyond reach, the torch
    engine's DDP hook handing the buckets back as they are."""
    own = getattr(_hvd(), "keep_gradients_local", None)
    if own is not None:
        own()
    elif getattr(optimizer, "backward_passes_per_step", _NEVER) != _NEVER:
        optimizer.set_backward_passes_per_step(_NEVER)


#: backward_passes_per_step that keeps hvd.DistributedOptimizer's gradient hooks from ever
#: starting an allreduce (each backward pass counts it down by one).
_NEVER = 2 ** 62


def synchronizes(optimizer) -> bool:
    """Whether :func:`synchronize` waits for anything on ``optimizer``: one with Horovod's
    ``synchronize()`` and ``skip_synchronize()`` (Horovod's ``hvd.DistributedOptimizer``, a class
    derived at run time from the wrapped one's, so known by what it has; the 1-bit
    optimizers'); False for a plain torch optimizer (one process; the torch engine's, under
    DDP)."""
    return all(callable(getattr(optimizer, m, None)) for m in ("synchronize", "skip_synchronize"))


def synchronize(optimizer) -> None:
    """Wait until the gradient allreduces that ``optimizer``'s backward hooks started are done
    and their averages are in ``.grad`` (Horovod: ``optimizer.synchronize()``; the 1-bit
    optimizers' the same call); nothing for a plain torch optimizer, whose
    gradients are complete after backward (one process, or DDP)."""
    if synchronizes(optimizer):
        optimizer.synchronize()  # Horovod: wait for the fused gradient allreduce


def skip_synchronize(optimizer) -> ContextManager[None]:
    """The context ``optimizer.step()`` runs in after :func:`synchronize`: Horovod's
    ``optimizer.skip_synchronize()`` (its ``step()`` would otherwise synchronize again, and warn)
    on an optimizer that :func:`synchronizes`; nothing for a plain torch optimizer."""
    # Horovod: the step after an explicit synchronize
    return optimizer.skip_synchronize() if synchronizes(optimizer) else contextlib.nullcontext()


def ring_allreduce_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes`` (reduce-scatter + allgather,
    2(n-1)/n of the buffer; Thakur et al. 2005); 0 for one rank."""
    return 2 * (world_size - 1) * nbytes // world_size


def comm_stats(optimizer) -> dict:
    """``{"wire_bytes": bytes this rank sent through the gradient / momentum collectives in the
    last step}`` (ring allreduce: 2(n-1)/n of the gradient bytes), or what the optimiser's own
    ``comm_stats()`` reports (the 1-bit optimisers: the compressed allreduce's bytes and
    ``"onebit_phase"``). Empty for an optimiser this project did not wrap."""
    own = getattr(optimizer, "comm_stats", None)
    if callable(own):
        return own()
    wire = getattr(optimizer, "hvd_lm_wire_bytes", None)
    return {} if wire is None else {"wire_bytes": wire}


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    root_rank: int = 0) -> None:
    """Every rank gets rank ``root_rank``'s parameters (``broadcast_parameters``) and, given
    ``optimizer``, its optimiser state (``state_dict()``: no collective, the 1-bit optimizers'
    too), as one object (``broadcast_object``, tensors on the host) the other ranks load: they
    need no state of their own, so a resume reads the checkpoint's on rank 0 alone (Horovod's
    ``broadcast_optimizer_state`` would first step a rank without state on zero gradients)."""
    hvd = _hvd()
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)  # Horovod
    if optimizer is not None:
        mine = hvd.rank() == root_rank
        state = to_host(optimizer.state_dict()) if mine else None
        if mine and torch.cuda.is_available():
            torch.cuda.synchronize()  # (to_host copies from a GPU asynchronously)
        state = broadcast_object(state, root_rank, name="optimizer_state")  # Horovod
        if not mine:
            optimizer.load_state_dict(state)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Rank ``root_rank``'s ``obj`` (any picklable value) on every rank."""
    return _hvd().broadcast_object(obj, root_rank=root_rank, name=name)


def _allreduce_floats(values: list[float], name: str, op: str) -> list[float]:
    hvd = _hvd()
    if hvd.size() == 1:  # what Horovod returns for one rank, without its background cycle
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    return hvd.allreduce(t, op=getattr(hvd, op), name=name).tolist()  # Horovod


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64), e.g. NLL bits and char counts."""
    return _allreduce_floats(values, name, "Sum")


def allreduce_max_each(values: list[float], name: str) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (float64; the same length on every
    rank), e.g. each step's slowest rank."""
    return _allreduce_floats(values, name, "Max")


def allreduce_max(value: float, name: str) -> float:
    """Maximum of ``value`` over all ranks."""
    return allreduce_max_each([value], name)[0]


def allgather(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Concatenation over ranks along dim 0 (rank order) of each rank's ``tensor``."""
    return _hvd().allgather(tensor.contiguous(), name=name)


def gather(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Rank 0: every rank's ``tensor`` (the same shape on each) concatenated along dim 0 in rank
    order; the other ranks: an empty [0, ...] tensor. Each rank sends its rows once and rank 0
    alone receives (an allgather hands every rank N x the rows). Horovod has no gather: its
    ``alltoall`` with splits [rows, 0, ..., 0] (Horovod docs, "alltoall"); the torch engine:
    ``torch.distributed.gather``."""
    hvd = _hvd()
    if engine_name() != "horovod":
        return hvd.gather(tensor, name=name)
    splits = torch.tensor([tensor.shape[0]] + [0] * (hvd.size() - 1), dtype=torch.int32)
    return alltoall(tensor, name, splits)


def alltoall(tensor: torch.Tensor, name: str, splits: torch.Tensor | None = None) -> torch.Tensor:
    """Row block i of ``tensor`` (dim 0 cut evenly over the ranks, or by ``splits``) to rank i;
    returns the blocks received, in rank order (``hvd.alltoall``)."""
    out = _hvd().alltoall(tensor.contiguous(), splits=splits, name=name)  # Horovod
    return out[0] if isinstance(out, tuple) else out  # 0.28 returns (tensor, received splits)


def allgather_object(obj, name: str) -> list:
    """Every rank's ``obj`` (picklable), in rank order (``hvd.allgather_object``)."""
    return _hvd().allgather_object(obj, name=name)


def gloo_timeout_s() -> float | None:
    """Seconds a collective of the Gloo controller waits for a lost peer before failing
    (``HOROVOD_GLOO_TIMEOUT_SECONDS``, default 30; the torch engine: its collective timeout,
    ``--gloo-timeout-s``); None under the MPI controller, which has no such timeout (a lost link
    stalls until TCP gives up)."""
    hvd = _hvd()
    if hasattr(hvd, "timeout_s"):
        return hvd.timeout_s()
    if hvd.mpi_enabled():
        return None
    return float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS") or HOROVOD_DEFAULT_GLOO_TIMEOUT_S)


def begin_steps() -> None:
    """The work begins (training's steps; eval's and the transfer commands' batches): the torch
    engine's collectives wait at most ``--gloo-timeout-s`` (30 s unless set) from here
    (:func:`hvd_lm.comm.torch_engine.begin_steps`; at startup as long as its rendezvous).
    Nothing on Horovod: its background thread waits for a late rank without a timeout; only a
    lost peer fails after ``HOROVOD_GLOO_TIMEOUT_SECONDS``."""
    getattr(_hvd(), "begin_steps", lambda: None)()


def timeout_phrase(timeout: float) -> str:
    """What ended a collective that waited ``timeout`` s (:func:`gloo_timeout_s`) for a lost
    peer, as the lost-peer line says it."""
    if engine_name() == "torch":
        return f"torch.distributed gave up after its timeout, --gloo-timeout-s={timeout:g} s"
    return f"Gloo gave up after HOROVOD_GLOO_TIMEOUT_SECONDS={timeout:g} s"


def is_collective_failure(exc: BaseException) -> bool:
    """True for Horovod's ``HorovodInternalError``: a collective failed (a peer lost, a timeout;
    Horovod has shut down), as opposed to an error of this rank's own work (the torch engine:
    :func:`hvd_lm.comm.torch_engine.is_collective_failure`)."""
    own = getattr(_hvd(), "is_collective_failure", None)
    if own is not None:
        return own(exc)
    from horovod.common.exceptions import HorovodInternalError
    return isinstance(exc, HorovodInternalError)


def barrier() -> None:
    """Wait for every rank (a tiny allreduce: works with every controller)."""
    allreduce_sum([0.0], name="barrier")


# ---- raw collectives for the benchmarks (benchmarks.bench_allreduce) -------------------------

def controller() -> str:
    """The controller Horovod runs with after :func:`init`: ``"mpi"`` or ``"gloo"``."""
    return "mpi" if _hvd().mpi_enabled() else "gloo"


def allreduce_inplace(tensor: torch.Tensor, name: str, op: str = "sum",
                      compression: str = "none") -> None:
    """``hvd.allreduce_`` of ``tensor`` in place (op ``sum`` or ``average``); with
    ``compression="fp16"`` the tensor is cast to float16 around the allreduce, as
    ``hvd.Compression.fp16`` does inside ``DistributedOptimizer`` (:func:`allreduce_group` of
    one tensor: Horovod's ``allreduce_`` is ``synchronize(allreduce_async_(...))``)."""
    allreduce_group([tensor], name, op, compression)


def allreduce_group(tensors: list[torch.Tensor], prefix: str, op: str = "average",
                    compression: str = "none") -> None:
    """Allreduce a list of tensors in place the way ``DistributedOptimizer`` does: an
    ``allreduce_async_`` on each (Horovod's background thread fuses what is ready together), then
    ``synchronize`` on each; ``compression="fp16"`` casts each to float16 around it."""
    hvd = _hvd()
    hop = {"sum": hvd.Sum, "average": hvd.Average}[op]
    wire = [t.to(torch.float16) for t in tensors] if compression == "fp16" else tensors
    # Horovod: every allreduce started, then each waited for
    handles = [hvd.allreduce_async_(t, op=hop, name=f"{prefix}.{i}") for i, t in enumerate(wire)]
    for h in handles:
        hvd.synchronize(h)  # Horovod
    if wire is not tensors:
        for t, w in zip(tensors, wire):
            t.copy_(w)


class RootError(RuntimeError):
    """Raised on every rank but 0 when rank 0's part of :func:`root_call` failed (rank 0 prints
    the message: ``quiet``, the command line prints no copy)."""
    quiet = True


def root_call(fn):
    """Run ``fn()`` on rank 0 and make every rank agree on the outcome
    (:func:`hvd_lm.comm.world.root_call`): its result on rank 0 and None elsewhere, or the same
    error everywhere (:class:`RootError` on the other ranks)."""
    return world.root_call(_hvd().rank() == 0, lambda x: broadcast_object(x, name="root_call"),
                           fn, RootError)


# ---- elastic training (Horovod docs, "Elastic Horovod") -----------------------------------------

def rank_context() -> RankContext:
    """This process's place in the job as Horovod has it now (after an elastic reset too)."""
    hvd = _hvd()
    return RankContext(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                       getattr(hvd, "LAUNCHER", "horovod"))


def elastic_state(model: torch.nn.Module, optimizer, **fields):
    """``hvd.elastic.TorchState`` of ``model`` and ``optimizer`` (their state dicts copied to host
    memory at each ``commit()``, restored after a failure, broadcast from rank 0 at each sync)
    plus plain ``fields`` (kept by reference at commit: assign new values, never mutate)."""
    return _hvd().elastic.TorchState(model=model, optimizer=optimizer, **fields)


def elastic_run(fn):
    """``hvd.elastic.run(fn)``: call ``fn(state)``; on ``HorovodInternalError`` (a worker lost)
    restore the last commit, on ``HostsUpdatedInterrupt`` (workers added or removed) keep it;
    then re-form the world (shutdown + init), run the state's reset callbacks, sync from rank 0
    and call ``fn`` again."""
    return _hvd().elastic.run(fn)
