"""The peers Horovod is measured against, called directly: raw MPI through mpi4py and
``torch.distributed`` (gloo), for ``python -m benchmarks allreduce`` and ``python -m benchmarks
train``.

This is the one module of the benchmarks that calls mpi4py and ``torch.distributed`` itself:
they are the baselines, so they must not go through :mod:`hvd_lm.comm`. Ranks are started by
``mpirun``; rank and world size come from :func:`hvd_lm.comm.world.from_environment`, and
torch's rendezvous from ``MASTER_ADDR``/``MASTER_PORT`` set by the driver.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from hvd_lm.comm.world import from_environment


class MpiComm:
    """Raw MPI (mpi4py ``COMM_WORLD``): in-place sum-allreduce, grouped non-blocking allreduce,
    max over ranks."""

    def __init__(self) -> None:
        # Imported here: mpi4py initialises MPI at import, which only an mpirun-started process
        # (or a singleton) can do; the rest of this module must stay importable without MPI.
        from mpi4py import MPI

        self.MPI, self.communicator = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.communicator.Get_rank(), self.communicator.Get_size()

    def allreduce(self, t: torch.Tensor, *_) -> None:
        """``Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`` of a float32 CPU tensor (no compression:
        Horovod's compression and name arguments are ignored)."""
        self.communicator.Allreduce(self.MPI.IN_PLACE, t.numpy(), op=self.MPI.SUM)

    def allreduce_group(self, tensors: list[torch.Tensor], *_) -> None:
        """Non-blocking ``Iallreduce`` on each tensor, then ``Waitall`` (MPI-3)."""
        reqs = [self.communicator.Iallreduce(self.MPI.IN_PLACE, t.numpy(), op=self.MPI.SUM)
                for t in tensors]
        self.MPI.Request.Waitall(reqs)

    def max(self, x: float) -> float:
        """Maximum of ``x`` over ranks."""
        return self.communicator.allreduce(x, op=self.MPI.MAX)

    def close(self) -> None:
        """Nothing to do (MPI finalises at exit)."""


class TorchGlooComm:
    """``torch.distributed`` with the gloo backend (``init_process_group`` from the launcher's
    rank and size)."""

    def __init__(self) -> None:
        ctx = from_environment()
        self.rank, self.size = ctx.rank, ctx.size
        tdist.init_process_group("gloo", rank=self.rank, world_size=self.size)

    def allreduce(self, t: torch.Tensor, *_) -> None:
        """``all_reduce`` (sum) in place (no compression: as :meth:`MpiComm.allreduce`)."""
        tdist.all_reduce(t)

    def allreduce_group(self, tensors: list[torch.Tensor], *_) -> None:
        """``all_reduce(async_op=True)`` on each tensor, then ``wait`` on each."""
        works = [tdist.all_reduce(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()

    def max(self, x: float) -> float:
        """Maximum of ``x`` over ranks."""
        t = torch.tensor([x], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t[0])

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        tdist.all_reduce(t)
        return t.tolist()

    def close(self) -> None:
        """A barrier, then ``destroy_process_group`` (a rank that tears its Gloo connections
        down while a peer still finishes can abort both: :func:`hvd_lm.comm.torch_engine.
        shutdown`)."""
        tdist.barrier()
        tdist.destroy_process_group()


def ddp(model: torch.nn.Module, comm: TorchGlooComm) -> torch.nn.Module:
    """``DistributedDataParallel`` over an initialised :class:`TorchGlooComm` (CPU)."""
    del comm  # the process group it initialised is the default one DDP uses
    return torch.nn.parallel.DistributedDataParallel(model)
