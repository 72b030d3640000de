"""``hvd-lm doctor --hosts n1:8,n2:8``: the preflight of a multi-node launch.

The most common multi-node complaint in Horovod's tracker is a job that hangs at start or at its
first allreduce: a node with several interfaces (``docker0``, a bridge, a management NIC) and
Horovod, OpenMPI or NCCL picking one the other nodes cannot reach (horovod#975, #2568, #1086,
#281, #584, #98), or ssh that is not passwordless both ways. The doctor finds out before any rank
starts, within a bounded time, and either prints the settings that work or stops with one line
that says what does not.

It starts one *agent* (``python -m hvd_lm.jobs.doctor``) on every host, over ssh exactly as the
launchers reach them (``ssh -o BatchMode=yes -o ConnectTimeout=5 HOST``: a password prompt or an
unknown host key fails instead of waiting; a host that resolves to this machine runs it
directly). Each agent reports its hostname, Python, hvd_lm/torch/Horovod/mpi4py versions, its
IPv4 interfaces (with link speed), GPUs, and whether it reads the shard folder (the manifest's
sha256 and every shard's size), and listens on an ephemeral TCP port on every address. Then every
host

* runs ``ssh -o BatchMode=yes OTHER true`` to every other host (OpenMPI's tree spawn and elastic
  Horovod start processes from any node, so ssh must work both ways), and
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
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
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
from typing import Optional

import hvd_lm
from hvd_lm.comm.hosts import interfaces, is_local, parse_hostfile, parse_hosts, peers_of
from hvd_lm.jobs import doctor_checks as checks
from hvd_lm.jobs.doctor_facts import gpu_count, package_versions, shard_facts, source_digest
from hvd_lm.options import Command, option

PROBE_TIMEOUT = 3.0     # seconds per TCP connection attempt
SSH_CONNECT = 5         # ssh ConnectTimeout, seconds


class DoctorError(RuntimeError):
    """A check failed; the message is the one line the launch stops with."""


# ---- the agent (one per host) --------------------------------------------------------------------

class _Listeners:
    """A TCP listener on an ephemeral port of every IPv4 address; each answers a connection with
    one JSON line ``{"host", "token"}`` (who was reached) and closes it. Each socket is held by
    its serving thread (a daemon: they end with the agent)."""

    def __init__(self, hostname: str, token: str, ifaces: dict[str, dict]):
        self.reply = (json.dumps({"host": hostname, "token": token}) + "\n").encode()
        self.ports: dict[str, list] = {}
        for name, info in ifaces.items():
            for addr in info["addrs"]:
                try:
                    s = socket.create_server((addr, 0))
                except OSError:
                    continue
                self.ports.setdefault(name, []).append([addr, s.getsockname()[1]])
                threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def listen_on(self, port: int) -> dict:
        """Also answer on ``port`` of every address (the torch engine's rendezvous port):
        ``{"port", "error"}``, the error (None: listening) saying why it cannot be opened."""
        try:
            s = socket.create_server(("", port))
        except OSError as e:
            return {"port": port, "error": f"port {port} cannot be opened on "
                    f"{socket.gethostname()} ({e.strerror or e}): another job or process holds it"}
        threading.Thread(target=self._serve, args=(s,), daemon=True).start()
        return {"port": port, "error": None}

    def _serve(self, s: socket.socket) -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(PROBE_TIMEOUT)
                conn.sendall(self.reply)


def probe(addr: str, port: int) -> dict:
    """Connect to a listener; ``{"ok": True, "host", "token"}`` with whom it reached, or
    ``{"ok": False, "error": "timed out" | "connection refused" | ...}``."""
    try:
        with socket.create_connection((addr, port), timeout=PROBE_TIMEOUT) as s:
            data = s.makefile("rb").readline()  # to the line's end or the connection's
        return {"ok": True, **json.loads(data.decode())}
    except socket.timeout:
        return {"ok": False, "error": f"timed out after {PROBE_TIMEOUT:g} s"}
    except (OSError, ValueError) as e:
        return {"ok": False, "error": getattr(e, "strerror", None) or str(e)}


def ssh_argv(host: str, port: int | None = None) -> list[str]:
    """``ssh`` as the doctor uses it: batch mode (no password or host-key prompt), a connect
    timeout, the port when given, and the host after ``--`` (so that a name starting with ``-``
    is never read as an option such as ``-oProxyCommand=...``; :func:`check_host_names` refuses
    those names anyway).

    Raises:
        ValueError: ``host`` starts with ``-`` (see :func:`check_host_names`).
    """
    check_host_names([host])
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT}",
            *(["-p", str(port)] if port else []), "--", host]


def check_host_names(hosts: list[str]) -> None:
    """Refuse a host name that starts with ``-`` (no host is named so; ssh would take it for an
    option, e.g. ``-oProxyCommand=CMD`` runs CMD) or holds whitespace or a control character.

    Raises:
        ValueError: one line naming the host.
    """
    for h in hosts:
        if h.startswith("-") or any(c.isspace() or ord(c) < 32 for c in h):
            raise ValueError(f"host name {h!r} is not a host name (it starts with '-' or holds "
                             "whitespace): refused before any ssh")


def ssh_check(host: str, port: int | None) -> dict:
    """``ssh HOST true`` in batch mode: ``{"ok": bool, "error": its last stderr line}``."""
    try:
        proc = subprocess.run([*ssh_argv(host, port), "true"], capture_output=True, text=True,
                              timeout=SSH_CONNECT + 15, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer within {SSH_CONNECT + 15} s"}
    except OSError as e:
        return {"ok": False, "error": str(e)}
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    return {"ok": proc.returncode == 0,
            "error": lines[-1] if lines and proc.returncode else ""}


@dataclass
class AgentConfig:
    """One host's agent (``python -m hvd_lm.jobs.doctor``): facts on stdout, then the checks
    the driver sends on stdin."""

    shards: str = option("", "shard folder to check ('' = none)")
    ssh_port: Optional[int] = option(None, "ssh port of the other hosts", ge=1, le=65535)
    timeout: float = option(60.0, "the agent exits after this many seconds whatever happens",
                            gt=0)
    rendezvous_port: Optional[int] = option(None, "also listen on this port (the first host's "
                                            "agent: the torch engine's rendezvous)", ge=1,
                                            le=65535)


def agent(cfg: AgentConfig) -> int:
    """Print this host's facts (one JSON line), read the plan (one JSON line: ``probes``,
    ``ssh``), run it in parallel, print the results (one JSON line), exit at stdin's EOF."""
    signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
    signal.alarm(max(1, int(cfg.timeout)))
    hostname = socket.gethostname()
    token = secrets.token_hex(8)
    ifaces = interfaces()
    listen = _Listeners(hostname, token, ifaces)
    gpus, gpu_names = gpu_count()
    facts = {"host": hostname, "token": token, "python": sys.version.split()[0],
             "executable": sys.executable, "hvd_lm": hvd_lm.__version__,
             "hvd_lm_path": str(Path(hvd_lm.__file__).parent), "hvd_lm_digest": source_digest(),
             "packages": package_versions(), "interfaces": ifaces, "listeners": listen.ports,
             "gpus": gpus, "gpu_names": gpu_names,
             "shards": shard_facts(cfg.shards) if cfg.shards else None,
             "rendezvous": listen.listen_on(cfg.rendezvous_port) if cfg.rendezvous_port else None}
    print(json.dumps(facts), flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0
    plan = json.loads(line)
    with cf.ThreadPoolExecutor(max_workers=32) as pool:
        probes = [pool.submit(probe, p["addr"], p["port"]) for p in plan["probes"]]
        sshs = {h: pool.submit(ssh_check, h, cfg.ssh_port) for h in plan["ssh"]}
        result = {"probes": [dict(p, **f.result()) for p, f in zip(plan["probes"], probes)],
                  "ssh": {h: f.result() for h, f in sshs.items()},
                  "paths": {p: os.path.exists(p) for p in plan.get("paths", [])}}
    print(json.dumps(result), flush=True)
    sys.stdin.read()  # stay reachable until every host is done probing
    return 0


# ---- the driver ----------------------------------------------------------------------------------

@dataclass
class Agent:
    """One host's agent process as the driver sees it."""

    host: str
    local: bool
    proc: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    stderr: list = field(default_factory=list)
    readers: list = field(default_factory=list)  # the threads pumping stdout and stderr

    def read_line(self, deadline: float) -> dict:
        """The next JSON line of the agent's stdout.

        Raises:
            DoctorError: the agent ended or said nothing before ``deadline`` (one line naming
                the host and, for ssh, its error).
        """
        try:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise DoctorError(f"{self.host}: no answer from the doctor's agent within the "
                              "timeout (a hung ssh or a stalled host)") from None
        if line is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            # stderr is read on its own thread: its last line (ssh's reason) may still be on the
            # way when stdout ends and the process exits; wait for that reader to reach EOF
            for t in self.readers:
                t.join(5)
            err = next((x for x in reversed(self.stderr) if x.strip()), "").strip()
            via = "" if self.local else f"ssh {self.host}: "
            raise DoctorError(f"{via}the doctor's agent on {self.host} exited "
                              f"{self.proc.returncode}: {err or 'no message'}")
        return json.loads(line)


def _pump(stream, sink) -> None:
    for line in stream:
        sink(line)
    sink(None)


def start_agent(host: str, cfg: "DoctorConfig", first: bool = False) -> Agent:
    """The agent on ``host``: directly when the host is this machine, else over ssh, with this
    process's working directory and ``PYTHONPATH`` (what the launchers pass to ranks); the
    ``first`` host's also listens on ``--rendezvous-port``."""
    argv = [cfg.python or sys.executable, "-m", "hvd_lm.jobs.doctor", "--timeout",
            str(cfg.timeout + 10)]
    # --shards absolute: a host that cannot enter this folder starts the agent elsewhere
    for flag, value in (("--rendezvous-port", first and cfg.rendezvous_port),
                        ("--shards", cfg.shards and os.path.abspath(cfg.shards)),
                        ("--ssh-port", cfg.ssh_port)):
        if value:
            argv += [flag, str(value)]
    local = is_local(host)
    if not local:
        env = f"env PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " \
            if os.environ.get("PYTHONPATH") else ""
        # a host that cannot enter this folder runs the agent in $HOME: the plan's path check
        # then names the folder (not a symptom of it, such as a missing manifest)
        remote = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; {env}{shlex.join(argv)}"
        argv = [*ssh_argv(host, cfg.ssh_port), remote]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    a = Agent(host, local, proc)
    a.readers = [threading.Thread(target=_pump, args=(proc.stdout, a.lines.put), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr,
                                                      lambda x: x and a.stderr.append(x)),
                                  daemon=True)]
    for t in a.readers:
        t.start()
    return a


