"""Lines of an input, and the stripes of a file that parallel workers read: worker k of n reads
the lines (or segments of whole lines) that start in its k-th byte range, so n workers read each
line exactly once (:mod:`data_prep.readers` parses them into records).
"""

from __future__ import annotations

import gzip
import zlib
from typing import Callable, Iterator, Optional

from data_prep.gzip_blocks import BLOCK_SIZE, _blocks, _Truncated
from data_prep.inputs import CorruptInput, InputSpec, ReadStats, count_bad, over_budget


def iter_lines(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *, keepends: bool = False,
               **kw) -> Iterator[tuple[int, str, bool]]:
    """Decoded lines of a file, optionally only one stripe of them (``kw``: the keyword
    arguments of :func:`iter_segments`, passed on).

    Striping: the uncompressed content is cut into blocks of ``block_size`` bytes, and stripe
    ``s`` of ``n`` owns the lines that *start* in blocks ``b`` with ``b % n == s``. Every stripe
    inflates the whole stream (gzip is not seekable) but splits and parses only its own lines, so
    ``n`` workers can share one file; the union over stripes is every line exactly once.

    Args:
        spec: the input.
        stripe, n_stripes: which stripe to yield (``0, 1``: all lines).
        keepends: keep the ``\\n`` (CSV needs it inside quoted fields); otherwise a trailing
            ``\\r\\n`` or ``\\n`` is removed.
        stats: counters to update (``bytes_in`` and ``truncated_files`` by stripe 0 only).
        skip_bad: count a truncated stream instead of raising.
        progress: called with the number of bytes read from disk since the last call.
        block_size: stripe block size in uncompressed bytes.
        max_line_bytes: longest line kept (:func:`iter_segments`).
    Yields:
        ``(line_number, text, valid_utf8)``; ``text`` was decoded with U+FFFD replacement where
        ``valid_utf8`` is False. A UTF-8 BOM at the start of line 1 is removed.
    Raises:
        BadRecord: truncated gzip stream (unless ``skip_bad``), at the cut line.
        CorruptInput: failed CRC or invalid compressed data.
    """
    for first, chunk in iter_segments(spec, stripe, n_stripes, **kw):
        ends_nl = chunk.endswith(b"\n")
        lines = chunk.removesuffix(b"\n").split(b"\n")
        last = first + len(lines) - 1
        for line_no, raw in enumerate(lines, first):
            if keepends and (line_no < last or ends_nl):
                raw += b"\n"
            elif not keepends and raw.endswith(b"\r"):
                raw = raw[:-1]
            yield line_no, *decode(raw, line_no == 1)


def decode(raw: bytes, first: bool) -> tuple[str, bool]:
    """``(text, valid_utf8)`` of ``raw``: UTF-8 decoded, invalid bytes as U+FFFD
    (``valid_utf8`` False); a UTF-8 BOM dropped when ``first`` (the file's or member's start)."""
    try:
        text, ok = raw.decode("utf-8"), True
    except UnicodeDecodeError:
        text, ok = raw.decode("utf-8", errors="replace"), False
    return (text[1:] if first and text.startswith("\ufeff") else text), ok


def iter_segments(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *,
                  stats: Optional[ReadStats] = None, skip_bad: bool = False,
                  progress: Optional[Callable[[int], None]] = None, block_size: int = BLOCK_SIZE,
                  max_line_bytes: Optional[int] = None) -> Iterator[tuple[int, bytes]]:
    """The raw lines of one stripe of a file in runs: the lines :func:`iter_lines` yields, same
    blocks, same ownership, same line numbers, same truncated/corrupt handling, but undecoded
    and several at a time.

    A line longer than ``max_line_bytes`` (at least two blocks; ``None``: no limit) is never held
    in memory: it is dropped as it streams past and reported as a bad record naming the file,
    the line and its size (raised unless ``skip_bad``), so one huge record cannot exceed
    ``prepare``'s memory budget.

    Yields:
        ``(first_line_number, chunk)``: ``chunk`` holds consecutive complete lines, each ending
        in ``\n`` except a last line of the file that has none; ``\r`` and a UTF-8 BOM are left
        in place (the caller strips them as :func:`iter_lines` does).
    Raises:
        BadRecord: truncated gzip stream (unless ``skip_bad``), at the cut line.
        CorruptInput: failed CRC or invalid compressed data.
    """
    stats = stats if stats is not None else ReadStats()
    line_no = 1
    pending: Optional[list] = None  # pieces of a partial line owned by this stripe
    pending_no = 0
    open_line = False
    first_stripe = stripe == 0
    limit = None if max_line_bytes is None else max(int(max_line_bytes), 2 * block_size)
    open_size, oversize = 0, False  # bytes of the open line so far; dropped for its size

    def too_long(size: int) -> None:
        count_bad(stats, skip_bad, spec.path, pending_no,
                  over_budget(f"a record of {size:,} bytes", limit))

    try:
        for b, data in enumerate(_blocks(spec.path, spec.compressed, block_size, progress)):
            if first_stripe:
                stats.bytes_in += len(data)
            owned = n_stripes == 1 or b % n_stripes == stripe
            start = 0
            if open_line:
                i = data.find(b"\n")
                if i < 0:
                    open_size += len(data)
                    if pending is not None:
                        pending.append(data)
                        if limit is not None and open_size > limit:
                            pending, oversize = None, True  # stream the rest of it past
                    continue
                line_no += 1
                start, open_line = i + 1, False
                if oversize:
                    oversize = False
                    too_long(open_size + start)
                elif pending is not None:
                    pending.append(data[:start])
                    if not owned or data.rfind(b"\n") + 1 <= start:
                        yield pending_no, b"".join(pending)
                        pending = None
            end = data.rfind(b"\n") + 1
            chunk = data[start:end] if owned and end > start else b""
            first = line_no
            if pending is not None:  # (owned) the completed line opens this block's run
                chunk, first, pending = b"".join(pending) + chunk, pending_no, None
            if end > start:
                line_no += data.count(b"\n", start, end)
            if chunk:
                yield first, chunk
            if end < len(data) and len(data) > start:
                open_line = True
                pending_no = line_no
                pending = [data[max(start, end):]] if owned else None
                open_size = len(data) - max(start, end)
        if oversize:
            too_long(open_size)
        elif pending is not None:
            yield pending_no, b"".join(pending)
    except _Truncated as e:
        if first_stripe:
            stats.truncated_files += 1
            where = (f"inside line {line_no} (the partial line is dropped)" if open_line
                     else f"after line {line_no - 1}")
            count_bad(stats, skip_bad, spec.path, line_no, f"gzip stream truncated {where}: {e}")
    except (gzip.BadGzipFile, zlib.error, OSError) as e:
        raise CorruptInput(spec.path, line_no, f"corrupt compressed stream: {e}") from e
