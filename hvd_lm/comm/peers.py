"""Which rank was lost: a tiny TCP listener per rank, probed when a collective fails.

A collective that loses a peer mid-way (its host's link went down, the host or the process died)
does not say which peer: Gloo gives up after ``HOROVOD_GLOO_TIMEOUT_SECONDS`` with "Timed out
waiting 30000ms for recv operation to complete", Horovod then shuts down with "Horovod has been
shut down. This was caused by an exception on one of the ranks ...". To turn that into one line
naming the host, every rank opens a listener on an ephemeral TCP port at start (:class:`PeerWatch`;
it answers a connection with its rank), the ranks exchange ``{rank, host, port}`` once (the
training loop's one ``allgather_object``), and after a failed collective each surviving host's
local rank 0 connects to the listeners of its own host's ranks and the next host's, 3 s each, in
parallel (:func:`probe_lost`; bounded: about 2 x world size connections per failure in all):

* no answer within 3 s: the host is unreachable (its link is down, or the host is gone);
* connection refused: the host is up but the rank's process is gone (killed, crashed);
* an answer: that rank is alive (it is not the one lost).

No collective library is used here (plain sockets), so the probe works after Horovod has shut
down. The listener thread is a daemon and costs nothing while nothing connects. The listener and
the probe (:func:`serve`, :func:`ask`) are also ``hvd-lm doctor``'s: its agents answer on every
address with their token (:mod:`hvd_lm.jobs.doctor_agent`).
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
        self.sock = serve(socket.create_server(("", 0)), {"rank": rank, "host": self.host})
        self.port = self.sock.getsockname()[1]

    def info(self) -> dict:
        """``{"rank", "host", "port"}``: what the other ranks need to probe this one."""
        return {"rank": self.rank, "host": self.host, "port": self.port}

    def close(self) -> None:
        """Stop listening: ``shutdown`` first, which wakes the thread blocked in ``accept()``
        (``close`` alone leaves it answering on Linux)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def serve(sock: socket.socket, reply: dict) -> socket.socket:
    """Answer every connection to the listening ``sock`` with ``reply`` as one JSON line, then
    close it, on a daemon thread until ``sock`` is closed; returns ``sock``."""
    line = (json.dumps(reply) + "\n").encode()

    def loop() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(PROBE_TIMEOUT)
                conn.sendall(line)

    threading.Thread(target=loop, daemon=True, name="hvd_lm-listener").start()
    return sock


def ask(addr: str, port: int, timeout: float = PROBE_TIMEOUT) -> dict:
    """The JSON line a listener (:func:`serve`) at ``addr:port`` answers, within ``timeout`` s
    to connect and as long again to read it.

    Raises:
        socket.timeout: no connection or no answer in time (a link down, a host gone).
        ConnectionRefusedError: nothing listens there (the host is up, the process gone).
        OSError: another network error.
        ValueError: the answer is not one JSON object (another process answered).
    """
    with socket.create_connection((addr, port), timeout=timeout) as s:
        answer = json.loads(s.makefile("rb").readline())
    if not isinstance(answer, dict):
        raise ValueError(f"{addr}:{port} answered as another process")
    return answer


def probe(peer: dict) -> str | None:
    """None when ``peer``'s listener answers as that rank, else why not (one phrase)."""
    try:
        addr = socket.gethostbyname(peer["host"])
    except OSError as e:
        return f"its host name does not resolve ({e})"
    try:
        answer = ask(addr, peer["port"])
    except socket.timeout:
        return (f"{addr} does not answer within {PROBE_TIMEOUT:g} s: its network link is down or "
                "the host is gone")
    except ConnectionRefusedError:
        return f"{addr} refuses the connection: the host is up but the rank's process is gone"
    except ValueError:
        answer = {}
    except OSError as e:
        return f"{addr}: {e}"
    same = answer.get("rank") == peer["rank"]
    return None if same else f"{addr}:{peer['port']} answered as another process"


def probe_targets(table: list[dict], me: int) -> list[dict]:
    """The peers rank ``me`` probes after a failed collective: the other ranks of its own host
    and every rank of the next host (hosts in the order of their first rank, a ring): each
    rank's host is probed by two hosts' first ranks at most, so the probes of a failure are
    about 2 x world size in all and 2 x ranks per host from any one prober, whatever the world
    size (an all-to-all probe was world size squared: 16K connections at 128 ranks)."""
    hosts = list(dict.fromkeys(p["host"] for p in table))
    mine = next(p["host"] for p in table if p["rank"] == me)
    nxt = hosts[(hosts.index(mine) + 1) % len(hosts)]
    return [p for p in table if p["rank"] != me and p["host"] in (mine, nxt)]


