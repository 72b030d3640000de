"""``hvd-lm doctor --hosts n1:8,n2:8``: the preflight of a multi-node launch.

The most common multi-node complaint in Horovod's tracker is a job that hangs at start or at its
first allreduce: a node with several interfaces (``docker0``, a bridge, a management NIC) and
Horovod, OpenMPI or NCCL picking one the other nodes cannot reach (horovod#975, #2568, #1086,
#281, #584, #98), or ssh that is not passwordless both ways. The doctor finds out before any rank
starts, within a bounded time, and either prints the settings that work or stops with one line
that says what does not.

It starts one *agent* (:mod:`hvd_lm.jobs.doctor_agent`) on every host, over ssh exactly as
horovodrun and OpenMPI reach them (``ssh -o BatchMode=yes -o ConnectTimeout=5 HOST``: a password
prompt or an unknown host key fails instead of waiting; a host that resolves to this machine runs
it directly), or, with ``--launcher srun`` (a SLURM job) or ``--launcher mpirun`` (a PBS job), with
one ``srun``/``mpirun`` that starts one agent per node the way the job's ranks start, each
connecting back to the doctor over TCP: no ssh between the nodes. Each agent reports its hostname,
Python, hvd_lm/torch/Horovod/mpi4py versions, its IPv4 interfaces (with link speed), GPUs, and
whether it reads the shard folder (the manifest's sha256 and every shard's size), and listens on an
ephemeral TCP port on every address. Then every host

* runs ``ssh -o BatchMode=yes OTHER true`` to the other hosts (OpenMPI's tree spawn and elastic
  Horovod start processes from any node, so ssh must work both ways; every pair up to 9 hosts,
  below; not with ``--launcher srun`` or ``mpirun``), and
* connects to every other host's listeners, 3 s each, and checks that the answer carries that
  host's token: an interface counts as *shared* when every host reaches every other one through
  it. ``docker0`` (``172.17.0.1`` on every node) fails this test: from n1 that address is n1
  itself;

and every host must see the working folder (every rank starts in it), ``--shards`` and each of
``--paths`` at the same path; a host that lacks one is named with the path and the reason (a
shared filesystem), instead of a symptom such as a missing manifest (an agent that cannot enter
the working folder runs in ``$HOME``). Host names go to ssh after ``--``; one starting with
``-`` is refused before any ssh.

Of the shared interfaces (loopback only when all hosts are this one machine) the fastest
(``/sys/class/net/IF/speed``; then by name) is used, or the ones ``--network-interface`` names are
verified. The result is the exact settings every library needs:

* ``horovodrun --network-interface IF`` (Horovod's own traffic and, for Gloo,
  ``HOROVOD_GLOO_IFACE``);
* ``mpirun -mca btl_tcp_if_include IF -mca oob_tcp_if_include IF`` (OpenMPI's TCP BTL and its
  runtime's out-of-band channel; without them OpenMPI 4.1 tries ``docker0`` and hangs);
* ``NCCL_SOCKET_IFNAME=IF`` (NCCL's bootstrap and socket transport) and ``GLOO_SOCKET_IFNAME=IF``
  (torch.distributed's Gloo).

For the torch engine (``--backend torch``), ``--rendezvous-port P`` also checks where its ranks
meet: the first host's agent opens P on every address (a port another job holds is named) and
every other host connects to it by the first host's name, 3 s each; the exports then add
``MASTER_ADDR`` (the first host) and ``MASTER_PORT`` (P).

``--format shell`` prints them as ``export`` lines, which the launch templates evaluate before
training (``PREFLIGHT=1``, their default); a value already in the environment is kept and
checked, as every template knob is. Every wait is bounded: each connection 3 s, each ssh 5 s to
connect, the whole check ``--timeout`` seconds (agents exit on their own after it too).

Bounded at any size, and every host that fails named in one run: at most
:data:`~hvd_lm.comm.hosts.SSH_AT_ONCE` (8) of the doctor's ssh connections are unauthenticated
at once (an agent's counts until its shell's first line), below sshd's default ``MaxStartups
10:30:100``; no host receives more than 8 of the agents' ssh checks
(:func:`~hvd_lm.comm.hosts.ssh_peers`: every pair up to 9 hosts, beyond that host 0 to every
host and each host to its 3 ring neighbours each side); TCP probes: every pair up to 16 hosts,
beyond that host 0 and 4 ring neighbours each side (:func:`~hvd_lm.comm.hosts.peers_of`), each
agent 32 connections at once at most, each listener queueing 1024.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hostlist

from hvd_lm.comm.hosts import (
    SSH_AT_ONCE,
    interfaces,
    is_local,
    parse_hostfile,
    parse_hosts,
    peers_of,
    same_host,
    ssh_peers,
)
from hvd_lm.comm.peers import PROBE_TIMEOUT
from hvd_lm.jobs import doctor_checks as checks
from hvd_lm.jobs.doctor_agent import BACKLOG, check_host_names, ssh_argv
from hvd_lm.options import Command, option

#: How the agents start (``--launcher``).
LAUNCHERS = ("ssh", "srun", "mpirun")


class DoctorError(RuntimeError):
    """A check failed; the message is the one line the launch stops with."""


@dataclass
class Agent:
    """One host's agent as the doctor sees it: the lines it sent, where its plan goes (``out``:
    the ssh process's stdin, or the agent's connection ``conn``) and the process that started it
    (None for an agent that connected back)."""

    host: str
    local: bool
    proc: Optional[subprocess.Popen]
    out: Any = None
    conn: Optional[socket.socket] = None
    lines: queue.Queue = field(default_factory=queue.Queue)
    stderr: list = field(default_factory=list)
    readers: list = field(default_factory=list)  # the threads pumping stdout and stderr

    def read_line(self, deadline: float) -> dict:
        """The next JSON line the agent sent (lines not starting with ``{`` are skipped: the
        remote shell's first line, a login script's chatter).

        Raises:
            DoctorError: the agent ended or said nothing before ``deadline`` (one line naming
                the host and, for ssh, its error).
        """
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise DoctorError(f"{self.host}: no answer from the doctor's agent within the "
                                  "timeout (a hung ssh or a stalled host)") from None
            if line is None and self.proc is None:
                raise DoctorError(f"the doctor's agent on {self.host} closed its connection")
            if line is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                # stderr is read on its own thread: its last line (ssh's reason) may still be on
                # the way when stdout ends and the process exits; wait for that reader's EOF
                for t in self.readers:
                    t.join(5)
                err = next((x for x in reversed(self.stderr) if x.strip()), "").strip()
                via = "" if self.local else f"ssh {self.host}: "
                raise DoctorError(f"{via}the doctor's agent on {self.host} exited "
                                  f"{self.proc.returncode}: {err or 'no message'}")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        """End the agent's input: it exits."""
        with contextlib.suppress(OSError):
            self.out.close()
            if self.conn:
                self.conn.shutdown(socket.SHUT_WR)


def _pump(stream, sink, first=None) -> threading.Thread:
    """A started daemon thread passing every line of ``stream`` to ``sink``, then None;
    ``first()`` at the first line or the end, whichever comes first."""
    def run() -> None:
        for i, line in enumerate(itertools.chain(stream, [None])):  # None: the end
            if i == 0 and first:
                first()
            sink(line)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _agent_argv(cfg: "DoctorConfig", *extra: str) -> list[str]:
    # --shards absolute: a host that cannot enter this folder starts the agent elsewhere
    return [cfg.python or sys.executable, "-m", "hvd_lm.jobs.doctor_agent", "--timeout",
            str(cfg.timeout + 10), *extra,
            *(["--shards", os.path.abspath(cfg.shards)] if cfg.shards else []),
            *(["--ssh-port", str(cfg.ssh_port)] if cfg.ssh_port else [])]


def start_agent(host: str, cfg: "DoctorConfig", first: bool, started) -> Agent:
    """The agent on ``host``: directly when the host is this machine, else over ssh, with this
    process's working directory and ``PYTHONPATH`` (what the launchers pass to ranks); the
    ``first`` host's also listens on ``--rendezvous-port``. ``started()`` is called once ssh is
    through (the remote shell's first line, or ssh's end), at once for a local host."""
    argv = _agent_argv(cfg, *(["--rendezvous-port", str(cfg.rendezvous_port)]
                              if first and cfg.rendezvous_port else []))
    local = is_local(host)
    if not local:
        env = f"env PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " \
            if os.environ.get("PYTHONPATH") else ""
        # a host that cannot enter this folder runs the agent in $HOME: the plan's path check
        # then names the folder (not a symptom of it, such as a missing manifest)
        remote = f"echo; cd {shlex.quote(os.getcwd())} 2>/dev/null; {env}{shlex.join(argv)}"
        argv = [*ssh_argv(host, cfg.ssh_port), remote]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    a = Agent(host, local, proc, out=proc.stdin)
    if local:
        started()
    a.readers = [_pump(proc.stdout, a.lines.put, None if local else started),
                 _pump(proc.stderr, lambda x: x and a.stderr.append(x))]
    return a


def ssh_agents(hosts: list[tuple[str, int]], cfg: "DoctorConfig", deadline: float,
               agents: list[Agent], procs: list) -> tuple[dict, dict]:
    """Start every host's agent (:func:`start_agent`), at most
    :data:`~hvd_lm.comm.hosts.SSH_AT_ONCE` of them connecting at once, into ``agents`` (their
    processes into ``procs``); their facts, and ``{host: why}`` for each that did not answer."""
    gate = threading.Semaphore(SSH_AT_ONCE)
    for i, (h, _) in enumerate(hosts):
        if not gate.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
        agents.append(start_agent(h, cfg, first=i == 0, started=gate.release))
        procs.append(agents[-1].proc)
    facts, failed = {}, {}
    for a in agents:
        try:
            facts[a.host] = a.read_line(deadline)
        except DoctorError as e:
            failed[a.host] = str(e)
    for h, _ in hosts[len(agents):]:
        failed[h] = f"{h}: not tried: the timeout ran out while other hosts' ssh connected"
    return facts, failed


def launcher_argv(launcher: str, names: list[str], agent: list[str]) -> list[str]:
    """The command that starts the ``agent`` command once on every host of ``names``: ``srun``,
    one task per node of the SLURM allocation (each knows its node: ``SLURMD_NODENAME``), or
    OpenMPI's ``mpirun``, one process per host as a PBS job's ranks start (one application
    context per host, which passes it ``--node HOST``), with PATH, LD_LIBRARY_PATH, PYTHONPATH
    and VIRTUAL_ENV."""
    n = len(names)
    if launcher == "srun":
        return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
                "--nodelist=" + ",".join(names), "--mpi=none", "--kill-on-bad-exit=0", *agent]
    argv = ["mpirun", "-bind-to", "none", "--oversubscribe",
            *(x for v in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")
              if v in os.environ for x in ("-x", v))]
    for i, h in enumerate(names):
        argv += [*([":"] if i else []), "-np", "1", "--host", f"{h}:1", *agent, "--node", h]
    return argv


