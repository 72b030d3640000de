"""torch's CPU threads per rank: the one rule ``hvd-lm train``, ``eval``, ``transfer`` and the tools
that run on ranks apply (the launch templates leave it to them: ``launch/env.sh`` sets only
``OMP_NUM_THREADS=1`` for the libraries beside torch).

Ranks on one machine share its cores. ``--threads 0`` (the default) gives each
``usable cores / ranks on this machine`` threads (at least 1), where the usable cores are this
process's affinity set (a SLURM/cgroup cpuset, ``taskset``, an MPI binding; ``os.cpu_count()``
would count every core of the machine) and the ranks on this machine are counted by the kernel's
boot id (``/proc/sys/kernel/random/boot_id``), not the host name: containers and network
namespaces on one machine (the cluster in a box) have host names of their own but share its
cores. The machine's other work counts too: the default is lowered to the usable cores left idle
(:func:`idle_cores`: ``psutil.cpu_percent`` over the affinity set for :data:`LOAD_SAMPLE_S`,
read after the ranks' gather, while they all wait in it), recorded where the command records its
settings. An explicit ``--threads N`` whose ranks x threads exceed the usable cores is kept,
with one warning line (oversubscribed threads spin against each other; what that cost:
docs/training.md, "Threads").
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import psutil
import torch

from hvd_lm.comm.world import env_int

#: Seconds the default ``--threads 0`` watches the machine's load (:func:`idle_cores`); paid only
#: when a rank's share of the cores is more than one thread.
LOAD_SAMPLE_S = 0.2

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _affinity():
    """The cores this process may run on (every core where there is no affinity set)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return range(os.cpu_count() or 1)


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity set, which ``os.cpu_count()`` (every core
    of the machine) ignores."""
    return len(_affinity())


def idle_cores(seconds: float = LOAD_SAMPLE_S) -> float:
    """How many of this process's usable cores the machine's other work leaves idle: the sum of
    each affinity core's idle fraction over ``seconds`` (``psutil.cpu_percent(percpu=True)``,
    the kernel's per-CPU times in ``/proc/stat``), e.g. 1.0 on a 2-core machine with one other
    busy process. ``HVD_LM_IDLE_CORES=N`` gives N instead of measuring (the tests set it, so that
    no result depends on what else the machine runs).

    Raises:
        LauncherEnvError: ``HVD_LM_IDLE_CORES`` not an integer >= 0.
    """
    fixed = env_int("HVD_LM_IDLE_CORES", 0, 1 << 20, "a count of idle cores")
    if fixed is not None:  # the tests: the same threads whatever else the machine runs
        return float(fixed)
    busy = psutil.cpu_percent(interval=seconds, percpu=True)
    return sum(1 - busy[c] / 100 for c in _affinity() if c < len(busy))


def machine_id() -> str:
    """This machine's identity across containers and network namespaces: the kernel's boot id
    (the host name where there is none)."""
    with contextlib.suppress(OSError), open(BOOT_ID) as f:
        return f.read(64).strip() or socket.gethostname()
    return socket.gethostname()


def ranks_on_this_machine(ctx, collective: bool = True) -> int:
    """How many ranks of the job share this machine's cores: every rank's :func:`machine_id`
    gathered (Horovod: ``allgather_object``; every rank must call it) and this one's counted;
    ``ctx.local_size`` without a collective (an elastic worker before its state's sync)."""
    if ctx is None or ctx.size == 1:
        return 1
    if not collective:
        return ctx.local_size
    from hvd_lm.comm import engine  # (torch on first use: transfer.fit reads usable_cores)
    ids = engine.allgather_object(machine_id(), name="machine_ids")  # collective: allgather
    return max(ctx.local_size, ids.count(machine_id()))


def threads_per_rank(requested: int, ranks_here: int, command: str = "train",
                     warn: bool = False) -> int:
    """torch's intra-op threads for one of ``ranks_here`` ranks on this machine: ``requested``,
    or (0) the usable cores / ``ranks_here``, lowered to the idle cores / ``ranks_here`` when the
    machine's other work holds some (:func:`idle_cores`), at least 1 (silently: the commands
    record their threads, train in its ``start`` record, eval in its JSON; a line on stderr
    would vary with the load). With ``warn``, one line on stderr naming ``hvd-lm COMMAND`` when
    an explicit ``requested`` puts ranks x threads (> 1 each) over the usable cores."""
    cores = usable_cores()
    threads = requested or max(1, cores // ranks_here)
    if not requested and threads > 1:  # the idle cores' share
        threads = min(threads, max(1, int(idle_cores() + 0.5) // ranks_here))
    if warn and threads > 1 and ranks_here * threads > cores:
        print(f"hvd-lm {command}: WARNING: {ranks_here} rank(s) x {threads} threads on "
              f"{socket.gethostname()} exceed its {cores} usable cores: steps can run 20-50x "
              f"slower; use --threads {max(1, cores // ranks_here)} (0 picks that)",
              file=sys.stderr, flush=True)
    return threads


def set_rank_threads(requested: int, ctx, command: str, collective: bool = True) -> int:
    """Apply :func:`threads_per_rank` to torch (``torch.set_num_threads``) for this rank of
    ``ctx`` (None: one process), warning once per machine; returns the threads."""
    here = ranks_on_this_machine(ctx, collective)
    threads = threads_per_rank(requested, here, command, warn=ctx is None or ctx.local_rank == 0)
    torch.set_num_threads(threads)
    return threads
