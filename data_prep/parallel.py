"""Where the pipeline runs: ``--workers`` local processes per rank, and optionally several MPI
ranks (``mpirun -np K python -m data_prep prepare ...``).

A phase is a list of independent tasks. :meth:`Context.run` gives task ``i`` to rank
``i % world_size``; each rank runs its share in-process (one worker) or in a
``concurrent.futures.ProcessPoolExecutor`` (several; a worker that dies, e.g. OOM-killed,
fails the phase instead of hanging it), then every rank receives every result (``allgather``),
so all ranks see the same outcome and the same error. MPI (:mod:`hvd_lm.comm.mpi`) is used only
when the launcher's environment says the process was started by an MPI launcher with more than one
rank (:func:`hvd_lm.comm.world.started_by_mpi`), so a plain run needs no MPI library.
"""

from __future__ import annotations

import ctypes
import errno
import multiprocessing as mp
import os
import signal
import sys
import traceback
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Sequence

from tqdm import tqdm

from hvd_lm.comm import mpi
from hvd_lm.comm.world import root_call, started_by_mpi
from hvd_lm.util.atomic import DiskFullError, free_bytes, human

_COUNTER = None  # shared progress counter inside pool workers


class PhaseError(RuntimeError):
    """A task of a phase failed on some rank or worker; the message holds every failure
    (rank, task, error) and is the same on all ranks."""


def _init_worker(counter, parent: int | None) -> None:
    """A pool worker's start: keep the shared progress ``counter``; on Linux, get SIGKILL when
    the parent dies (``prctl(PR_SET_PDEATHSIG)``, prctl(2)), so ``kill -9`` of ``prepare`` never
    leaves workers writing behind a ``--resume``, and exit at once if the parent (``parent``;
    None: a forkserver's child, not checked) is already gone."""
    global _COUNTER
    _COUNTER = counter
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _add_progress(n: int) -> None:
    with _COUNTER.get_lock():
        _COUNTER.value += n


def _call(fn: Callable, task: Any) -> Any:
    return fn(task, _add_progress if _COUNTER is not None else None)


