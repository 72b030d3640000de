"""What a launcher tells a process, and the environment for launching local ranks.

Launchers announce a process's place in the job through environment variables; this module is the
one reader of them (training, eval, transfer, data_prep and the benchmarks all ask here). Families,
tried in this order, each read as a whole (never a rank from one launcher and a size from another):

==============  ====================  ====================  ==========================
launcher        rank                  world size            local rank / local size
==============  ====================  ====================  ==========================
horovodrun      HOROVOD_RANK          HOROVOD_SIZE          HOROVOD_LOCAL_RANK / _SIZE
OpenMPI mpirun  OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK /
                                                            OMPI_COMM_WORLD_LOCAL_SIZE
MPICH / Intel   PMI_RANK              PMI_SIZE              MPI_LOCALRANKID /
                                                            MPI_LOCALNRANKS
SLURM srun      SLURM_PROCID          SLURM_STEP_NUM_TASKS  SLURM_LOCALID /
                                                            SLURM_STEP_TASKS_PER_NODE
torchrun        RANK                  WORLD_SIZE            LOCAL_RANK / LOCAL_WORLD_SIZE
==============  ====================  ====================  ==========================

(OpenMPI: "mpirun(1)" environment variables; MPICH Hydra's PMI variables; SLURM "srun(1)" OUTPUT
ENVIRONMENT VARIABLES; PyTorch "torchrun" docs; Horovod sets its own in ``horovodrun``'s Gloo mode.)
A missing local rank/size falls back to rank/size (one node). Reading the environment needs no MPI
library; :func:`hvd_lm.comm.horovod.init` gives the authoritative values once Horovod is up.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import hvd_lm

#: (name, rank, size, local rank, local size) variables of each launcher family, in lookup order.
LAUNCHER_VARS = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
     "SLURM_STEP_TASKS_PER_NODE"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
)
#: Families that start MPI processes (an MPI library can then be initialised).
MPI_FAMILIES = ("openmpi", "pmi", "slurm")


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0..size-1.
        size: world size (number of ranks).
        local_rank / local_size: rank and rank count on this node (GPU binding: one GPU per local
            rank).
        launcher: the family that announced it (``"horovodrun"``, ``"openmpi"``, ``"pmi"``,
            ``"slurm"``, ``"torchrun"``, ``"horovod"`` once Horovod is initialised), or
            ``"none"`` for a plain process.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    launcher: str = "none"

    @property
    def is_root(self) -> bool:
        """True on rank 0, the rank that logs and writes outputs."""
        return self.rank == 0


def _int(value: str | None) -> int | None:
    """Leading integer of an environment value (SLURM writes ``"2(x3)"``), else None."""
    if value is None:
        return None
    m = re.match(r"\s*(\d+)", value)
    return int(m.group(1)) if m else None


def from_environment(environ: Mapping[str, str] | None = None) -> RankContext:
    """The :class:`RankContext` the launcher's environment announces (``rank 0 of 1`` when none
    does). A family counts only when its world-size variable is set.

    Raises:
        ValueError: a family's variables are inconsistent (rank outside 0..size-1), naming them.
    """
    env = os.environ if environ is None else environ
    for family, rank_v, size_v, lrank_v, lsize_v in LAUNCHER_VARS:
        size = _int(env.get(size_v))
        if size is None or size < 1:
            continue
        rank = _int(env.get(rank_v))
        rank = 0 if rank is None else rank
        local_rank = _int(env.get(lrank_v))
        local_size = _int(env.get(lsize_v))
        if not 0 <= rank < size:
            raise ValueError(f"launcher environment: {rank_v}={env.get(rank_v)!r} is outside "
                             f"0..{size - 1} ({size_v}={env.get(size_v)!r})")
        return RankContext(rank, size, rank if local_rank is None else local_rank,
                           size if local_size is None else local_size, family)
    return RankContext()


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """World size announced by the launcher's environment, 1 when none does."""
    return from_environment(environ).size


