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
``tar``
    A tar archive of text files, one document per member: :mod:`data_prep.tars`.

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
* a record longer than the per-document budget (``max_line_bytes``): a line, a CSV record whose
  quote never closes, a ``<review>`` block of many lines alike, stopped as it passes the budget
  and a bad record (with ``skip_bad`` a CSV file goes on at the next line, a ``.review`` file at
  the block's ``</review>``).
* truncated gzip stream: the records before the cut are read, the cut-off last line is dropped,
  and the cut is a bad record (line = the line it cut); ``truncated_files`` counts it.
* corrupt gzip stream (bad CRC, invalid deflate data): :class:`CorruptInput` is raised; the
  damaged place is unknown, so callers drop everything read from that file.
* unknown format, missing text column, unreadable file: :class:`InputError` (never skipped).
"""

from __future__ import annotations

import ast
import csv
import functools
import json
import re
from typing import Callable, Iterator, Optional

import orjson  # C JSON parser (PyPI): the fast path of :func:`_json_records`

from data_prep import inputs
from data_prep.gzip_blocks import BLOCK_SIZE
from data_prep.inputs import CSV_FIELD_LIMIT, LINE_FORMATS, InputSpec, ReadStats, count_bad, utf8_ok
from data_prep.lines import decode, iter_lines, iter_segments
from data_prep.tars import read_tar_members

_TAG = re.compile(r"<([A-Za-z_][\w.-]*)>")


#: A line with at least this many ``[`` and ``{`` (it could nest containers deeper than
#: ``json`` can: its C scanner stops at Python's recursion limit, 1000 frames, orjson at depth
#: 1024) is parsed by ``json`` only, so both parsers accept exactly the same lines. (Counted only
#: in lines that hold a ``[`` or a second ``{``.)
_DEEP_LINE = 500


def _json_records(spec, segments, stats, skip_bad, utf8_errors):
    """``(line_number, text)`` of a json / loose-json file, from the raw runs of lines of
    :func:`iter_segments`.

    A ``json`` line is first given to ``orjson.loads`` (bytes in, no decode). When it yields an
    object whose text field is a string, that string is what ``json.loads`` gives for the line:
    orjson accepts only valid UTF-8 and standard JSON (no NaN/Infinity, no lone surrogates,
    no BOM), all of which ``json`` accepts with the same result, and duplicate keys keep the
    last value in both. Every other line (blank, invalid, BOM, not an object, missing field,
    invalid UTF-8, possibly deep nesting), and every ``loose-json`` line, is decoded and parsed
    by ``json.loads`` (``ast.literal_eval``), and what is wrong with it is named.
    """
    key, loose = spec.text_field, spec.format == "loose-json"
    parse, what = (ast.literal_eval, "Python literal") if loose else (json.loads, "JSON")
    for first, chunk in segments:
        for line_no, raw in enumerate(chunk.removesuffix(b"\n").split(b"\n"), first):
            if not loose and (len(raw) < _DEEP_LINE or (
                    b"[" not in raw and raw.find(b"{", raw.find(b"{") + 1) < 0)
                    or raw.count(b"[") + raw.count(b"{") < _DEEP_LINE):
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    obj = None
                if type(obj) is dict and type(value := obj.get(key)) is str:
                    stats.records += 1
                    yield line_no, value
                    continue
            text, ok = decode(raw[:-1] if raw.endswith(b"\r") else raw, line_no == 1)
            if not text or text.isspace():
                stats.blank_lines += 1
                continue
            try:
                obj = parse(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError) as e:
                count_bad(stats, skip_bad, spec.path, line_no, f"invalid {what}: {e}")
                continue
            if not isinstance(obj, dict):
                count_bad(stats, skip_bad, spec.path, line_no,
                          f"{what} value is a {type(obj).__name__}, expected an object")
            elif not isinstance(value := obj.get(key), str):
                count_bad(stats, skip_bad, spec.path, line_no, f"no field {key!r}" if key not in obj
                          else f"field {key!r} is {type(value).__name__}, expected a string")
            elif ok or utf8_ok(stats, skip_bad, utf8_errors, spec.path, line_no):
                stats.records += 1
                yield line_no, value


class _TooLong(Exception):
    """A record grew past the per-document cap (raised by :class:`_Feed` through the csv
    reader)."""


class _Feed:
    """The lines of a CSV/TSV file after its header, for ``csv.reader``, counting the characters
    of the record being parsed: past ``cap`` it raises :class:`_TooLong` (an unclosed quote
    makes the rest of the file one field; without the cap it is held whole, 4 bytes a
    character; the caller sets ``first``, ``invalid`` and ``size`` back at each record's start).
    An iterator class, not a generator: it goes on after raising."""

    def __init__(self, lines, header_lines: int, cap: Optional[int]):
        self.lines, self.header_lines, self.cap = iter(lines), header_lines, cap
        self.first, self.last, self.invalid, self.size = None, 0, False, 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        for line_no, text, ok in self.lines:
            if line_no <= self.header_lines:
                continue
            if self.first is None:
                self.first = line_no
            self.last = line_no
            self.invalid = self.invalid or not ok
            self.size += len(text)
            if self.cap is not None and self.size > self.cap:
                raise _TooLong()
            return text
        raise StopIteration


def _delimited_records(spec, lines, stats, skip_bad, utf8_errors, cap=None):
    if not spec.columns:  # empty file: no header, no records
        return
    csv.field_size_limit(CSV_FIELD_LIMIT)
    feed = _Feed(lines, spec.header_lines, cap)
    reader = csv.reader(feed, **_dialect(spec.format))
    ncols = len(spec.columns)
    idx = spec.columns.index(spec.text_field)
    while True:
        feed.first, feed.invalid, feed.size = None, False, 0  # a new record
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            count_bad(stats, skip_bad, spec.path, feed.first or feed.last, f"CSV error: {e}")
            continue
        except _TooLong:  # with --skip-bad: a fresh reader goes on at the next line
            count_bad(stats, skip_bad, spec.path, feed.first, inputs.over_budget(
                f"a record of more than {cap:,} characters (a quote never closed?)", cap))
            reader = csv.reader(feed, **_dialect(spec.format))
            continue
        line_no = feed.first
        if not row or (len(row) == 1 and not row[0].strip()):
            stats.blank_lines += 1
            continue
        if len(row) != ncols:
            count_bad(stats, skip_bad, spec.path, line_no,
                 f"{len(row)} fields, expected {ncols} (header of {spec.format.upper()})")
            continue
        if feed.invalid and not utf8_ok(stats, skip_bad, utf8_errors, spec.path, line_no):
            continue
        stats.records += 1
        yield line_no, row[idx]


def _review_records(spec, lines, stats, skip_bad, utf8_errors, cap=None):
    want, bad = spec.text_field, functools.partial(count_bad, stats, skip_bad, spec.path)
    in_review = skipping = invalid = False
    start = size = 0
    cur = value = None  # the open field's tag; the text field's lines, once its tag is seen
    for line_no, text, ok in lines:
        s = text.strip()
        if not in_review:
            if not s:
                stats.blank_lines += 1
            elif s == "<review>":
                in_review, skipping, start, size = True, False, line_no, 0
                cur, value, invalid = None, None, not ok
            else:
                bad(line_no, f"expected <review>, got {s[:40]!r}")
            continue
        invalid = invalid or not ok
        size += len(text) + 1
        if cap is not None and size > cap and not skipping:  # a block of many short lines
            bad(start, inputs.over_budget(f"a <review> block of more than {cap:,} characters", cap))
            skipping, value, cur = True, None, None  # --skip-bad: on to its </review>
        if skipping:  # until the block's end
            in_review = s != "</review>"
            continue
        if cur is None:
            if s == "</review>":
                in_review = False
                if value is None:
                    bad(start, f"<review> block has no <{want}>")
                elif not invalid or utf8_ok(stats, skip_bad, utf8_errors, spec.path, start):
                    stats.records += 1
                    yield start, "\n".join(value)
                continue
            m = _TAG.fullmatch(s)
            if m and m.group(1) != "review":
                cur = m.group(1)
                if cur == want:
                    value = []
            elif s:
                bad(line_no, f"unexpected {s[:40]!r} between fields of the <review> block "
                    f"starting at line {start}")
                skipping = True
        elif s == f"</{cur}>":
            cur = None
        elif s in ("<review>", "</review>"):
            bad(line_no, f"{s} inside <{cur}> (field not closed) in the block starting at line "
                f"{start}")
            if s == "<review>":
                start, cur, value, invalid = line_no, None, None, not ok
            else:
                in_review = False
        elif cur == want:
            value.append(text)
    if in_review:
        bad(start, "<review> block not closed at end of file")


def _text_records(spec, lines, stats, skip_bad, utf8_errors):
    for line_no, text, ok in lines:
        if not text or text.isspace():
            stats.blank_lines += 1
            continue
        if not ok and not utf8_ok(stats, skip_bad, utf8_errors, spec.path, line_no):
            continue
        stats.records += 1
        yield line_no, text


def _dialect(fmt: str) -> dict:
    if fmt == "tsv":
        return {"delimiter": "\t", "quoting": csv.QUOTE_NONE, "strict": False}
    return {"delimiter": ",", "quotechar": '"', "doublequote": True, "strict": False}


def read_documents(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *,
                   stats: Optional[ReadStats] = None, skip_bad: bool = False,
                   utf8_errors: str = "replace", progress: Optional[Callable[[int], None]] = None,
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
        max_line_bytes: longest line (record) kept, see :func:`iter_segments`; for ``tar``,
            the largest member read; for ``csv``/``tsv`` records (quoted fields span lines) and
            ``review`` blocks, the most characters one record may span, however many lines.
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
    if spec.format == "tar":
        return read_tar_members(spec, stats, skip_bad, utf8_errors, progress, max_line_bytes)
    read = dict(stats=stats, skip_bad=skip_bad, progress=progress, block_size=block_size,
                max_line_bytes=max_line_bytes)
    if spec.format in ("json", "loose-json"):
        return _json_records(spec, iter_segments(spec, stripe, n_stripes, **read), stats,
                             skip_bad, utf8_errors)
    lines = iter_lines(spec, stripe, n_stripes, keepends=spec.format in ("csv", "tsv"), **read)
    # one document's bound whatever its line structure (an unclosed CSV quote, a .review block
    # of many lines): the line reader's own (iter_segments)
    cap = None if max_line_bytes is None else max(int(max_line_bytes), 2 * block_size)
    if spec.format in ("csv", "tsv"):
        return _delimited_records(spec, lines, stats, skip_bad, utf8_errors, cap)
    if spec.format == "review":
        return _review_records(spec, lines, stats, skip_bad, utf8_errors, cap)
    return _text_records(spec, lines, stats, skip_bad, utf8_errors)


def read_document_batches(spec: InputSpec, stripe: int = 0, n_stripes: int = 1, *,
                          batch: int = 4096, **kw) -> Iterator[list]:
    """The texts of :func:`read_documents` (same arguments, passed on as ``kw``: same texts in
    the same order, same counters and errors) as lists, without line numbers: the bulk path of
    ``prepare``. A list holds up to ``batch`` texts and about ``block_size`` characters."""
    out: list = []
    size, limit = 0, kw.get("block_size", BLOCK_SIZE)
    for _, text in read_documents(spec, stripe, n_stripes, **kw):
        out.append(text)
        size += len(text)
        if len(out) >= batch or size >= limit:
            yield out
            out, size = [], 0
    if out:
        yield out
