"""How the project opens a path it was given: the one owner of the rules every command follows.

**Showing a path or value.** :func:`shown` renders anything a user gave (a path, a flag's value,
a field read from a file) into an error line: control characters escaped as Python writes them
(``\\n``, ``\\x1b``, so a path holding a newline never prints a second, forged ``ERROR:`` line),
cut to about :data:`SHOWN_CHARS` characters keeping its head and tail. Every command's error line
goes through it whole (:func:`hvd_lm.options.error_text`, capped at :data:`LINE_CHARS`).

**Reading.** A file a command reads is a regular file: a FIFO, a device or a socket is named and
refused before it is opened (a FIFO nobody writes blocks ``open``; ``/dev/zero`` never ends), and
opened with ``O_NONBLOCK`` and checked again on the descriptor, so a file swapped in between is
refused too (:func:`open_regular`). Streams are allowed only where a command reads one by design
(``classify --input``, an anonymous pipe ``<(cmd)`` as a config). Each kind of file is read
within a size budget (:func:`read_bounded`, :func:`read_json`: the budgets are the callers'
constants, listed in docs/reliability.md; a regular file over it is refused from its size,
before a byte is read); a file that may be large is streamed (:func:`iter_lines`: 1 MiB reads, a
line over its cap skipped, never held) or read in a window at its end or start
(:func:`tail_lines`, :func:`head_lines`); a ``.npy`` array (:func:`load_npy`) is read only
after its header's shape and dtype give a size within the budget and within what the file
holds, so an array is never allocated before it is known to fit.

**Writing.** An output file given by a flag is checked before any work (:func:`check_output`):
not a folder, not a FIFO or device, not one of the files the command reads (compared by device
and inode: another spelling or a link counts too) and not one the command itself writes; it is
then written atomically (:mod:`hvd_lm.util.atomic`: a rename replaces a link, never writes through
it). A file a run appends to or locks inside its own folder (``metrics.jsonl``, ``.lock``) is
opened by :func:`open_append`: never through a link that leads out of the folder, never a
FIFO or device.

Errors are :class:`FileRefused` (a ``ValueError``), one line naming the file and what it is.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

#: Characters of a path or value shown in an error line (:func:`shown`).
SHOWN_CHARS = 200
#: Characters of a whole error line (:func:`hvd_lm.options.error_text`).
LINE_CHARS = 1000

# C0 and C1 controls, DEL, the Unicode line/paragraph separators, and lone surrogates (a path
# of bytes that are not UTF-8, as os.fsdecode gives it)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as it goes into an error line: a string or path as its text, anything else as
    ``repr``; every control character escaped (``\\n``, ``\\t``, ``\\x1b``, ``\\u2028``, a lone
    surrogate as ``\\udcff``); longer than ``limit`` characters, its head and tail with the
    number of characters left out between them (a path's file name stays readable)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else repr(value)
    if isinstance(text, bytes):
        text = repr(text)
    text = _CONTROL.sub(lambda m: repr(m.group(0))[1:-1], text)  # '\n' -> '\\n', as repr
    if len(text) <= limit:
        return text
    tail = max(limit // 3, 1)
    head = max(limit - tail, 1)
    return f"{text[:head]}...({len(text) - head - tail:,} characters left out)...{text[-tail:]}"


class FileRefused(ValueError):
    """A path a command was given is not a file it may read or write: not a regular file, over
    its size budget, not what it should hold, or an output that would replace an input or lead
    out of the command's folder. The message names the file (:func:`shown`) and what it is."""


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a link"), (stat.S_ISREG, "a regular file"))


def kind_of(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``"a FIFO (named pipe)"``, ``"a character device"``,
    ``"a folder"``, ``"a regular file"``, ..."""
    return next((words for test, words in _KINDS if test(mode)), "not a file")


def _anonymous_pipe(path: Path) -> bool:
    """``/dev/fd/N`` or ``/proc/<pid>/fd/N`` of a pipe (``<(cmd)``): its writer exists."""
    with contextlib.suppress(OSError):
        return os.readlink(path).startswith("pipe:")
    return False


def check_regular(path: str | Path, what: str = "", streams: bool = False,
                  folder: bool = False) -> os.stat_result:
    """Stat ``path`` (following links) and refuse what is not a regular file, without opening it.

    Args:
        what: how the refusal ends (e.g. ``"a config is a YAML file"``).
        streams: accept a FIFO too (a command that reads a stream by design); an anonymous pipe
            (``/dev/fd/N`` of ``<(cmd)``) is always accepted.
        folder: refuse what is not a folder instead (:func:`check_folder`).

    Raises:
        FileNotFoundError: no such file (naming it). FileRefused: a folder, FIFO, device or
            socket, naming what it is.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{shown(path)}: no such "
                                f"{'folder' if folder else 'file'}") from None
    return _regular(path, st, what, streams, folder)


