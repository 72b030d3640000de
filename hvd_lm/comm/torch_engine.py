"""The torch engine: the part of ``horovod.torch``'s API that :mod:`hvd_lm.comm.engine` calls,
on ``torch.distributed`` (the one caller of it besides the benchmarks' baselines), so that the
same trainer runs without Horovod on any number of ranks (``--backend torch``), and one process
where Horovod is not installed.

* Process group: Gloo for CPU tensors, and on a machine with CUDA, NCCL for CUDA tensors in the
  same group (``init_process_group("cpu:gloo,cuda:nccl")``: metrics, objects and the barrier
  travel on Gloo, gradients on NCCL). Once the steps begin (:func:`begin_steps`) every
  collective waits at most the timeout of :func:`configure` (``--gloo-timeout-s``, default 30 s
  as Horovod's Gloo); before, at startup, as long as the rendezvous (ranks load data and build
  the model at different speeds: a rank 2 s late at the weights' broadcast is no failure, as a
  rank late for Horovod's background negotiation is none). Gloo then raises on the waiting
  rank; NCCL's watchdog aborts the communicator (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, PyTorch's
  default 3: tear the process down) and the launcher reports the rank.
* Rendezvous (where the ranks meet: a ``TCPStore`` rank 0 opens), in this order:
  ``MASTER_ADDR``/``MASTER_PORT`` (torchrun sets them;
  :func:`hvd_lm.comm.world.rendezvous_endpoint`), else under an MPI launcher (mpirun, MPICH,
  srun with PMI) rank 0 opens the store on a free port and sends its host and port to the
  others with one MPI broadcast (DeepSpeed's ``mpi_discovery`` does the same), else under srun
  the first host of the step. The host is resolved first, within
  :data:`hvd_lm.comm.world.RESOLVE_TIMEOUT_S` (a name that does not resolve, or a resolver that
  does not answer, is one line naming ``MASTER_ADDR`` and its value, at once, not a rank silent
  for the rendezvous timeout). Rank, world size and local rank come from
  :func:`hvd_lm.comm.world.from_environment` (torchrun, OpenMPI, MPICH, srun). One process
  without a launcher forms a world of one over an in-memory store.
* Collectives: ``allreduce`` (sum, average, max; average = sum / size), ``allgather`` (ranks may
  hold different first dimensions, as Horovod allows), ``alltoall`` (the 1-bit allreduce),
  ``gather``, ``broadcast_parameters`` / ``broadcast_object``, ``allgather_object``.
* Gradients: :func:`wrap_model` wraps the model in ``torch.nn.parallel.DistributedDataParallel``
  (its reducer: buckets of ``bucket_cap_mb`` whose allreduce starts from backward hooks; PyTorch
  "DistributedDataParallel" design notes; DDP's ``no_sync()`` holds back the windows before a
  step's last: :func:`hvd_lm.comm.engine.no_sync`), and for ``--compression`` torch's
  ``fp16_compress_hook`` / ``bf16_compress_hook``
  (``torch.distributed.algorithms.ddp_comm_hooks``); :func:`keep_gradients_local` switches the
  hook to one that leaves the gradients as they are (a 1-bit optimizer's compressed phase
  reduces its momentum itself). ``DistributedOptimizer`` is then the optimizer itself: the
  gradients are averaged when backward returns.

Elastic training stays Horovod's (its driver re-forms the world; torchrun's elastic agent
restarts every worker from the last checkpoint instead): :data:`elastic` says so.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hvd_lm.comm.world import (
    MPI_FAMILIES,
    RankContext,
    from_environment,
    rendezvous_endpoint,
    resolve_host,
)

# Horovod's reduction ops, by the names hvd_lm looks up.
Average, Sum, Max, Adasum = "average", "sum", "max", "adasum"
_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Max: dist.ReduceOp.MAX}

#: Seconds a collective waits for a peer unless configured (Horovod's Gloo default).
DEFAULT_TIMEOUT_S = 30.0
#: Largest gradient bucket unless configured: DDP's ``bucket_cap_mb`` (25 MiB).
DEFAULT_BUCKET_MB = 25.0
#: Seconds the rendezvous waits for every rank to arrive (ranks start seconds apart).
RENDEZVOUS_TIMEOUT_S = 300.0

#: What :func:`hvd_lm.comm.engine.rank_context` reports as the launcher (set by :func:`init`).
LAUNCHER = "torch"


class RendezvousError(RuntimeError):
    """The ranks could not meet (the message names the endpoint and how it was chosen)."""


_settings = {"timeout_s": DEFAULT_TIMEOUT_S, "bucket_mb": DEFAULT_BUCKET_MB, "local": False}
_ctx = RankContext()


def configure(timeout_s: float | None = None, bucket_mb: float | None = None) -> None:
    """Settings :func:`init` and :func:`wrap_model` use: the collective timeout in seconds
    (None: 30) and the largest gradient bucket in MiB (None: 25, DDP's; 0: one per tensor)."""
    _settings["timeout_s"] = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    _settings["bucket_mb"] = DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)


