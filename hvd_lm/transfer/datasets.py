"""Labelled text datasets for sentiment transfer (``hvd-lm transfer``).

Every loader returns :class:`LabelledSplit` objects: the texts as ``str`` and the labels as an
int64 array of 0/1 (binary sentiment). Supported inputs:

* **SST-2** (binary Stanford Sentiment Treebank, Socher et al. 2013, as prepared by OpenAI and
  NVIDIA/sentiment-discovery): ``train.csv``, ``val.csv`` and optionally ``test.csv`` in one
  folder, each a CSV with header ``label,sentence`` (:func:`load_sst2`).
* **IMDB** (Large Movie Review Dataset v1.0, Maas et al. 2011) in its original ``aclImdb`` layout,
  ``{train,test}/{pos,neg}/<id>_<rating>.txt``, either as a folder or as the ``.tar.gz`` itself,
  read member by member with :mod:`tarfile` (nothing is extracted to disk) (:func:`load_imdb`).
* **Any CSV / TSV or JSON-lines file** (optionally gzip-compressed) with a text field and a label
  field (:func:`load_table`).

Unlabelled texts for ``hvd-lm classify``/``visualize`` (:func:`load_texts`): the same CSV/TSV and
JSON-lines files (labels optional), plain text with one text per non-blank line, or standard
input; one record reader (:func:`_records`) serves both, with the same file/line/field errors.

Label mapping (:func:`normalize_label`, case-insensitive, surrounding whitespace ignored):
``1``, ``1.0``, ``pos``, ``positive``, ``true`` -> 1 and ``0``, ``0.0``, ``neg``, ``negative``,
``false`` -> 0 (JSON booleans and the integers 0/1 as well). Anything else (for example ``-1``,
``2`` or ``neutral``) stops with a :class:`DatasetError` naming the file, line and field: a silently
merged or dropped class would give a wrong accuracy.

A split without a validation file gets one carved from its training split
(:func:`carve_validation`, stratified and seeded), which the transfer report records.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from sklearn.model_selection import train_test_split

#: Accepted label spellings (lower-cased, stripped) and the class they map to.
LABEL_MAP: dict[str, int] = {
    "1": 1, "1.0": 1, "pos": 1, "positive": 1, "true": 1,
    "0": 0, "0.0": 0, "neg": 0, "negative": 0, "false": 0,
}
#: Default fraction of a training split carved off as validation when none is given.
DEFAULT_VAL_FRACTION = 0.1

_IMDB_MEMBER = re.compile(r"(?:^|/)(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")
_CSV_SUFFIXES = (".csv", ".tsv")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


class DatasetError(ValueError):
    """A dataset file cannot be used: missing file/column, unknown label, bad line, empty split.

    The message names the file, and where it applies the line and the field.
    """


@dataclass
class LabelledSplit:
    """One split of a binary-labelled text dataset.

    Attributes:
        name: split name (``train``, ``val``, ``test``).
        texts: N review/sentence texts.
        labels: int64 array [N] of 0 (negative) / 1 (positive).
        source: where the examples came from (a path, plus how they were selected), for reports.
        notes: remarks for the transfer report (e.g. "val carved from train").
    """

    name: str
    texts: list[str]
    labels: np.ndarray
    source: str
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels, dtype=np.int64)
        if len(self.texts) != len(self.labels):
            raise ValueError(f"{self.name}: {len(self.texts)} texts but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, indices: Iterable[int], name: str | None = None,
             how: str = "") -> "LabelledSplit":
        """A new split of the examples at ``indices`` (in that order)."""
        idx = np.asarray(list(indices), dtype=np.int64)
        return LabelledSplit(name or self.name, [self.texts[i] for i in idx], self.labels[idx],
                             f"{self.source}{' ' + how if how else ''}", list(self.notes))

    def summary(self) -> dict:
        """``{"n", "positive", "negative", "chars", "source"}`` (chars = UTF-8 bytes)."""
        pos = int(self.labels.sum())
        return {"n": len(self), "positive": pos, "negative": len(self) - pos,
                "chars": int(sum(len(t.encode("utf-8", "replace")) for t in self.texts)),
                "source": self.source}


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
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    key = str(value).strip().lower() if value is not None else ""
    if key in LABEL_MAP:
        return LABEL_MAP[key]
    raise DatasetError(f"{where}: unknown label {value!r} (accepted: 1/pos/positive/true -> 1, "
                       f"0/neg/negative/false -> 0)")


def _check_nonempty(split: LabelledSplit, origin: str) -> LabelledSplit:
    if len(split) == 0:
        raise DatasetError(f"{origin}: split '{split.name}' has no examples")
    return split


def _open_text(path: Path) -> io.TextIOBase:
    if str(path) == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", newline="")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _kind(path: Path, fallback: str | None = None) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(".tsv"):
        return "tsv"
    if name.endswith(_CSV_SUFFIXES):
        return "csv"
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if fallback:
        return fallback
    raise DatasetError(f"{path}: unknown file type (expected .csv, .tsv, .jsonl, .json or .ndjson, "
                       f"optionally .gz)")


def _records(path: Path, stream, kind: str, text_field: str, label_field: str | None
             ) -> Iterator[tuple[int, str, object]]:
    """(line number, text, raw label or None) of each record of an open ``stream`` of ``kind``
    (``csv``, ``tsv``, ``jsonl``, ``lines``); ``label_field`` None reads no label. Blank lines
    of JSON-lines and plain-lines input are skipped.

    Raises:
        DatasetError: missing column/key, short row, invalid JSON, non-string text; naming the
            file and line.
    """
    if kind in ("csv", "tsv"):
        reader = csv.DictReader(stream, delimiter="\t" if kind == "tsv" else ",")
        cols = reader.fieldnames or []
        for name in (text_field, label_field):
            if name is not None and name not in cols:
                raise DatasetError(f"{path}: line 1: no column '{name}' in header {cols}")
        for row in reader:
            text = row.get(text_field)
            label = row.get(label_field) if label_field is not None else ""
            if text is None or label is None:
                missing = text_field if text is None else label_field
                raise DatasetError(f"{path}:{reader.line_num}: field '{missing}' missing (row has "
                                   f"{len([v for v in row.values() if v is not None])} values)")
            yield reader.line_num, text, (label if label_field is not None else None)
    elif kind == "jsonl":
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            for name in (text_field, label_field):
                if name is not None and name not in obj:
                    raise DatasetError(f"{where}: field '{name}' missing (keys: {sorted(obj)})")
            if not isinstance(obj[text_field], str):
                raise DatasetError(f"{where}: field '{text_field}' is "
                                   f"{type(obj[text_field]).__name__}, expected a string")
            yield lineno, obj[text_field], (obj[label_field] if label_field is not None else None)
    else:
        for lineno, line in enumerate(stream, 1):
            text = line.rstrip("\r\n")
            if text.strip():
                yield lineno, text, None


def load_table(path: str | Path, split: str, text_field: str = "text",
               label_field: str = "label") -> LabelledSplit:
    """Read a CSV/TSV (header row) or JSON-lines file, optionally ``.gz``.

    TSV is chosen by the ``.tsv`` suffix. CSV is read with :mod:`csv` (quoted fields may hold
    commas, quotes and newlines); JSON-lines needs one object per non-blank line.

    Args:
        path: the file.
        split: split name recorded in the result.
        text_field / label_field: column (CSV) or key (JSON) names.
    Returns:
        The split, in file order.
    Raises:
        DatasetError: file missing, unknown type, missing column/key (naming the line for JSON and
            short CSV rows), invalid JSON, unknown label, or no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file (split '{split}')")
    texts: list[str] = []
    labels: list[int] = []
    with _open_text(path) as f:
        for line, text, label in _records(path, f, _kind(path), text_field, label_field):
            labels.append(normalize_label(label, f"{path}:{line}: field '{label_field}'"))
            texts.append(text)
    return _check_nonempty(LabelledSplit(split, texts, np.array(labels, np.int64), str(path)),
                           str(path))


