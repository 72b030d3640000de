"""A private SLURM cluster for tests (Debian's SLURM 22.05 + MUNGE): the one owner of SLURM's
daemons and configuration, on localhost or on the namespace hosts of tests/cluster.py.

:func:`running_cluster` starts ``munged``, ``slurmctld`` and ``slurmd`` in the foreground as child
processes of the test run, with everything in one directory: a fresh MUNGE key and socket,
``slurm.conf`` (one node ``localhost`` with 2+ CPUs, ``proctrack/linuxproc``, ``task/none``,
``select/cons_tres``, no accounting), state, spool, logs and pid files, on free TCP ports. Client
commands reach it through ``SLURM_CONF`` only, so a system SLURM or MUNGE is never touched.
Teardown cancels the cluster's jobs and stops exactly the processes it started (tracked by
PID; they also get SIGTERM if the test process dies, via ``PR_SET_PDEATHSIG``).

With ``nodes`` and ``on_node`` (what :meth:`tests.cluster.Cluster.slurm` passes) it is a
multi-node cluster: ``slurmctld`` and ``munged`` on the first node, one ``slurmd`` per node, each
started inside its node (``on_node(name, cwd)``: the argv prefix that runs a command there),
spool, pid and log files per node (``%n``), and client commands run on the first node. MUNGE's
socket is a file, so the one ``munged`` serves every node.

Missing packages are installed with ``apt-get`` when running as root on Debian/Ubuntu
(:func:`ensure_tools`); otherwise :class:`Unavailable` is raised for the caller to skip. Every wait
is bounded and every failure message carries the daemon logs.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

#: binary -> Debian package that provides it
SLURM_TOOLS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
               "sbatch": "slurm-client", "scontrol": "slurm-client", "squeue": "slurm-client",
               "scancel": "slurm-client", "sinfo": "slurm-client", "srun": "slurm-client"}
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
NODE = "localhost"


class Unavailable(RuntimeError):
    """The cluster cannot run here (tools missing and not installable); callers skip."""


def find_tool(name: str) -> str | None:
    """Path of ``name`` on PATH or in /usr/sbin, /sbin (daemons live there, often off PATH)."""
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name) if p.is_file()), None)


def ensure_tools(tools: dict[str, str], timeout: float = 900) -> dict[str, str]:
    """Paths of ``tools`` (binary -> Debian package), installing missing packages with apt-get.

    Raises:
        Unavailable: a tool is missing and cannot be installed (not root, no apt-get, apt failed),
            with the reason and apt's output.
    """
    missing = {pkg for tool, pkg in tools.items() if not find_tool(tool)}
    if missing:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise Unavailable(f"missing {sorted(missing)} and cannot install them (needs root and "
                              f"apt-get): apt-get install {' '.join(sorted(missing))}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        lock = ["-o", "DPkg::Lock::Timeout=120"]
        for cmd in (["apt-get", *lock, "update", "-qq"],
                    ["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends",
                     *sorted(missing)]):
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=timeout)
            except subprocess.TimeoutExpired:
                raise Unavailable(f"{' '.join(cmd)} did not finish in {timeout:.0f} s") from None
            if proc.returncode != 0:
                raise Unavailable(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                                  f"{(proc.stdout + proc.stderr)[-3000:]}")
    paths = {tool: find_tool(tool) for tool in tools}
    still = [t for t, p in paths.items() if not p]
    if still:
        raise Unavailable(f"{still} still missing after installing {sorted(missing)}")
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the test process exits (Linux PR_SET_PDEATHSIG=1)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class SlurmCluster:
    """One-node SLURM cluster rooted at ``root`` (see the module docstring).

    Attributes:
        root: directory with slurm.conf, munge key and socket, state, spool and logs.
        env: environment for client commands (SLURM_CONF set, outer SLURM_* job variables dropped).
        cpus: CPUs each node offers (at least 2, so a 2-task job fits).
        nodes: (name, address) of each node, the controller first (default: localhost).
        on_node: ``(name, cwd) -> argv prefix`` that runs a command on that node in ``cwd``
            (default: here).
    """

    def __init__(self, root: Path, tools: dict[str, str], cpus: int | None = None,
                 nodes: list[tuple[str, str]] | None = None, on_node=None, detach: bool = False):
        self.root = Path(root)
        self.tools = tools
        self.cpus = max(2, cpus or os.cpu_count() or 2)
        #: (name, address) of every node, the controller first
        self.nodes = list(nodes or [(NODE, "127.0.0.1")])
        #: (node name, working directory) -> argv prefix running a command there
        self.on_node = on_node or (lambda name, cwd: [])
        self.procs: dict[str, subprocess.Popen | _Daemon] = {}
        #: daemons in their own session, outliving this process (``python -m tests.cluster up
        #: --slurm``); else they get SIGTERM when it exits
        self.detach = detach
        self.conf = self.root / "slurm.conf"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(self.conf)

    # ---- lifecycle ---------------------------------------------------------------------------
    def write_config(self) -> None:
        """MUNGE key (created if missing, mode 0400) and slurm.conf on two free ports."""
        r = self.root
        for d in ("state", "spool", "log", "run",
                  *(f"spool-{n}" for n, _ in self.nodes if len(self.nodes) > 1)):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
        (ctl, ctl_addr), many = self.nodes[0], len(self.nodes) > 1
        per_node = "-%n" if many else ""
        self.conf.write_text("\n".join([
            f"# {len(self.nodes)}-node test cluster written by tests/slurm_cluster.py",
            "ClusterName=hvdlmtest",
            f"SlurmctldHost={ctl}({ctl_addr})",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",

            f"SlurmUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'run/munge.sock'}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}{per_node}",
            f"SlurmctldPidFile={r / 'run/slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run/slurmd'}{per_node}.pid",
            f"SlurmctldLogFile={r / 'log/slurmctld.log'}",
            f"SlurmdLogFile={r / 'log/slurmd'}{per_node}.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "KillWait=5",
            "MinJobAge=600",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *(f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} State=UNKNOWN"
              for name, addr in self.nodes),
            f"PartitionName=debug Nodes={','.join(n for n, _ in self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP",
            "",
        ]))
        # PMIx makes /tmp/spmix_appdir_<uid>_<job>.<step> for each step: two one-node clusters
        # on this machine at once (two test files, both numbering their jobs from 1) would share
        # it and fail the second step's launch ("File exists"); this cluster's own folder
        # instead. A multi-node cluster's nodes each have their own /tmp (tests/cluster.py) and
        # must keep it: one folder for all would be the collision.
        if not many:
            (r / "pmix").mkdir(exist_ok=True)
            (self.conf.parent / "mpi.conf").write_text(f"PMIxCliTmpDirBase={r / 'pmix'}\n")

    def _spawn(self, name: str, cmd: list[str], node: str | None = None) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")
        cmd = [*self.on_node(node or self.nodes[0][0], self.root), *cmd]
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
            cwd=self.root, **({"start_new_session": True} if self.detach else
                              {"preexec_fn": _die_with_parent}))
        out.close()

    def start(self, timeout: float = 60) -> None:
        """Start munged, slurmctld, slurmd; return once the node is idle.

        Raises:
            RuntimeError: a daemon exited or the node was not idle within ``timeout`` s (with the
                daemon logs).
        """
        self.write_config()
        r, t = self.root, self.tools
        sock = r / "run/munge.sock"
        self._spawn("munged", [t["munged"], "--foreground", "--force", f"--socket={sock}",
                               f"--key-file={r / 'munge.key'}",
                               f"--pid-file={r / 'run/munged.pid'}",
                               f"--log-file={r / 'log/munged.log'}",
                               f"--seed-file={r / 'run/munged.seed'}"])
        self._wait(lambda: sock.exists(), 15, "munged to create its socket")
        self._spawn("slurmctld", [t["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        for node, _ in self.nodes:
            self._spawn(f"slurmd-{node}" if len(self.nodes) > 1 else "slurmd",
                        [t["slurmd"], "-D", "-N", node, "-f", str(self.conf)], node)
        names = [n for n, _ in self.nodes]
        self._wait(lambda: all(self.node_state(n) == "idle" for n in names), timeout,
                   f"node(s) {', '.join(names)} to become idle")

    def pids(self) -> dict[str, int]:
        """``{daemon name: PID}`` of the daemons started (what :meth:`attach` takes back)."""
        return {name: proc.pid for name, proc in self.procs.items()}

    @classmethod
    def attach(cls, root: Path, tools: dict[str, str], pids: dict[str, int], **kw
               ) -> "SlurmCluster":
        """The cluster another process started under ``root`` (detached), from its daemons'
        PIDs; ``kw`` as the constructor's (``nodes``, ``on_node``, ``cpus``).

        Raises:
            RuntimeError: one of its daemons is gone.
        """
        c = cls(root, tools, **kw)
        c.procs = {name: _Daemon(pid) for name, pid in pids.items()}
        dead = [name for name, d in c.procs.items() if d.poll() is not None]
        if dead:
            raise RuntimeError(f"SLURM under {root}: {', '.join(dead)} no longer run(s)")
        return c

    def stop(self) -> None:
        """Cancel this cluster's jobs (bounded wait), then stop the daemons it started."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                jobs = self.client(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
                if jobs:
                    self.client(["scancel", *jobs], check=False)
                    deadline = time.monotonic() + 20
                    while (time.monotonic() < deadline and
                           self.client(["squeue", "-h", "-o", "%i"], check=False).stdout.split()):
                        time.sleep(0.5)
        for name in [*(n for n in self.procs if n.startswith("slurmd")), "slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"{dead} exited while waiting for {what}\n{self.logs()}")
            if ok():
                return
            time.sleep(0.25)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def logs(self, chars: int = 2500) -> str:
        """The tails of the daemon logs (for failure messages)."""
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace")
            parts.append(f"--- {f.name}\n{text[-chars:]}")
        return "\n".join(parts)

    # ---- client commands -----------------------------------------------------------------------
    def client(self, cmd: list[str], check: bool = True, timeout: float = 30,
               env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        exe = self.tools.get(cmd[0]) or cmd[0]
        run_env = {k: v for k, v in (env or self.env).items() if not k.startswith("SLURM_")}
        run_env["SLURM_CONF"] = str(self.conf)
        where = self.on_node(self.nodes[0][0], cwd or self.root)
        proc = subprocess.run([*where, exe, *cmd[1:]], capture_output=True, text=True,
                              timeout=timeout, env=run_env, cwd=cwd or self.root)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def node_state(self, node: str | None = None) -> str:
        """A node's state (default: the first) as sinfo prints it (idle, alloc, mix, down*,
        ...); '' if unknown."""
        proc = self.client(["sinfo", "-h", "-n", node or self.nodes[0][0], "-o", "%T"],
                           check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def sbatch(self, script: Path, cwd: Path, env: dict, *args: str) -> str:
        """Submit ``script`` from ``cwd`` with ``env`` (exported to the job); returns the job id."""
        proc = self.client(["sbatch", "--parsable", *args, str(script)], env=env, cwd=cwd)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, StdOut, ...)."""
        out = self.client(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float, until=None) -> dict[str, str]:
        """Poll the job until ``until(info)`` (default: a terminal state); on timeout cancel it
        and raise AssertionError with its log and the daemon logs."""
        until = until or (lambda info: info.get("JobState") in TERMINAL_STATES)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info):
                return info
            time.sleep(0.25)
        self.client(["scancel", job_id], check=False)
        log = Path(info.get("StdOut", ""))
        text = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no job log)"
        raise AssertionError(f"job {job_id} not done in {timeout:.0f} s: {info}\n--- job log\n"
                             f"{text}\n{self.logs()}")

    def release_requeued(self, job_id: str, timeout: float = 60) -> None:
        """Start a requeued job now. SLURM holds a requeued job for about 2 minutes (its BeginTime);
        a real cluster just waits. Starting it within the same second as the requeue fails with
        "Job credential revoked", hence the pause before ``scontrol update StartTime=now``."""
        self.wait_job(job_id, timeout, lambda i: i.get("JobState") == "PENDING"
                      and int(i.get("Restarts", "0")) >= 1)
        time.sleep(2)
        self.client(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])


class _Daemon:
    """A daemon another process started, by PID: what :class:`SlurmCluster` uses of a
    ``subprocess.Popen`` (``pid``, ``poll``, ``terminate``, ``kill``, ``wait``)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while it runs, else -1 (its status went to the process that started it)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                alive = f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            alive = False
        if not alive:
            self.returncode = -1
        return None if alive else self.returncode

    def terminate(self) -> None:
        """SIGTERM."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Until it is gone.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` s.
        """
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.05)
        return -1


@contextlib.contextmanager
def running_cluster(root: Path, start_timeout: float = 60) -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster` under ``root``; stopped (only its own daemons) on exit.

    Raises:
        Unavailable: SLURM/MUNGE missing and not installable, or not running as root (slurmd
            must be root to start jobs as the submitting user).
        RuntimeError: the daemons did not come up (logs included).
    """
    if os.geteuid() != 0:
        raise Unavailable("a local SLURM cluster needs root (slurmd runs job steps as the user)")
    cluster = SlurmCluster(root, ensure_tools(SLURM_TOOLS))
    try:
        cluster.start(start_timeout)
        yield cluster
    finally:
        cluster.stop()