def timeout_s() -> float:
    """Seconds a collective waits for a peer (:func:`configure`)."""
    return _settings["timeout_s"]


#: Sets a group's timeout after its creation (recent PyTorch; None in older releases).
_SET_TIMEOUT = getattr(dist.distributed_c10d, "_set_pg_timeout", None)


def begin_steps() -> None:
    """From now on every collective of the group waits at most :func:`timeout_s` (until now: the
    rendezvous timeout, 300 s), on Gloo and NCCL alike
    (``torch.distributed.distributed_c10d._set_pg_timeout``); nothing in a world of one."""
    if _SET_TIMEOUT and dist.is_initialized() and dist.get_world_size() > 1:
        _SET_TIMEOUT(timedelta(seconds=timeout_s()))


def _store(ctx: RankContext, rdzv_timeout: timedelta):
    """The TCP store every rank connects to (see the module docstring for where it is)."""
    endpoint = rendezvous_endpoint()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    if endpoint is None and ctx.launcher in MPI_FAMILIES:
        from hvd_lm.comm.mpi import world as mpi_world

        mpi = mpi_world()
        if mpi.size == ctx.size:  # rank 0 opens the store on a free port, MPI tells the others
            store = None
            if ctx.rank == 0:
                store = dist.TCPStore("0.0.0.0", 0, ctx.size, is_master=True,
                                      timeout=rdzv_timeout, wait_for_workers=False)
                # how the others reach rank 0: the IPv4 address of GLOO_SOCKET_IFNAME when set
                # (the doctor exports it), else this host's name (resolved on each peer)
                from hvd_lm.comm.hosts import interfaces

                wanted = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
                addrs = interfaces().get(wanted, {}).get("addrs") if wanted else None
                endpoint = ((addrs or [socket.gethostname()])[0], store.port,
                            f"rank 0 via MPI ({ctx.launcher})")
            endpoint = mpi.bcast(endpoint)
            if store is not None:
                return store, endpoint
    if endpoint is None:
        raise RendezvousError(
            f"--backend torch with {ctx.size} ranks ({ctx.launcher}) needs to know where rank 0 "
            "is: set MASTER_ADDR (rank 0's host) and MASTER_PORT, launch with torchrun, or with "
            "mpirun/srun (MPI tells the ranks)")
    addr, port, source = endpoint
    resolve_host(addr, port, source)  # a name that does not resolve: named now, not in 300 s
    try:
        store = dist.TCPStore(addr, port, ctx.size, is_master=ctx.rank == 0 and not agent,
                              timeout=rdzv_timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RendezvousError(
            f"rank {ctx.rank} on host {socket.gethostname()} cannot "
            f"{'open' if ctx.rank == 0 else 'reach'} the rendezvous {addr}:{port} (from "
            f"{source}) within {rdzv_timeout.total_seconds():g} s: {why}; check it with "
            "`hvd-lm doctor --hosts ... --rendezvous-port PORT`") from None
    if agent:  # the agent's own keys live there too: this attempt's prefix, as torch's env://
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"/worker/attempt_{restart}", store)
    return store, endpoint


