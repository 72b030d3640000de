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

The lock file is the folder's own: it is opened with ``O_NOFOLLOW`` (a ``.lock`` that is a link is
refused, never followed: the holder record would otherwise replace the file it leads to), and a
FIFO, a device or a file with other hard links is refused too (:class:`LockFileError`).
``filelock`` (PyPI) was weighed for the ``flock`` part: it also opens with ``O_NOFOLLOW``, but
it leaves the file in place on release and records no holder, both of which this module does
(the holder named in a refusal, the file gone after a clean run), so it would not replace this
code, only sit under it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

import psutil

from hvd_lm.util.files import FileRefused, kind_of, open_checked, shown

LOCK_NAME = ".lock"


class FolderBusyError(RuntimeError):
    """Another live job holds the folder's lock; the message names it (host, pid, start)."""


class LockFileError(FileRefused):
    """A folder's ``.lock`` is a link, a FIFO, a device or a file with other hard links: not a
    file the lock may write its holder into; the message names it."""


def _open_lock(path: Path) -> int:
    """A read-write descriptor of ``path`` (created 0o644), never through a link.

    Raises:
        LockFileError: a link, not a regular file, or a file of several names (hard links).
    """
    def own(st: os.stat_result) -> None:
        why = (f"{kind_of(st.st_mode)}, not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"a file of {st.st_nlink} names (hard links), whose other names would be "
               "overwritten" if st.st_nlink > 1 else "")
        if why:
            raise LockFileError(f"{shown(path)}: {why}; a folder's lock is a file of its own: "
                                "remove it")

    try:  # O_NOFOLLOW: a .lock that is a link is refused, never followed
        return open_checked(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, own)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        target = ""
        with contextlib.suppress(OSError):
            target = f" to {shown(os.readlink(path))}"
        raise LockFileError(f"{shown(path)}: a link{target}; a folder's lock is a file of its "
                            "own (the holder written through the link would replace the file "
                            "it leads to): remove the link") from None


def _holder(info: dict) -> str:
    start = info.get("start")
    when = "an unknown time"
    with contextlib.suppress(TypeError, ValueError, OverflowError, OSError):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start))
    words = info.get("command")
    cmd = shown(" ".join(map(str, words)) if isinstance(words, list) else "", 120)
    return (f"pid {shown(info.get('pid', '?'), 20)} on host {shown(info.get('host', '?'), 80)} "
            f"since {when}" + (f" ({cmd})" if cmd else ""))


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host and is not a zombie (psutil)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):  # (ValueError: a pid below 0, in no process)
        return False
    except psutil.AccessDenied:  # another user's: it exists
        return True


class FolderLock(contextlib.AbstractContextManager):
    """Exclusive lock of ``folder`` for this process (a context manager; :meth:`release` too).

    Args:
        folder: the folder to own (created when missing).
        what: how errors call the folder (e.g. ``"run folder"``).

    Raises:
        FolderBusyError: another live process holds it.
        LockFileError: ``.lock`` is a link, not a regular file, or hard-linked (never written).
        OSError: the lock file cannot be created (e.g. a read-only folder).
    """

    def __init__(self, folder: str | Path, what: str = "folder"):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            self._fd = _open_lock(self.path)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = self._read()
                os.close(self._fd)
                self._fd = None
                raise FolderBusyError(
                    f"{shown(self.folder)}: this {what} is in use by another job ({_holder(info)});"
                    " wait for it to finish, stop it, or use another folder") from None
            # A releasing holder may have unlinked the file between our open and flock: then
            # we hold a lock on a file nobody else can see, so start again on the new one.
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.stat(self.path), os.fstat(self._fd)):
                    break
            os.close(self._fd)
        previous = self._read()
        pid = previous.get("pid")
        if previous.get("host") == socket.gethostname() and isinstance(pid, int) \
                and not pid_alive(pid):
            print(f"warning: {shown(self.folder)}: taking over the lock of {_holder(previous)}, "
                  "which is gone", file=sys.stderr)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(),
                  "command": list(sys.argv)}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(self._fd)

    def _read(self) -> dict:
        with contextlib.suppress(OSError, ValueError):  # (an empty file: not JSON either)
            info = json.loads(os.pread(self._fd, 1 << 16, 0).decode("utf-8", "replace"))
            return info if isinstance(info, dict) else {}
        return {}

    def release(self) -> None:
        """Remove the lock file and unlock (idempotent); a job that opened the file just before
        sees it gone and starts again (the inode check in ``__init__``)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __exit__(self, *exc) -> None:
        self.release()
