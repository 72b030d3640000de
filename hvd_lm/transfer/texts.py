"""Reading records of text files, for sentiment transfer and the tools on top of it: CSV/TSV
(a header row), JSON lines, or plain lines (one text per non-blank line), gzip-compressed or not,
or standard input; one record reader (:func:`_records`) serves the labelled datasets
(:mod:`hvd_lm.transfer.datasets`) and the unlabelled texts of ``hvd-lm classify``/``visualize``
(:func:`iter_texts`), with the same file/line/field errors.

Input is read in bounded memory: a physical line longer than ``max_line_bytes``
(:data:`DEFAULT_MAX_LINE_BYTES`; classify's ``--max-line-bytes``) stops the read with one
:class:`DatasetError` naming the file and line, after reading at most that many characters of it,
so an endless stream without a newline (``--input -`` fed by ``yes | tr -d '\\n'``) cannot grow
the process; :func:`iter_texts` yields records one at a time for a caller that streams.

Label mapping (:func:`normalize_label`, case-insensitive, surrounding whitespace ignored):
``1``, ``1.0``, ``pos``, ``positive``, ``true`` -> 1 and ``0``, ``0.0``, ``neg``, ``negative``,
``false`` -> 0 (JSON booleans and the integers 0/1 as well). Anything else (for example ``-1``,
``2`` or ``neutral``) stops with a :class:`DatasetError` naming the file, line and field: a silently
merged or dropped class would give a wrong accuracy.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hvd_lm.formats.tokenizer import replace_surrogates
from hvd_lm.options import option
from hvd_lm.util.files import FileRefused, check_regular, open_regular

#: Accepted label spellings (lower-cased, stripped) and the class they map to.
LABEL_MAP: dict[str, int] = {
    "1": 1, "1.0": 1, "pos": 1, "positive": 1, "true": 1,
    "0": 0, "0.0": 0, "neg": 0, "negative": 0, "false": 0,
}
#: Longest line read, in UTF-8 bytes (``--max-line-bytes``): 1 MiB, 500 times a long review
#: (features use the first 2,000 bytes of a text,
#: :data:`hvd_lm.transfer.features.DEFAULT_MAX_CHARS`).
DEFAULT_MAX_LINE_BYTES = 1 << 20



class DatasetError(ValueError):
    """A dataset file cannot be used: missing file/column, unknown label, bad line, empty split.

    The message names the file, and where it applies the line and the field.
    """


def normalize_label(value, where: str) -> int:
    """Map a raw label to 0/1 using :data:`LABEL_MAP`.

    Args:
        value: the raw value (str, int, float or bool).
        where: ``"file:line: field 'x'"``, used in the error message.
    Returns:
        0 or 1.
    Raises:
        DatasetError: the value is not one of the accepted spellings.
    """
    if isinstance(value, (int, float)) and value in (0, 1):  # bool too (False, True)
        return int(value)
    key = str(value).strip().lower() if value is not None else ""
    if key in LABEL_MAP:
        return LABEL_MAP[key]
    raise DatasetError(f"{where}: unknown label {value!r} (accepted: 1/pos/positive/true -> 1, "
                       f"0/neg/negative/false -> 0)")


#: Bytes that are not UTF-8, as text read with ``errors="surrogateescape"`` holds them.
_UNDECODED = re.compile("[\udc80-\udcff]")


def read_lines(stream, path, max_bytes: int = DEFAULT_MAX_LINE_BYTES,
               flag: str | None = None) -> Iterator[str]:
    """The lines of a text ``stream`` (line ends kept; opened by :func:`_open_text`, which keeps
    bytes that are not UTF-8 as lone surrogates), each UTF-8 text of at most ``max_bytes`` bytes
    besides its line end; at most ``max_bytes + 1`` characters of a line are ever held.

    Args:
        flag: the command's flag that sets ``max_bytes`` (``"--max-line-bytes"``), named in
            the error; None where the command has none.

    Raises:
        DatasetError: a line that is not UTF-8 or longer, naming ``path`` and the line number
            (1-based).
    """
    for lineno, line in enumerate(iter(lambda: stream.readline(max_bytes + 1), ""), 1):
        body = line.rstrip("\r\n")
        if _UNDECODED.search(body):  # the bytes again, for the decoder's reason
            try:
                body.encode("utf-8", "surrogateescape").decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text ({e.reason}); convert it, "
                                   "e.g. with iconv -t utf-8") from None
        if len(body) > max_bytes or (4 * len(body) > max_bytes and len(
                body.encode("utf-8", "surrogatepass")) > max_bytes):
            raise DatasetError(f"{path}:{lineno}: line longer than {max_bytes:,} bytes"
                               + (f" ({flag} sets the limit)" if flag else "") +
                               "; is this the text you meant to read?")
        yield line


def _refusing(opener, path: Path, what: str, *args):
    """``opener(path, what, *args)`` (:func:`hvd_lm.util.files.check_regular`,
    :func:`~hvd_lm.util.files.open_regular` or :func:`~hvd_lm.util.files.check_folder`): the one
    check of every path transfer reads, a missing one or a refused one (a FIFO, a folder, a
    device...) as :class:`DatasetError` naming it and what it is."""
    try:
        return opener(path, what, *args)
    except FileNotFoundError as e:  # the check's "PATH: no such file" (or folder)
        raise DatasetError((e.strerror if e.filename is None else f"{path}: no such file")
                           + (f" ({what})" if what else "")) from None
    except FileRefused as e:
        raise DatasetError(str(e)) from None


@contextmanager
def _open_text(path: Path, what: str, streams: bool = False) -> Iterator[io.TextIOBase]:
    """UTF-8 text of standard input (``-``) or of a regular file (a FIFO too with ``streams``),
    gunzipped when its name ends in ``.gz``, opened through :func:`hvd_lm.util.files.open_regular`.

    Raises:
        DatasetError: no such file, or a folder, device, socket (or FIFO) named as what it is.
    """
    raw = sys.stdin.buffer if str(path) == "-" else _refusing(open_regular, path, what, streams)
    with raw, io.TextIOWrapper(gzip.GzipFile(fileobj=raw, mode="rb") if path.suffix == ".gz"
                               else raw, encoding="utf-8-sig", newline="",
                               errors="surrogateescape") as f:
        yield f


def _kind(path: Path, fallback: str | None = None) -> str:
    """``csv``, ``tsv`` or ``jsonl`` by the name's suffix (``.gz`` ignored), else ``fallback``.

    Raises:
        DatasetError: another suffix and no ``fallback``.
    """
    name = path.name.lower().removesuffix(".gz")
    kind = ("tsv" if name.endswith(".tsv") else "csv" if name.endswith(".csv") else
            "jsonl" if name.endswith((".jsonl", ".json", ".ndjson")) else fallback)
    if not kind:
        raise DatasetError(f"{path}: unknown file type (expected .csv, .tsv, .jsonl, .json or "
                           ".ndjson, optionally .gz)")
    return kind


def _records(path: Path, stream, kind: str, text_field: str, label_field: str | None,
             max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
             flag: str | None = None) -> Iterator[tuple[int, str, int | None]]:
    """(line number, text, label 0/1 or None) of each record of an open ``stream`` of ``kind``
    (``csv``, ``tsv``, ``jsonl``, ``lines``), read one at a time (:func:`read_lines`);
    ``label_field`` None reads no label, else labels are mapped by :func:`normalize_label`.
    Blank lines of JSON-lines and plain-lines input are skipped.

    Raises:
        DatasetError: missing column/key, short row, invalid CSV or JSON, non-string text, an
            unknown label, a line over ``max_line_bytes``; naming the file and line.
    """
    lines = read_lines(stream, path, max_line_bytes, flag)
    fields = [n for n in (text_field, label_field) if n is not None]

    def label(raw, line: int) -> int | None:
        return None if label_field is None else normalize_label(
            raw, f"{path}:{line}: field '{label_field}'")

    if kind in ("csv", "tsv"):
        # TSV as Amazon's *.tsv and data_prep read it: tab-separated, no quoting (a quote is text)
        dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if kind == "tsv" else {}
        reader = csv.DictReader(lines, **dialect)
        try:
            cols = reader.fieldnames or []
            twice = sorted({c for c in cols if cols.count(c) > 1})
            if twice:
                raise DatasetError(f"{path}: line 1: column(s) {twice} appear more than once in "
                                   f"the header {cols}")
            if missing := [n for n in fields if n not in cols]:
                raise DatasetError(f"{path}: line 1: no column '{missing[0]}' in header {cols}")
            for row in reader:
                if None in row:  # more fields than the header names: a misquoted row
                    raise DatasetError(f"{path}:{reader.line_num}: {len(cols) + len(row[None])} "
                                       f"fields, the header has {len(cols)} (quote fields that "
                                       f"hold a {'tab' if kind == 'tsv' else 'comma'})")
                # a short row: DictReader fills the fields it lacks with None
                if missing := [n for n in fields if row[n] is None]:
                    raise DatasetError(f"{path}:{reader.line_num}: field '{missing[0]}' missing "
                                       f"(row has {len([v for v in row.values() if v is not None])}"
                                       " values)")
                yield reader.line_num, row[text_field], label(row.get(label_field), reader.line_num)
        except csv.Error as e:
            raise DatasetError(f"{path}:{reader.line_num}: bad CSV ({e})") from None
    elif kind == "jsonl":
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:  # a 5,000-digit number, deep nesting
                raise DatasetError(f"{where}: unreadable JSON ({type(e).__name__}: "
                                   f"{str(e)[:80]})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if missing := [n for n in fields if n not in obj]:
                raise DatasetError(f"{where}: field '{missing[0]}' missing (keys: {sorted(obj)})")
            if not isinstance(obj[text_field], str):
                raise DatasetError(f"{where}: field '{text_field}' is "
                                   f"{type(obj[text_field]).__name__}, expected a string")
            yield lineno, replace_surrogates(obj[text_field]), label(obj.get(label_field), lineno)
    else:
        for lineno, line in enumerate(lines, 1):
            text = line.rstrip("\r\n")
            if text.strip():
                yield lineno, text, None


#: ``--format`` of text inputs (:func:`iter_texts`); ``auto`` goes by the file name.
TEXT_FORMATS = ("auto", "csv", "tsv", "jsonl", "lines")


@dataclass
class TextOptions:
    """The settings of the commands that read texts with :func:`iter_texts` (``classify``,
    ``visualize`` inherit them)."""

    input: str = option("-", "texts: CSV/TSV/JSON lines/plain lines (.gz ok), - = standard input")
    format: str = option("auto", "input format (auto: by suffix, else plain lines)",
                         choices=TEXT_FORMATS)
    text_field: str = option("text", "text column/key of CSV/TSV/JSON-lines input")


@dataclass
class TextStream:
    """Texts read one record at a time (:func:`iter_texts`).

    Attributes:
        name: the file, or ``<stdin>``.
        records: (line number where the record ends, text, label 0/1 or None) per record.
    """

    name: str
    records: Iterator[tuple[int, str, int | None]]


def iter_texts(path: str | Path, fmt: str = "auto", text_field: str = "text",
               label_field: str | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
               flag: str | None = None) -> TextStream:
    """Texts from a CSV/TSV (header row), JSON-lines or plain-text file (one text per non-blank
    line), gzip-compressed or not, or from standard input (``-``), one record at a time: the
    file is opened and read as the iterator is consumed (and closed when it ends).

    Args:
        fmt: one of :data:`TEXT_FORMATS`; ``auto``: ``.csv``/``.tsv``/``.jsonl``/``.json``/
            ``.ndjson`` (optionally ``.gz``) by suffix, anything else (and ``-``) plain lines.
        text_field: column/key of the text (CSV/TSV/JSON lines).
        label_field: also read 0/1 labels from this column/key (:func:`normalize_label`).
        max_line_bytes: longest line read (:func:`read_lines`); flag: the command's flag that
            sets it, named in the error (None: the command has none).
    Returns:
        The :class:`TextStream` (its records are read as they are consumed).
    Raises:
        DatasetError: unknown format, missing file, a folder, device or socket (at once; a
            FIFO is read: ``--input <(cmd)``); any record error (file and line named) while
            iterating.
    """
    if fmt not in TEXT_FORMATS:
        raise DatasetError(f"unknown input format {fmt!r} (known: {', '.join(TEXT_FORMATS)})")
    path = Path(path)
    stdin = str(path) == "-"
    if not stdin:  # at once, not when the records are first read
        _refusing(check_regular, path, "texts are read from a file or a pipe", True)
    kind = fmt if fmt != "auto" else ("lines" if stdin else _kind(path, "lines"))
    if kind == "lines" and label_field:
        raise DatasetError(f"{path}: plain-lines input has no label field "
                           f"({label_field!r}); use CSV/TSV or JSON lines")
    name = "<stdin>" if stdin else str(path)

    def records() -> Iterator[tuple]:
        with _open_text(path, "texts are read from a file or a pipe", streams=True) as f:
            yield from _records(Path(name), f, kind, text_field, label_field or None,
                                max_line_bytes, flag)

    return TextStream(name, records())
