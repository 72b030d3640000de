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

Files are read record by record by :mod:`hvd_lm.transfer.texts` (which also reads the unlabelled
texts of ``hvd-lm classify``/``visualize``), with the same file/line/field errors, labels mapped by
:func:`hvd_lm.transfer.texts.normalize_label` and lines capped at ``max_line_bytes``.

A split without a validation file gets one carved from its training split
(:func:`carve_validation`, stratified and seeded), which the transfer report records.
"""

from __future__ import annotations

import re
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
from sklearn.model_selection import train_test_split

from hvd_lm.transfer.texts import (  # noqa: F401 - DatasetError and LABEL_MAP are used from here
    LABEL_MAP,
    DatasetError,
    _kind,
    _open_text,
    _records,
    normalize_label,
)

#: Default fraction of a training split carved off as validation when none is given.
DEFAULT_VAL_FRACTION = 0.1

_IMDB_MEMBER = re.compile(r"(?:^|/)(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")


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


def _check_nonempty(split: LabelledSplit, origin: str) -> LabelledSplit:
    if len(split) == 0:
        raise DatasetError(f"{origin}: split '{split.name}' has no examples")
    return split


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
        DatasetError: file missing or not a regular file (a FIFO, a device), unknown type,
            missing column/key (naming the line for JSON and
            short CSV rows), invalid JSON, unknown label, or no rows.
    """
    path = Path(path)
    texts: list[str] = []
    labels: list[int] = []
    with _open_text(path, f"split '{split}' is read from a regular file") as f:
        for line, text, label in _records(path, f, _kind(path), text_field, label_field):
            labels.append(normalize_label(label, f"{path}:{line}: field '{label_field}'"))
            texts.append(text)
    return _check_nonempty(LabelledSplit(split, texts, np.array(labels, np.int64), str(path)),
                           str(path))


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


#: The longest IMDB review read, in bytes (the longest in aclImdb is about 14 kB).
MAX_REVIEW_BYTES = 1 << 20


def first_line(e: BaseException) -> str:
    """An exception's message up to its first line break (its type's name when empty)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


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
        DatasetError: path missing, no ``train/{pos,neg}`` reviews found, a damaged or
            truncated tarball, or a review over :data:`MAX_REVIEW_BYTES`.
    """
    p = Path(path)
    found: list[tuple[str, int, int, str]] = []

    def review(where: str, size: int, read) -> str:
        if size > MAX_REVIEW_BYTES:  # a review is a few kB: this is not the aclImdb archive
            raise DatasetError(f"{where}: {size:,} bytes, over the {MAX_REVIEW_BYTES:,} a "
                               "review may hold")
        return read().decode("utf-8", errors="replace")

    if p.is_file():
        try:
            with tarfile.open(p, "r:*") as tf:
                for m in tf:
                    hit = _IMDB_MEMBER.search(m.name) if m.isfile() else None
                    if hit:
                        text = review(f"{p}[{m.name!r}]", m.size, tf.extractfile(m).read)
                        found.append((hit[1], int(hit[2] == "pos"), int(hit[3]), text))
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise DatasetError(f"{p}: not a readable tar archive, or a damaged or truncated "
                               f"one ({first_line(e)})") from None
    elif p.is_dir():
        root = p / "aclImdb" if (p / "aclImdb").is_dir() else p
        for f in root.glob("*/*/*.txt"):
            hit = _IMDB_MEMBER.search(f.relative_to(root).as_posix())
            if hit and f.is_file():  # a regular file (a link to /dev/zero is none)
                found.append((hit[1], int(hit[2] == "pos"), int(hit[3]),
                              review(str(f), f.stat().st_size, f.read_bytes)))
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
