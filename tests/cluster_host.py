"""The machine side of the cluster in a box (tests/cluster.py): its constants, the processes
and namespaces it owns, the tools it needs, teardown and the session lock."""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from tests.slurm_cluster import Unavailable, ensure_tools

PREFIX = "hvdlm"                       # namespace names: hvdlm-sw, hvdlm-n1, ...
SUBNET = "10.77.0"                     # private, exists only inside the namespaces
DECOY_IF, DECOY_ADDR = "docker0", "172.17.0.1/16"
DEFAULT_ROOT = Path(os.environ.get("HVD_LM_CLUSTER_DIR", "/tmp/hvdlm-cluster"))
CHECKOUT = Path(__file__).resolve().parents[1]  # the repository the nodes run
#: set (to its PID) by the process that holds :func:`session_lock`, for its children
HOLDER_VAR = "HVD_LM_CLUSTER_HOLDER"
#: binary -> Debian package
TOOLS = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux", "unshare": "util-linux",
         "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
         "ping": "iputils-ping"}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")



def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9, ``"100mbit"`` -> 1e8 (tc's decimal units), bits per second.

    Raises:
        ValueError: not ``<number>[k|m|g]bit``.
    """
    m = _RATE.match(rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: expected e.g. 10gbit, 1gbit, 100mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _sh(cmd: list[str], timeout: float = 30, check: bool = True, **kw
        ) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie child of this process is reaped and counts as gone)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def our_namespaces() -> list[str]:
    """Names of this cluster's network namespaces that exist now (``ip netns list``)."""
    proc = _sh(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX + "-")]


def pids_in_namespace(ns: str) -> list[int]:
    """PIDs of every process whose network namespace is ``ns`` (``ip netns pids``)."""
    proc = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def check_available() -> dict[str, str]:
    """The tools' paths, once this machine can make the cluster (root, namespaces).

    Raises:
        Unavailable: not root, a tool missing and not installable, or namespaces cannot be
            created (e.g. an unprivileged container), with the reason.
    """
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root: run the cluster tests as root")
    tools = ensure_tools(TOOLS)
    probe = f"{PREFIX}-probe"
    proc = _sh(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        raise Unavailable(f"cannot create a network namespace ({proc.stderr.strip()}): run "
                          "them on a host or a container allowed to (CAP_SYS_ADMIN)")
    _sh(["ip", "netns", "del", probe], check=False)
    return tools


def shared_tmp(root: Path) -> list[Path]:
    """Folders under /tmp that every node shares with this machine (each node's /tmp is its
    own): the cluster folder, pytest's temporary folders (``/tmp/pytest-of-<user>``), this
    checkout and the interpreter's environment when they are under /tmp (a clone in /tmp: the
    nodes run its ``.venv/bin/python`` at the same path) and those listed in
    ``HVD_LM_CLUSTER_SHARE`` (colon-separated); a folder inside another is left out (shared
    with it). Everything outside /tmp is shared."""
    user = os.environ.get("USER") or ("root" if os.geteuid() == 0 else str(os.geteuid()))
    dirs = [Path(root), Path(f"/tmp/pytest-of-{user}"), CHECKOUT, Path(sys.prefix),
            Path(sys.base_prefix),
            *(Path(p) for p in os.environ.get("HVD_LM_CLUSTER_SHARE", "").split(":") if p)]
    found = list(dict.fromkeys(d.resolve() for d in dirs))
    found = [d for d in found if d.is_relative_to("/tmp") and d != Path("/tmp")]
    return [d for d in found if not any(d != e and d.is_relative_to(e) for e in found)]


def find(tool: str) -> str:
    """Path of a tool (PATH, /usr/sbin, /sbin)."""
    from tests.slurm_cluster import find_tool
    path = find_tool(tool)
    if not path:
        raise Unavailable(f"{tool} not found")
    return path


def down(root: Path = DEFAULT_ROOT) -> list[str]:
    """Tear down every namespace of this cluster (whatever state it is in): SIGTERM, then
    SIGKILL after 3 s, to every process in them; delete them (their veths go too); remove the
    cluster folder. Idempotent; returns the namespaces deleted.

    Raises:
        RuntimeError: a process or namespace could not be removed.
    """
    names = our_namespaces()
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        pids = {p for ns in names for p in pids_in_namespace(ns)}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if _alive(p)}
            time.sleep(0.05)
    left = {ns: [p for p in pids_in_namespace(ns) if _alive(p)] for ns in names}
    if any(left.values()):
        raise RuntimeError(f"processes left in the cluster's namespaces: {left}")
    for ns in names:
        _sh(["ip", "netns", "del", ns])
    if Path(root).is_dir():
        shutil.rmtree(root, ignore_errors=True)
    still = our_namespaces()
    if still:
        raise RuntimeError(f"namespaces left: {still}")
    return names


@contextlib.contextmanager
def session_lock(root: Path = DEFAULT_ROOT, timeout: float = 900) -> Iterator[None]:
    """Hold ``<root>.lock`` (flock) so that two test sessions on this machine never share the
    one set of namespace names; waits at most ``timeout`` s.

    Raises:
        Unavailable: another session held it for ``timeout`` s.
    """
    path = Path(f"{root}.lock")
    with open(path, "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"another session holds {path} (its cluster is up): let "
                                      "it end, or python -m tests.cluster down") from None
                time.sleep(1)
        os.environ[HOLDER_VAR] = str(os.getpid())  # its children may use the command line
        try:
            yield
        finally:
            os.environ.pop(HOLDER_VAR, None)
            fcntl.flock(f, fcntl.LOCK_UN)


def write_ssh_files(root: Path, addrs: dict[str, str]) -> None:
    """The cluster's ssh keys, ``sshd_config`` and client config under ``root`` (``addrs``: node
    name -> eth0 address): every node's sshd takes root's key only, every client knows every
    node by name and address."""
    s = root / "ssh"
    for key in ("id_ed25519", "host_ed25519"):
        if not (s / key).exists():
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{PREFIX}-{key}",
                 "-f", str(s / key)])
    shutil.copy(s / "id_ed25519.pub", s / "authorized_keys")
    names = ",".join([*addrs, *addrs.values()])
    (s / "known_hosts").write_text(f"{names} {(s / 'host_ed25519.pub').read_text()}")
    (root / "sshd_config").write_text("\n".join([
        "# sshd of one namespace node (tests/cluster.py)",
        "Port 22",
        f"HostKey {s / 'host_ed25519'}",
        "PidFile none",
        "PermitRootLogin prohibit-password",
        f"AuthorizedKeysFile {s / 'authorized_keys'}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "MaxStartups 100:30:200",
        "MaxSessions 100",
        "ClientAliveInterval 5",
        "ClientAliveCountMax 3",
        "Subsystem sftp internal-sftp", ""]))
    hosts = " ".join([*addrs, f"{SUBNET}.*"])
    (root / "ssh_config.d" / "hvdlm-cluster.conf").write_text("\n".join([
        "# ssh client settings inside the namespace nodes (tests/cluster.py)",
        f"Host {hosts}",
        "  User root",
        f"  IdentityFile {s / 'id_ed25519'}",
        f"  UserKnownHostsFile {s / 'known_hosts'}",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "  ConnectTimeout 5",
        "  ServerAliveInterval 5",
        "  ServerAliveCountMax 3",
        "  LogLevel ERROR", ""]))
