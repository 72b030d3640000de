"""One host's ``hvd-lm doctor`` agent (``python -m hvd_lm.jobs.doctor_agent``; the doctor,
:mod:`hvd_lm.jobs.doctor`, starts one on every host): it prints its facts as one JSON line,
listens on an ephemeral TCP port of every address, reads the plan (one JSON line: whom to probe
and ssh to, which paths to look for), runs it, 32 connections at once at most, prints the
results (one JSON line) and stays reachable until the doctor closes its input.

Started over ssh it speaks on stdout and stdin; started by ``srun`` or ``mpirun`` (one per
node, ``--report-to``) it connects back to the doctor and speaks on that connection, naming its
node (``--node``, or SLURM's name for it: ``SLURMD_NODENAME``).

Its facts: its GPUs, the shard folder as it reads it, the package versions every rank imports
and a digest of hvd_lm's sources (two checkouts of one commit agree).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

import hvd_lm
from hvd_lm.comm.hosts import interfaces, same_host
from hvd_lm.comm.peers import PROBE_TIMEOUT, ask, serve
from hvd_lm.options import Command, error_text, option
from hvd_lm.util.files import open_regular, read_bounded

BACKLOG = 1024          # connections a listener queues (every host probes host 0's at once)
SSH_CONNECT = 5         # ssh ConnectTimeout, seconds


def gpu_count() -> tuple[int, list[str]]:
    """(GPUs, their names) from ``nvidia-smi`` (10 s at most), else the driver's
    ``/proc/driver/nvidia/gpus`` entries, else (0, [])."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        if proc.returncode == 0:
            names = [x.strip() for x in proc.stdout.splitlines() if x.strip()]
            return len(names), names
    d = Path("/proc/driver/nvidia/gpus")
    return len(list(d.iterdir())) if d.is_dir() else 0, []


