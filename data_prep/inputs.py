"""The vocabulary of reading inputs, shared by every reader: format names, the errors (naming file
and line), the counters of what was skipped (:class:`ReadStats`) and an input's resolved
description (:class:`InputSpec`). The formats themselves are documented in
:mod:`data_prep.readers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

#: Format names accepted by ``--format``.
FORMATS = ("json", "loose-json", "csv", "tsv", "review", "text", "tar")


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


#: Members of a ``tar`` archive read as documents when ``--tar-members`` is not given
#: (comma-separated ``fnmatch`` globs over the member's path in the archive).
TAR_DEFAULT_MEMBERS = "*.txt"
#: ... less aclImdb's ``test/`` reviews (IMDB's held-out split: never LM text), when
#: ``--tar-members`` is not given (its URL lists and ``imdbEr.txt`` are
#: :data:`TAR_NOT_DOCUMENTS`, left out whatever the globs). Counted in the summary
#: (``members_left_out``).
TAR_DEFAULT_EXCLUDE = ("aclImdb/test/*", "*/aclImdb/test/*")
#: Members never read as documents, whatever ``--tar-members`` says: aclImdb's URL lists and
#: expected-rating table, matched on the member's file name (in any folder: IMDB's
#: ``*/train/pos/*.txt`` glob matches a ``train/pos/urls_pos.txt`` too). Counted in
#: ``members_left_out``.
TAR_NOT_DOCUMENTS = ("urls_*.txt", "imdbEr.txt")


#: How many bad records are kept as samples (per reader and after merging).
MAX_BAD_SAMPLES = 5


CSV_FIELD_LIMIT = 2**31 - 1


class InputError(ValueError):
    """An input cannot be read as asked (unknown format, missing column, unreadable file).
    Never skipped by ``skip_bad``; the message names the file."""


class _AtLine:
    """An error at a line of a file: attributes ``path``, ``line`` (1-based) and ``reason``;
    ``str()`` is ``"PATH:LINE: REASON"``; picklable across worker processes."""

    def __init__(self, path: str, line: int, reason: str):
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.line, self.reason))


class BadRecord(_AtLine, ValueError):
    """One malformed record (:class:`_AtLine`)."""


class CorruptInput(_AtLine, InputError):
    """A compressed stream fails its integrity check (CRC) or holds invalid deflate data; raised
    after the records before the failure were yielded (:class:`_AtLine`)."""


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
        members_left_out: ``tar`` members the globs matched but :data:`TAR_NOT_DOCUMENTS`
            (whatever the globs) or :data:`TAR_DEFAULT_EXCLUDE` (the default globs) left out.
    """

    records: int = 0
    blank_lines: int = 0
    bad_records: int = 0
    utf8_replaced: int = 0
    truncated_files: int = 0
    corrupt_files: int = 0
    bytes_in: int = 0
    members_left_out: int = 0
    bad_samples: list = field(default_factory=list)

    def add_bad(self, path: str, line: int, reason: str) -> None:
        """Count one skipped bad record and keep it as a sample while there are fewer than
        :data:`MAX_BAD_SAMPLES`."""
        self.bad_records += 1
        if len(self.bad_samples) < MAX_BAD_SAMPLES:
            self.bad_samples.append((path, line, reason))

    def merge(self, other: "ReadStats") -> None:
        """Add ``other``'s counts; keep the first samples in (path, line) order."""
        for f in fields(self):  # every counter (a subclass's too)
            if f.name != "bad_samples":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.bad_samples = sorted(self.bad_samples + [tuple(s) for s in other.bad_samples],
                                  key=lambda s: (s[0], s[1]))[:MAX_BAD_SAMPLES]


@dataclass(frozen=True)
class InputSpec:
    """How to read one input file (built by :func:`resolve_input`).

    Attributes:
        path: absolute path.
        format: one of :data:`FORMATS`.
        text_field: field/column/tag holding the text (``None`` for ``text``); for ``tar``,
            the member globs (``--tar-members``).
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


def count_bad(stats: ReadStats, skip_bad: bool, path: str, line: int, reason: str) -> None:
    """Raise :class:`BadRecord`, or with ``skip_bad`` count and sample it."""
    if not skip_bad:
        raise BadRecord(path, line, reason)
    stats.add_bad(path, line, reason)


def over_budget(what: str, limit: int) -> str:
    """The reason given for a record over the per-document budget of ``limit`` bytes: ``what``
    (the record and its size) and what to do."""
    return (f"{what} is longer than the {limit:,} bytes the memory budget allows per document "
            "(raise --max-memory-mb, or --skip-bad to drop it)")


def utf8_ok(stats: ReadStats, skip_bad: bool, utf8_errors: str, path: str, line: int) -> bool:
    """Handle a record that held invalid UTF-8; True when it is still to be used."""
    if utf8_errors == "strict":
        count_bad(stats, skip_bad, path, line, "invalid UTF-8")
        return False
    stats.utf8_replaced += 1
    return True