def group_agents(hosts: list[tuple[str, int]], cfg: "DoctorConfig", deadline: float,
                 agents: list[Agent], procs: list) -> tuple[dict, dict]:
    """One ``srun`` or ``mpirun`` (:func:`launcher_argv`, into ``procs``) starts an agent on
    every host; each connects back over TCP (to this host's name or one of its addresses) with
    the doctor's key and its node's name, and becomes one of ``agents``. Their facts, and one
    line naming every host no agent answered for, with the launcher's first line
    (``{hosts: why}``)."""
    names = [h for h, _ in hosts]
    key = secrets.token_hex(8)
    facts: dict[str, dict] = {}
    with socket.create_server(("", 0), backlog=BACKLOG) as srv:
        addrs = (a for i in interfaces().values() for a in i["addrs"])
        here = [socket.gethostname(), *sorted(addrs, key=lambda a: a.startswith("127."))]
        rdzv = (["--rendezvous-port", str(cfg.rendezvous_port), "--rendezvous-host", names[0]]
                if cfg.rendezvous_port else [])
        argv = launcher_argv(cfg.launcher, names, _agent_argv(
            cfg, "--report-to", f"{','.join(here)}:{srv.getsockname()[1]}", "--key", key, *rdzv))
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(proc)
        said: list[str] = []
        reader = _pump(proc.stdout, lambda x: x and said.append(x))
        srv.settimeout(0.2)
        while len(facts) < len(names) and time.monotonic() < deadline:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                if proc.poll() is not None:
                    break
                continue
            conn.settimeout(None)
            a = Agent("", False, None, out=conn.makefile("w"), conn=conn)
            _pump(conn.makefile("r"), a.lines.put)
            try:
                f = a.read_line(time.monotonic() + PROBE_TIMEOUT)
            except (DoctorError, ValueError):
                f = {}
            a.host = next((n for n in names if f.get("key") == key and same_host(n, f["node"])), "")
            if a.host and a.host not in facts:
                facts[a.host] = f
                agents.append(a)
            else:
                a.close()
    missing = hostlist.collect_hostlist([n for n in names if n not in facts])
    if not missing:
        return facts, {}
    state = "is still running" if proc.poll() is None else f"exited {proc.returncode}"
    reader.join(0 if proc.poll() is None else 5)  # (once it exited: every line it wrote read)
    said1 = next((x.strip() for x in said if any(c.isalpha() for c in x)), "no message")
    return facts, {missing: f"no agent reported from {missing} ({len(names) - len(facts)} of "
                   f"{len(names)} hosts; {cfg.launcher} started them and {state}; its first "
                   f"line: {said1})"}


