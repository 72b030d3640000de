"""Readers for the review-text formats in ``../shared/data``: each yields ``(line_number, text)``.

Formats (``--format``; inferred from the file name when not given, see :func:`infer_format`):

``json``
    JSON lines, one object per line, text in a field (default: the first of
    :data:`TEXT_FIELD_CANDIDATES` present in the first record, e.g. McAuley's ``reviewText``).
``loose-json``
    One Python dict literal per line (``{'reviewText': '...', ...}``), the format of the full
    2014 McAuley dump that sentiment-discovery reads with ``--loose-json``; parsed with
    ``ast.literal_eval``. A ``.json`` file whose first record is not JSON but is a dict literal is
    sniffed as ``loose-json``.
``csv``
    Comma-separated with a header row and standard quoting (``csv`` module, ``doublequote``);
    quoted fields may span lines; a UTF-8 BOM is dropped; the field size limit is raised to
    2**31-1 characters.
``tsv``
    Tab-separated with a header row and *no* quoting (``csv.QUOTE_NONE``), one record per line
    (Amazon Customer Reviews ``*.tsv``).
``review``
    Blitzer et al.'s multi-domain sentiment ``*.review`` files: ``<review>`` ... ``</review>``
    blocks in which each field is an opening tag line, its value lines and a closing tag line.
    The text is the value lines of the field (default ``review_text``) joined by ``\\n``.
``text``
    Plain text, one document per line (the line without its ``\\n`` / ``\\r\\n``).

Any file may be gzip-compressed (recognised by its magic bytes, not its name). Lines end at
``\\n``; JSON/TSV/text lines also lose a trailing ``\\r``; CSV keeps line ends inside quoted
fields as written. A document's line number is the line where its record starts (1-based).

Bad input (each case is counted in :class:`ReadStats`):

* malformed record (JSON/literal syntax error, not an object, missing or non-string text field,
  wrong CSV/TSV field count, broken ``<review>`` block): :class:`BadRecord` naming file and line;
  with ``skip_bad=True`` it is counted in ``bad_records`` and the first
  :data:`MAX_BAD_SAMPLES` are kept in ``bad_samples`` instead.
* invalid UTF-8: with ``utf8_errors="replace"`` (default) invalid bytes become U+FFFD and the line
  is counted in ``utf8_replaced``; with ``"strict"`` the record is a bad record.
* blank (whitespace-only) lines between records: skipped, counted in ``blank_lines``.
* truncated gzip stream: the records before the cut are read, the cut-off last line is dropped,
  and the cut is a bad record (line = the line it cut); ``truncated_files`` counts it.
* corrupt gzip stream (bad CRC, invalid deflate data): :class:`CorruptInput` is raised; the
  damaged place is unknown, so callers drop everything read from that file.
* unknown format, missing text column, unreadable file: :class:`InputError` (never skipped).
"""

from __future__ import annotations

import ast
import csv
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

try:  # C JSON parser (PyPI ``orjson``): the fast path of :func:`read_document_batches`
    import orjson
except ImportError:  # pragma: no cover - a dependency; the stdlib path gives the same result
    orjson = None

#: Format names accepted by ``--format``.
FORMATS = ("json", "loose-json", "csv", "tsv", "review", "text")
#: Formats with exactly one record per line; their files can be read in stripes (see
#: :func:`iter_lines`) by several workers at once.
LINE_FORMATS = frozenset({"json", "loose-json", "tsv", "text"})
#: Text field names tried, in order, when ``--text-field`` is not given (json, loose-json,
#: csv, tsv): McAuley/Kaggle ``reviewText``, Amazon Customer Reviews ``review_body``, Fine Food
#: ``Text``, SST ``sentence``, and common generic names.
TEXT_FIELD_CANDIDATES = ("reviewText", "review_body", "review_text", "Text", "text", "sentence",
                         "review", "content", "body")