def _regular(path: str | Path, st: os.stat_result, what: str, streams: bool,
             folder: bool = False) -> os.stat_result:
    """``st`` when it is a regular file's (or a stream's, or a folder's: see
    :func:`check_regular`).

    Raises:
        FileRefused: naming the file and what it is.
    """
    mode = st.st_mode
    if stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode) or (
            stat.S_ISFIFO(mode) and (streams or _anonymous_pipe(Path(path)))):
        return st
    raise FileRefused(f"{shown(path)}: {kind_of(mode)}, not a "
                      f"{'folder' if folder else 'regular file'}" + (f"; {what}" if what else ""))


def check_folder(path: str | Path, what: str = "") -> os.stat_result:
    """:func:`check_regular` for a path that names a folder (a dataset's ``--data-dir``).

    Raises:
        FileNotFoundError: no such folder (naming it). FileRefused: a file, FIFO, device or
            socket, naming what it is.
    """
    return check_regular(path, what, folder=True)


def open_regular(path: str | Path, what: str = "", streams: bool = False) -> IO[bytes]:
    """``open(path, "rb")`` of a regular file (:func:`check_regular` before, and its descriptor
    checked again after an ``O_NONBLOCK`` open, so nothing swapped in between blocks or passes).

    Raises:
        FileNotFoundError / FileRefused: as :func:`check_regular`. OSError: unreadable.
    """
    check_regular(path, what, streams)
    return os.fdopen(open_checked(path, os.O_RDONLY,
                                  lambda st: _regular(path, st, what, streams)), "rb")


def open_checked(path: str | Path, flags: int, check: Callable[[os.stat_result], Any]) -> int:
    """A descriptor of ``os.open(path, flags)`` (a file it creates: 0o644) opened
    ``O_NONBLOCK | O_CLOEXEC``, so a FIFO or device never blocks the open, and returned in
    blocking mode once ``check`` (given the descriptor's stat) has not raised; the one way
    this project opens a file it then checks (:func:`open_regular`, :func:`open_append`, a
    folder's lock).

    Raises:
        What ``check`` raises (the descriptor closed). OSError: the open itself fails.
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        check(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: str | Path, limit: int, what: str, too_big: str = "") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (reading stops at ``limit`` + 1).

    Args:
        what: what such a file is, for the refusal (``"an export's config.json is a few kB"``).
        too_big: the end of the refusal of a file larger than ``limit`` instead (default
            ``what``).

    Raises:
        FileNotFoundError / FileRefused: not a regular file, or larger than ``limit``.
    """
    with open_regular(path, what) as f:
        _within(path, os.fstat(f.fileno()).st_size, limit, too_big or what)  # before a read
        raw = f.read(limit + 1)  # (a /proc file, a pipe: sizes of 0)
    _within(path, len(raw), limit, too_big or what)
    return raw


def _within(path: str | Path, size: int, limit: int, what: str) -> None:
    """Refuse a file of ``size`` bytes over ``limit`` (:class:`FileRefused` naming it)."""
    if size > limit:
        raise FileRefused(f"{shown(path)}: more than {limit:,} bytes; {what}")


