"""Atomic file writes, the one implementation every writer of the project uses.

A file is written under a fresh temporary name in its destination folder (same file system), flushed
to disk with ``fsync``, then renamed over the destination with ``os.replace`` (atomic on POSIX),
and the folder entry is fsync'd; on any error the temporary file is removed. A reader, or a run
killed half way, therefore sees either the old file, or no file, or the complete new one.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator


def fsync_dir(directory: str | Path) -> None:
    """fsync a folder so a rename inside it is durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(path: str | Path, suffix: str = "") -> Path:
    """A fresh temporary name beside ``path``: ``.<name>.<pid>.<random>.tmp`` plus ``suffix``
    (for libraries that add an extension when it is missing, e.g. ``np.save`` and ``.npy``).
    Leftovers of killed writers therefore match ``.*.tmp*``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{suffix}")


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path (:func:`temp_path`) to write ``path``'s new content to; on a clean
    exit it is fsync'd and renamed over ``path``, on an exception it is removed and the exception
    re-raised."""
    path = Path(path)
    tmp = temp_path(path, suffix)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