def run_doctor(cfg: "DoctorConfig") -> checks.Report:
    """Start the agents, collect facts, run the checks (see the module docstring).

    Raises:
        ValueError: bad ``--hosts``/``--hostfile``.
        DoctorError: hosts did not answer (ssh, Python) within the timeout: one line naming
            every one of them.
    """
    hosts = parse_hostfile(cfg.hostfile) if cfg.hostfile else parse_hosts(cfg.hosts)
    names = [h for h, _ in hosts]
    check_host_names(names)
    paths = paths_to_check(cfg)
    t0 = time.monotonic()
    deadline = t0 + cfg.timeout
    report = checks.Report(hosts=hosts, launcher=cfg.launcher)
    agents: list[Agent] = []
    procs: list[subprocess.Popen] = []
    try:
        start = ssh_agents if cfg.launcher == "ssh" else group_agents
        facts, failed = start(hosts, cfg, deadline, agents, procs)
        if failed:  # every host named, in a line of bounded length
            why = list(failed.values())
            every = "; ".join(why)
            if len(why) > 1 and len(every) >= 800:  # SLURM's form of the names (python-hostlist)
                every = f"{hostlist.collect_hostlist(list(failed))}; the first: {why[0]}"
            raise DoctorError(every if len(why) == 1 else f"{len(why)} of {len(hosts)} hosts did "
                              f"not answer: {every}")
        report.facts = {h: facts[h] for h in names}
        by_host = {a.host: a for a in agents}
        for i, a in enumerate(by_host[h] for h in names):
            probes = [{"target": b, "iface": iface, "addr": addr, "port": port}
                      for b in (names[j] for j in peers_of(i, len(names)))
                      for iface, lst in report.facts[b]["listeners"].items() for addr, port in lst]
            if cfg.rendezvous_port and i > 0:  # the torch engine's ranks meet at the first host
                probes.append({"target": names[0], "iface": checks.RENDEZVOUS, "addr": names[0],
                               "port": cfg.rendezvous_port})
            ssh = [names[j] for j in ssh_peers(i, len(names))] if cfg.launcher == "ssh" else []
            print(json.dumps({"probes": probes, "ssh": ssh, "paths": list(paths)}), file=a.out,
                  flush=True)
        results = {h: by_host[h].read_line(deadline) for h in names}
    finally:
        for a in agents:
            a.close()
        for p in procs:  # each ends at its input's end; else SIGTERM (srun ends its step), KILL
            for sig in (0, signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)  # (0: none sent)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
                    break
    for a, res in results.items():
        for b, r in res["ssh"].items():
            report.ssh[f"{a} -> {b}"] = r
            if not r["ok"]:
                report.errors.append(f"ssh {a} -> {b} failed: {r['error'] or 'exit status != 0'}"
                                     " (passwordless ssh must work between all hosts, both ways)")
    lacking = checks.check_paths(report, results, paths, socket.gethostname())
    checks.check_versions(report)
    checks.analyse_reach(report, results)
    checks.choose(report, cfg.network_interface, os.environ)
    if cfg.rendezvous_port:
        checks.check_rendezvous(report, results, cfg.rendezvous_port, os.environ)
    if cfg.shards:
        checks.check_shards(report, cfg.shards, skip=lacking)
    checks.check_gpus(report, cfg.device)
    report.seconds = time.monotonic() - t0
    return report