#: torchrun's default rendezvous port (``--master-port``), the torch engine's too.
DEFAULT_MASTER_PORT = 29500


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list (``n[01-03,7],m1`` -> ``n01``; ``scontrol show
    hostnames`` lists them in this order, and srun's block distribution puts task 0 there).

    Raises:
        ValueError: an empty or malformed list.
    """
    m = re.match(r"\s*([^,\[\s]+)(?:\[(\d+)[^\]]*\])?", nodelist or "")
    if not m:
        raise ValueError(f"SLURM host list {nodelist!r} names no host")
    return m.group(1) + (m.group(2) or "")


def rendezvous_endpoint(environ: Mapping[str, str] | None = None) -> tuple[str, int, str] | None:
    """Where the torch engine's ranks meet (the TCP store rank 0 opens), from the environment:
    ``(address, port, source)``, or None when the environment does not say (the engine then
    asks the MPI launcher: :func:`hvd_lm.comm.torch_engine.init`).

    * ``MASTER_ADDR`` (torchrun sets it; with mpirun or srun set it to rank 0's host) with
      ``MASTER_PORT`` (default :data:`DEFAULT_MASTER_PORT`);
    * under srun without it: the first host of ``SLURM_STEP_NODELIST`` (where block
      distribution runs task 0) and ``MASTER_PORT``, else 29500 + ``SLURM_JOB_ID`` mod 1000 (two
      jobs sharing a node do not pick the same port).

    Raises:
        ValueError: ``MASTER_PORT`` is not a port number (naming it).
    """
    env = os.environ if environ is None else environ
    port_text = env.get("MASTER_PORT", "").strip()
    port = None
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"MASTER_PORT={port_text!r} is not a TCP port (1..65535)")
        port = int(port_text)
    if env.get("MASTER_ADDR", "").strip():
        return env["MASTER_ADDR"].strip(), port or DEFAULT_MASTER_PORT, "MASTER_ADDR"
    nodelist = env.get("SLURM_STEP_NODELIST") or ""
    if from_environment(env).launcher == "slurm" and nodelist:
        job = _int(env.get("SLURM_JOB_ID")) or 0
        return (first_slurm_host(nodelist), port or DEFAULT_MASTER_PORT + job % 1000,
                "SLURM_STEP_NODELIST")
    return None


def started_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPI launcher (OpenMPI, MPICH/Intel PMI, srun) started this process with more
    than one rank, so that an MPI library can be initialised (mpi4py, Horovod's MPI controller)."""
    ctx = from_environment(environ)
    return ctx.size > 1 and ctx.launcher in MPI_FAMILIES


def under_openmpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when OpenMPI's ``mpirun`` (directly, or as ``horovodrun --mpi`` runs it) started this
    process, whatever the world size: its ``OMPI_COMM_WORLD_SIZE`` is set. Such a process must
    expect mpirun's teardown on SIGTERM/SIGINT (:class:`hvd_lm.train.log.StopSignals`)."""
    env = os.environ if environ is None else environ
    return "OMPI_COMM_WORLD_SIZE" in env


def _proc_ppid(pid: int) -> int | None:
    """Parent PID of ``pid`` from ``/proc/<pid>/stat`` (Linux), None when unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _proc_cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def horovodrun_mpi_shell() -> int | None:
    """PID of the ``/bin/sh -c mpirun ...`` that ``horovodrun --mpi`` turns into (Horovod 0.28.1
    ``runner/mpi_run.py``: ``os.execve('/bin/sh', ['/bin/sh', '-c', mpirun_command])``) when this
    rank was started by it on this node (this rank's parent is mpirun, mpirun's parent that
    shell), else None.

    A signal sent to ``horovodrun --mpi`` (that shell) kills only the shell: mpirun and the ranks
    never see it. Ranks therefore watch this PID (:class:`hvd_lm.train.log.StopSignals`) and
    treat its disappearance like SIGTERM.
    """
    mpirun = os.getppid()
    if Path((_proc_cmdline(mpirun) or [""])[0]).name not in ("mpirun", "mpiexec", "orterun"):
        return None
    shell = _proc_ppid(mpirun)
    cmd = _proc_cmdline(shell) if shell else []
    if len(cmd) >= 3 and Path(cmd[0]).name in ("sh", "dash", "bash") and cmd[1] == "-c" \
            and cmd[2].lstrip().startswith("mpirun"):
        return shell
    return None


def local_mpi_env(**extra: str) -> dict[str, str]:
    """Environment for ranks launched on this machine by ``mpirun``/``horovodrun`` (tests,
    benchmarks, the demo): this interpreter's bin folder first on ``PATH``, the repository on
    ``PYTHONPATH``, one OpenMP thread per rank unless set, OpenMPI allowed to run as root and in
    containers (no ptrace single-copy), and ``OMPI_MCA_mpi_yield_when_idle=1``: with ranks sharing
    cores, OpenMPI's busy-polling in Horovod's MPI controller steals the compute threads' cores
    (measured 4.7x slower 2-rank steps on 2 cores). ``extra`` is applied last."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    repo = str(hvd_lm.REPO_ROOT)
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.update(extra)
    return env


#: Variables ``mpirun`` forwards to ranks on other hosts (``-x``), by name or prefix (Horovod docs,
#: "Running Horovod": ``-x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH``); OpenMPI forwards OMPI_*.
FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "OMP_", "HOROVOD_", "NCCL_",
             "GLOO_", "MASTER_", "HVD_LM_")


def mpirun_argv(np_: int, argv: list[str], hosts: str = "", network_interface: str = "",
                env: Mapping[str, str] | None = None) -> list[str]:
    """``mpirun -np N`` with Horovod's recommended OpenMPI flags (docs "Running Horovod": no
    binding, slots in order, ob1 PML, no openib BTL), then this interpreter and ``argv``.

    Args:
        hosts: ``host:slots,...`` (``-H``); '' = this node. With hosts, every variable of ``env``
            (default: this process's) named in :data:`FORWARDED` is passed on with ``-x``.
        network_interface: the interface OpenMPI's TCP BTL and out-of-band channel use across
            hosts (``btl_tcp_if_include``, ``oob_tcp_if_include``: what ``hvd-lm doctor``
            prints); '' = OpenMPI's choice, which a docker0 on the hosts makes hang.
    """
    cmd = ["mpirun", "-np", str(np_)]
    if hosts:
        cmd += ["-H", hosts]
        names = sorted(n for n in (os.environ if env is None else env)
                       if n in FORWARDED or n.startswith(tuple(x for x in FORWARDED
                                                               if x.endswith("_"))))
        cmd += [w for n in names for w in ("-x", n)]
    if network_interface:
        cmd += ["-mca", "btl_tcp_if_include", network_interface,
                "-mca", "oob_tcp_if_include", network_interface]
    return cmd + ["-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl",
                  "^openib", sys.executable, *argv]


def horovodrun_argv(np_: int, argv: list[str], controller: str = "gloo", hosts: str = "",
                    network_interface: str = "") -> list[str]:
    """``horovodrun -np N -H localhost:N --gloo|--mpi`` with this interpreter and ``argv``
    (the ``horovodrun`` beside this interpreter when there is one); ``hosts`` (``host:slots,...``)
    instead of localhost, ``network_interface`` as ``--network-interface``."""
    here = Path(sys.executable).parent / "horovodrun"
    hr = str(here) if here.exists() else "horovodrun"
    nic = ["--network-interface", network_interface] if network_interface else []
    return [hr, "-np", str(np_), "-H", hosts or f"localhost:{np_}", f"--{controller}", *nic,
            sys.executable, *argv]
