"""``hvd-lm classify CHECKPOINT CLASSIFIER``: a saved sentiment classifier applied to new texts
(sentiment-discovery's ``run_classifier.py``).

1. The classifier written by ``hvd-lm transfer`` (:mod:`hvd_lm.transfer.saved`) is read and the
   model is checked against the weights' sha256 it records: another model is refused.
2. Texts are read from CSV/TSV (a header row), JSON lines or plain lines (one text per non-blank
   line), gzip-compressed or not, or standard input (:func:`hvd_lm.transfer.texts.iter_texts`);
   a bad record stops the run naming the file, line and field, as in ``hvd-lm transfer``.
3. The input is streamed: texts are read in blocks (:data:`BLOCK_TEXTS` texts or
   :data:`BLOCK_CHARS` characters, whichever comes first), each block is featurized and its rows
   written before the next is read, so memory does not grow with the input; a line longer than
   ``--max-line-bytes`` (default 1 MiB) stops the run naming its line, so an endless stream
   without a newline cannot grow it either.
4. Features are computed exactly as the classifier's were (feature kind, max chars, whitespace
   normalisation and precision from its JSON) by :func:`hvd_lm.transfer.features.featurize`:
   batched (within a block), padding-invariant, on GPU or CPU, split over the ranks under
   ``horovodrun``/``mpirun`` (launch ``python -m hvd_lm classify ...``; every rank reads the same
   blocks) and gathered back in input order on rank 0.
5. Rank 0 writes one row per text, in input order: ``line`` (where the record ends in the input),
   ``probability`` (of the positive class), ``label`` (1 where the margin is > 0, i.e.
   probability > 0.5), the input's label when ``--label-field`` is given, and the text (unless
   ``--no-text``); as CSV/TSV/JSON lines by the output's suffix (``.gz`` compresses), or CSV on
   standard output for ``-``. A file is written under a temporary name and renamed when complete
   (an error leaves none); standard output gets each block's rows as they are ready. With labels
   the accuracy is reported: on the split the classifier was validated on, it is transfer's
   validation accuracy (same features, same weights).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from hvd_lm.comm.world import world_size
from hvd_lm.model import device as devices
from hvd_lm.options import Command, option
from hvd_lm.train.log import Progress
from hvd_lm.transfer import texts as text_input
from hvd_lm.transfer.features import RankOptions, featurize, open_classified
from hvd_lm.transfer.saved import USAGE_ERRORS
from hvd_lm.util.atomic import atomic_path
from hvd_lm.util.units import parse_bytes

#: Texts featurized and written at a time (sorted by length into batches within the block).
BLOCK_TEXTS = 4096
#: Characters of text held at a time at most (a block ends when its texts reach this many).
BLOCK_CHARS = 1 << 20


@dataclass
class ClassifyConfig(text_input.TextOptions, RankOptions):
    """Settings of ``hvd-lm classify`` (the shared ones: :class:`RankOptions`,
    :class:`~hvd_lm.transfer.texts.TextOptions`)."""

    checkpoint: str = option("", "checkpoint file, run directory (its latest) or exported "
                             "folder; must be the one the classifier was fit on",
                             positional=True, required=True)
    classifier: str = option("", "classifier: hvd-lm transfer's --out folder or its "
                             "classifier.safetensors", positional=True, required=True)
    output: str = option("-", "predictions: .csv, .tsv or .jsonl (.gz ok); - = CSV on standard "
                         "output")
    label_field: str = option("", "also read 0/1 labels from this column/key and report the "
                              "accuracy")
    keep_text: bool = option(True, "copy each text into the output (--no-text: don't)",
                             switch=False, flag="--no-text")
    max_line_bytes: int = option(text_input.DEFAULT_MAX_LINE_BYTES, "longest input line, bytes "
                                 "(e.g. 4M); a longer one stops the run naming it, so an endless "
                                 "line cannot fill memory", parse=parse_bytes, ge=1)
    precision: str = option("", "autocast precision (default: the classifier's features')",
                            choices=("",) + devices.PRECISIONS)


@contextlib.contextmanager
def open_predictions(path: str) -> Iterator:
    """A text file to write predictions to as they come: standard output for ``-``, else a
    temporary file renamed to ``path`` when the block exits cleanly (removed on an error;
    gzip-compressed for ``.gz``)."""
    if path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    with atomic_path(path) as tmp:
        opener = gzip.open if path.lower().endswith(".gz") else open
        with opener(tmp, "wt", encoding="utf-8", newline="") as f:
            yield f


def blocks(records: Iterable[tuple]) -> Iterator[list[tuple]]:
    """``records`` in lists of at most :data:`BLOCK_TEXTS` records, each list ending once its
    texts (the records' second item) reach :data:`BLOCK_CHARS` characters; read lazily."""
    block, chars = [], 0
    for r in records:
        block.append(r)
        chars += len(r[1])
        if len(block) >= BLOCK_TEXTS or chars >= BLOCK_CHARS:
            yield block
            block, chars = [], 0
    if block:
        yield block


def classify(cfg: ClassifyConfig) -> int:
    """``hvd-lm classify`` (see the module docstring): write the predictions and print one
    summary line on rank 0 (on standard error when the predictions go to standard output).

    Raises:
        ClassifierError: bad classifier files, or a checkpoint other than the classifier's.
        DatasetError: bad input (file, line and field named), a line over
            ``--max-line-bytes``, or no texts.
        FileNotFoundError: no checkpoint. ValueError: bad option.
    """
    if cfg.input == "-" and world_size() > 1:
        raise ValueError("--input - (standard input) reaches rank 0 only: give a file when "
                         "launching several ranks")
    stream = text_input.iter_texts(cfg.input, cfg.format, cfg.text_field, cfg.label_field or None,
                                   cfg.max_line_bytes, "--max-line-bytes")
    lm, saved = open_classified(cfg, cfg.classifier, "classify", {"--output": cfg.output},
                                [cfg.input], cfg.precision, cfg.backend)
    feat, is_root = saved.features, lm.ctx is None or lm.ctx.rank == 0
    kind = text_input._kind(Path(cfg.output), "csv")
    n = positive = correct = chars = truncated = seconds = 0
    writer = None
    bar = Progress("hvd-lm classify", None, "char", enabled=is_root and cfg.progress)
    with open_predictions(cfg.output) if is_root else contextlib.nullcontext() as out:
        for block in blocks(stream.records):
            res = featurize(lm.model, [t for _, t, _ in block], feat["kind"], feat["max_chars"],
                            cfg.batch_size, lm.device, lm.ctx, False, "classify", cfg.time_chunk,
                            cfg.precision or feat["precision"], feat["normalize"])
            chars, seconds, truncated = (chars + res.chars, seconds + res.seconds,
                                         truncated + res.truncated)
            bar.update(res.chars)
            if not is_root:
                continue
            prob, pred = saved.model.predict_proba(res.features), saved.model.predict(res.features)
            rows = [{"line": line, "probability": round(float(p), 6), "label": int(y),
                     **({"true_label": label} if label is not None else {}),
                     **({"text": text} if cfg.keep_text else {})}
                    for (line, text, label), p, y in zip(block, prob, pred)]
            correct += sum(r["label"] == r.get("true_label") for r in rows)
            if kind == "jsonl":
                out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            else:
                if writer is None:  # the header row once, from the first block's keys
                    writer = csv.DictWriter(out, list(rows[0]), lineterminator="\n",
                                            delimiter="\t" if kind == "tsv" else ",")
                    writer.writeheader()
                writer.writerows(rows)
            n += len(rows)
            positive += int(pred.sum())
        bar.close()
        if is_root and n == 0:
            raise text_input.DatasetError(f"{stream.name}: no texts")
    if is_root:
        acc = f", accuracy {100 * correct / n:.2f}% against --label-field" \
            if cfg.label_field else ""
        cut = f", {truncated:,} texts cut to max chars" if truncated else ""
        print(f"classified {n:,} texts: {positive:,} positive ({100 * positive / n:.1f}%){acc}; "
              f"{chars:,} chars at {chars / seconds if seconds > 0 else float('nan'):,.0f} "
              f"chars/s on {lm.ctx.size if lm.ctx else 1} rank(s), {lm.device}{cut}; wrote "
              f"{'standard output' if cfg.output == '-' else cfg.output}",
              file=sys.stderr if cfg.output == "-" else sys.stdout)
    return 0


CLASSIFY = Command(
    ClassifyConfig, classify, usage_errors=USAGE_ERRORS,
    description="Apply a classifier saved by hvd-lm transfer to new texts: probability and "
    "label per text as CSV/TSV/JSON lines (NVIDIA/sentiment-discovery run_classifier.py). The "
    "checkpoint must be the one the classifier was fit on (sha256).")