class Context:
    """Rank, world size and local workers of this process.

    Attributes:
        rank, size: MPI rank and world size (0 and 1 without MPI).
        workers: local worker processes per rank (>= 1).
        mpi: the :class:`hvd_lm.comm.mpi.MpiWorld` (the world communicator), or ``None``.
        progress: show tqdm bars (rank 0 only).
        disk: (folder, bytes) named when a task runs out of disk space: the folder the tasks
            write into and an estimate of what the whole job needs there (None: not named).
    """

    def __init__(self, workers: int = 1, progress: bool = True, use_mpi: Optional[bool] = None):
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self.mpi = mpi.world() if use_mpi or (use_mpi is None and started_by_mpi()) else None
        self.rank, self.size = (0, 1) if self.mpi is None else (self.mpi.rank, self.mpi.size)
        self.progress = progress and self.rank == 0
        self.disk: Optional[tuple] = None

    @property
    def is_root(self) -> bool:
        """True on rank 0 (the rank that plans and writes the manifest)."""
        return self.rank == 0

    @property
    def slots(self) -> int:
        """Processes working in parallel over all ranks (world size x workers)."""
        return self.size * self.workers

    def root_call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and return its result on every rank; an exception there is
        raised on every rank (as :class:`PhaseError` elsewhere, as itself on rank 0)."""
        if self.mpi is None:  # the one rank
            return fn()
        return root_call(self.is_root, self.mpi.bcast, fn, PhaseError, share=True)

    def run(self, fn: Callable[[Any, Optional[Callable[[int], None]]], Any], tasks: Sequence,
            desc: str = "", weight: Optional[Callable[[Any], int]] = None) -> list:
        """Run ``fn(task, progress)`` for every task, spread over ranks and workers.

        Args:
            fn: a module-level function (picklable); ``progress`` is ``None`` or a callable
                taking an int (units of ``weight``, e.g. bytes read).
            tasks: picklable task descriptions.
            desc: progress-bar label.
            weight: a task's share of the progress bar in ``fn``'s units (the bar's total is this
                rank's tasks' sum); ``None`` counts tasks.
        Returns:
            Results in task order, on every rank.
        Raises:
            PhaseError: any task failed anywhere (message lists the failures).
        """
        mine = list(range(self.rank, len(tasks), self.size))
        results, errors = {}, []  # task index -> result; failures described
        by_bytes = weight is not None
        total = sum(weight(tasks[i]) for i in mine) if by_bytes else len(mine)

        def make_bar() -> tqdm:  # disabled off rank 0, without tasks, and off a terminal
            label = desc if self.size == 1 else f"{desc} (rank 0 of {self.size})"
            return tqdm(total=total, desc=label,
                        unit="B" if by_bytes else "task", unit_scale=by_bytes, leave=False,
                        dynamic_ncols=True, disable=None if self.progress and mine else True)

        if self.workers == 1 or len(mine) <= 1:
            with make_bar() as bar:
                cb = bar.update if by_bytes and not bar.disable else None
                for i in mine:
                    try:
                        results[i] = fn(tasks[i], cb)
                    except Exception as e:  # noqa: BLE001 - reported on every rank
                        errors.append(self._describe(e, i))
                        break
                    if not by_bytes:
                        bar.update(1)
        else:
            self._run_pool(fn, tasks, mine, results, errors, make_bar, by_bytes)
        if self.mpi is not None:
            gathered = self.mpi.allgather((results, errors))
            results = {i: r for done, _ in gathered for i, r in done.items()}
            errors = [e for _, failed in gathered for e in failed]
        if errors:
            raise PhaseError("; ".join(dict.fromkeys(errors)))  # each distinct message once
        return [results[i] for i in range(len(tasks))]

    def _describe(self, e: BaseException, i: int) -> str:
        where = f"rank {self.rank}: " if self.size > 1 else ""
        if isinstance(e, BrokenProcessPool):
            return (f"{where}a worker process died (killed, or out of memory: lower "
                    "--max-memory-mb or --workers); rerun with --resume to continue")
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
                and not isinstance(e, DiskFullError)):  # a bare "[Errno 28]" names nothing
            folder, needed = self.disk or (e.filename or os.getcwd(), None)
            need = f"the job needs about {human(needed)} there, " if needed else ""
            return (f"{where}{e.filename or folder}: no space left on the device ({need}"
                    f"{human(free_bytes(folder))} free); free space and rerun with --resume to "
                    "continue")
        text = str(e) or type(e).__name__
        if not isinstance(e, (ValueError, OSError, RuntimeError)):
            text = "".join(traceback.format_exception_only(type(e), e)).strip()
        return f"{where}{text}"

    def _run_pool(self, fn, tasks, mine, results, errors, make_bar, by_bytes) -> None:
        method = "forkserver" if self.mpi is not None else "fork"
        if method not in mp.get_all_start_methods():
            method = "spawn"
        ctx = mp.get_context(method)
        counter = ctx.Value("q", 0)
        with ProcessPoolExecutor(max_workers=min(self.workers, len(mine)), mp_context=ctx,
                                 initializer=_init_worker,
                                 initargs=(counter, os.getpid() if method == "fork" else None)
                                 ) as ex:
            futures = {ex.submit(_call, fn, tasks[i]): i for i in mine}
            pending = set(futures)
            # the bar (and tqdm's monitor thread) only after the workers were forked
            with make_bar() as bar:
                while pending:
                    done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
                    for fut in done:
                        try:
                            results[futures[fut]] = fut.result()
                        except Exception as e:  # noqa: BLE001 - includes BrokenProcessPool
                            errors.append(self._describe(e, futures[fut]))
                        if not by_bytes:
                            bar.update(1)
                    if by_bytes and not bar.disable:
                        bar.update(counter.value - bar.n)
                    if errors:
                        ex.shutdown(wait=True, cancel_futures=True)
                        return
