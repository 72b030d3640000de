"""Host lists and this host's network, for multi-node launches (``hvd-lm doctor``, the
benchmarks across hosts): ``host:slots`` lists and hostfiles as horovodrun and OpenMPI take them
(SLURM's compressed names expanded), whether a name is this machine (Horovod's rule for starting
a rank without ssh), which peers a host checks, and this host's IPv4 interfaces and link speeds
(psutil)."""

from __future__ import annotations

import re
import socket

import hostlist

from hvd_lm.options.command import error_text
from hvd_lm.util.files import FileRefused, read_bounded, shown

FULL_MESH_HOSTS = 16    # up to this many hosts every pair is checked; above, ring neighbours
#: Most of the doctor's ssh connections one host receives at once (:func:`ssh_peers`), and most
#: ssh connections the doctor has unauthenticated at once: under sshd's default ``MaxStartups
#: 10:30:100``, which drops unauthenticated connections beyond 10.
SSH_AT_ONCE = 8
#: Largest hostfile read (:func:`parse_hostfile`): a PBS/SLURM node list has a line per rank,
#: 100,000 ranks of 64-byte names in 6.4 MB.
HOSTFILE_MAX_BYTES = 16 << 20


def parse_hosts(text: str, merge: bool = False, what: str = "--hosts") -> list[tuple[str, int]]:
    """``"n1:8,n2:8"`` (horovodrun's ``-H``; ``n1`` alone is 1 slot) -> [(host, slots)], in
    first-seen order; SLURM's compressed names expand (``n[001-004,7]:8``, what
    ``$SLURM_JOB_NODELIST`` holds: python-hostlist's ``expand_hostlist``), each with the slots
    of its item; with ``merge`` (a node list, one line per rank) a host listed twice adds up its
    slots. The one reader of host lists: ``hvd-lm doctor``, ``hvd-lm launch --hosts``, the
    launch templates' ``HOSTS`` and hostfiles (:func:`parse_hostfile`).

    Raises:
        ValueError: one line naming ``what`` (the flag or variable): an empty list, an empty
            name, a bad slot count, brackets SLURM's syntax does not read, or (without
            ``merge``) a host listed twice (``localhost:8`` 64 times would be one host of 512
            slots).
    """
    out: dict[str, int] = {}
    items = []
    # items split at the commas outside brackets (linear: a look-ahead for "]" was quadratic)
    for item in (x.strip(" ") for x in re.findall(r"(?:\[[^\]]*\]?|[^,\[])+", text) if x.strip()):
        if re.search(r"[\x00-\x1f\x7f]", item):  # a newline in a name: a script's next line
            raise ValueError(f"{what} {item!r} is not host or host:slots (a control character "
                             "inside)")
        names, _, slots = item.partition(":")
        try:
            items += [f"{h}:{slots}" if slots else h for h in hostlist.expand_hostlist(names)]
        except hostlist.BadHostlist as e:
            raise ValueError(f"{what} {item!r} is not SLURM's host list syntax, e.g. "
                             f"n[001-004,7]:8 ({e})") from None
    for item in items:
        host, _, slots = item.partition(":")
        if not host or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise ValueError(f"{what} {item!r} is not host or host:slots (slots >= 1)")
        if host in out and not merge:
            n = sum(x.partition(":")[0] == host for x in items)
            raise ValueError(f"{what} lists {host} {n} times: give each host once, with all "
                             f"its ranks as its slots ({host}:N)")
        out[host] = out.get(host, 0) + int(slots or 1)
    if not out:
        raise ValueError(f"{what} is empty: give host:slots,... (e.g. n1:8,n2:8) or a hostfile")
    return list(out.items())