def paths_to_check(cfg: "DoctorConfig") -> dict[str, str]:
    """``{absolute path: what it is}`` every host must see at the same path: the working folder
    (every rank starts in it), ``--shards`` and each of ``--paths``. A path that does not exist
    here (a run folder not made yet) is checked by its nearest existing parent; a relative one is
    taken from this folder, as the ranks take it."""
    out = {os.getcwd(): f"the working folder {os.getcwd()}"}
    named = ([("--shards", cfg.shards)] if cfg.shards else []) + [
        ("--paths", p.strip()) for p in cfg.paths.split(",") if p.strip()]
    for label, p in named:
        full = os.path.abspath(p)
        q = next(x for x in (Path(full), *Path(full).parents) if x.exists())  # "/" at least
        out.setdefault(str(q), f"{label} {p}" + (f" ({full})" if full != p else "")
                       + (f" (not made yet: its parent {q})" if str(q) != full else ""))
    return out


@dataclass
class DoctorConfig:
    """Settings of ``hvd-lm doctor``."""

    hosts: str = option("", "hosts as horovodrun -H takes them: n1:8,n2:8 (slots = ranks), or "
                        "SLURM's compressed n[001-004,7]:8 ($SLURM_JOB_NODELIST)")
    hostfile: str = option("", "or a hostfile: 'node1 slots=8' / 'node1:8' lines, or one line "
                           "per rank ($PBS_NODEFILE); names as in --hosts")
    network_interface: str = option("", "interface(s) to verify instead of picking one, e.g. "
                                    "eth0 or ib0")
    shards: str = option("", "shard folder every host must read (the manifest must be the "
                         "same everywhere)")
    device: str = option("auto", "cuda: every host needs one GPU per slot; auto: checked on "
                         "hosts that have GPUs; cpu: not checked", choices=("auto", "cuda", "cpu"))
    paths: str = option("", "more paths every host must see at the same path, comma-separated: "
                        "the run folder, a --config file (one not made yet: its parent)")
    python: str = option("", "interpreter with hvd_lm at the same path on every host (default: "
                         "this one)")
    ssh_port: Optional[int] = option(None, "ssh port of the hosts (default 22)", ge=1, le=65535)
    rendezvous_port: Optional[int] = option(None, "the torch engine (--backend torch): check "
                                            "that the first host can open this port and every "
                                            "other host reaches it there; exports MASTER_ADDR "
                                            "and MASTER_PORT", ge=1, le=65535)
    launcher: str = option("ssh", "how the agents start: ssh (from here to every host, as "
                           "horovodrun reaches them; ssh between the hosts is checked too), srun "
                           "(one task per node of this SLURM job) or mpirun (OpenMPI, one "
                           "process per host: a PBS job); srun and mpirun need no ssh between "
                           "the hosts", choices=LAUNCHERS)
    timeout: float = option(45.0, "seconds the whole check may take (each connection 3 s, each "
                            "ssh 5 s to connect)", gt=0)
    format: str = option("text", "text: the report; shell: `export` lines for the launch "
                         "(report on stderr); json: everything", choices=("text", "shell", "json"))

    def check(self) -> None:
        """Exactly one of --hosts and --hostfile."""
        if bool(self.hosts) == bool(self.hostfile):
            raise ValueError("give --hosts n1:8,n2:8 or --hostfile FILE (one of them)")


