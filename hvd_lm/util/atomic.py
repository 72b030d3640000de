"""Atomic file writes, the one implementation every writer of the project uses.

A file is written under a fresh temporary name in its destination folder (same file system), flushed
to disk with ``fsync``, then renamed over the destination with ``os.replace`` (atomic on POSIX),
and the folder entry is fsync'd; on any error the temporary file is removed. A reader, or a run
killed half way, therefore sees either the old file, or no file, or the complete new one.

A full disk (``ENOSPC``, or ``EDQUOT`` for a quota) becomes :class:`DiskFullError`, one line naming
the file, the bytes it needed and the bytes free, with the old file still in place.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterator


class DiskFullError(OSError):
    """No space left (or quota exceeded) writing a file; the message names the file, the bytes
    needed and the bytes free. The previous version of the file, if any, is intact."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]" prefix
        return self.strerror or super().__str__()


def free_bytes(directory: str | Path) -> int:
    """Bytes available to this user on the file system holding ``directory`` (or its nearest
    existing parent)."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    return shutil.disk_usage(d).free


def human(n: float) -> str:
    """Bytes as ``"1.2 GB"`` (decimal units, as ``df -H``)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fsync_dir(directory: str | Path) -> None:
    """fsync a folder so a rename inside it is durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_path(path: str | Path, suffix: str = "") -> Path:
    """A fresh temporary name beside ``path``: ``.<name>.<pid>.<random>.tmp`` plus ``suffix``
    (for libraries that add an extension when it is missing, e.g. ``np.save`` and ``.npy``).
    Leftovers of killed writers therefore match ``.*.tmp*``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{suffix}")


#: The names :func:`temp_path` gives: ``.<name>.<pid>.<8 hex digits>.tmp<suffix>``.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp(?P<suffix>.*)$")


def remove_stale_temps(folder: str | Path, owns: Callable[[str], bool]) -> list[Path]:
    """Remove the temporary files a killed writer left in ``folder``: only names of
    :data:`TEMP_NAME`'s pattern whose destination name ``owns`` accepts (e.g. a checkpoint's
    ``step_00000030.pt``) and whose writer is not this process; nothing else is touched. The
    caller must own the folder (hold its lock), so no live writer's file is removed.

    Returns:
        The removed paths.
    """
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = TEMP_NAME.match(p.name)
        if m and owns(m.group("name")) and int(m.group("pid")) != os.getpid() and p.is_file() \
                and not p.is_symlink():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "", needed: int | None = None,
                then: str = "the previous file, if any, is unchanged") -> Iterator[Path]:
    """Yield a temporary path (:func:`temp_path`) to write ``path``'s new content to: a file, or
    a folder the caller makes there (an exported model), renamed onto a missing or empty
    folder. On a clean exit it is fsync'd (a folder: each of its files, and the folder) and
    renamed over ``path``; on an exception it is removed and the exception re-raised (a full
    disk as :class:`DiskFullError`, naming ``needed`` bytes when given, and ``then``)."""
    path = Path(path)
    tmp = temp_path(path, suffix)
    try:
        yield tmp
        for part in sorted(tmp.iterdir()) if tmp.is_dir() else [tmp]:
            with open(part, "rb+") as fh:
                os.fsync(fh.fileno())
        if tmp.is_dir():
            fsync_dir(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        size = tmp.stat().st_size if tmp.is_file() else 0
        shutil.rmtree(tmp, ignore_errors=True)  # a folder
        tmp.unlink(missing_ok=True)  # a file
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) \
                and not isinstance(e, DiskFullError):
            need = (f"{human(needed)} needed" if needed is not None
                    else f"more than the {human(size)} written before it ran out")
            raise DiskFullError(e.errno, f"{path}: no space left on the device ({need}, "
                                f"{human(free_bytes(path.parent))} free); {then}") from None
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; return ``path``.

    Raises:
        DiskFullError: no space for ``len(data)`` bytes (the old file stays).
    """
    with atomic_path(path, needed=len(data)) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return ``path`` (see :func:`write_bytes`)."""
    return write_bytes(path, text.encode("utf-8"))
