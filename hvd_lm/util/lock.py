"""One job per output folder: an exclusive lock on ``<folder>/.lock``.

A training run folder (checkpoints, ``metrics.jsonl``, ``config.yaml``) or a ``prepare`` output
folder belongs to one job at a time. :class:`FolderLock` takes ``fcntl.flock(LOCK_EX | LOCK_NB)``
on ``<folder>/.lock`` and writes the holder into it (host, pid, start time, command), so a second
job fails at once with an error naming the holder instead of interleaving its files with the
first's. The kernel releases a ``flock`` when its process dies (even ``kill -9``), so a lock
left by a dead job is simply free again; the recorded holder is then reported as a warning
("taking over from pid N on host H, which is gone"). A clean release removes the file. ``flock``
locks are per host: on a network file system shared by several nodes only one node's jobs are
excluded, which is why the holder line names the host (Linux ``flock(2)``: NFS emulates it with
byte-range locks since 2.6.12).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".lock"


class FolderBusyError(RuntimeError):
    """Another live job holds the folder's lock; the message names it (host, pid, start)."""


def _holder(info: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("start", 0)))
    cmd = " ".join(info.get("command", []))[:120]
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {when}"
            + (f" ({cmd})" if cmd else ""))


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host and is not a zombie (``/proc/<pid>/stat``,
    else ``kill(pid, 0)``)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state[state.rindex(")") + 2:].split()[0] != "Z"


class FolderLock:
    """Exclusive lock of ``folder`` for this process (a context manager; :meth:`release` too).

    Args:
        folder: the folder to own (created when missing).
        what: how errors call the folder (e.g. ``"run folder"``).

    Raises:
        FolderBusyError: another live process holds it.
        OSError: the lock file cannot be created (e.g. a read-only folder).
    """

    def __init__(self, folder: str | Path, what: str = "folder"):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.what = what
        self.previous: dict | None = None
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = self._read()
                os.close(self._fd)
                self._fd = None
                raise FolderBusyError(
                    f"{self.folder}: this {what} is in use by another job ({_holder(info)}); "
                    "wait for it to finish, stop it, or use another folder") from None
            # A releasing holder may have unlinked the file between our open and flock: then
            # we hold a lock on a file nobody else can see, so start again on the new one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(self._fd)
        self.previous = self._read() or None
        if self.previous and self.previous.get("host") == socket.gethostname() \
                and isinstance(self.previous.get("pid"), int) \
                and not pid_alive(self.previous["pid"]):
            print(f"warning: {self.folder}: taking over the lock of {_holder(self.previous)}, "
                  "which is gone", file=sys.stderr)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(),
                  "command": list(sys.argv)}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(self._fd)

    def _read(self) -> dict:
        try:
            text = os.pread(self._fd, 1 << 16, 0).decode("utf-8", "replace").strip()
            return json.loads(text) if text else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        """Remove the lock file and unlock (idempotent); a job that opened the file just before
        sees it gone and starts again (the inode check in ``__init__``)."""
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