def init() -> None:
    """Join the process group (see the module docstring); a second call does nothing.

    Raises:
        RendezvousError: the ranks cannot meet (one line naming the endpoint).
        hvd_lm.comm.world.LauncherEnvError: a launcher variable out of its range
            (``RANK=-1``, ``WORLD_SIZE=0``), a bad ``MASTER_PORT``, or a ``MASTER_ADDR`` that is
            no host name or does not resolve: one line naming the variable and its value.
    """
    global _ctx, LAUNCHER
    if dist.is_initialized():
        return
    ctx = from_environment()
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    rdzv = timedelta(seconds=max(RENDEZVOUS_TIMEOUT_S, timeout_s()))
    if ctx.size == 1:  # nobody to meet
        store, where = dist.HashStore(), "in memory"
    else:
        store, (addr, port, source) = _store(ctx, rdzv)
        where = f"{addr}:{port} from {source}"
    # a torch that cannot change the timeout later waits --gloo-timeout-s at startup too
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.size,
                            timeout=rdzv if _SET_TIMEOUT else timedelta(seconds=timeout_s()))
    # PyTorch's advice: destroy the group before the interpreter exits (left to the static
    # destructors, Gloo's threads could end the process with "terminate called without an
    # active exception" after a finished run: a rank torchrun reported as failed)
    atexit.register(shutdown)
    _ctx = ctx
    LAUNCHER = f"torch ({backend}; {ctx.launcher}; rendezvous {where})"


#: Set by :meth:`hvd_lm.options.Command.invoke` when the command returned 0: the exit may wait
#: for the peers.
ENDED_CLEANLY = False


def shutdown() -> None:
    """Leave the process group (at exit too: :func:`init` registers it). After a command that
    ended cleanly, first a barrier: no rank tears its Gloo connections down while a peer still
    finishes (PyTorch docs, "Shutdown": destroy where communications are no longer needed): a
    rank that left first could abort with "terminate called without an active exception".
    After a failure no barrier: a stalled peer would hold the exit for the collective
    timeout."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a group a lost peer broke: nothing to leave
            if ENDED_CLEANLY:
                dist.barrier()
            dist.destroy_process_group()


rank, size = dist.get_rank, dist.get_world_size


def local_rank() -> int:
    return _ctx.local_rank


def local_size() -> int:
    return _ctx.local_size


def mpi_enabled() -> bool:
    """False: no MPI controller (``hvd.mpi_enabled()``'s question)."""
    return False


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a failed collective (a peer lost, a timeout): torch's ``DistError``
    family, or the ``RuntimeError`` Gloo raises when a peer's connection closes or times out
    (in a collective, or in the store wait of its lazy connect to a stalled peer: "wait timeout
    after 2000ms, keys: //worker/attempt_0/0//cpu//0/0")."""
    return isinstance(exc, dist.DistError) or isinstance(exc, RuntimeError) and any(
        k in str(exc) for k in ("Gloo", "gloo", "Connection closed by peer", "Connection reset",
                                "NCCL", "Timed out waiting", "wait timeout after"))


# ---- collectives --------------------------------------------------------------------------------

def allreduce_async_(tensor: torch.Tensor, op=Average, name: str | None = None) -> tuple:
    """Start an in-place reduction (sum, average or maximum); :func:`synchronize` waits for it.
    The handle: (the work, ``tensor``, the op)."""
    return dist.all_reduce(tensor, op=_OPS[op], async_op=True), tensor, op


def synchronize(handle: tuple) -> torch.Tensor:
    """Wait for :func:`allreduce_async_`'s reduction; its tensor (divided by the ranks for an
    average)."""
    work, tensor, op = handle
    work.wait()
    return tensor.div_(size()) if op == Average else tensor


def allreduce(tensor: torch.Tensor, op=Average, name: str | None = None) -> torch.Tensor:
    """The reduction over ranks (sum, average or maximum) of a copy of ``tensor``."""
    return synchronize(allreduce_async_(tensor.clone(), op))


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order; the first dimensions may
    differ (each is padded to the largest for the collective, then cut back)."""
    n = size()
    tensor = torch.atleast_1d(tensor)
    rows = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    counts = [torch.zeros_like(rows) for _ in range(n)]
    dist.all_gather(counts, rows)
    counts = [int(c) for c in counts]
    top = max(counts)  # (the 1-bit allreduce's every step: equal rows, no copy)
    padded = tensor if len(tensor) == top else torch.cat(
        [tensor, tensor.new_zeros((top - len(tensor), *tensor.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def gather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Rank 0: every rank's ``tensor`` (the same shape on each) concatenated along dim 0 in rank
    order; the other ranks: an empty [0, ...] tensor (``torch.distributed.gather``)."""
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size())] if rank() == 0 else None
    dist.gather(tensor, parts, dst=0)
    return torch.cat(parts) if parts else tensor.new_empty((0, *tensor.shape[1:]))


