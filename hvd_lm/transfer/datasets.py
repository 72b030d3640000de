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
* **Blitzer et al.'s ``.review`` files** (Multi-Domain Sentiment Dataset, 2007: ``positive.review``
  and ``negative.review`` per domain, ``.gz`` ok), read by ``prepare``'s own reader
  (:func:`data_prep.readers.read_documents`) and labelled by the file's name or its folder's
  (:func:`load_review`). ``--train`` (``--val``, ``--test``) takes several files, comma-separated,
  or a folder of ``.review`` files (:func:`load_files`).

Files are read record by record by :mod:`hvd_lm.transfer.texts` (which also reads the unlabelled
texts of ``hvd-lm classify``/``visualize``), with the same file/line/field errors, labels mapped by
:func:`hvd_lm.transfer.texts.normalize_label` and lines capped at ``max_line_bytes``.

A split without a validation file gets one carved from its training split
(:func:`carve_validation`, stratified and seeded), or ``--split TRAIN,VAL,TEST`` carves one
labelled set into all three (:func:`carve_splits`); the transfer report records either. No text
is on both sides: exact duplicates are dropped from a set before it is carved
(:func:`drop_duplicates`), and a given val/test text that is also in train is dropped from val/test
(:func:`drop_overlap`; a ``--dataset``'s own splits are only counted: the benchmark as published).
"""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
from sklearn.model_selection import train_test_split

from hvd_lm.options import error_text
from hvd_lm.transfer import texts as text_input
from hvd_lm.transfer.texts import DEFAULT_MAX_LINE_BYTES, LABEL_MAP, DatasetError
from hvd_lm.util.files import check_folder, check_regular

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

    def nonempty(self) -> "LabelledSplit":
        """``self``, or DatasetError naming its source when it has no examples."""
        if len(self) == 0:
            raise DatasetError(f"{self.source}: split '{self.name}' has no examples")
        return self

    def summary(self) -> dict:
        """``{"n", "positive", "negative", "chars", "source"}`` (chars = UTF-8 bytes)."""
        pos = int(self.labels.sum())
        return {"n": len(self), "positive": pos, "negative": len(self) - pos,
                "chars": int(sum(len(t.encode("utf-8", "replace")) for t in self.texts)),
                "source": self.source}


def load_table(path: str | Path, split: str, text_field: str = "text",
               label_field: str = "label", what: str = "") -> LabelledSplit:
    """Read a CSV/TSV (header row) or JSON-lines file, optionally ``.gz``.

    TSV is chosen by the ``.tsv`` suffix. CSV is read with :mod:`csv` (quoted fields may hold
    commas, quotes and newlines); JSON-lines needs one object per non-blank line.

    Args:
        path: the file.
        split: split name recorded in the result.
        text_field / label_field: column (CSV) or key (JSON) names.
        what: how a refusal of the path ends (default: the split is read from a regular file).
    Returns:
        The split, in file order.
    Raises:
        DatasetError: file missing or not a regular file (a FIFO, a device), unknown type,
            missing column/key (naming the line for JSON and
            short CSV rows), invalid JSON, unknown label, or no rows.
    """
    path = Path(path)
    with text_input._open_text(path, what or f"split '{split}' is read from a regular file") as f:
        rows = list(text_input._records(path, f, text_input._kind(path), text_field, label_field))
    return LabelledSplit(split, [r[1] for r in rows], [r[2] for r in rows], str(path)).nonempty()


#: ``.review`` file (or folder) names that give its label (:func:`review_label`).
REVIEW_SUFFIXES = (".review", ".review.gz")


def review_label(path: Path, required: bool = True) -> int | None:
    """The label of a Blitzer ``.review`` file: its name without the suffix (``positive``,
    ``negative``, ``pos``, ``neg``: :data:`LABEL_MAP`), else its folder's name; None when
    neither names one and not ``required``.

    Raises:
        DatasetError: ``required`` and neither names a label (Blitzer's ``unlabeled.review``),
            naming the file.
    """
    for name in (path.name.lower().split(".")[0], path.parent.name.lower()):
        if name in LABEL_MAP:
            return LABEL_MAP[name]
    if not required:
        return None
    raise DatasetError(f"{path}: a .review file is labelled by its name or its folder's "
                       f"(positive/negative, pos/neg); '{path.name}' in '{path.parent.name}/' "
                       "names neither (Blitzer's unlabeled.review has no labels)")


def load_review(path: str | Path, split: str, text_field: str | None = None) -> LabelledSplit:
    """A Blitzer ``.review`` file (``.gz`` ok) as one class: every ``<review>`` block's
    ``text_field`` (None: ``review_text``) read by ``prepare``'s reader, labelled by
    :func:`review_label`.

    Raises:
        DatasetError: no label in the name, a missing or unreadable file, a broken block (file
            and line named), or no reviews.
    """
    from data_prep import readers, sniff  # prepare's reader: the one owner of the format
    from data_prep.inputs import BadRecord, InputError

    path = Path(path)
    label = review_label(path)
    try:
        spec = sniff.resolve_input(path, "review", text_field)
        texts = [t for _, t in readers.read_documents(spec, max_line_bytes=DEFAULT_MAX_LINE_BYTES)]
    except (InputError, BadRecord) as e:
        raise DatasetError(str(e)) from None
    return LabelledSplit(split, texts, np.full(len(texts), label, np.int64), str(path)).nonempty()


def load_files(paths: str, split: str, text_field: str = "text",
               label_field: str = "label") -> LabelledSplit:
    """One split from ``paths``: a file, or several comma-separated, or a folder of ``.review``
    files (each read by :func:`load_review`; a folder's unlabelled ones, as Blitzer's
    ``unlabeled.review``, are left out), concatenated in the order given; CSV/TSV/JSON lines by
    :func:`load_table`.

    Raises:
        DatasetError: as the loaders, or a folder with no labelled ``.review`` file.
    """
    parts: list[LabelledSplit] = []
    for item in [p.strip() for p in str(paths).split(",") if p.strip()]:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.lower().endswith(REVIEW_SUFFIXES))
            files = [p for p in found if review_label(p, required=False) is not None]
            if not files:
                raise DatasetError(f"{path}: a folder of {split} data holds .review files named "
                                   f"by their label (positive.review, negative.review); it has "
                                   f"{[p.name for p in found] or 'none'}")
        else:
            files = [path]
        field = None if text_field == "text" else text_field  # .review: review_text
        parts += [load_review(f, split, field) if f.name.lower().endswith(REVIEW_SUFFIXES)
                  else load_table(f, split, text_field, label_field) for f in files]
    if not parts:
        raise DatasetError(f"--{split}: no file given")
    return LabelledSplit(split, [t for p in parts for t in p.texts],
                         np.concatenate([p.labels for p in parts]),
                         " + ".join(p.source for p in parts))


def load_sst2(data_dir: str | Path) -> dict[str, LabelledSplit]:
    """SST-2 as shipped by sentiment-discovery: ``train.csv`` and ``val.csv`` (and ``test.csv`` if
    present), header ``label,sentence``, label 1 = positive.

    Returns:
        ``{"train", "val"[, "test"]}`` -> split (6,920 / 872 rows for the standard files).
    Raises:
        DatasetError: the folder or a required file missing, or either not what it should be
            (a FIFO, a file, a device: named as what it is), or any :func:`load_table` error.
    """
    d = Path(data_dir)
    what = "SST-2 is read from --data-dir: train.csv and val.csv, and test.csv if present"
    text_input._refusing(check_folder, d, what)
    return {split: load_table(d / f"{split}.csv", split, "sentence", "label", what)
            for split in ("train", "val", "test")
            if split != "test" or os.path.lexists(d / "test.csv")}


#: The longest IMDB review read, in bytes (the longest in aclImdb is about 14 kB).
MAX_REVIEW_BYTES = 1 << 20


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
        DatasetError: path missing or not a folder or regular file (a FIFO, a device: named as
            what it is), no ``train/{pos,neg}`` reviews found, a damaged or truncated tarball,
            or a review over :data:`MAX_REVIEW_BYTES`.
    """
    p = Path(path)
    found: list[tuple[str, int, int, str]] = []

    def add(hit: re.Match, where: str, size: int, read) -> None:  # (split, label, id, text)
        if size > MAX_REVIEW_BYTES:  # a review is a few kB: this is not the aclImdb archive
            raise DatasetError(f"{where}: {size:,} bytes, over the {MAX_REVIEW_BYTES:,} a "
                               "review may hold")
        found.append((hit[1], int(hit[2] == "pos"), int(hit[3]),
                      read().decode("utf-8", errors="replace")))

    if not p.is_dir():
        text_input._refusing(check_regular, p,
                             "IMDB is read from the aclImdb folder or its .tar.gz")
        try:
            with tarfile.open(p, "r:*") as tf:
                for m in tf:
                    if m.isfile() and (hit := _IMDB_MEMBER.search(m.name)):
                        add(hit, f"{p}[{m.name!r}]", m.size, tf.extractfile(m).read)
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise DatasetError(f"{p}: not a readable tar archive, or a damaged or truncated "
                               f"one ({error_text(e)})") from None
    else:
        root = p / "aclImdb" if (p / "aclImdb").is_dir() else p
        for f in root.glob("*/*/*.txt"):  # regular files only (a link to /dev/zero is none)
            if (hit := _IMDB_MEMBER.search(f.relative_to(root).as_posix())) and f.is_file():
                add(hit, str(f), f.stat().st_size, f.read_bytes)
    found.sort(key=lambda r: (r[0], -r[1], r[2]))  # by split, pos first, numeric id order
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
    try:
        tr, va = train_test_split(np.arange(len(train)), test_size=fraction, random_state=seed,
                                  stratify=train.labels)
    except ValueError as e:
        raise DatasetError(f"{train.source}: cannot carve a {fraction:.0%} validation split "
                           f"({e})") from None
    how = f"[{fraction:.0%} stratified, seed {seed}]"
    return (train.take(np.sort(tr), "train", f"minus carved val {how}"),
            train.take(np.sort(va), "val", f"carved val {how}"))


def carve_splits(data: LabelledSplit, ratios: tuple[float, float, float],
                 seed: int = 0) -> dict[str, LabelledSplit]:
    """``data`` cut into train/val[/test] in the ``ratios`` (``--split 80,10,10``, read as
    ``prepare``'s ``--split``), each stratified by label and seeded
    (:func:`sklearn.model_selection.train_test_split`, twice), kept in the original order.

    Raises:
        DatasetError: no val share, or too few examples of a class for a split.
    """
    tr, va, te = (float(r) for r in ratios)
    if va <= 0:
        raise DatasetError(f"--split {tr:g},{va:g},{te:g}: give val a share (the C and the unit "
                           "are chosen on train, val is reported)")
    how = f"[--split {tr:g},{va:g},{te:g}: stratified, seed {seed}]"
    idx = np.arange(len(data))
    try:
        rest, test = (train_test_split(idx, test_size=te / (tr + va + te), random_state=seed,
                                       stratify=data.labels) if te > 0 else (idx, idx[:0]))
        train, val = train_test_split(rest, test_size=va / (tr + va), random_state=seed,
                                      stratify=data.labels[rest])
    except ValueError as e:
        raise DatasetError(f"{data.source}: cannot carve --split {tr:g},{va:g},{te:g} from "
                           f"{len(data)} examples ({e})") from None
    return {k: data.take(np.sort(v), k, how) for k, v in
            (("train", train), ("val", val), ("test", test)) if len(v)}  # (no test share: none)


def drop_duplicates(split: LabelledSplit) -> LabelledSplit:
    """``split`` without the exact copies of a text it holds before (the text itself is the key;
    the first copy kept, with its label), a note saying how many were dropped and how many of
    them were labelled otherwise; ``split`` itself when no text repeats."""
    first: dict[str, int] = {}
    for i, t in enumerate(split.texts):
        first.setdefault(t, i)
    dropped = len(split) - len(first)
    if not dropped:
        return split
    clash = int((split.labels != split.labels[[first[t] for t in split.texts]]).sum())
    out = split.take(first.values(), how=f"[{dropped:,} duplicates dropped]")
    out.notes.append(f"{dropped:,} duplicate texts dropped from train before val/test were carved "
                     f"from it (the first copy kept; {clash:,} of them labelled otherwise)")
    return out


def drop_overlap(splits: dict[str, LabelledSplit], dataset: str | None = None,
                 published: Iterable[str] = ()) -> None:
    """Count the val/test texts that also appear in train and drop them from the split they are
    in (``splits`` changed in place), with one note in train's ``notes``; the splits named in
    ``published`` (``--dataset``'s own: a standard benchmark) are counted and left intact."""
    seen, said, total = set(splits["train"].texts), [], 0
    for name in ("val", "test"):
        s = splits.get(name)
        keep = [] if s is None else [i for i, t in enumerate(s.texts) if t not in seen]
        n = 0 if s is None else len(s) - len(keep)
        if n and name in published:
            said.append(f"{n:,} in {name} kept (--dataset {dataset}'s own split, as published)")
        elif n:
            splits[name] = s.take(keep, how=f"[{n:,} texts also in train dropped]")
            said.append(f"{n:,} dropped from {name}")
        total += n
    if total:
        splits["train"].notes.append(f"{total:,} val/test texts also appear in train: "
                                     + ", ".join(said))


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
                max_examples: int = 0, seed: int = 0,
                split: tuple[float, float, float] | None = None) -> dict[str, LabelledSplit]:
    """Resolve what ``hvd-lm transfer`` was given into ``{"train", "val"[, "test"]}``.

    Either ``dataset`` (``"sst2"`` or ``"imdb"``) with ``data_dir``, or explicit ``train`` (and
    optional ``val``/``test``) files (:func:`load_files`: CSV/TSV/JSON lines, ``.review``
    files, comma-separated lists, ``.review`` folders). Explicit files override the dataset's.
    ``split`` (``--split``) carves the training set into train/val/test (:func:`carve_splits`);
    else without a validation split, one is carved from train (:func:`carve_validation`); before
    either, train's duplicate texts are dropped (:func:`drop_duplicates`). The texts of a given
    val/test split that are also in train are dropped from it, or only counted in ``dataset``'s
    own splits (:func:`drop_overlap`). ``max_examples > 0`` then subsamples every split
    (:func:`subsample`).

    Raises:
        DatasetError: nothing to load, unknown dataset name, ``split`` beside a given val or test
            split, or any loader error.
    """
    splits: dict[str, LabelledSplit] = {}
    if dataset:
        if data_dir is None:
            raise DatasetError(f"--dataset {dataset} needs --data-dir")
        if dataset not in ("sst2", "imdb"):
            raise DatasetError(f"unknown dataset {dataset!r} (known: sst2, imdb)")
        splits.update((load_sst2 if dataset == "sst2" else load_imdb)(data_dir))
    published = set(splits) - {"train"}
    for name, path in (("train", train), ("val", val), ("test", test)):
        if path:
            splits[name] = load_files(path, name, text_field, label_field)
            published.discard(name)
    if "train" not in splits:
        raise DatasetError("no training split: give --dataset NAME --data-dir DIR or --train FILE")
    if split is not None and (given := [k for k in ("val", "test") if k in splits]):
        raise DatasetError(f"--split carves the training set into train, val and test, and "
                           f"{' and '.join(given)} split(s) are given too (--{given[0]} or "
                           f"--dataset's files): give one or the other")
    drop_overlap(splits, dataset, published)
    if split is not None or "val" not in splits:  # copies of a text would land on both sides
        splits["train"] = drop_duplicates(splits["train"])
    if split is not None:
        splits = carve_splits(splits["train"], split, seed)
    elif "val" not in splits:
        splits["train"], splits["val"] = carve_validation(splits["train"], val_fraction, seed)
        splits["train"].notes.append(f"no validation split given: {val_fraction:.0%} of train "
                                     f"carved off as val (stratified, seed {seed})")
    if max_examples > 0:
        splits = {k: subsample(v, max_examples, seed) for k, v in splits.items()}
    for name, s in splits.items():
        s.nonempty()
        if len(np.unique(s.labels)) < 2 and name == "train":
            raise DatasetError(f"{s.source}: split 'train' has only one class "
                               f"({int(s.labels[0])}); need both 0 and 1")
    return {k: splits[k] for k in ("train", "val", "test") if k in splits}
