"""Which rank was lost: a tiny TCP listener per rank, probed when a collective fails.

A collective that loses a peer mid-way (its host's link went down, the host or the process died)
does not say which peer: Gloo gives up after ``HOROVOD_GLOO_TIMEOUT_SECONDS`` with "Timed out
waiting 30000ms for recv operation to complete", Horovod then shuts down with "Horovod has been
shut down. This was caused by an exception on one of the ranks ...". To turn that into one line
naming the host, every rank opens a listener on an ephemeral TCP port at start (:class:`PeerWatch`;
it answers a connection with its rank), the ranks exchange ``{rank, host, port}`` once (the
training loop's one ``allgather_object``), and after a failed collective each surviving rank
connects to every other rank's listener, 3 s each, in parallel (:func:`probe_peers`):

* no answer within 3 s: the host is unreachable (its link is down, or the host is gone);
* connection refused: the host is up but the rank's process is gone (killed, crashed);
* an answer: that rank is alive (it is not the one lost).

No collective library is used here (plain sockets), so the probe works after Horovod has shut
down. The listener thread is a daemon and costs nothing while nothing connects.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import socket
import threading

PROBE_TIMEOUT = 3.0  # seconds per connection attempt


class PeerWatch:
    """This rank's listener (see the module docstring).

    Args:
        rank: this process's rank (what the listener answers).
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.host = socket.gethostname()
        self.sock = socket.create_server(("", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True, name="hvd_lm-peerwatch").start()

    def info(self) -> dict:
        """``{"rank", "host", "port"}``: what the other ranks need to probe this one."""
        return {"rank": self.rank, "host": self.host, "port": self.port}

    def _serve(self) -> None:
        reply = (json.dumps({"rank": self.rank, "host": self.host}) + "\n").encode()
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(PROBE_TIMEOUT)
                conn.sendall(reply)

    def close(self) -> None:
        """Stop listening."""
        with contextlib.suppress(OSError):
            self.sock.close()


def probe(peer: dict, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when ``peer``'s listener answers as that rank, else why not (one phrase)."""
    try:
        addr = socket.gethostbyname(peer["host"])
    except OSError as e:
        return f"its host name does not resolve ({e})"
    try:
        with socket.create_connection((addr, peer["port"]), timeout=timeout) as s:
            s.settimeout(timeout)
            data = s.makefile("rb").readline()
        if json.loads(data.decode() or "{}").get("rank") == peer["rank"]:
            return None
        return f"{addr}:{peer['port']} answered as another process"
    except socket.timeout:
        return (f"{addr} does not answer within {timeout:g} s: its network link is down or the "
                "host is gone")
    except ConnectionRefusedError:
        return f"{addr} refuses the connection: the host is up but the rank's process is gone"
    except (OSError, ValueError) as e:
        return f"{addr}: {e}"


def probe_peers(table: list[dict], me: int, timeout: float = PROBE_TIMEOUT) -> dict[int, str]:
    """``{rank: why}`` for every other rank in ``table`` (:meth:`PeerWatch.info` of each) that
    does not answer; empty when all do. All probes run at once (at most ``timeout`` s)."""
    others = [p for p in table if p["rank"] != me]
    if not others:
        return {}
    with cf.ThreadPoolExecutor(max_workers=min(64, len(others))) as pool:
        results = list(pool.map(lambda p: probe(p, timeout), others))
    return {p["rank"]: why for p, why in zip(others, results) if why}


def lost_peers_text(table: list[dict], me: int, timeout: float = PROBE_TIMEOUT) -> str:
    """The lost ranks as one phrase: ``rank 1 on host n2 (10.77.0.2 does not answer ...)``
    (grouped by host when a host lost several ranks), or a phrase saying every peer answers."""
    lost = probe_peers(table, me, timeout)
    if not lost:
        return "every other rank still answers (the failure is not a lost host)"
    by_host: dict[tuple[str, str], list[int]] = {}
    hosts = {p["rank"]: p["host"] for p in table}
    for r, why in sorted(lost.items()):
        by_host.setdefault((hosts[r], why), []).append(r)
    parts = []
    for (host, why), ranks in by_host.items():
        rs = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
        parts.append(f"{rs} on host {host} ({why})")
    return "lost " + "; ".join(parts)


class LostPeer(RuntimeError):
    """A collective failed because a peer was lost (the message names its host).

    Attributes:
        report: True on the ranks that print the line (each node's local rank 0), False on the
            others, which exit 1 quietly so that the job log gets one line per node, not one per
            rank.
    """

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report