def run_doctor(cfg: "DoctorConfig", env: dict[str, str] | None = None) -> checks.Report:
    """Start the agents, collect facts, run the checks (see the module docstring).

    Raises:
        ValueError: bad ``--hosts``/``--hostfile``.
        DoctorError: a host did not answer (ssh, Python) within the timeout.
    """
    env = dict(os.environ if env is None else env)
    hosts = parse_hostfile(cfg.hostfile) if cfg.hostfile else parse_hosts(cfg.hosts)
    check_host_names([h for h, _ in hosts])
    paths = paths_to_check(cfg)
    t0 = time.monotonic()
    deadline = t0 + cfg.timeout
    report = checks.Report(hosts=hosts)
    agents = [start_agent(h, cfg, first=i == 0) for i, (h, _) in enumerate(hosts)]
    try:
        for a in agents:
            report.facts[a.host] = a.read_line(deadline)
        names = [a.host for a in agents]
        for i, a in enumerate(agents):
            peers = [names[j] for j in peers_of(i, len(agents))]
            probes = [{"target": b, "iface": iface, "addr": addr, "port": port}
                      for b in peers
                      for iface, lst in report.facts[b]["listeners"].items()
                      for addr, port in lst]
            if cfg.rendezvous_port and i > 0:  # the torch engine's ranks meet at the first host
                probes.append({"target": names[0], "iface": checks.RENDEZVOUS, "addr": names[0],
                               "port": cfg.rendezvous_port})
            a.proc.stdin.write(json.dumps({"probes": probes, "ssh": peers,
                                           "paths": list(paths)}) + "\n")
            a.proc.stdin.flush()
        results = {a.host: a.read_line(deadline) for a in agents}
    finally:
        for a in agents:
            with contextlib.suppress(OSError):
                a.proc.stdin.close()
        for a in agents:
            try:
                a.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(a.proc.pid, signal.SIGKILL)
                a.proc.wait(5)
    for a, res in results.items():
        for b, r in res["ssh"].items():
            report.ssh[f"{a} -> {b}"] = r
            if not r["ok"]:
                report.errors.append(f"ssh {a} -> {b} failed: {r['error'] or 'exit status != 0'}"
                                     " (passwordless ssh must work between all hosts, both ways)")
    lacking = checks.check_paths(report, results, paths, socket.gethostname())
    checks.check_versions(report)
    checks.analyse_reach(report, results)
    checks.choose(report, cfg.network_interface, env)
    if cfg.rendezvous_port:
        checks.check_rendezvous(report, results, cfg.rendezvous_port, env)
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
        q = Path(full)
        while not q.exists() and q != q.parent:
            q = q.parent
        what = f"{label} {p}" + (f" ({full})" if full != p else "")
        if str(q) != full:
            what += f" (not made yet: its parent {q})"
        out.setdefault(str(q), what)
    return out