def doctor(cfg: DoctorConfig) -> int:
    """Run the checks and print the report; 1 with every failure in the one error line
    (``cfg`` is validated: exactly one of --hosts and --hostfile)."""
    report = run_doctor(cfg)
    if cfg.format == "json":
        print(json.dumps(vars(report), indent=1))
    elif cfg.format == "shell":
        if not report.errors:
            print(checks.render(report), file=sys.stderr)
            for var, value in report.exports.items():
                print(f"export {var}={shlex.quote(value)}")
    else:
        print(checks.render(report))
    if report.errors:  # every one, so that a run names every bad host
        raise DoctorError(report.errors[0] if len(report.errors) == 1 else
                          f"{len(report.errors)} problems: " + " | ".join(report.errors))
    return 0


DOCTOR = Command(
    DoctorConfig, doctor, config_flag=False, usage_errors=(ValueError,),
    description="Preflight of a multi-node launch: passwordless ssh both ways, the same Python "
    "and hvd_lm everywhere, the network interface every host reaches every other one through "
    "(prints the exact --network-interface / btl_tcp_if_include / NCCL_SOCKET_IFNAME to use), "
    "ports, the shard folder, GPUs per host. Stops with one line when something is wrong.",
    epilog="examples:\n  hvd-lm doctor --hosts node1:8,node2:8 --shards data/amazon\n"
    "  eval \"$(hvd-lm doctor --hostfile hosts.txt --format shell)\"   # what the templates do")