#: ``--format`` of text inputs (:func:`load_texts`); ``auto`` goes by the file name.
TEXT_FORMATS = ("auto", "csv", "tsv", "jsonl", "lines")


@dataclass
class TextInput:
    """Texts to classify or visualise (:func:`load_texts`).

    Attributes:
        texts: N strings, in input order.
        lines: N line numbers where each text's record ends (1-based).
        labels: int64 [N] 0/1 when a label field was read, else None.
        source: the file (``-`` for standard input) and format.
    """

    texts: list[str]
    lines: list[int]
    labels: np.ndarray | None
    source: str


def load_texts(path: str | Path, fmt: str = "auto", text_field: str = "text",
               label_field: str | None = None) -> TextInput:
    """Texts from a CSV/TSV (header row), JSON-lines or plain-text file (one text per non-blank
    line), gzip-compressed or not, or from standard input (``-``).

    Args:
        fmt: one of :data:`TEXT_FORMATS`; ``auto``: ``.csv``/``.tsv``/``.jsonl``/``.json``/
            ``.ndjson`` (optionally ``.gz``) by suffix, anything else (and ``-``) plain lines.
        text_field: column/key of the text (CSV/TSV/JSON lines).
        label_field: also read 0/1 labels from this column/key (:func:`normalize_label`).
    Raises:
        DatasetError: unknown format, missing file, no texts, or any record error (file and
            line named).
    """
    if fmt not in TEXT_FORMATS:
        raise DatasetError(f"unknown input format {fmt!r} (known: {', '.join(TEXT_FORMATS)})")
    path = Path(path)
    stdin = str(path) == "-"
    if not stdin and not path.is_file():
        raise DatasetError(f"{path}: no such file")
    kind = fmt if fmt != "auto" else ("lines" if stdin else _kind(path, "lines"))
    if kind == "lines" and label_field:
        raise DatasetError(f"{path}: plain-lines input has no label field "
                           f"({label_field!r}); use CSV/TSV or JSON lines")
    name = "<stdin>" if stdin else str(path)
    texts, lines, labels = [], [], []
    with _open_text(path) as f:
        for line, text, label in _records(Path(name), f, kind, text_field, label_field or None):
            if label_field:
                labels.append(normalize_label(label, f"{name}:{line}: field '{label_field}'"))
            texts.append(text)
            lines.append(line)
    if not texts:
        raise DatasetError(f"{name}: no texts")
    return TextInput(texts, lines, np.array(labels, np.int64) if label_field else None,
                     f"{name} ({kind})")