def probe_lost(table: list[dict], me: int) -> list[dict]:
    """``[{rank, host, why}]`` for each of :func:`probe_targets` that does not answer, in rank
    order; empty when all do. All probes run at once (at most :data:`PROBE_TIMEOUT` s)."""
    targets = probe_targets(table, me)
    with cf.ThreadPoolExecutor(max_workers=min(64, len(targets) or 1)) as pool:
        results = list(pool.map(probe, targets))
    return [{"rank": p["rank"], "host": p["host"], "why": why}
            for p, why in zip(targets, results) if why]


def lost_text(lost: list[dict]) -> str:
    """The lost ranks as one phrase: ``lost rank 1 on host n2 (10.77.0.2 does not answer ...)``
    (grouped by host and reason when a host lost several ranks), or a phrase saying every probed
    peer answers."""
    if not lost:
        return "every probed rank still answers (the failure is not a lost host)"
    by_host: dict[tuple[str, str], list[int]] = {}
    for p in sorted(lost, key=lambda p: p["rank"]):
        by_host.setdefault((p["host"], p["why"]), []).append(p["rank"])
    return "lost " + "; ".join(f"rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))} on "
                               f"host {host} ({why})" for (host, why), ranks in by_host.items())


class LostPeer(RuntimeError):
    """A collective failed because a peer was lost (the message names its host), or, after a
    stop signal, because the launcher is stopping the job.

    Attributes:
        report: True on the ranks that print the line (each host's local rank 0), False on the
            others, which exit 1 quietly so that the job log gets one line per host, not one per
            rank.
        record: a ``failure`` record is written (False after a stop signal: the launcher names
            the rank that failed first, and a teardown's probes would name every rank it
            stopped).
        lost: ``[{rank, host, why}]`` this rank's probes found (the record keeps them: the
            launch's summary joins every host's).
    """

    def __init__(self, message: str, report: bool = True, record: bool = True,
                 lost: list[dict] | None = None):
        super().__init__(message)
        self.report, self.record, self.lost = report, record, lost


def failure(table: list[dict], ctx, step: int, waited: float, newest, signalled) -> LostPeer:
    """The error of a collective that failed during ``step``, on the rank ``ctx``
    (:class:`hvd_lm.comm.world.RankContext`), ``waited`` seconds into it, ``newest`` the newest
    complete checkpoint (None: none). ``signalled()`` says whether a stop signal has come: then
    the launcher is tearing the job down (torchrun, horovodrun and mpirun stop every rank once
    one failed, and name it): nothing is probed and nothing recorded, a probe's findings
    included when the signal came during it (they would name the ranks being stopped). Else
    each host's local rank 0 probes (:func:`probe_lost`) and names who is lost; the other ranks
    probe nothing and stay quiet."""
    from hvd_lm.comm import engine  # (here: the closing block reads lost_text without torch)

    ckpt = f"the newest complete checkpoint is {newest or 'none (no step was saved)'}"
    torn_down = LostPeer(f"stopped on a signal during step {step} before its checkpoint: a "
                         "collective failed and the launcher is stopping the job (it names the "
                         f"rank that failed first); {ckpt}", report=ctx.local_rank == 0,
                         record=False)
    if signalled():
        return torn_down
    if ctx.local_rank != 0:
        return LostPeer("a collective failed (this host's first rank names the lost peer)",
                        report=False)
    # Gloo's timeout is named only when it is what ended the wait (a killed peer fails at once)
    limit = engine.gloo_timeout_s()
    bound = (f" ({engine.timeout_phrase(limit)})" if limit and waited >= 0.8 * limit else
             f" after {waited:.1f} s (its peer's connection closed)")
    lost = probe_lost(table, ctx.rank)
    if signalled():
        return torn_down
    return LostPeer(f"{lost_text(lost)}: a collective failed at step {step}{bound}; {ckpt}; "
                    "bring the host back or leave it out, and run again with --resume auto (the "
                    "launch templates add it)", lost=lost)