def shard_facts(folder: str) -> dict:
    """What this host sees of a shard folder: ``{"manifest_sha256", "shards", "bytes"}``, or
    ``{"error": one line}`` when the manifest or a shard cannot be read."""
    from hvd_lm.formats.manifest import MAX_MANIFEST_BYTES, load_manifest

    try:
        man = load_manifest(folder)  # a regular file within MAX_MANIFEST_BYTES, or refused
        total = 0
        for s in man.shards:  # a FIFO or a device named like a shard is refused, never opened
            with open_regular(s.path, "a shard is an HDF5 file") as f:
                f.read(8)
                total += os.fstat(f.fileno()).st_size
        raw = read_bounded(Path(folder) / "manifest.json", MAX_MANIFEST_BYTES,
                           "a manifest lists its shards (hvd_lm.formats.manifest)")
        return {"manifest_sha256": hashlib.sha256(raw).hexdigest(),
                "shards": len(man.shards), "bytes": total}
    except (OSError, ValueError) as e:
        return {"error": error_text(e)}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages every rank imports (None when missing)."""
    out = dict.fromkeys(("torch", "horovod", "mpi4py", "numpy"))
    for name in out:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def source_digest() -> str:
    """sha256 over hvd_lm's Python sources (names and bytes): two checkouts of the same commit
    agree, a host with another version of the code does not (version strings alone would)."""
    h = hashlib.sha256()
    pkg = Path(hvd_lm.__file__).parent
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(pkg)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def listeners(reply: dict, ifaces: dict[str, dict]) -> dict[str, list]:
    """``{interface: [[addr, port], ...]}``: a TCP listener on an ephemeral port of every IPv4
    address, each answering a connection with ``reply``, one JSON line ``{"host", "token"}``
    (who was reached), and closing it (:func:`hvd_lm.comm.peers.serve`)."""
    ports: dict[str, list] = {}
    for name, info in ifaces.items():
        for addr in info["addrs"]:
            with contextlib.suppress(OSError):  # (an address that cannot be bound is left out)
                s = serve(socket.create_server((addr, 0), backlog=BACKLOG), reply)
                ports.setdefault(name, []).append([addr, s.getsockname()[1]])
    return ports


def listen_on(port: int, reply: dict) -> dict:
    """Also answer ``reply`` on ``port`` of every address (the torch engine's rendezvous port):
    ``{"port", "error"}``, the error (None: listening) saying why it cannot be opened."""
    try:
        serve(socket.create_server(("", port)), reply)
    except OSError as e:
        return {"port": port, "error": f"port {port} cannot be opened on "
                f"{socket.gethostname()} ({e.strerror or e}): another job or process holds it"}
    return {"port": port, "error": None}


def probe(addr: str, port: int) -> dict:
    """Connect to a listener (:func:`hvd_lm.comm.peers.ask`): ``{"ok": True, "host",
    "token"}`` with whom it reached, or ``{"ok": False, "error": "timed out" | ...}``."""
    try:
        return {"ok": True, **ask(addr, port)}
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
    return {"ok": proc.returncode == 0, "error": lines[-1] if lines and proc.returncode else ""}


@dataclass
class AgentConfig:
    """One host's agent: facts, then the checks the doctor sends (stdout and stdin, or the
    connection ``--report-to`` opens)."""

    shards: str = option("", "shard folder to check ('' = none)")
    ssh_port: Optional[int] = option(None, "ssh port of the other hosts", ge=1, le=65535)
    timeout: float = option(60.0, "the agent exits after this many seconds whatever happens", gt=0)
    rendezvous_port: Optional[int] = option(None, "also listen on this port (the first host's "
                                            "agent: the torch engine's rendezvous)", ge=1, le=65535)
    rendezvous_host: str = option("", "listen on --rendezvous-port only on this node (the "
                                  "first; agents started by srun or mpirun)")
    node: str = option("", "the listed name of this host (mpirun gives each agent its own; "
                       "under srun: SLURMD_NODENAME)")
    report_to: str = option("", "speak to the doctor at ADDR[,ADDR...]:PORT (the first address "
                            "that answers within 3 s) instead of stdout and stdin")
    key: str = option("", "with --report-to: the doctor's key, sent back with the facts")


def connect_back(report_to: str):
    """(writer, reader) of a connection to the doctor at ``ADDR[,ADDR...]:PORT``, the first
    address that accepts within :data:`PROBE_TIMEOUT` seconds; None when none does."""
    addrs, _, port = report_to.rpartition(":")
    for addr in addrs.split(","):
        with contextlib.suppress(OSError, ValueError):
            s = socket.create_connection((addr, int(port)), timeout=PROBE_TIMEOUT)
            s.settimeout(None)
            return s.makefile("w"), s.makefile("r")
    return None


def agent(cfg: AgentConfig) -> int:
    """Print this host's facts (one JSON line), read the plan (one JSON line: ``probes``,
    ``ssh``, ``paths``), run it in parallel, print the results (one JSON line), exit at the
    input's end; 2 when the doctor at ``--report-to`` cannot be reached."""
    signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
    signal.alarm(max(1, int(cfg.timeout)))
    reply = {"host": socket.gethostname(), "token": secrets.token_hex(8)}  # who was reached
    ifaces = interfaces()
    gpus, gpu_names = gpu_count()
    # started by srun or mpirun: which listed host this is
    node = cfg.node or os.environ.get("SLURMD_NODENAME", "")
    first = not cfg.rendezvous_host or same_host(node, cfg.rendezvous_host)
    facts = {**reply, "python": sys.version.split()[0], "executable": sys.executable,
             "hvd_lm": hvd_lm.__version__, "hvd_lm_path": str(Path(hvd_lm.__file__).parent),
             "hvd_lm_digest": source_digest(), "packages": package_versions(),
             "interfaces": ifaces, "listeners": listeners(reply, ifaces),
             "gpus": gpus, "gpu_names": gpu_names, "node": node, "key": cfg.key,
             "shards": shard_facts(cfg.shards) if cfg.shards else None,
             "rendezvous": listen_on(cfg.rendezvous_port, reply)
             if cfg.rendezvous_port and first else None}
    out, inp = ((connect_back(cfg.report_to) or (None, None)) if cfg.report_to
                else (sys.stdout, sys.stdin))
    if out is None:
        print(f"hvd-lm doctor: ERROR: {node or reply['host']} cannot reach the doctor at "
              f"{cfg.report_to}", file=sys.stderr)
        return 2
    print(json.dumps(facts), file=out, flush=True)
    if not (line := inp.readline()):
        return 0
    plan = json.loads(line)
    with cf.ThreadPoolExecutor(max_workers=32) as pool:
        probes = [pool.submit(probe, p["addr"], p["port"]) for p in plan["probes"]]
        sshs = {h: pool.submit(ssh_check, h, cfg.ssh_port) for h in plan["ssh"]}
        result = {"probes": [dict(p, **f.result()) for p, f in zip(plan["probes"], probes)],
                  "ssh": {h: f.result() for h, f in sshs.items()},
                  "paths": {p: os.path.exists(p) for p in plan.get("paths", [])}}
    print(json.dumps(result), file=out, flush=True)
    inp.read()  # stay reachable until every host is done probing
    return 0


AGENT = Command(AgentConfig, agent, config_flag=False)


if __name__ == "__main__":  # one host's agent
    sys.exit(AGENT.main(None, "python -m hvd_lm.jobs.doctor_agent"))