def load_sst2(data_dir: str | Path) -> dict[str, LabelledSplit]:
    """SST-2 as shipped by sentiment-discovery: ``train.csv`` and ``val.csv`` (and ``test.csv`` if
    present), header ``label,sentence``, label 1 = positive.

    Returns:
        ``{"train", "val"[, "test"]}`` -> split (6,920 / 872 rows for the standard files).
    Raises:
        DatasetError: the folder or a required file is missing, or any :func:`load_table` error.
    """
    d = Path(data_dir)
    if not d.is_dir():
        raise DatasetError(f"{d}: SST-2 folder not found (expected train.csv and val.csv)")
    out = {}
    for split in ("train", "val", "test"):
        p = d / f"{split}.csv"
        if p.is_file():
            out[split] = load_table(p, split, text_field="sentence", label_field="label")
        elif split != "test":
            raise DatasetError(f"{p}: no such file (SST-2 needs train.csv and val.csv)")
    return out


def _imdb_sort_key(item: tuple[str, int, int, str]) -> tuple:
    split, label, num, _ = item
    return split, -label, num  # pos first, then neg; numeric id order


def load_imdb(path: str | Path) -> dict[str, LabelledSplit]:
    """IMDB (aclImdb v1.0) from its folder or its ``.tar.gz``/``.tar``.

    ``path`` may be the ``aclImdb`` folder, a folder holding it, or the tarball. Files
    ``{train,test}/{pos,neg}/<id>_<rating>.txt`` are read (``unsup/`` and other files are
    ignored); label = folder (pos -> 1, neg -> 0). Tar members are read in place with
    :meth:`tarfile.TarFile.extractfile`. Within a split, examples are ordered pos then neg, by id.

    Returns:
        ``{"train"[, "test"]}`` -> split, whichever are present (the shared tarball holds train
        only: 25,000 reviews, 12,500 per class).
    Raises:
        DatasetError: path missing, or no ``train/{pos,neg}`` reviews found.
    """
    p = Path(path)
    found: list[tuple[str, int, int, str]] = []
    if p.is_file():
        try:
            tf = tarfile.open(p, "r:*")
        except tarfile.TarError as e:
            raise DatasetError(f"{p}: not a readable tar archive ({e})") from None
        with tf:
            for m in tf:
                hit = _IMDB_MEMBER.search(m.name) if m.isfile() else None
                if hit:
                    text = tf.extractfile(m).read().decode("utf-8", errors="replace")
                    found.append((hit[1], int(hit[2] == "pos"), int(hit[3]), text))
    elif p.is_dir():
        root = p / "aclImdb" if (p / "aclImdb").is_dir() else p
        for f in root.glob("*/*/*.txt"):
            hit = _IMDB_MEMBER.search(f.relative_to(root).as_posix())
            if hit:
                found.append((hit[1], int(hit[2] == "pos"), int(hit[3]),
                              f.read_bytes().decode("utf-8", errors="replace")))
    else:
        raise DatasetError(f"{p}: IMDB not found (expected the aclImdb folder or its .tar.gz)")
    found.sort(key=_imdb_sort_key)
    out = {}
    for split in ("train", "test"):
        rows = [r for r in found if r[0] == split]
        if rows:
            out[split] = LabelledSplit(split, [r[3] for r in rows], np.array([r[1] for r in rows]),
                                       f"{p}:{split}/{{pos,neg}}")
    if "train" not in out:
        raise DatasetError(f"{p}: split 'train' has no examples (no train/pos/*.txt or "
                           f"train/neg/*.txt)")
    return out


