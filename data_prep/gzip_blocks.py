"""Reading a file in blocks of bytes, gzip or not (recognised by its magic bytes), with a truncated
stream told apart from a corrupt one: the bottom of :mod:`data_prep.readers` (which documents
what each case means for the records read).
"""

from __future__ import annotations

import gzip
import itertools
import zlib
from typing import Callable, Iterator, Optional

#: Uncompressed block size (bytes) of the striped line reader.
BLOCK_SIZE = 1 << 20


def is_gzip(path: str) -> bool:
    """True when the file starts with the gzip magic bytes ``1f 8b``."""
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


class CountingReader:
    """A binary file whose reads report their sizes to ``progress`` (bytes read from disk): the
    gzip block readers here and the tar reader (:mod:`data_prep.tars`) count their input with it."""

    def __init__(self, raw, progress):
        self.raw, self.progress = raw, progress

    def read(self, n=-1):
        data = self.raw.read(n)
        if self.progress is not None and data:
            self.progress(len(data))
        return data


def _reblock(pieces: Iterator[bytes], block_size: int) -> Iterator[bytes]:
    """``pieces`` regrouped into blocks of exactly ``block_size`` bytes (the last one shorter),
    so block boundaries depend on the content only (a piece of exactly one block passes
    uncopied)."""
    buf = bytearray()
    for piece in pieces:
        if not buf and len(piece) == block_size:
            yield piece
            continue
        buf += piece
        while len(buf) >= block_size:
            yield bytes(buf[:block_size])
            del buf[:block_size]
    if buf:
        yield bytes(buf)


def _blocks_gzipfile(path: str, compressed: bool, block_size: int,
                     progress: Optional[Callable[[int], None]]) -> Iterator[bytes]:
    """Uncompressed content of a file in blocks of exactly ``block_size`` bytes (the last one
    shorter). ``GzipFile.read1`` is used because ``read(n)`` loses already-inflated data when
    the stream turns out truncated.

    Raises:
        _Truncated: the gzip stream ended early (after yielding every inflated byte).
        CorruptInput-like OSError/zlib.error/gzip.BadGzipFile: passed up to the caller.
    """
    truncated: list = []

    def pieces():
        with open(path, "rb") as f:
            raw = CountingReader(f, progress)
            read = gzip.GzipFile(fileobj=raw, mode="rb").read1 if compressed else raw.read
            try:
                while piece := read(block_size):
                    yield piece
            except EOFError as e:  # truncated: every byte inflated before the cut was yielded
                truncated.append(e)

    yield from _reblock(pieces(), block_size)
    if truncated:
        raise _Truncated(str(truncated[0]))


class _Anomaly(Exception):
    """The fast inflater met something other than clean gzip members (damage, truncation)."""


def _inflate_blocks(path: str, block_size: int,
                    progress: Optional[Callable[[int], None]]) -> Iterator[bytes]:
    """Blocks of exactly ``block_size`` uncompressed bytes of a gzip file (the last shorter),
    inflated by ``zlib.decompressobj`` directly (1 MiB reads, no ``GzipFile`` layers; faster,
    docs/data_prep.md). Concatenated members and zero padding between them are read as
    ``GzipFile`` reads them; output per call is capped, so memory stays bounded.

    Raises:
        _Anomaly: damaged or truncated stream (the caller replays it with ``GzipFile``).
    """
    cap = max(block_size, 1 << 16)

    def pieces():
        in_member = False
        with open(path, "rb") as f:
            raw = CountingReader(f, progress)
            while data := raw.read(1 << 20):  # compressed bytes per read
                while data:
                    if not in_member:  # a member starts (after zero padding, as GzipFile)
                        data = data.lstrip(b"\0")
                        if not data:
                            break
                        d = zlib.decompressobj(31)
                        in_member = True
                    yield d.decompress(data, cap)
                    if d.eof:
                        in_member, data = False, d.unused_data
                    else:
                        data = d.unconsumed_tail
        if in_member:
            raise _Anomaly("truncated")

    try:
        yield from _reblock(pieces(), block_size)
    except (zlib.error, OSError) as e:
        raise _Anomaly(str(e)) from e


def _blocks(path: str, compressed: bool, block_size: int,
            progress: Optional[Callable[[int], None]]) -> Iterator[bytes]:
    """Uncompressed content of a file in blocks of exactly ``block_size`` bytes (the last one
    shorter), so block boundaries depend on the content only.

    gzip files are inflated by :func:`_inflate_blocks`; the last few blocks are held back, and
    when the stream turns out damaged or truncated it is replayed with ``GzipFile``
    (:func:`_blocks_gzipfile`, the reference) from the block after the last one passed on, so
    the blocks before the failure, the exception and the line it names are the reference's.
    Held back: as many blocks as one ``GzipFile.read1`` call can lose (``max(block_size,
    8192)`` bytes) plus one.

    Raises:
        _Truncated: the gzip stream ended early (after yielding every inflated byte).
        CorruptInput-like OSError/zlib.error/gzip.BadGzipFile: passed up to the caller.
    """
    if not compressed:
        yield from _blocks_gzipfile(path, compressed, block_size, progress)
        return
    hold = -(-max(block_size, 8192) // block_size) + 1
    held: list = []
    passed = 0
    try:
        for block in _inflate_blocks(path, block_size, progress):
            held.append(block)
            if len(held) > 2 * hold:
                yield from held[:hold]
                passed += hold
                del held[:hold]
    except _Anomaly:  # the reference, from the first block not passed on
        yield from itertools.islice(_blocks_gzipfile(path, True, block_size, None), passed, None)
        return
    yield from held


class _Truncated(Exception):
    pass
