"""Every mpi4py call of the project outside the raw-MPI benchmark baseline
(:mod:`hvd_lm.perf.baselines`): the world communicator as data_prep's ranks use it.

mpi4py initialises MPI when imported, which only a process started by an MPI launcher (or a
singleton) should do, so :func:`world` imports it on first use, and callers ask
:func:`hvd_lm.comm.world.started_by_mpi` first.
"""

from __future__ import annotations

from typing import Any


class MpiWorld:
    """``MPI.COMM_WORLD`` with the few collectives data_prep needs (pickled Python objects)."""

    def __init__(self) -> None:
        # Imported here, not at module top: importing mpi4py initialises MPI (see the docstring).
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        """Wait for every rank."""
        self.comm.Barrier()

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``obj`` on every rank."""
        return self.comm.bcast(obj, root=root)

    def allgather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        return self.comm.allgather(obj)


def world() -> MpiWorld:
    """The world communicator (initialises MPI on first use)."""
    return MpiWorld()