def carve_validation(train: LabelledSplit, fraction: float = DEFAULT_VAL_FRACTION,
                     seed: int = 0) -> tuple[LabelledSplit, LabelledSplit]:
    """Split ``train`` into (train', val): a stratified, seeded ``fraction`` goes to val
    (:func:`sklearn.model_selection.train_test_split`). Both keep the original relative order.

    Raises:
        DatasetError: fraction outside (0, 1) or too few examples per class.
    """
    if not 0 < fraction < 1:
        raise DatasetError(f"validation fraction must be in (0, 1), got {fraction}")
    idx = np.arange(len(train))
    try:
        tr, va = train_test_split(idx, test_size=fraction, random_state=seed,
                                  stratify=train.labels)
    except ValueError as e:
        raise DatasetError(f"{train.source}: cannot carve a {fraction:.0%} validation split "
                           f"({e})") from None
    how = f"[{fraction:.0%} stratified, seed {seed}]"
    return (train.take(np.sort(tr), "train", f"minus carved val {how}"),
            train.take(np.sort(va), "val", f"carved val {how}"))


def subsample(split: LabelledSplit, n: int, seed: int = 0) -> LabelledSplit:
    """At most ``n`` examples of ``split``: a seeded subsample, stratified by label when every
    class can be represented, kept in original order. Returns ``split`` itself if ``n >= len``."""
    if n <= 0 or n >= len(split):
        return split
    idx = np.arange(len(split))
    counts = np.bincount(split.labels, minlength=2)
    strat = split.labels if n >= 2 and counts.min() >= 2 and len(split) - n >= 2 else None
    keep, _ = train_test_split(idx, train_size=n, random_state=seed, stratify=strat)
    return split.take(np.sort(keep), how=f"[{n} of {len(split)}, seed {seed}"
                      f"{', stratified' if strat is not None else ''}]")


def load_splits(dataset: str | None = None, data_dir: str | Path | None = None,
                train: str | Path | None = None, val: str | Path | None = None,
                test: str | Path | None = None, text_field: str = "text",
                label_field: str = "label", val_fraction: float = DEFAULT_VAL_FRACTION,
                max_examples: int = 0, seed: int = 0) -> dict[str, LabelledSplit]:
    """Resolve what ``hvd-lm transfer`` was given into ``{"train", "val"[, "test"]}``.

    Either ``dataset`` (``"sst2"`` or ``"imdb"``) with ``data_dir``, or explicit ``train`` (and
    optional ``val``/``test``) CSV/JSON-lines files. Explicit files override the dataset's. Without
    a validation split, one is carved from train (:func:`carve_validation`). ``max_examples > 0``
    then subsamples every split (:func:`subsample`).

    Raises:
        DatasetError: nothing to load, unknown dataset name, or any loader error.
    """
    splits: dict[str, LabelledSplit] = {}
    if dataset:
        if data_dir is None:
            raise DatasetError(f"--dataset {dataset} needs --data-dir")
        if dataset == "sst2":
            splits.update(load_sst2(data_dir))
        elif dataset == "imdb":
            splits.update(load_imdb(data_dir))
        else:
            raise DatasetError(f"unknown dataset {dataset!r} (known: sst2, imdb)")
    for name, path in (("train", train), ("val", val), ("test", test)):
        if path:
            splits[name] = load_table(path, name, text_field, label_field)
    if "train" not in splits:
        raise DatasetError("no training split: give --dataset NAME --data-dir DIR or --train FILE")
    if "val" not in splits:
        splits["train"], splits["val"] = carve_validation(splits["train"], val_fraction, seed)
        note = (f"no validation split given: {val_fraction:.0%} of train carved off as val "
                f"(stratified, seed {seed})")
        splits["train"].notes.append(note)
    if max_examples > 0:
        splits = {k: subsample(v, max_examples, seed) for k, v in splits.items()}
    for name, s in splits.items():
        _check_nonempty(s, s.source)
        if len(np.unique(s.labels)) < 2 and name == "train":
            raise DatasetError(f"{s.source}: split 'train' has only one class "
                               f"({int(s.labels[0])}); need both 0 and 1")
    return {k: splits[k] for k in ("train", "val", "test") if k in splits}