@dataclass
class DoctorConfig:
    """Settings of ``hvd-lm doctor``."""

    hosts: str = option("", "hosts as horovodrun -H takes them: n1:8,n2:8 (slots = ranks)")
    hostfile: str = option("", "or a hostfile: 'node1 slots=8' / 'node1:8' lines, or one line "
                           "per rank ($PBS_NODEFILE)")
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
    timeout: float = option(45.0, "seconds the whole check may take (each connection 3 s, each "
                            "ssh 5 s to connect)", gt=0)
    format: str = option("text", "text: the report; shell: `export` lines for the launch "
                         "(report on stderr); json: everything", choices=("text", "shell", "json"))

    def check(self) -> None:
        """Exactly one of --hosts and --hostfile."""
        if bool(self.hosts) == bool(self.hostfile):
            raise ValueError("give --hosts n1:8,n2:8 or --hostfile FILE (one of them)")


def doctor(cfg: DoctorConfig) -> int:
    """Run the checks and print the report; 1 with the first failure as the one error line
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
    if report.errors:
        raise DoctorError(report.errors[0])
    return 0


DOCTOR = Command(
    DoctorConfig, doctor, config_flag=False, usage_errors=(ValueError,),
    description="Preflight of a multi-node launch: passwordless ssh both ways, the same Python "
    "and hvd_lm everywhere, the network interface every host reaches every other one through "
    "(prints the exact --network-interface / btl_tcp_if_include / NCCL_SOCKET_IFNAME to use), "
    "ports, the shard folder, GPUs per host. Stops with one line when something is wrong.",
    epilog="examples:\n"
    "  hvd-lm doctor --hosts node1:8,node2:8 --shards data/amazon\n"
    "  eval \"$(hvd-lm doctor --hostfile hosts.txt --format shell)\"   # what the templates do")
AGENT = Command(AgentConfig, agent, config_flag=False)


if __name__ == "__main__":  # one host's agent: python -m hvd_lm.jobs.doctor
    sys.exit(AGENT.main(None, "python -m hvd_lm.jobs.doctor"))
