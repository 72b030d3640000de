"""Every mpi4py call of the project outside the raw-MPI benchmark baseline
(:mod:`benchmarks.baselines`): the world communicator as data_prep's ranks use it.

mpi4py initialises MPI when imported, which only a process started by an MPI launcher (or a
singleton) should do, so :func:`world` imports it on first use, and callers ask
:func:`hvd_lm.comm.world.started_by_mpi` first.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

from hvd_lm.comm.world import env_seconds

#: Seconds the ranks' first barrier may take before the job stops naming the likely cause
#: (``HVD_LM_MPI_CONNECT_TIMEOUT`` overrides: seconds, finite, above 0, at most a week;
#: :func:`hvd_lm.comm.world.env_seconds`).
CONNECT_TIMEOUT_S = 120.0


class MpiUnreachable(RuntimeError):
    """The ranks' first barrier did not complete in time: they cannot reach each other."""


class MpiWorld:
    """``MPI.COMM_WORLD`` with the few collectives data_prep needs (pickled Python objects).

    Raises:
        hvd_lm.comm.world.LauncherEnvError: ``HVD_LM_MPI_CONNECT_TIMEOUT`` is not a number of
            seconds above 0 (``-1``, ``0``, ``abc``, ``nan``): one line naming it and its value,
            before MPI is initialised.
        MpiUnreachable: from the constructor, when the ranks' first barrier (nonblocking,
            polled) does not complete within :data:`CONNECT_TIMEOUT_S`: across hosts OpenMPI
            may pick an interface another host cannot reach (``docker0``) and every collective
            then hangs with no message; this names the fix instead, and aborts the job.
    """

    def __init__(self, connect_timeout_s: float | None = None) -> None:
        # read before MPI starts: a bad value ends every rank with one line, no MPI job to abort
        timeout = connect_timeout_s if connect_timeout_s is not None else env_seconds(
            "HVD_LM_MPI_CONNECT_TIMEOUT", CONNECT_TIMEOUT_S)
        # Imported here, not at module top: importing mpi4py initialises MPI (see the docstring).
        from mpi4py import MPI

        self.communicator = MPI.COMM_WORLD
        self.rank, self.size = self.communicator.Get_rank(), self.communicator.Get_size()
        if self.size > 1:
            self._first_barrier(timeout)

    def _first_barrier(self, timeout: float) -> None:
        request = self.communicator.Ibarrier()
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                text = (f"rank {self.rank} on {socket.gethostname()}: the {self.size} ranks did "
                        f"not reach each other within {timeout:g} s (MPI's first barrier): "
                        "across hosts OpenMPI may use an interface another host cannot reach "
                        "(docker0...); run `hvd-lm doctor --hosts ...` and give mpirun the "
                        "interface it prints (-mca btl_tcp_if_include IF -mca "
                        "oob_tcp_if_include IF), with -x PATH so every rank runs the venv's "
                        "Python")
                print(f"ERROR: {text}", file=sys.stderr, flush=True)
                self.communicator.Abort(1)  # the others wait in the same barrier: end the job
                raise MpiUnreachable(text)  # (Abort does not return)
            time.sleep(0.01)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``obj`` on every rank."""
        return self.communicator.bcast(obj, root=root)

    def allgather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        return self.communicator.allgather(obj)


#: The world communicator (``world()`` initialises MPI on first use).
world = MpiWorld
