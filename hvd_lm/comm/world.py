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
library; :func:`hvd_lm.comm.engine.init` gives the authoritative values once Horovod is up.

Every value is read strictly (:func:`env_int`, :func:`env_seconds`): an integer in its range (a
world size >= 1, a rank in 0..size-1 and given when size > 1, a port in 1..65535), a duration
finite and above 0 (``HVD_LM_MPI_CONNECT_TIMEOUT``), ``MASTER_ADDR`` a host name that resolves
within :data:`RESOLVE_TIMEOUT_S`; anything else is :class:`LauncherEnvError`, one line naming the
variable and its value (``RANK=-1`` is never rank 0, ``WORLD_SIZE=0`` never a world of one). An
empty variable counts as unset.
"""

from __future__ import annotations

import math
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from hvd_lm.util.files import shown

#: The engines ``--backend`` picks from (:func:`hvd_lm.comm.engine.use_backend`): ``auto`` is
#: Horovod when it imports, else torch.
BACKENDS = ("horovod", "torch", "auto")
#: The ``--backend`` flag's help, the same for every command that runs on ranks.
BACKEND_HELP = ("collective engine: horovod (Horovod), torch (torch.distributed: NCCL on CUDA, "
                "Gloo on CPU; under torchrun, mpirun or srun) or auto (Horovod when installed, "
                "else torch); docs/training.md#two-engines-horovod-and-torchdistributed")

#: (name, rank, size, local rank, local size) variables of each launcher family, in lookup order.
LAUNCHER_VARS = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
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


#: Most ranks a job may announce (torch.distributed and Gloo count ranks in a 32-bit int).
MAX_RANKS = 2**31 - 1


class LauncherEnvError(ValueError):
    """A variable a launcher (or the user, for a launcher) sets holds what no launcher writes: a
    rank that is not an integer or lies outside the world, a world size of 0, a timeout of -1 s,
    a host name with a space. The message is one line naming the variable and its value."""


def _value(env: Mapping[str, str] | None, name: str) -> str | None:
    """``env[name]`` (None: ``os.environ``) stripped, or None when it is unset or empty (a
    template's ``VAR=``)."""
    text = ((os.environ if env is None else env).get(name) or "").strip()
    return text or None


def _named(name: str, value: str) -> str:
    """``NAME='value'`` as an error line shows it (control characters escaped, cut)."""
    return f"{name}={shown(repr(value), 120)}"


def env_int(name: str, lo: int, hi: int, what: str, environ: Mapping[str, str] | None = None,
            context: str = "") -> int | None:
    """The integer in ``lo..hi`` a variable holds, or None when it is unset or empty.

    Args:
        what: what the value is, for the error (``"a rank"``, ``"a TCP port"``).
        context: what the range comes from, appended to the error (``"WORLD_SIZE='2'"``).

    Raises:
        LauncherEnvError: not an integer (``x``, ``1.5``, ``nan``), or outside ``lo..hi``
            (``-1``, ``0`` for a size), naming the variable, its value and the range.
    """
    text = _value(environ, name)
    if text is None:
        return None
    n = int(text) if re.fullmatch(r"[+-]?\d{1,30}", text) else None
    if n is None or not lo <= n <= hi:
        why = f"an integer in {lo}..{hi}" if n is None else f"outside {lo}..{hi}"
        raise LauncherEnvError(f"launcher environment: {_named(name, text)} is not {what}: "
                               f"{why}" + (f" ({context})" if context else ""))
    return n


def env_seconds(name: str, default: float | None, hi: float = 7 * 86400.0,
                environ: Mapping[str, str] | None = None) -> float | None:
    """A duration in seconds a variable holds (``HVD_LM_MPI_CONNECT_TIMEOUT=120``, ``2.5``), or
    ``default`` when it is unset or empty.

    Raises:
        LauncherEnvError: not a number, not finite (``nan``, ``inf``), not above 0, or above
            ``hi`` (a week by default), naming the variable and its value.
    """
    text = _value(environ, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= hi):
        raise LauncherEnvError(f"{_named(name, text)} is not a duration: give seconds, a "
                               f"finite number above 0 and at most {hi:g}"
                               + (f" (unset: {default:g})" if default is not None else ""))
    return value


def _slurm_tasks_on_node(env: Mapping[str, str], name: str, node: int) -> int | None:
    """Tasks on node ``node`` of the step from SLURM's compressed per-node list
    (``SLURM_STEP_TASKS_PER_NODE=2(x3),1``: 2 tasks on each of nodes 0-2, 1 on node 3), read
    without expanding it; None when unset.

    Raises:
        LauncherEnvError: not such a list, or naming fewer nodes than ``node`` + 1.
    """
    text = _value(env, name)
    if text is None:
        return None
    if not re.fullmatch(r"\d{1,9}(\(x\d{1,9}\))?(,\d{1,9}(\(x\d{1,9}\))?)*", text):
        raise LauncherEnvError(f"launcher environment: {_named(name, text)} is not SLURM's "
                               "list of tasks per node (e.g. 2(x3),1)")
    first = 0
    for m in re.finditer(r"(\d+)(?:\(x(\d+)\))?", text):
        first += int(m.group(2) or 1)
        if node < first:
            if int(m.group(1)) < 1:
                break
            return int(m.group(1))
    raise LauncherEnvError(f"launcher environment: {_named(name, text)} names no task count "
                           f">= 1 for node {node} (SLURM_NODEID)")


def from_environment(environ: Mapping[str, str] | None = None) -> RankContext:
    """The :class:`RankContext` the launcher's environment announces (``rank 0 of 1`` when none
    does). A family counts only when its world-size variable is set (and not empty); its
    variables are then read strictly: every one an integer in its range, the rank given when
    the world has more than one rank (SLURM's tasks per node read for this node,
    ``SLURM_NODEID``).

    Raises:
        LauncherEnvError: a world size that is not an integer >= 1 (``WORLD_SIZE=0``, ``x``), a
            rank missing, not an integer or outside 0..size-1 (``RANK=-1``, ``x``), a local
            rank or size out of its range: one line naming the variable and its value.
    """
    env = os.environ if environ is None else environ
    for family, rank_v, size_v, lrank_v, lsize_v in LAUNCHER_VARS:
        size = env_int(size_v, 1, MAX_RANKS, "a world size", env)
        if size is None:
            continue
        of = _named(size_v, env[size_v].strip())
        rank = env_int(rank_v, 0, size - 1, "a rank", env, of)
        if rank is None:
            if size > 1:
                raise LauncherEnvError(f"launcher environment: {of} but {rank_v} is not set: "
                                       f"every rank of {size} would be rank 0")
            rank = 0
        if family == "slurm":
            node = env_int("SLURM_NODEID", 0, MAX_RANKS, "a node index", env) or 0
            local_size = _slurm_tasks_on_node(env, lsize_v, node)
            if local_size is not None and local_size > size:
                raise LauncherEnvError(f"launcher environment: {_named(lsize_v, env[lsize_v])} "
                                       f"gives {local_size} tasks on node {node}, more than {of}")
        else:
            local_size = env_int(lsize_v, 1, size, "a local world size", env, of)
        local_size = size if local_size is None else local_size
        local_rank = env_int(lrank_v, 0, local_size - 1, "a local rank", env,
                             f"{local_size} rank(s) on this node")
        return RankContext(rank, size, rank if local_rank is None else local_rank,
                           local_size, family)
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


#: A host name or address as ``MASTER_ADDR`` may hold it: letters, digits, ``.-_``, an IPv6
#: address's ``:`` (and ``[]``, ``%`` zone); no whitespace (``'127.0.0.1 x'``).
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")


def rendezvous_endpoint(environ: Mapping[str, str] | None = None) -> tuple[str, int, str] | None:
    """Where the torch engine's ranks meet (the TCP store rank 0 opens), from the environment:
    ``(address, port, source)``, or None when the environment does not say (the engine then
    asks the MPI launcher: :func:`hvd_lm.comm.torch_engine.init`).

    * ``MASTER_ADDR`` (torchrun sets it; with mpirun or srun set it to rank 0's host) with
      ``MASTER_PORT`` (default :data:`DEFAULT_MASTER_PORT`);
    * under srun without it: the first host of ``SLURM_STEP_NODELIST`` (where block
      distribution runs task 0) and ``MASTER_PORT``, else 29500 + ``SLURM_JOB_ID`` mod 1000 (two
      jobs sharing a node do not pick the same port).

    The name is checked here, not resolved (:func:`resolve_host` does that, within a bounded
    time).

    Raises:
        LauncherEnvError: ``MASTER_PORT`` is not a port number, ``MASTER_ADDR`` not a host name
            or address (whitespace, a control character), ``SLURM_JOB_ID`` not an integer:
            naming the variable and its value.
    """
    env = os.environ if environ is None else environ
    port = env_int("MASTER_PORT", 1, 65535, "a TCP port", env)
    addr = _value(env, "MASTER_ADDR")
    if addr is not None:
        if not _HOST.fullmatch(addr):
            raise LauncherEnvError(f"launcher environment: {_named('MASTER_ADDR', addr)} is not "
                                   "a host name or address (rank 0's host: letters, digits, "
                                   "'.', '-', ':'; no spaces)")
        return addr, port or DEFAULT_MASTER_PORT, "MASTER_ADDR"
    if from_environment(env).launcher == "slurm" and (nodelist := env.get("SLURM_STEP_NODELIST")):
        job = env_int("SLURM_JOB_ID", 0, 2**63 - 1, "a job id", env) or 0
        return (first_slurm_host(nodelist), port or DEFAULT_MASTER_PORT + job % 1000,
                "SLURM_STEP_NODELIST")
    return None


#: Seconds a rendezvous host may take to resolve (:func:`resolve_host`) before the rank fails
#: naming it: a resolver that does not answer would otherwise hold the rank in the store's
#: connect loop for the whole rendezvous timeout, saying nothing.
RESOLVE_TIMEOUT_S = 30.0


def resolve_host(host: str, port: int, source: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """Check that ``host`` resolves to an address (``socket.getaddrinfo`` in a daemon thread,
    waited for at most ``timeout_s``: the C resolver has no timeout of its own).

    Args:
        source: where the name came from (``"MASTER_ADDR"``, ``"SLURM_STEP_NODELIST"``), for
            the error: the variable and its value are named.

    Raises:
        LauncherEnvError: the name does not resolve, or not within ``timeout_s``.
    """
    answer: list = []

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as e:
            answer.append(e)

    worker = threading.Thread(target=lookup, name="resolve-rendezvous", daemon=True)
    worker.start()
    worker.join(timeout_s)
    where = (_named(source, host) if source == "MASTER_ADDR" else
             f"{shown(repr(host), 120)} (from {source})")
    hint = "set MASTER_ADDR to rank 0's host name or address, as every rank resolves it"
    if not answer:
        raise LauncherEnvError(f"launcher environment: {where} did not resolve to an address "
                               f"within {timeout_s:g} s (the name service does not answer); "
                               f"{hint}")
    if isinstance(answer[0], Exception) or not answer[0]:
        why = getattr(answer[0], "strerror", None) or str(answer[0]) or "no address"
        raise LauncherEnvError(f"launcher environment: {where} does not resolve to an address "
                               f"({shown(why, 120)}); {hint}")


def root_call(is_root: bool, bcast, fn, error: type[Exception], share: bool = False):
    """Run ``fn()`` on rank 0 (``is_root``) and make every rank agree on the outcome, through
    ``bcast`` (a broadcast from rank 0 of a picklable object): rank 0 re-raises its own exception,
    the others ``error(its message)``, so a failure of rank 0's part (a locked run folder, a full
    disk) stops every rank with one clear line instead of leaving them in a collective. Returns
    ``fn()``'s result on rank 0, and with ``share`` on every rank (else None there)."""
    result, failure = None, None
    if is_root:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            failure = e
    message, shared = bcast((None if failure is None else str(failure),
                             result if share and failure is None else None))
    if failure is not None:
        raise failure
    if message is not None:
        raise error(message)
    return result if is_root else shared


def started_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPI launcher (OpenMPI, MPICH/Intel PMI, srun) started this process with more
    than one rank, so that an MPI library can be initialised (mpi4py, Horovod's MPI controller)."""
    ctx = from_environment(environ)
    return ctx.size > 1 and ctx.launcher in MPI_FAMILIES


def under_openmpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when OpenMPI's ``mpirun`` (directly, or as ``horovodrun --mpi`` runs it) started this
    process, whatever the world size: its ``OMPI_COMM_WORLD_SIZE`` is set. Such a process must
    expect mpirun's teardown on SIGTERM/SIGINT (:class:`hvd_lm.train.deadline.StopSignals`)."""
    return "OMPI_COMM_WORLD_SIZE" in (os.environ if environ is None else environ)


def horovodrun_mpi_shell() -> int | None:
    """PID of the ``/bin/sh -c mpirun ...`` that ``horovodrun --mpi`` turns into (Horovod 0.28.1
    ``runner/mpi_run.py``: ``os.execve('/bin/sh', ['/bin/sh', '-c', mpirun_command])``) when this
    rank was started by it on this node (this rank's parent is mpirun, mpirun's parent that
    shell), else None.

    A signal sent to ``horovodrun --mpi`` (that shell) kills only the shell: mpirun and the ranks
    never see it. Ranks therefore watch this PID (:class:`hvd_lm.train.deadline.StopSignals`) and
    treat its disappearance like SIGTERM (the processes read with psutil; one gone or not
    readable: None).
    """
    import psutil

    try:
        mpirun = psutil.Process(os.getppid())
        if Path((mpirun.cmdline() or [""])[0]).name not in ("mpirun", "mpiexec", "orterun"):
            return None
        shell = mpirun.parent()
        cmd = shell.cmdline() if shell else []
    except psutil.Error:
        return None
    by_shell = len(cmd) >= 3 and Path(cmd[0]).name in ("sh", "dash", "bash") and cmd[1] == "-c"
    return shell.pid if by_shell and cmd[2].lstrip().startswith("mpirun") else None


def stand_in_for_horovodrun_shell() -> None:
    """Under ``horovodrun --gloo`` where ``/bin/sh`` is bash (RHEL and its kin), fork: the
    child goes on as the rank, this process waits for it and exits with its status.

    Horovod 0.28.1 starts each rank as ``/bin/sh -c "env ... python ..."``
    (``runner/common/util/safe_shell_exec.py``) and stops a job by SIGTERM to that shell's
    children, a wait of up to 5 s for them, then SIGSTOP, SIGTERM and SIGKILL to the shell.
    dash forks the command, so the rank is the child and gets the SIGTERM it checkpoints on; bash
    execs it, so the rank *is* the shell and is frozen and killed without one (no checkpoint,
    exit 137). Standing in for the shell gives the rank dash's place on every host. Nothing
    happens elsewhere: the parent must be Horovod's spawned middleman (psutil; unreadable: no
    fork). A signal sent to this stand-in is passed on to the rank. Call before anything starts
    a thread (torch, Horovod).
    """
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in os.environ:
        return
    import signal

    import psutil

    try:
        if "multiprocessing.spawn" not in " ".join(psutil.Process().parent().cmdline()):
            return
    except (psutil.Error, AttributeError):  # gone, unreadable, or no parent
        return
    if (rank := os.fork()) == 0:
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda s, _frame: os.kill(rank, s))
    code = os.waitstatus_to_exitcode(os.waitpid(rank, 0)[1])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here on a shell's fate, as dash's
    os._exit(128 - code if code < 0 else code)