def allgather_object(obj, name: str | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Rank ``root_rank``'s picklable ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None) -> torch.Tensor:
    """Row block i of ``tensor`` (dim 0 split evenly over the ranks) to rank i; the blocks
    received, in rank order."""
    if splits is not None:
        raise ValueError("the torch engine's alltoall splits dim 0 evenly (splits=None)")
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor.contiguous())
    return out


@torch.no_grad()
def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Overwrite every tensor of ``params`` (a state dict, or (name, tensor) pairs) with rank
    ``root_rank``'s, in place."""
    items = params.items() if hasattr(params, "items") else params
    for _, t in sorted(items, key=lambda kv: kv[0]):
        if isinstance(t, torch.Tensor):
            dist.broadcast(t, src=root_rank)


class Compression:
    """``hvd.Compression``'s names, plus bfloat16 (which Horovod 0.28.1's PyTorch adapter lacks):
    the DDP communication hook each selects (:func:`wrap_model`). fp16 keeps 11 significant bits
    and overflows above 65504; bf16 keeps 8 and has fp32's range."""

    none, fp16, bf16 = "none", "fp16", "bf16"


_HOOKS = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
          "bf16": default_hooks.bf16_compress_hook}


def wrap_model(model: torch.nn.Module, compression: str = "none") -> torch.nn.Module:
    """``model`` in ``DistributedDataParallel`` (buckets of at most the :func:`configure`'d MiB,
    0: one per tensor; the communication hook of ``compression``: "none", "fp16" or "bf16"),
    or ``model`` itself in a world of one (nothing to reduce). The wrapper's construction
    broadcasts rank 0's parameters: every rank calls it at the same point.

    Raises:
        ValueError: an unknown compression.
    """
    if compression not in _HOOKS:
        raise ValueError(f"dist.compression must be one of {list(_HOOKS)}, got {compression!r}")
    _settings["local"] = False
    if size() == 1:
        return model
    device = next(model.parameters()).device
    ddp = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=_settings["bucket_mb"])  # (the LM has no buffers to sync)
    reduce = _HOOKS[compression]

    def hook(state, bucket):  # while keep_gradients_local is on: the bucket handed back as it is
        if _settings["local"]:
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return reduce(state, bucket)  # Horovod's role: the average over the ranks

    ddp.register_comm_hook(None, hook)
    return ddp


def keep_gradients_local() -> None:
    """From the next backward on, the DDP hook leaves each rank's gradients unreduced (a 1-bit
    optimizer's compressed phase), until :func:`wrap_model` wraps a model again. One flag per
    process: a process trains one model at a time."""
    _settings["local"] = True


def DistributedOptimizer(optimizer, named_parameters=None,  # noqa: N802 - Horovod's name
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op=Average):
    """``optimizer`` itself: under DDP (:func:`wrap_model`) the gradients are averaged when
    backward returns, so there is nothing to wait for at the step (the only op:
    :func:`hvd_lm.comm.engine.distributed_optimizer` refuses Adasum, Horovod's, first)."""
    return optimizer


class _NoElastic:
    """``hvd.elastic`` on the torch engine: any use says elastic training is Horovod's."""

    def __getattr__(self, name):
        raise RuntimeError("elastic training is Horovod's (horovodrun --min-np ...): run it "
                           "with --backend horovod, Horovod built (`make setup`, docs/install.md)")


elastic = _NoElastic()