#: Default field of the ``review`` format.
REVIEW_DEFAULT_FIELD = "review_text"
#: How many bad records are kept as samples (per reader and after merging).
MAX_BAD_SAMPLES = 5
#: Uncompressed block size (bytes) of the striped line reader.
BLOCK_SIZE = 1 << 20

_SUFFIX_FORMATS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".csv": "csv",
                   ".tsv": "tsv", ".tab": "tsv", ".review": "review", ".txt": "text",
                   ".text": "text"}
_GZIP_MAGIC = b"\x1f\x8b"
_TAG = re.compile(r"<([A-Za-z_][\w.-]*)>")
_CSV_LIMIT = 2**31 - 1


class InputError(ValueError):
    """An input cannot be read as asked (unknown format, missing column, unreadable file).
    Never skipped by ``skip_bad``; the message names the file."""


class BadRecord(ValueError):
    """One malformed record. Attributes ``path``, ``line`` (1-based) and ``reason``;
    ``str()`` is ``"PATH:LINE: REASON"``."""

    def __init__(self, path: str, line: int, reason: str):
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}")

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (self.path, self.line, self.reason))


class CorruptInput(InputError):
    """A compressed stream fails its integrity check (CRC) or holds invalid deflate data; raised
    after the records before the failure were yielded. Attributes ``path``, ``line``."""

    def __init__(self, path: str, line: int, reason: str):
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}")

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (self.path, self.line, self.reason))


class _Truncated(Exception):
    pass