def iter_lines(path: str | Path, limit: int, what: str, line_limit: int = 1 << 20,
               chunk: int = 1 << 20) -> Iterator[tuple[int, bytes | None]]:
    """The lines of a regular file of at most ``limit`` bytes, streamed ``chunk`` bytes at a
    time: ``(number, line)`` (1-based, without its newline), or ``(number, None)`` for a line
    longer than ``line_limit`` bytes, read past and never held. Memory: ``chunk`` +
    ``line_limit`` bytes, whatever the file's size or line structure (a sparse file of zeros is
    one endless line).

    Args:
        what: what such a file is, for the refusal (``"a run's metrics.jsonl ..."``).

    Raises:
        FileNotFoundError / FileRefused: not a regular file, or larger than ``limit`` bytes
            (from its size, before reading; or a file that grew past it while read).
    """
    with open_regular(path, what) as f:
        _within(path, os.fstat(f.fileno()).st_size, limit, what)
        number = total = 0
        while line := f.readline(line_limit + 1):
            number += 1
            total += len(line)
            overlong = len(line) > line_limit and not line.endswith(b"\n")
            while overlong and line and not line.endswith(b"\n"):  # its rest read past
                _within(path, total, limit, what)
                line = f.readline(chunk)
                total += len(line)
            _within(path, total, limit, what)
            yield number, None if overlong else line.removesuffix(b"\n")


def _window(path: str | Path, limit: int, what: str, tail: bool) -> list[bytes]:
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        start = max(size - limit, 0) if tail else 0
        if start:  # one byte before the window: whether its first line starts there
            f.seek(start - 1)
            data = f.read(limit + 1)
            whole, data = data[:1] == b"\n", data[1:]
        else:
            data, whole = f.read(limit + (not tail)), True
    lines = data.split(b"\n")
    if not tail and len(data) > limit:  # cut at the limit: its last line is not whole
        lines = data[:limit].split(b"\n")[:-1]
    elif not whole:
        lines = lines[1:]
    return lines[:-1] if lines and not lines[-1] else lines


def tail_lines(path: str | Path, limit: int, what: str = "") -> list[bytes]:
    """The whole lines (without newlines) in the last ``limit`` bytes of a regular file, in
    file order: the records a job appended last, read in ``limit`` bytes whatever the file's
    size (a line cut by the window's start is left out).

    Raises:
        FileNotFoundError / FileRefused: not a regular file.
    """
    return _window(path, limit, what, tail=True)


def head_lines(path: str | Path, limit: int, what: str = "") -> list[bytes]:
    """The whole lines (without newlines) in the first ``limit`` bytes of a regular file (a
    line cut by the limit is left out; the last line of a shorter file counts, newline or not).

    Raises:
        FileNotFoundError / FileRefused: not a regular file.
    """
    return _window(path, limit, what, tail=False)


def read_json(path: str | Path, limit: int, what: str) -> Any:
    """A JSON file read within ``limit`` bytes (:func:`read_bounded`).

    Raises:
        FileNotFoundError / FileRefused: as :func:`read_bounded`, or not UTF-8 JSON, or nested
            deeper than Python's parser goes (a ``RecursionError`` otherwise).
    """
    raw = read_bounded(path, limit, what)
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FileRefused(f"{shown(path)}: not JSON ({shown(str(e))})") from None
    except RecursionError:
        raise FileRefused(f"{shown(path)}: JSON nested too deeply; {what}") from None


# ---- numpy arrays: the header before the data ----------------------------------------------------

