"""``python -m tests.cluster``: the cluster in a box (tests/cluster.py) from the command line,
what a session on this machine uses to measure::

    python -m tests.cluster up 3 --rate 1gbit     # 3 nodes, 1 Gbit/s links
    python -m tests.cluster up 2 --slurm          # and SLURM, left running: prints SLURM_CONF
    python -m tests.cluster run n1 -- hostname    # a command on node n1 (cwd and env kept)
    python -m tests.cluster shape 100mbit         # reshape every link (none: unshaped)
    python -m tests.cluster status | ping | down  # down: SLURM, every process, namespace, file

It runs from any folder once ``make setup`` has put the checkout on the venv's path
(``scripts/setup.sh``: ``_hvd_lm_checkout.pth``)."""
from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
from pathlib import Path

from tests.cluster import DECOY_ADDR, DECOY_IF, Cluster
from tests.cluster_host import DEFAULT_ROOT, HOLDER_VAR, down, shared_tmp
from tests.slurm_cluster import Unavailable


def _not_held(root: Path) -> None:
    """Refuse to change the cluster while a test session holds it (:func:`session_lock`).

    Raises:
        RuntimeError: the lock is held.
    """
    if os.environ.get(HOLDER_VAR):  # run by the session that holds it (tests/test_journey.py)
        return
    with open(f"{root}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"a test session holds the cluster in a box ({root}.lock): wait "
                               "until it ends") from None
        fcntl.flock(f, fcntl.LOCK_UN)


def _print_slurm(c: Cluster) -> None:
    """Start SLURM (detached: it outlives this command) and say how to use it."""
    slurm = c.slurm(detach=True)
    print(f"slurm: slurmctld on {c.names[0]}, slurmd on {', '.join(c.names)}; its commands "
          f"reach slurmctld from the nodes only:\n"
          f"export SLURM_CONF={slurm.conf}\n"
          f"python -m tests.cluster run {c.names[0]} -- sbatch job.sbatch   # then squeue, "
          "scancel, ... the same way; `python -m tests.cluster down` stops it all")


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.cluster up N [--rate R] [--slurm] | slurm | down | status | shape RATE |
    link NODE up|down | ping | run NODE -- CMD...``; one ``ERROR:`` line on failure."""
    p = argparse.ArgumentParser(prog="python -m tests.cluster", description="A cluster in a "
                                "box: N hosts as Linux network namespaces on this machine.")
    p.add_argument("--root", default=str(DEFAULT_ROOT), help="cluster folder")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start N nodes (reuses a healthy cluster of that size)")
    u.add_argument("n", type=int, nargs="?", default=3)
    u.add_argument("--rate", default=None, help="tbf rate of every link, e.g. 1gbit")
    u.add_argument("--slurm", action="store_true", help="and SLURM over them (slurmctld on n1, "
                   "one slurmd per node), left running; prints the SLURM_CONF to export")
    sub.add_parser("slurm", help="start SLURM on the running nodes (left running), print the "
                   "SLURM_CONF to export")
    sub.add_parser("down", help="stop everything, delete the namespaces and the folder")
    sub.add_parser("status", help="nodes, addresses, link rate, job processes")
    s = sub.add_parser("shape", help="set every link's rate (none: unshaped)")
    s.add_argument("rate")
    lk = sub.add_parser("link", help="plug or unplug a node's cable at the switch")
    lk.add_argument("node")
    lk.add_argument("state", choices=("up", "down"))
    sub.add_parser("ping", help="round-trip times n1 -> every other node")
    r = sub.add_parser("run", help="run a command on a node: run n1 -- CMD ...")
    r.add_argument("node")
    r.add_argument("argv", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    root = Path(a.root)
    try:
        if a.cmd in ("up", "slurm", "down"):
            _not_held(root)
        if a.cmd == "up":
            c = Cluster.up(a.n, a.rate, root)
            print(f"up: {', '.join(f'{n.name}={n.addr}' for n in c.nodes.values())}; links "
                  f"{c.rate or 'unshaped'}; decoy {DECOY_IF} {DECOY_ADDR} on every node; shared "
                  f"with the nodes: everything outside /tmp, and "
                  f"{', '.join(map(str, shared_tmp(root)))} (add folders with "
                  "HVD_LM_CLUSTER_SHARE=DIR:DIR before up)")
            if a.slurm:
                _print_slurm(c)
        elif a.cmd == "slurm":
            _print_slurm(Cluster.attach(root))
        elif a.cmd == "down":
            print(f"down: removed {down(root) or 'nothing'}")
        elif a.cmd == "run":
            cmd = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
            c = Cluster.attach(root)
            return subprocess.call(c.prefix(a.node) + cmd)
        else:
            c = Cluster.attach(root)
            if a.cmd == "shape":
                c.shape(None if a.rate == "none" else a.rate)
                print(f"links: {c.rate or 'unshaped'}")
            elif a.cmd == "link":
                c.link(a.node, a.state == "up")
            elif a.cmd == "ping":
                for n in c.names[1:]:
                    print(f"{c.names[0]} -> {n}: {c.ping(c.names[0], n)}")
            else:
                for n in c.nodes.values():
                    print(f"{n.name} {n.addr} ns={n.ns} holder={n.holder} sshd={n.sshd} "
                          f"jobs={len(c.processes(n.name))}")
                print(f"links: {c.rate or 'unshaped'}")
                conf = c.root / "slurm" / "slurm.conf"
                print(f"slurm: running, SLURM_CONF={conf}" if c.slurm_running() else
                      "slurm: not running (python -m tests.cluster slurm)")
    except (Unavailable, RuntimeError, ValueError, KeyError) as e:
        print(f"tests.cluster: ERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