@dataclass
class ReadStats:
    """Counters of one reader (all counts are records or lines; bytes are uncompressed).

    Attributes:
        records: documents yielded.
        blank_lines: whitespace-only lines between records, skipped.
        bad_records: malformed records skipped (``skip_bad``).
        utf8_replaced: lines whose invalid UTF-8 was replaced by U+FFFD.
        truncated_files: gzip streams that ended early.
        corrupt_files: streams that failed their integrity check (set by the caller that drops
            the file).
        bytes_in: uncompressed bytes read (by stripe 0 of a file only, so sums are per file).
        bad_samples: the first :data:`MAX_BAD_SAMPLES` bad records as ``(path, line, reason)``.
    """

    records: int = 0
    blank_lines: int = 0
    bad_records: int = 0
    utf8_replaced: int = 0
    truncated_files: int = 0
    corrupt_files: int = 0
    bytes_in: int = 0
    bad_samples: list = field(default_factory=list)

    def add_bad(self, path: str, line: int, reason: str) -> None:
        """Count one skipped bad record and keep it as a sample while there are fewer than
        :data:`MAX_BAD_SAMPLES`."""
        self.bad_records += 1
        if len(self.bad_samples) < MAX_BAD_SAMPLES:
            self.bad_samples.append((path, line, reason))

    def merge(self, other: "ReadStats") -> None:
        """Add ``other``'s counts; keep the first samples in (path, line) order."""
        for name in ("records", "blank_lines", "bad_records", "utf8_replaced",
                     "truncated_files", "corrupt_files", "bytes_in"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.bad_samples = sorted(self.bad_samples + [tuple(s) for s in other.bad_samples],
                                  key=lambda s: (s[0], s[1]))[:MAX_BAD_SAMPLES]


@dataclass(frozen=True)
class InputSpec:
    """How to read one input file (built by :func:`resolve_input`).

    Attributes:
        path: absolute path.
        format: one of :data:`FORMATS`.
        text_field: field/column/tag holding the text (``None`` for ``text``).
        format_source: ``"given"``, ``"file name"`` or ``"file name + content"``.
        field_source: ``"given"``, ``"default"``, ``"header"`` or ``"first record"``.
        columns: CSV/TSV header, else ``None``.
        header_lines: lines taken by the header (CSV/TSV), else 0.
        size: bytes on disk. compressed: gzip stream.
    """

    path: str
    format: str
    text_field: Optional[str]
    format_source: str
    field_source: str
    columns: Optional[tuple] = None
    header_lines: int = 0
    size: int = 0
    compressed: bool = False

    def describe(self) -> str:
        """One line for summaries: ``name: format (how), field F (how)``."""
        s = f"{os.path.basename(self.path)}: {self.format} ({self.format_source})"
        if self.text_field is not None:
            s += f", text field {self.text_field!r} ({self.field_source})"
        return s + (", gzip" if self.compressed else "")


def is_gzip(path: str) -> bool:
    """True when the file starts with the gzip magic bytes ``1f 8b``."""
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


def infer_format(path: str) -> Optional[str]:
    """Format from the file name (``.gz``/``.gzip`` suffix ignored): ``.json``/``.jsonl``/
    ``.ndjson`` -> json, ``.csv`` -> csv, ``.tsv``/``.tab`` -> tsv, ``.review`` -> review,
    ``.txt``/``.text`` -> text; ``None`` when unknown."""
    name = os.path.basename(path).lower()
    for ext in (".gz", ".gzip"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return _SUFFIX_FORMATS.get(os.path.splitext(name)[1])


def _blocks_gzipfile(path: str, compressed: bool, block_size: int,
            progress: Optional[Callable[[int], None]]) -> Iterator[bytes]:
    """Uncompressed content of a file in blocks of exactly ``block_size`` bytes (the last one
    shorter), so block boundaries depend on the content only. ``GzipFile.read1`` is used because
    ``read(n)`` loses already-inflated data when the stream turns out truncated.

    Raises:
        _Truncated: the gzip stream ended early (after yielding every inflated byte).
        CorruptInput-like OSError/zlib.error/gzip.BadGzipFile: passed up to the caller.
    """
    with open(path, "rb") as raw:
        read = gzip.GzipFile(fileobj=raw, mode="rb").read1 if compressed else raw.read
        buf = bytearray()
        done = 0
        truncated = None
        while True:
            try:
                piece = read(block_size)
            except EOFError as e:
                truncated = e
                piece = b""
            if progress is not None:
                pos = raw.tell()
                progress(pos - done)
                done = pos
            if not piece:
                break
            if not buf and len(piece) == block_size:
                yield piece
                continue
            buf += piece
            while len(buf) >= block_size:
                yield bytes(buf[:block_size])
                del buf[:block_size]
        if buf:
            yield bytes(buf)
        if truncated is not None:
            raise _Truncated(str(truncated))


#: Compressed bytes per ``read`` of the zlib inflater.
_READ_SIZE = 1 << 20


class _Anomaly(Exception):
    """The fast inflater met something other than clean gzip members (damage, truncation)."""


def _inflate_blocks(path: str, block_size: int,
                    progress: Optional[Callable[[int], None]]) -> Iterator[bytes]:
    """Blocks of exactly ``block_size`` uncompressed bytes of a gzip file (the last shorter),
    inflated by ``zlib.decompressobj`` directly (1 MiB reads, no ``GzipFile`` layers; about 40%
    faster). Concatenated members and zero padding between them are read as ``GzipFile`` reads
    them; output per call is capped, so memory stays bounded.

    Raises:
        _Anomaly: damaged or truncated stream (the caller replays it with ``GzipFile``).
    """
    cap = block_size if block_size >= 1 << 16 else 1 << 16
    d = zlib.decompressobj(31)
    in_member = False
    buf = bytearray()
    done = 0
    try:
        with open(path, "rb") as raw:
            while True:
                data = raw.read(_READ_SIZE)
                if progress is not None:
                    pos = raw.tell()
                    progress(pos - done)
                    done = pos
                if not data:
                    break
                while data:
                    if not in_member:  # a member starts (after zero padding, as GzipFile)
                        data = data.lstrip(b"\0")
                        if not data:
                            break
                        d = zlib.decompressobj(31)
                        in_member = True
                    out = d.decompress(data, cap - len(buf) if cap == block_size else cap)
                    if d.eof:
                        in_member, data = False, d.unused_data
                    else:
                        data = d.unconsumed_tail
                    if not buf and len(out) == block_size:
                        yield out
                        continue
                    buf += out
                    while len(buf) >= block_size:
                        yield bytes(buf[:block_size])
                        del buf[:block_size]
    except (zlib.error, OSError) as e:
        raise _Anomaly(str(e)) from e
    if in_member:
        raise _Anomaly("truncated")
    if buf:
        yield bytes(buf)


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
                for b in held[:hold]:
                    yield b
                passed += hold
                del held[:hold]
    except _Anomaly:
        for i, block in enumerate(_blocks_gzipfile(path, compressed, block_size, None)):
            if i >= passed:
                yield block
        return
    yield from held


def iter_lines(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *, keepends: bool = False,
               stats: Optional[ReadStats] = None, skip_bad: bool = False,
               progress: Optional[Callable[[int], None]] = None,
               block_size: int = BLOCK_SIZE,
               max_line_bytes: Optional[int] = None) -> Iterator[tuple[int, str, bool]]:
    """Decoded lines of a file, optionally only one stripe of them.

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
    for first, chunk in iter_segments(spec, stripe, n_stripes, stats=stats, skip_bad=skip_bad,
                                      progress=progress, block_size=block_size,
                                      max_line_bytes=max_line_bytes):
        lines = chunk.split(b"\n")
        ends_nl = lines[-1] == b""
        if ends_nl:
            lines.pop()
        last = len(lines) - 1
        for k, raw in enumerate(lines):
            if keepends:
                if k < last or ends_nl:
                    raw += b"\n"
            elif raw.endswith(b"\r"):
                raw = raw[:-1]
            try:
                text, ok = raw.decode("utf-8"), True
            except UnicodeDecodeError:
                text, ok = raw.decode("utf-8", errors="replace"), False
            if first + k == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield first + k, text, ok


def iter_segments(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *,
                  stats: Optional[ReadStats] = None, skip_bad: bool = False,
                  progress: Optional[Callable[[int], None]] = None,
                  block_size: int = BLOCK_SIZE,
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
        _bad(stats, skip_bad, spec.path, pending_no,
             f"a record of {size:,} bytes is longer than the {limit:,} bytes the memory budget "
             "allows per document (raise --max-memory-mb, or --skip-bad to drop it)")

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
            if owned:
                chunk = data[start:end] if end > start else b""
                if pending is not None:  # the completed line opens this block's run
                    chunk = b"".join(pending) + chunk
                    first, pending = pending_no, None
                else:
                    first = line_no
                if end > start:
                    line_no += data.count(b"\n", start, end)
                if chunk:
                    yield first, chunk
            elif end > start:
                line_no += data.count(b"\n", start, end)
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
            _bad(stats, skip_bad, spec.path, line_no, f"gzip stream truncated {where}: {e}")
    except (gzip.BadGzipFile, zlib.error, OSError) as e:
        raise CorruptInput(spec.path, line_no, f"corrupt compressed stream: {e}") from e


def _bad(stats: ReadStats, skip_bad: bool, path: str, line: int, reason: str) -> None:
    """Raise :class:`BadRecord`, or with ``skip_bad`` count and sample it."""
    if not skip_bad:
        raise BadRecord(path, line, reason)
    stats.add_bad(path, line, reason)


def _utf8_ok(stats: ReadStats, skip_bad: bool, utf8_errors: str, path: str, line: int) -> bool:
    """Handle a record that held invalid UTF-8; True when it is still to be used."""
    if utf8_errors == "strict":
        _bad(stats, skip_bad, path, line, "invalid UTF-8")
        return False
    stats.utf8_replaced += 1
    return True


def _json_record(spec, line_no, text, ok, stats, skip_bad, utf8_errors, parse, what):
    """One line of a json/loose-json file: its text field, or ``None`` (blank line or bad
    record, counted)."""
    if not text or text.isspace():
        stats.blank_lines += 1
        return None
    key = spec.text_field
    try:
        obj = parse(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError) as e:
        _bad(stats, skip_bad, spec.path, line_no, f"invalid {what}: {e}")
        return None
    if not isinstance(obj, dict):
        _bad(stats, skip_bad, spec.path, line_no, f"{what} value is a "
             f"{type(obj).__name__}, expected an object")
        return None
    value = obj.get(key)
    if not isinstance(value, str):
        reason = (f"no field {key!r}" if key not in obj else
                  f"field {key!r} is {type(value).__name__}, expected a string")
        _bad(stats, skip_bad, spec.path, line_no, reason)
        return None
    if not ok and not _utf8_ok(stats, skip_bad, utf8_errors, spec.path, line_no):
        return None
    stats.records += 1
    return value


def _json_records(spec, lines, stats, skip_bad, utf8_errors, loose):
    parse = ast.literal_eval if loose else json.loads
    what = "Python literal" if loose else "JSON"
    for line_no, text, ok in lines:
        value = _json_record(spec, line_no, text, ok, stats, skip_bad, utf8_errors, parse, what)
        if value is not None:
            yield line_no, value


#: A line with at least this many ``[`` and ``{`` (it could nest containers deeper than
#: ``json`` can: its C scanner stops at Python's recursion limit, 1000 frames, orjson at depth
#: 1024) is parsed by ``json`` only, so both parsers accept exactly the same lines. (Counted only
#: in lines that hold a ``[`` or a second ``{``.)
_DEEP_LINE = 500


def _json_batches(spec, segments, stats, skip_bad, utf8_errors):
    """Texts of a JSON-lines file, a list per run of lines from :func:`iter_segments`.

    Each line is first given to ``orjson.loads`` (bytes in, no decode). When it yields an
    object whose text field is a string, that string is what ``json.loads`` gives for the line:
    orjson accepts only valid UTF-8 and standard JSON (no NaN/Infinity, no lone surrogates,
    no BOM), all of which ``json`` accepts with the same result, and duplicate keys keep the
    last value in both. Every other line (blank, invalid, BOM, not an object, missing field,
    invalid UTF-8, possibly deep nesting) goes through the ``json`` path of
    :func:`read_documents` unchanged, so errors, counters and texts are the same.
    """
    key = spec.text_field
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    deep = _DEEP_LINE
    slow = _json_record
    parse = json.loads
    for line_no, chunk in segments:
        lines = chunk.split(b"\n")
        if not lines[-1]:
            lines.pop()
        texts = []
        append = texts.append
        fast = 0
        for raw in lines:
            if (len(raw) < deep or (b"[" not in raw and raw.find(b"{", raw.find(b"{") + 1) < 0)
                    or raw.count(b"[") + raw.count(b"{") < deep):
                try:
                    obj = loads(raw)
                except decode_error:
                    obj = None
                if type(obj) is dict:
                    value = obj.get(key)
                    if type(value) is str:
                        append(value)
                        fast += 1
                        line_no += 1
                        continue
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            try:
                text, ok = raw.decode("utf-8"), True
            except UnicodeDecodeError:
                text, ok = raw.decode("utf-8", errors="replace"), False
            if line_no == 1 and text.startswith("\ufeff"):
                text = text[1:]
            stats.records += fast  # counts in step with read_documents, even when it raises
            fast = 0
            value = slow(spec, line_no, text, ok, stats, skip_bad, utf8_errors, parse, "JSON")
            if value is not None:  # (counted in stats.records by _json_record)
                append(value)
            line_no += 1
        stats.records += fast
        yield texts


def _delimited_records(spec, lines, stats, skip_bad, utf8_errors):
    if not spec.columns:  # empty file: no header, no records
        return
    csv.field_size_limit(_CSV_LIMIT)
    state = {"first": None, "last": 0, "invalid": False}

    def feed():
        for line_no, text, ok in lines:
            if line_no <= spec.header_lines:
                continue
            if state["first"] is None:
                state["first"] = line_no
            state["last"] = line_no
            if not ok:
                state["invalid"] = True
            yield text

    reader = csv.reader(feed(), **_dialect(spec.format))
    ncols = len(spec.columns)
    idx = spec.columns.index(spec.text_field)
    while True:
        state["first"], state["invalid"] = None, False
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            _bad(stats, skip_bad, spec.path, state["first"] or state["last"], f"CSV error: {e}")
            continue
        line_no = state["first"]
        if not row or (len(row) == 1 and not row[0].strip()):
            stats.blank_lines += 1
            continue
        if len(row) != ncols:
            _bad(stats, skip_bad, spec.path, line_no,
                 f"{len(row)} fields, expected {ncols} (header of {spec.format.upper()})")
            continue
        if state["invalid"] and not _utf8_ok(stats, skip_bad, utf8_errors, spec.path, line_no):
            continue
        stats.records += 1
        yield line_no, row[idx]


def _review_records(spec, lines, stats, skip_bad, utf8_errors):
    want = spec.text_field
    in_review = skipping = False
    start = 0
    cur: Optional[str] = None
    value: Optional[list] = None
    invalid = False
    for line_no, text, ok in lines:
        s = text.strip()
        if not in_review:
            if not s:
                stats.blank_lines += 1
            elif s == "<review>":
                in_review, skipping, start = True, False, line_no
                cur, value, invalid = None, None, not ok
            else:
                _bad(stats, skip_bad, spec.path, line_no, f"expected <review>, got {s[:40]!r}")
            continue
        invalid = invalid or not ok
        if skipping:
            if s == "</review>":
                in_review = False
            continue
        if cur is None:
            if s == "</review>":
                in_review = False
                if value is None:
                    _bad(stats, skip_bad, spec.path, start, f"<review> block has no <{want}>")
                elif not invalid or _utf8_ok(stats, skip_bad, utf8_errors, spec.path, start):
                    stats.records += 1
                    yield start, "\n".join(value)
                continue
            m = _TAG.fullmatch(s)
            if m and m.group(1) != "review":
                cur = m.group(1)
                if cur == want:
                    value = []
            elif s:
                _bad(stats, skip_bad, spec.path, line_no,
                     f"unexpected {s[:40]!r} between fields of the <review> block "
                     f"starting at line {start}")
                skipping = True
        elif s == f"</{cur}>":
            cur = None
        elif s in ("<review>", "</review>"):
            _bad(stats, skip_bad, spec.path, line_no,
                 f"{s} inside <{cur}> (field not closed) in the block starting at line {start}")
            if s == "<review>":
                start, cur, value, invalid = line_no, None, None, not ok
            else:
                in_review = False
        elif cur == want:
            value.append(text)
    if in_review:
        _bad(stats, skip_bad, spec.path, start,
             "<review> block not closed at end of file")


def _text_records(spec, lines, stats, skip_bad, utf8_errors):
    for line_no, text, ok in lines:
        if not text or text.isspace():
            stats.blank_lines += 1
            continue
        if not ok and not _utf8_ok(stats, skip_bad, utf8_errors, spec.path, line_no):
            continue
        stats.records += 1
        yield line_no, text


def _dialect(fmt: str) -> dict:
    if fmt == "tsv":
        return {"delimiter": "\t", "quoting": csv.QUOTE_NONE, "strict": False}
    return {"delimiter": ",", "quotechar": '"', "doublequote": True, "strict": False}


def read_documents(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *,
                   stats: Optional[ReadStats] = None, skip_bad: bool = False,
                   utf8_errors: str = "replace",
                   progress: Optional[Callable[[int], None]] = None,
                   block_size: int = BLOCK_SIZE,
                   max_line_bytes: Optional[int] = None) -> Iterator[tuple[int, str]]:
    """The documents of one input file (or of one stripe of it).

    Args:
        spec: from :func:`resolve_input`.
        stripe, n_stripes: read only one stripe (:func:`iter_lines`); only for
            :data:`LINE_FORMATS`.
        stats: counters to update (see :class:`ReadStats`).
        skip_bad: count and sample malformed records instead of raising.
        utf8_errors: ``"replace"`` (invalid bytes -> U+FFFD, counted) or ``"strict"`` (the
            record is a bad record).
        progress: called with bytes read from disk since the last call.
        block_size: stripe block size (uncompressed bytes).
        max_line_bytes: longest line (record) kept, see :func:`iter_segments`.
    Yields:
        ``(line_number, text)``: 1-based line where the record starts, and the text exactly as
        stored (no normalisation).
    Raises:
        BadRecord: malformed record (unless ``skip_bad``); names file and line.
        CorruptInput: damaged compressed stream. ValueError: striping a multi-line format.
    """
    if n_stripes > 1 and spec.format not in LINE_FORMATS:
        raise ValueError(f"{spec.path}: format {spec.format} cannot be read in stripes")
    if utf8_errors not in ("replace", "strict"):
        raise ValueError(f"utf8_errors must be 'replace' or 'strict', got {utf8_errors!r}")
    stats = stats if stats is not None else ReadStats()
    keepends = spec.format in ("csv", "tsv")
    lines = iter_lines(spec, stripe, n_stripes, keepends=keepends, stats=stats,
                       skip_bad=skip_bad, progress=progress, block_size=block_size,
                       max_line_bytes=max_line_bytes)
    if spec.format in ("json", "loose-json"):
        return _json_records(spec, lines, stats, skip_bad, utf8_errors,
                             spec.format == "loose-json")
    if spec.format in ("csv", "tsv"):
        return _delimited_records(spec, lines, stats, skip_bad, utf8_errors)
    if spec.format == "review":
        return _review_records(spec, lines, stats, skip_bad, utf8_errors)
    return _text_records(spec, lines, stats, skip_bad, utf8_errors)


def read_document_batches(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *,
                          stats: Optional[ReadStats] = None, skip_bad: bool = False,
                          utf8_errors: str = "replace",
                          progress: Optional[Callable[[int], None]] = None,
                          block_size: int = BLOCK_SIZE,
                          batch: int = 4096,
                          max_line_bytes: Optional[int] = None) -> Iterator[list]:
    """The texts of :func:`read_documents` (same arguments, same texts in the same order, same
    counters and errors) as lists, without line numbers: the bulk path of ``prepare``.

    JSON-lines files (``json``) are read as raw byte runs (:func:`iter_segments`) and parsed
    with orjson, one list per run (about ``block_size`` bytes); the other formats are the
    :func:`read_documents` records in lists of up to ``batch``.
    """
    if spec.format == "json" and orjson is not None:
        if n_stripes > 1 and spec.format not in LINE_FORMATS:  # pragma: no cover - json is one
            raise ValueError(f"{spec.path}: format {spec.format} cannot be read in stripes")
        if utf8_errors not in ("replace", "strict"):
            raise ValueError(f"utf8_errors must be 'replace' or 'strict', got {utf8_errors!r}")
        stats = stats if stats is not None else ReadStats()
        segments = iter_segments(spec, stripe, n_stripes, stats=stats, skip_bad=skip_bad,
                                 progress=progress, block_size=block_size,
                                 max_line_bytes=max_line_bytes)
        yield from _json_batches(spec, segments, stats, skip_bad, utf8_errors)
        return
    out: list = []
    for _, text in read_documents(spec, stripe, n_stripes, stats=stats, skip_bad=skip_bad,
                                  utf8_errors=utf8_errors, progress=progress,
                                  block_size=block_size, max_line_bytes=max_line_bytes):
        out.append(text)
        if len(out) >= batch:
            yield out
            out = []
    if out:
        yield out


def _head_lines(path: str, compressed: bool, max_lines: int = 64) -> list[tuple[int, str]]:
    """Up to ``max_lines`` decoded lines (with ends) from the start of a file, for sniffing."""
    spec = InputSpec(path=path, format="text", text_field=None, format_source="",
                     field_source="", compressed=compressed)
    out = []
    try:
        # lines over 1 MiB are skipped: sniffing needs a few records, not a huge one in memory
        for line_no, text, _ in iter_lines(spec, keepends=True, skip_bad=True,
                                           block_size=1 << 16, max_line_bytes=1 << 20):
            out.append((line_no, text))
            if len(out) >= max_lines:
                break
    except CorruptInput:
        pass  # reported when the file is read for real
    return out


def resolve_input(path, fmt: Optional[str] = None, text_field: Optional[str] = None) -> InputSpec:
    """Decide how to read ``path``: format (given, or from the name and the first record) and
    text field (given, the format's default, or the first of :data:`TEXT_FIELD_CANDIDATES` in the
    CSV/TSV header or first JSON record).

    Raises:
        InputError: missing/unreadable file, unknown format, or no usable text field (the
            message lists what the file has).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise InputError(f"{path}: is a folder, not a file; pass the files in it (e.g. "
                         f"{path}/*.json.gz)")
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    try:
        size = os.path.getsize(path)
        compressed = is_gzip(path)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e})") from e
    if fmt is not None and fmt not in FORMATS:
        raise InputError(f"{path}: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    fsrc = "given"
    if fmt is None:
        fmt, fsrc = infer_format(path), "file name"
        if fmt is None:
            raise InputError(f"{path}: cannot infer the format from the file name; pass --format "
                             f"({', '.join(FORMATS)})")
    head = _head_lines(path, compressed) if size else []
    first = next(((n, t) for n, t in head if t.strip()), None)
    if fmt == "json" and fsrc == "file name" and first is not None:
        try:
            json.loads(first[1])
        except ValueError:
            try:
                if isinstance(ast.literal_eval(first[1].strip()), dict):
                    fmt, fsrc = "loose-json", "file name + content"
            except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
                pass
    kw = dict(path=path, format=fmt, size=size, compressed=compressed, format_source=fsrc)
    if fmt == "text":
        return InputSpec(text_field=None, field_source="", **kw)
    if fmt == "review":
        return InputSpec(text_field=text_field or REVIEW_DEFAULT_FIELD,
                         field_source="given" if text_field else "default", **kw)
    if fmt in ("csv", "tsv"):
        csv.field_size_limit(_CSV_LIMIT)
        lines = iter(t for n, t in head)
        try:
            header = next(csv.reader(lines, **_dialect(fmt)), None)
        except csv.Error as e:
            raise InputError(f"{path}:1: unreadable {fmt.upper()} header ({e})") from e
        if not header:
            if size and not head:
                raise InputError(f"{path}: no header row")
            header = []
        consumed = len(head) - sum(1 for _ in lines)
        columns = tuple(header)
        if text_field is None:
            text_field = next((c for c in TEXT_FIELD_CANDIDATES if c in columns), None)
            fld_src = "header"
        else:
            fld_src = "given"
        if columns and text_field not in columns:
            what = (f"no column {text_field!r}" if text_field is not None else
                    "no text column among " + ", ".join(TEXT_FIELD_CANDIDATES))
            raise InputError(f"{path}: {what} in the {fmt.upper()} header "
                             f"(columns: {', '.join(columns)}); pass --text-field")
        if not columns:  # empty file: nothing to read
            text_field = text_field or TEXT_FIELD_CANDIDATES[0]
        return InputSpec(text_field=text_field, field_source=fld_src, columns=columns,
                         header_lines=consumed, **kw)
    # json / loose-json
    if text_field is not None:
        return InputSpec(text_field=text_field, field_source="given", **kw)
    obj = None
    if first is not None:
        try:
            obj = (json.loads(first[1]) if fmt == "json" else ast.literal_eval(first[1].strip()))
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            obj = None  # reported as a bad record when read
    if isinstance(obj, dict):
        found = next((c for c in TEXT_FIELD_CANDIDATES if c in obj), None)
        if found is None:
            raise InputError(f"{path}:{first[0]}: none of the usual text fields in the first "
                             f"record (keys: {', '.join(map(str, obj))}); pass --text-field")
        return InputSpec(text_field=found, field_source="first record", **kw)
    return InputSpec(text_field=TEXT_FIELD_CANDIDATES[0], field_source="default", **kw)