def load_npy(path: str | Path, budget: int, what: str = "") -> "np.ndarray":  # noqa: F821
    """A ``.npy`` array read only after its header says it fits: a regular file, a real .npy
    header (not a zip: an ``.npz`` named ``.npy``; NEP 1 / numpy's ``format.py``: magic,
    version, a header of at most 10,000 bytes: a dict literal), no object dtype (pickles), no
    negative dimension, at most ``budget`` bytes of data, and no more than the file holds (a 2
    TiB header on a 128-byte file is refused, not allocated).

    Raises:
        FileNotFoundError / FileRefused: naming the file and what its header says.
    """
    import numpy as np

    where, fmt = shown(path), np.lib.format
    with open_regular(path, what) as f:
        if f.read(4) == b"PK\x03\x04":
            raise FileRefused(f"{where}: a zip archive (an .npz?), not a .npy array file")
        f.seek(0)
        try:
            version = fmt.read_magic(f)
            reader = {(1, 0): fmt.read_array_header_1_0,
                      (2, 0): fmt.read_array_header_2_0}.get(version)
            if reader is None:
                raise ValueError(f"format version {version}")
            shape, _, dtype = reader(f, max_header_size=10_000)
        except (ValueError, OSError, SyntaxError, TypeError, EOFError) as e:
            raise FileRefused(f"{where}: not a .npy array ({shown(str(e), 120)})") from None
        if dtype.hasobject:
            raise FileRefused(f"{where}: an array of Python objects (a pickle), not numbers")
        if any(type(n) is not int or n < 0 for n in shape):
            raise FileRefused(f"{where}: shape {shown(shape)} is not a shape")
        nbytes = math.prod(shape) * dtype.itemsize
        holds = os.fstat(f.fileno()).st_size - f.tell()
        desc = f"its header declares {shown(list(shape), 80)} {dtype} ({nbytes:,} bytes)"
        if nbytes > budget:
            raise FileRefused(f"{where}: {desc}, more than the {budget:,} bytes such an array "
                              "may take")
        if nbytes > holds:
            raise FileRefused(f"{where}: {desc}, but holds {holds:,} bytes of data (truncated "
                              "or not written by numpy)")
        f.seek(0)
        try:
            return np.load(f, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise FileRefused(f"{where}: unreadable .npy array ({shown(str(e), 120)})") from None


# ---- writing ----------------------------------------------------------------------------------

def inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it, both with their links resolved."""
    p, d = Path(path).resolve(), Path(folder).resolve()
    return p == d or d in p.parents


def check_output(path: str | Path, flag: str, *reads: str | Path,
                 writes: Iterable[str | Path | Callable[[Path], bool]] = ()) -> None:
    """Refuse, before any work, an output file that the command could not write or that would
    replace a file it reads or writes.

    Args:
        path: the output (a flag's value).
        flag: the flag, for the message.
        reads: files the command reads; the output may be none of them (compared by device and
            inode: another spelling, a link or a hard link counts too).
        writes: what the command itself writes: paths (the output may be none of them nor lie
            under one), or predicates on the output's resolved path, true or a description
            when the output is one of those files (e.g. "a file of --out OUT").

    Raises:
        FileRefused: an existing folder, FIFO, device or socket (an atomic write would replace
            it, or ``open`` block on it), one of ``reads``, or one of ``writes``; naming
            ``flag``, the path and the file it would replace.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError:
        pass  # nothing there yet
    else:
        if stat.S_ISDIR(st.st_mode):
            raise FileRefused(f"{flag} {shown(path)}: is a folder; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{flag} {shown(path)}: is {kind_of(st.st_mode)}, not a file; "
                              "give a file name")
        for k in reads:
            with contextlib.suppress(OSError):  # (an input that is not there: not this file)
                if os.path.samefile(p, k):
                    raise FileRefused(f"{flag} {shown(path)}: is {shown(k)}, which this command "
                                      "reads; write the output elsewhere")
    resolved = p.resolve()
    for w in writes:
        hit = w(resolved) if callable(w) else inside(resolved, w) and f"{shown(w)}"
        if hit:
            what = hit if isinstance(hit, str) else "one of the files"
            raise FileRefused(f"{flag} {shown(path)}: is {what}, which this command writes; "
                              "write the output elsewhere")


def open_append(folder: str | Path, name: str, buffering: int = -1) -> IO[str]:
    """``open(folder/name, "a")`` (a run's ``metrics.jsonl``, created 0o644): never through a
    link that leads out of ``folder`` (a link inside it is followed), never a FIFO, device or
    socket (opened ``O_NONBLOCK`` and checked on the descriptor before blocking mode is
    restored).

    Raises:
        FileRefused: a link leading out of the folder, or not a regular file, naming both.
        OSError: the open itself fails.
    """
    d = Path(folder)
    path = d / name
    why = "a run writes only regular files inside its folder"
    follow = False
    with contextlib.suppress(OSError):
        if path.is_symlink():
            target = path.resolve()
            if not inside(target, d) or target == d.resolve():
                raise FileRefused(f"{shown(path)}: a link to {shown(target)}, outside "
                                  f"{shown(d)}; {why}: remove the link")
            follow = True
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = open_checked(path, flags, lambda st: _regular(path, st, why, streams=False))
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a link since the check above
            raise FileRefused(f"{shown(path)}: a link; {why}: remove the link") from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise FileRefused(f"{shown(path)}: a FIFO (named pipe), not a regular file") from None
        raise
    return os.fdopen(fd, "a", buffering=buffering)
