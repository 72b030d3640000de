"""What an input is: its format from its name or its first lines, and the field that holds the text
(``--format`` / ``--text-field`` given or sniffed), as the :class:`~data_prep.inputs.InputSpec` the
readers take.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import json
import os
import re
from typing import Optional

from data_prep import inputs
from data_prep.gzip_blocks import is_gzip
from data_prep.inputs import FORMATS, TEXT_FIELD_CANDIDATES, CorruptInput, InputError, InputSpec
from data_prep.lines import iter_lines
from data_prep.readers import _dialect
from hvd_lm.util.files import FileRefused, check_regular, shown

_SUFFIX_FORMATS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".csv": "csv",
                   ".tsv": "tsv", ".tab": "tsv", ".review": "review", ".txt": "text",
                   ".text": "text"}
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


def infer_format(path: str) -> Optional[str]:
    """Format from the file name (``.gz``/``.gzip`` suffix ignored): ``.json``/``.jsonl``/
    ``.ndjson`` -> json, ``.csv`` -> csv, ``.tsv``/``.tab`` -> tsv, ``.review`` -> review,
    ``.txt``/``.text`` -> text, ``.tar`` (``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``)
    -> tar; ``None`` when unknown."""
    name = os.path.basename(path).lower()
    return "tar" if name.endswith(_TAR_SUFFIXES) else _SUFFIX_FORMATS.get(
        os.path.splitext(re.sub(r"\.gz(ip)?$", "", name))[1])


def _head_lines(path: str, compressed: bool, max_lines: int = 64) -> list[tuple[int, str]]:
    """Up to ``max_lines`` decoded lines (with ends) from the start of a file, for sniffing."""
    spec = InputSpec(path=path, format="text", text_field=None, format_source="",
                     field_source="", compressed=compressed)
    out = []
    with contextlib.suppress(CorruptInput):  # reported when the file is read for real
        # lines over 1 MiB are skipped: sniffing needs a few records, not a huge one in memory
        for line_no, text, _ in iter_lines(spec, keepends=True, skip_bad=True,
                                           block_size=1 << 16, max_line_bytes=1 << 20):
            out.append((line_no, text))
            if len(out) >= max_lines:
                break
    return out


def _parse(text: str, fmt: str):
    """The value of a ``json`` / ``loose-json`` record line; None when it does not parse (or
    for another format)."""
    with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        if fmt in ("json", "loose-json"):
            return json.loads(text) if fmt == "json" else ast.literal_eval(text.strip())
    return None


def resolve_input(path, fmt: Optional[str] = None, text_field: Optional[str] = None,
                  tar_members: Optional[str] = None) -> InputSpec:
    """Decide how to read ``path``: format (given, or from the name and the first record) and
    text field (given, the format's default, or the first of :data:`TEXT_FIELD_CANDIDATES` in the
    CSV/TSV header or first JSON record); for a ``tar`` archive, ``tar_members`` (default
    :data:`TAR_DEFAULT_MEMBERS`) instead of a text field. A ``text_field`` naming several fields,
    comma-separated, is a preference list: each file reads the first of them it has (a corpus of
    sources that each name their text differently, in one run); a ``#N`` in it is column N
    (1-based) of a CSV/TSV without a header row, for a file whose first row holds none of the
    names listed (that row is then a record).

    Raises:
        InputError: missing/unreadable file, unknown format, or no usable text field (the
            message lists what the file has).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise InputError(f"{path}: is a folder, not a file; pass the files in it (e.g. "
                         f"{path}/*.json.gz)")
    try:  # a FIFO (it blocks), a device (/dev/zero never ends) or a socket: named, not opened
        check_regular(path, "prepare reads review files")
    except FileNotFoundError:
        raise InputError(f"{shown(path)}: no such file") from None
    except FileRefused as e:
        raise InputError(str(e)) from None
    try:
        size, compressed = os.path.getsize(path), is_gzip(path)
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
    kw = dict(path=path, format=fmt, size=size, compressed=compressed, format_source=fsrc)
    if fmt == "tar":  # binary: nothing to sniff; the members are read in the archive's order
        globs = tar_members or inputs.TAR_DEFAULT_MEMBERS
        if not [g for g in globs.split(",") if g.strip()]:
            raise InputError(f"{path}: --tar-members {tar_members!r} holds no glob")
        return InputSpec(text_field=globs, field_source="given" if tar_members else "default",
                         **kw)
    head = _head_lines(path, compressed) if size else []
    first = next(((n, t) for n, t in head if t.strip()), None)
    obj = _parse(first[1], fmt) if first is not None else None  # None: not parsed
    if fmt == "json" and fsrc == "file name" and first is not None and obj is None:
        loose = _parse(first[1], "loose-json")  # a dict literal in a .json file
        if isinstance(loose, dict):
            fmt, fsrc, obj = "loose-json", "file name + content", loose
    kw.update(format=fmt, format_source=fsrc)
    wanted = [f.strip() for f in text_field.split(",")] if text_field else None
    if text_field is not None and not any(wanted or ()):
        raise InputError(f"{path}: --text-field {text_field!r} names no field")
    if wanted and "" in wanted:  # 'body,,title': a name lost between two commas, not skipped
        raise InputError(f"--text-field {text_field!r}: an empty name in the list (two commas "
                         "in a row, or one at an end); give the field names, comma-separated")
    for name in wanted or ():
        if name.startswith("#") and not re.fullmatch(r"#[1-9]\d{0,3}", name):
            raise InputError(f"--text-field {name!r}: a column number of a CSV/TSV without a "
                             "header row is #1 to #9999 (1-based)")
    names = wanted or TEXT_FIELD_CANDIDATES
    one = wanted is not None and len(wanted) == 1  # one field given: that field, no choice
    if fmt == "text":
        return InputSpec(text_field=None, field_source="", **kw)
    if fmt == "review":
        if wanted and not one:  # the first listed tag the first blocks hold
            tags = {t.strip()[1:-1] for _, t in head if re.fullmatch(r"\s*<[\w.-]+>\s*", t)}
            pick = next((w for w in wanted if w in tags), wanted[0])
            return InputSpec(text_field=pick, field_source="given, first in the blocks", **kw)
        return InputSpec(text_field=wanted[0] if wanted else inputs.REVIEW_DEFAULT_FIELD,
                         field_source="given" if wanted else "default", **kw)
    if fmt in ("csv", "tsv"):
        csv.field_size_limit(inputs.CSV_FIELD_LIMIT)
        lines = iter(t for n, t in head)
        try:
            header = next(csv.reader(lines, **_dialect(fmt)), None)
        except csv.Error as e:
            raise InputError(f"{path}:1: unreadable {fmt.upper()} header ({e})") from e
        if not header and size and not head:
            raise InputError(f"{path}: no header row")
        consumed = len(head) - sum(1 for _ in lines)
        columns = tuple(header or ())
        text_field = names[0] if one else next((c for c in names if c in columns), None)
        fld_src = "given" if one else "header" if wanted is None else "given, first in the header"
        numbered = [n for n in names if re.fullmatch(r"#[1-9]\d{0,3}", n)]
        if columns and text_field not in columns and numbered:
            # none of the named columns: a file without a header row, its first row is data
            if int(numbered[0][1:]) > len(columns):
                raise InputError(f"{path}: --text-field {numbered[0]}: the first row has "
                                 f"{len(columns)} columns")
            return InputSpec(text_field=numbered[0], field_source="given, no header row",
                             columns=tuple(f"#{i + 1}" for i in range(len(columns))),
                             header_lines=0, **kw)
        if columns and text_field not in columns:
            what = (f"no column {names[0]!r}" if len(names) == 1 else
                    "no text column among " + ", ".join(names))
            raise InputError(f"{path}: {what} in the {fmt.upper()} header "
                             f"(columns: {', '.join(columns)}); pass --text-field")
        # (an empty file has no columns and nothing to read: the field is the first name)
        return InputSpec(text_field=text_field or names[0], field_source=fld_src, columns=columns,
                         header_lines=consumed, **kw)
    # json / loose-json
    if one:
        return InputSpec(text_field=names[0], field_source="given", **kw)
    if isinstance(obj, dict):  # (a first record that is not one is a bad record when read)
        found = next((c for c in names if c in obj), None)
        if found is None:
            which = "the usual text fields" if wanted is None else ", ".join(names)
            raise InputError(f"{path}:{first[0]}: none of {which} in the first record (keys: "
                             f"{', '.join(map(str, obj))}); pass --text-field")
        return InputSpec(text_field=found, field_source="first record", **kw)
    return InputSpec(text_field=names[0], field_source="default", **kw)