def parse_hostfile(path: str, what: str = "--hostfile") -> list[tuple[str, int]]:
    """Hosts of an OpenMPI/horovodrun hostfile (``node1 slots=8``, ``node1:8``) or a PBS/SLURM
    node list (one line per rank: repeated names add slots); ``#`` starts a comment; a name may
    be SLURM's compressed form (``n[001-004] slots=8``: :func:`parse_hosts`).

    Read within :data:`HOSTFILE_MAX_BYTES` (:func:`hvd_lm.util.files.read_bounded`): a FIFO, a
    device or a socket is named as what it is, never opened.

    Raises:
        ValueError: the file is missing, not a regular file, larger than
            :data:`HOSTFILE_MAX_BYTES`, not UTF-8 or lists no host; a malformed line (named with
            its number). Each names ``what`` (the flag or variable) and the file.
    """
    try:
        text = read_bounded(path, HOSTFILE_MAX_BYTES, "a hostfile is text, a line per host or "
                            "per rank (hvd_lm.comm.hosts.HOSTFILE_MAX_BYTES)").decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what} {shown(path)}: no such file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {shown(path)}: not UTF-8 text (byte {e.start:,})") from None
    except (FileRefused, OSError) as e:
        raise ValueError(f"{what} {error_text(e)}") from None
    out: dict[str, int] = {}
    for i, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        host, colon, count = words[0].partition(":")
        slots = int(count) if colon and count.isdigit() else (None if colon else 1)
        for w in words[1:]:
            if w.startswith(("slots=", "max_slots=")) and w.split("=", 1)[1].isdigit():
                slots = int(w.split("=", 1)[1]) if w.startswith("slots=") else slots
            else:
                slots = None
        if not host or slots is None or slots < 1:
            raise ValueError(f"{what} {shown(path)}:{i}: expected 'host', 'host:N' or 'host "
                             f"slots=N' with N >= 1, got {raw.strip()[:120]!r}")
        for h, n in parse_hosts(f"{host}:{slots}", True, f"{what} {shown(path)}:{i}:"):
            out[h] = out.get(h, 0) + n
    if not out:
        raise ValueError(f"{what} {shown(path)}: no hosts listed")
    return list(out.items())


def is_local(host: str) -> bool:
    """True when ``host`` resolves to an IPv4 address of this machine (its network namespace,
    loopback included: Horovod's rule for starting a rank without ssh); an unresolvable name is
    not local."""
    import psutil

    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    return any(a.address in addrs for nic in psutil.net_if_addrs().values() for a in nic)


def peers_of(i: int, n: int) -> list[int]:
    """Indices of the hosts host ``i`` checks: all others up to :data:`FULL_MESH_HOSTS` hosts,
    beyond that host 0 and its 4 ring neighbours on each side (O(n) checks per host)."""
    near = range(n) if n <= FULL_MESH_HOSTS else {(i + d) % n for d in range(-4, 5)} | {0}
    return sorted(set(near) - {i})


def ssh_peers(i: int, n: int) -> list[int]:
    """Indices of the hosts host ``i`` checks ssh to: all others up to ``SSH_AT_ONCE + 1``
    hosts; beyond that host 0 reaches every host (the launchers start ranks from it) and every
    other host its 3 ring neighbours on each side. So no host receives more than
    :data:`SSH_AT_ONCE` of these connections, however many hosts there are."""
    everyone = n <= SSH_AT_ONCE + 1 or i == 0
    near = range(n) if everyone else {(i + d) % n for d in (-3, -2, -1, 1, 2, 3)}
    return sorted(set(near) - {i})


def same_host(a: str, b: str) -> bool:
    """True when two names of a host agree, a short name matching the long one
    (``n1`` and ``n1.cluster``: a node list and ``hostname`` may differ so; addresses must be
    equal)."""
    short = [x.split(".")[0] for x in (a, b) if not x.replace(".", "").isdigit()]
    return a == b or (len(short) == 2 and short[0] == short[1])


def interfaces() -> dict[str, dict]:
    """``{name: {"addrs": [IPv4...], "speed_mbit": int (-1 unknown), "loopback": bool}}`` of
    every interface that is up and has an IPv4 address (psutil's addresses and link speed)."""
    import psutil

    stats = psutil.net_if_stats()
    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        st = stats.get(name)
        if not v4 or (st is not None and not st.isup):
            continue
        # (psutil's speed is 0 when unknown)
        out[name] = {"addrs": v4, "speed_mbit": st.speed if st is not None and st.speed > 0 else -1,
                     "loopback": all(a.startswith("127.") for a in v4)}
    return out
