"""A cluster in a box: N hosts as Linux network namespaces on this machine (the one owner).

Each node ``n1..nN`` is a network namespace (``hvdlm-n1``...) entered through a *holder* process
that also has its own UTS namespace (hostname ``n1``) and a private mount namespace in which

* ``/etc/hosts`` lists every node (``10.77.0.<i> n<i>``), so each node resolves the others and
  itself by name (Horovod and OpenMPI tell hosts apart by name and address);
* ``/etc/ssh/ssh_config.d`` holds this cluster's client config (key, known hosts, user root,
  ``BatchMode``, ``ConnectTimeout 5``), so plain ``ssh n2`` works inside every node, as it does
  for a user with keys in ``~/.ssh`` on a real cluster, for horovodrun, OpenMPI's ``plm_rsh``
  (tree spawn included) and job scripts alike; root's own ``~/.ssh`` and ``/etc/ssh`` of this
  machine are never touched;
* ``/run`` is a private tmpfs (sshd's privilege-separation directory lives there) and ``/sys``
  is the node's own sysfs.

Every node runs its own ``sshd`` (this cluster's host key, ``AuthorizedKeysFile`` in the cluster
folder, root login by key only). The nodes' ``eth0`` are veth pairs to a bridge in a separate
switch namespace (``hvdlm-sw``), so nothing is added to this machine's own namespace and traffic
stays between the namespaces. Each node also has a decoy ``docker0`` (a bridge with no ports,
``172.17.0.1/16`` on every node, as Docker leaves it on real nodes): an interface the other nodes
cannot reach, the cause of Horovod's and OpenMPI's classic multi-node hang (horovod#975, #2568,
#1086). ``tc qdisc ... tbf`` on both ends of every link sets its bandwidth (:meth:`Cluster.shape`);
this kernel has no netem, so latency is measured (:meth:`Cluster.ping`), not set. The nodes share
this machine's filesystem, so paths (the checkout, ``.venv``, shards, run folders) are the same
everywhere, except under ``/tmp`` (see below; a checkout under ``/tmp``, a clone there, is
shared with its ``.venv``).

Faults: :meth:`Cluster.link` unplugs a node's cable at the switch (its ``eth0`` loses carrier),
:meth:`Cluster.kill_jobs` kills every process of a node but the cluster's daemons.
:meth:`Cluster.slurm` starts SLURM over the nodes (tests/slurm_cluster.py: ``slurmctld`` and
``munged`` on n1, one ``slurmd`` per node; from the command line ``up N --slurm`` leaves it
running, its daemons' PIDs in ``state.json``, and ``down`` stops it with everything else).

Setup and teardown are idempotent and take seconds; :meth:`Cluster.down` kills every process in
the cluster's namespaces (found by namespace, not by name), deletes the namespaces (their veths
go with them) and the cluster folder. Command line (``python -m tests.cluster up 3 --rate 1gbit``,
``up 2 --slurm``, ``run n1 -- hostname``, ``shape 100mbit``, ``status``, ``ping``, ``down``):
tests/cluster_cli.py; the tests use the pytest fixture ``cluster`` in tests/conftest.py. What the
nodes share: everything outside ``/tmp``; under ``/tmp`` each node has its own, but for the
cluster folder, pytest's temporary folders, the checkout and its venv (when they are under
``/tmp``) and the folders listed in ``HVD_LM_CLUSTER_SHARE``
(colon-separated, read by ``up``): work in one of those, as on a real cluster's shared filesystem.

Needs root, ``ip``/``tc`` (iproute2), ``nsenter``/``unshare`` (util-linux), ``sshd``
(openssh-server) and ``ping`` (iputils-ping); missing packages are installed with apt-get as
``tests/slurm_cluster.py`` does. :class:`Unavailable` (raised by :func:`check_available`) says why
a cluster cannot be made here; the tests skip with that reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.cluster_host import (
    DECOY_ADDR,
    DECOY_IF,
    DEFAULT_ROOT,
    PREFIX,
    SUBNET,
    _cmdline,
    _netns_inode,
    _sh,
    check_available,
    down,
    find,
    pids_in_namespace,
    rate_bits,
    shared_tmp,
    write_ssh_files,
)
from tests.slurm_cluster import SlurmCluster, Unavailable, ensure_tools


@dataclass
class Node:
    """One host: ``name`` (its hostname), ``ns`` (network namespace), ``addr`` (eth0's IPv4),
    ``holder`` (PID of the process whose namespaces every command on the node enters)."""

    name: str
    ns: str
    addr: str
    holder: int = 0
    sshd: int = 0


class Cluster:
    """N namespace hosts (see the module docstring). Create with :meth:`up`; reattach from
    another process with :meth:`attach`.

    Attributes:
        root: the cluster folder (keys, configs, logs, state.json).
        nodes: name -> :class:`Node`, in order ``n1..nN``.
        rate: the links' tbf rate (``"1gbit"``) or None (unshaped).
    """

    def __init__(self, root: Path = DEFAULT_ROOT):
        self.root = Path(root)
        self.nodes: dict[str, Node] = {}
        self.rate: str | None = None
        self.shares: list[str] = []  # the folders under /tmp its nodes share (shared_tmp)
        self._slurm: SlurmCluster | None = None

    # ---- state -------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Node names, n1 first."""
        return list(self.nodes)

    def _save(self) -> None:
        state = {"rate": self.rate, "shares": self.shares,
                 "nodes": [vars(n) for n in self.nodes.values()],
                 "slurm": self._slurm.pids() if self._slurm else None}
        (self.root / "state.json").write_text(json.dumps(state, indent=1))

    @classmethod
    def attach(cls, root: Path = DEFAULT_ROOT) -> "Cluster":
        """The running cluster described by ``root/state.json``.

        Raises:
            RuntimeError: no running cluster there (or a node's holder is gone).
        """
        c = cls(root)
        path = Path(root) / "state.json"
        if not path.is_file():
            raise RuntimeError(f"no cluster is up ({path} missing): python -m tests.cluster up 3")
        state = json.loads(path.read_text())
        c.rate, c.shares = state["rate"], state.get("shares", [])
        c.nodes = {n["name"]: Node(**n) for n in state["nodes"]}
        dead = [n.name for n in c.nodes.values() if _netns_inode(n.holder) is None]
        if dead:
            raise RuntimeError(f"the cluster in {root} is broken (holder of {dead} gone): "
                               "python -m tests.cluster down, then up")
        if state.get("slurm"):  # started by another process (up --slurm): its daemons, by PID
            from tests.slurm_cluster import SLURM_TOOLS
            with contextlib.suppress(RuntimeError, Unavailable):
                c._slurm = SlurmCluster.attach(c.root / "slurm", ensure_tools(SLURM_TOOLS),
                                               state["slurm"], **c._slurm_layout())
        return c

    def _slurm_layout(self) -> dict:
        return {"cpus": 2, "nodes": [(n.name, n.addr) for n in self.nodes.values()],
                "on_node": self.prefix}

    def healthy(self) -> bool:
        """Every node's holder and sshd are alive, and n1 reaches every node by ssh."""
        if not self.nodes or any(_netns_inode(n.holder) is None or _netns_inode(n.sshd) is None
                                 for n in self.nodes.values()):
            return False
        first = self.names[0]
        return all(self.run(first, ["ssh", n, "true"], timeout=15, check=False).returncode == 0
                   for n in self.names)

    # ---- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def up(cls, n: int = 3, rate: str | None = None, root: Path = DEFAULT_ROOT) -> "Cluster":
        """Start (or reuse, when the same size is healthy) an ``n``-node cluster; links shaped to
        ``rate`` (None: unshaped).

        Raises:
            Unavailable: see :func:`check_available`.
            ValueError: n < 2 or n > 200, or a bad rate.
            RuntimeError: a step failed (the cluster is torn down first).
        """
        if not 2 <= n <= 200:
            raise ValueError(f"a cluster needs 2..200 nodes, got {n}")
        if rate:
            rate_bits(rate)
        with contextlib.suppress(RuntimeError):
            c = cls.attach(root)  # reused when its nodes share what this process needs
            if len(c.nodes) == n and {str(d) for d in shared_tmp(root)} <= set(c.shares) \
                    and c.healthy():
                c.shape(rate)
                return c
        check_available()
        down(root)
        c = cls(root)
        try:
            c._create(n)
            c.shape(rate)
        except BaseException:
            down(root)
            raise
        return c

    def _create(self, n: int) -> None:
        r = self.root
        for d in ("ssh", "ssh_config.d", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.nodes = {f"n{i}": Node(f"n{i}", f"{PREFIX}-n{i}", f"{SUBNET}.{i}")
                      for i in range(1, n + 1)}
        self.shares = [str(d) for d in shared_tmp(r)]
        self._write_ssh_files()
        (r / "hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost\n" + "".join(
            f"{node.addr} {node.name}\n" for node in self.nodes.values()))
        sw = f"{PREFIX}-sw"
        _sh(["ip", "netns", "add", sw])
        self._ip(sw, "link", "set", "lo", "up")
        self._ip(sw, "link", "add", "br0", "type", "bridge")
        self._ip(sw, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes.values(), 1):
            _sh(["ip", "netns", "add", node.ns])
            # veth pair made here, both ends moved out at once: nothing stays in this namespace
            _sh(["ip", "link", "add", f"{PREFIX}{i}a", "netns", node.ns, "type", "veth",
                 "peer", "name", f"p{i}", "netns", sw])
            self._ip(sw, "link", "set", f"p{i}", "master", "br0", "up")
            self._ip(node.ns, "link", "set", f"{PREFIX}{i}a", "name", "eth0")
            self._ip(node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            self._ip(node.ns, "link", "set", "eth0", "up")
            self._ip(node.ns, "link", "set", "lo", "up")
            self._ip(node.ns, "link", "add", DECOY_IF, "type", "bridge")
            self._ip(node.ns, "addr", "add", DECOY_ADDR, "dev", DECOY_IF)
            self._ip(node.ns, "link", "set", DECOY_IF, "up")
            self._start_holder(node)
            self._start_sshd(node)
        self._save()
        deadline = time.monotonic() + 30
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not reach each other by ssh within 30 s:\n"
                                   + self.logs())
            time.sleep(0.3)

    def _ip(self, ns: str, *args: str) -> None:
        _sh(["ip", "-n", ns, *args])

    def _write_ssh_files(self) -> None:
        write_ssh_files(self.root, {n: node.addr for n, node in self.nodes.items()})

    def _start_holder(self, node: Node) -> None:
        r = self.root
        shares = []
        for d in map(Path, self.shares):
            d.mkdir(parents=True, exist_ok=True)
            rel = shlex.quote(str(d.relative_to("/tmp")))
            shares.append(f"mkdir -p /tmp/{rel} && mount --bind /run/hosttmp/{rel} /tmp/{rel}")
        script = "; ".join([
            f"hostname {node.name}",
            f"mount --bind {r / 'hosts'} /etc/hosts",
            f"mount --bind {r / 'ssh_config.d'} /etc/ssh/ssh_config.d",
            "mount -t tmpfs -o mode=0755 tmpfs /run",
            "mkdir -p /run/sshd /run/hosttmp",
            # the node's own /tmp (SLURM's PMIx and OpenMPI keep per-node files there), with
            # the cluster folder and pytest's temporary folders shared like the rest of the disk
            "mount --rbind /tmp /run/hosttmp",
            "mount -t tmpfs -o mode=1777 tmpfs /tmp",
            *shares,
            # the node's own sysfs (its interfaces), with this machine's cgroups kept (slurmd)
            "mkdir -p /run/cgroup && mount --rbind /sys/fs/cgroup /run/cgroup"
            " && umount -l /sys && mount -t sysfs sysfs /sys"
            " && mount --move /run/cgroup /sys/fs/cgroup",
            "exec sleep infinity"])
        log = open(r / "log" / f"holder-{node.name}.log", "ab")
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{node.ns}", "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", "-c", script], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        node.holder = proc.pid
        deadline = time.monotonic() + 10
        while _cmdline(proc.pid) != "sleep infinity":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{node.name}: the namespace holder did not start:\n"
                                   + self.logs())
            time.sleep(0.02)

    def _start_sshd(self, node: Node) -> None:
        log = open(self.root / "log" / f"sshd-{node.name}.log", "ab")
        proc = subprocess.Popen(self.prefix(node.name) + [
            find("sshd"), "-D", "-e", "-f", str(self.root / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        node.sshd = proc.pid

    def logs(self, chars: int = 2000) -> str:
        """Tails of the cluster's logs (holders, sshd, SLURM), for failure messages."""
        out = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace")
            if text.strip():
                out.append(f"--- {f.name}\n{text[-chars:]}")
        return "\n".join(out)

    # ---- commands on a node ----------------------------------------------------------------------
    def prefix(self, node: str, cwd: str | os.PathLike | None = None) -> list[str]:
        """argv prefix that runs a command on ``node`` (its network, UTS and mount namespaces;
        working directory ``cwd``, default this process's)."""
        return ["nsenter", "-t", str(self.nodes[node].holder), "-n", "-u", "-m",
                f"--wd={os.fspath(cwd or os.getcwd())}", "--"]

    def run(self, node: str, argv: list, timeout: float = 120, check: bool = True,
            cwd=None, env: dict | None = None, input: str | None = None
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``node`` and wait (at most ``timeout`` s: then its whole process group
        is killed and ``subprocess.TimeoutExpired`` raised).

        Raises:
            AssertionError: ``check`` and a non-zero exit, with its output.
        """
        proc = self.popen(node, argv, cwd=cwd, env=env,
                          stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and res.returncode != 0:
            raise AssertionError(f"{node}: {' '.join(map(str, argv))} exited {res.returncode}\n"
                                 f"--- stdout\n{out[-6000:]}\n--- stderr\n{err[-6000:]}")
        return res

    def popen(self, node: str, argv: list, cwd=None, env: dict | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` on ``node`` in a new session (its process group = its PID), text
        output captured unless ``stdout``/``stderr`` are given."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self.prefix(node, cwd) + [str(a) for a in argv], env=env,
                                text=True, start_new_session=True, **kw)

    # ---- links and faults ------------------------------------------------------------------------
    def shape(self, rate: str | None) -> None:
        """Every link at ``rate`` in both directions (tbf on the node's eth0 and on its switch
        port; burst 1 ms of the rate, at least 32 KiB: 950 Mbit/s of TCP at 1gbit, where a
        burst of 100 us (12.5 KB) gave 580 Mbit/s, the segmenting costing CPU; queue 100 ms);
        None removes the shaping.

        Raises:
            ValueError: a malformed rate.
        """
        for i, node in enumerate(self.nodes.values(), 1):
            for ns, dev in ((node.ns, "eth0"), (f"{PREFIX}-sw", f"p{i}")):
                if rate is None:
                    _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    burst = max(32 * 1024, int(rate_bits(rate) / 8 / 1000))
                    _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                         rate, "burst", str(burst), "latency", "100ms"])
        self.rate = rate
        self._save()

    def link(self, node: str, up: bool) -> None:
        """Plug (``up``) or unplug ``node``'s cable at the switch: its eth0 loses carrier and
        nothing reaches it; its processes keep running."""
        i = self.names.index(node) + 1
        self._ip(f"{PREFIX}-sw", "link", "set", f"p{i}", "up" if up else "down")

    def sshd(self, node: str, running: bool) -> None:
        """Stop or (re)start ``node``'s sshd (a node that does not accept ssh)."""
        n = self.nodes[node]
        if running:
            if _netns_inode(n.sshd) is None:
                self._start_sshd(n)
                self._save()
                deadline = time.monotonic() + 10
                while self.run(self.names[0], ["ssh", node, "true"], timeout=15,
                               check=False).returncode:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{node}: sshd did not come back:\n{self.logs()}")
                    time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(n.sshd, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while _netns_inode(n.sshd) is not None and time.monotonic() < deadline:
                time.sleep(0.05)

    def daemons(self) -> set[int]:
        """PIDs of the cluster's own processes (holders, sshd listeners, SLURM daemons and the
        helpers slurmctld and munged fork for themselves, e.g. ``slurmctld: slurmscriptd``; a
        job's ``slurmstepd`` is not theirs: slurmd double-forks it)."""
        pids = {p for n in self.nodes.values() for p in (n.holder, n.sshd)}
        if self._slurm:
            for name, proc in self._slurm.procs.items():
                pids.add(proc.pid)
                if not name.startswith("slurmd"):
                    with contextlib.suppress(psutil.Error):
                        pids |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        return pids

    def processes(self, node: str) -> dict[int, str]:
        """``{pid: command line}`` of every process on ``node`` but the cluster's daemons
        (a job's ranks, launchers, ssh sessions)."""
        ns = _netns_inode(self.nodes[node].holder)
        keep = self.daemons()
        out = {}
        for pid in pids_in_namespace(self.nodes[node].ns):
            if pid not in keep and _netns_inode(pid) == ns:
                out[pid] = _cmdline(pid)
        return {p: c for p, c in out.items() if c}

    def kill_jobs(self, node: str | None = None, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every non-daemon process on ``node`` (all nodes when None); returns
        the PIDs signalled."""
        done = []
        for name in ([node] if node else self.names):
            for pid in self.processes(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                    done.append(pid)
        return done

    def wait_idle(self, timeout: float = 20) -> dict[str, dict[int, str]]:
        """Wait until no node has a job process left; returns what is left after ``timeout``
        (empty when idle)."""
        deadline = time.monotonic() + timeout
        while True:
            left = {n: p for n in self.names if (p := self.processes(n))}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def ping(self, src: str, dst: str, count: int = 20) -> dict:
        """Round-trip time from ``src`` to ``dst`` over the link (ICMP, ``count`` probes 10 ms
        apart after one warm-up): ``{"min_ms", "avg_ms", "max_ms"}``."""
        self.run(src, ["ping", "-c", "1", "-W", "2", dst], timeout=10)
        out = self.run(src, ["ping", "-q", "-c", str(count), "-i", "0.01", dst], timeout=30).stdout
        m = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)", out)
        if not m:
            raise RuntimeError(f"ping {src} -> {dst}: no rtt in {out!r}")
        return {"min_ms": float(m.group(1)), "avg_ms": float(m.group(2)),
                "max_ms": float(m.group(3))}

    def down(self) -> list[str]:
        """Stop SLURM (its jobs cancelled) if it runs, then :func:`down` the whole cluster."""
        if self._slurm is not None:
            with contextlib.suppress(Exception):
                self._slurm.stop()
            self._slurm = None
        return down(self.root)

    def slurm_running(self) -> bool:
        """SLURM's daemons run (started here or by another process)."""
        return self._slurm is not None and all(p.poll() is None
                                               for p in self._slurm.procs.values())

    # ---- SLURM -------------------------------------------------------------------------------
    def slurm(self, start_timeout: float = 90, detach: bool = False) -> SlurmCluster:
        """SLURM over the nodes (started on first call, or the one running already): slurmctld
        and munged on n1, one slurmd per node; client commands run on n1 (slurmctld listens on
        n1's address, which only the nodes reach) with ``SLURM_CONF`` = ``<root>/slurm/
        slurm.conf``. ``detach``: the daemons outlive this process (``python -m tests.cluster up
        N --slurm``; their PIDs are in state.json). Stopped by :meth:`down` (and, being in the
        nodes' namespaces, by :func:`down` from any process).

        Raises:
            Unavailable: SLURM/MUNGE missing and not installable.
            RuntimeError: the daemons did not come up (logs included).
        """
        if self._slurm is not None and all(p.poll() is None for p in self._slurm.procs.values()):
            return self._slurm
        if self._slurm is not None:  # a daemon died: start afresh
            self._slurm.stop()
            self._slurm = None
        from tests.slurm_cluster import SLURM_TOOLS
        slurm = SlurmCluster(self.root / "slurm", ensure_tools(SLURM_TOOLS), detach=detach,
                             **self._slurm_layout())
        self._slurm = slurm
        try:
            slurm.start(start_timeout)
        except BaseException:
            slurm.stop()
            self._slurm = None
            raise
        finally:
            self._save()
        return self._slurm




if __name__ == "__main__":  # python -m tests.cluster ...: tests/cluster_cli.py
    from tests.cluster_cli import main
    sys.exit(main())
