"""``hvd-lm classify CHECKPOINT CLASSIFIER``: a saved sentiment classifier applied to new texts
(sentiment-discovery's ``run_classifier.py``).

1. The classifier written by ``hvd-lm transfer`` (:mod:`hvd_lm.transfer.saved`) is read and the
   checkpoint is checked against the sha256 it records: another checkpoint is refused.
2. Texts are read from CSV/TSV (a header row), JSON lines or plain lines (one text per non-blank
   line), gzip-compressed or not, or standard input (:func:`hvd_lm.transfer.datasets.load_texts`);
   a bad record stops the run naming the file, line and field, as in ``hvd-lm transfer``.
3. Features are computed exactly as the classifier's were (feature kind, max chars, whitespace
   normalisation and precision from its JSON) by :func:`hvd_lm.transfer.features.featurize`:
   batched, padding-invariant, on GPU or CPU, split over the ranks under ``horovodrun``/``mpirun``
   (launch ``python -m hvd_lm classify ...``) and gathered back in input order on rank 0.
4. Rank 0 writes one row per text, in input order: ``line`` (where the record ends in the input),
   ``probability`` (of the positive class), ``label`` (1 where the margin is > 0, i.e.
   probability > 0.5), the input's label when ``--label-field`` is given, and the text (unless
   ``--no-text``); as CSV/TSV/JSON lines by the output's suffix (``.gz`` compresses), or CSV on
   standard output for ``-``. With labels the accuracy is reported: on the split the classifier
   was validated on, it is transfer's validation accuracy (same features, same weights).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import sys
import time
from dataclasses import dataclass

from hvd_lm.comm import horovod as comm
from hvd_lm.comm.world import world_size
from hvd_lm.model import device as devices
from hvd_lm.options import Command, option
from hvd_lm.transfer import datasets
from hvd_lm.transfer.features import featurize, open_lm
from hvd_lm.transfer.saved import USAGE_ERRORS, ClassifierError, check_checkpoint, load_classifier
from hvd_lm.util.atomic import atomic_path, write_text
from hvd_lm.util.digest import file_sha256


@dataclass
class ClassifyConfig:
    """Settings of ``hvd-lm classify``."""

    checkpoint: str = option("", "checkpoint file, run directory (its latest) or exported "
                             "folder; must be the one the classifier was fit on",
                             positional=True, required=True)
    classifier: str = option("", "classifier: hvd-lm transfer's --out folder, its "
                             "classifier.json or classifier.npz", positional=True, required=True)
    input: str = option("-", "texts: CSV/TSV/JSON lines/plain lines (.gz ok), - = standard input")
    output: str = option("-", "predictions: .csv, .tsv or .jsonl (.gz ok); - = CSV on standard "
                         "output")
    format: str = option("auto", "input format (auto: by suffix, else plain lines)",
                         choices=datasets.TEXT_FORMATS)
    text_field: str = option("text", "text column/key of CSV/TSV/JSON-lines input")
    label_field: str = option("", "also read 0/1 labels from this column/key and report the "
                              "accuracy")
    keep_text: bool = option(True, "copy each text into the output (--no-text: don't)",
                             switch=False, flag="--no-text")
    batch_size: int = option(64, "texts per batch per rank", ge=1)
    time_chunk: int = option(256, "steps per model call", ge=1)
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    precision: str = option("", "autocast precision (default: the classifier's features')",
                            choices=("",) + devices.PRECISIONS)
    threads: int = option(0, "torch CPU threads (0 = default)", ge=0)
    progress: bool = option(True, "tqdm bar (--no-progress: none)", switch=False,
                            flag="--no-progress")


def _output_kind(path: str) -> str:
    name = path.lower()[:-3] if path.lower().endswith(".gz") else path.lower()
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "tsv" if name.endswith(".tsv") else "csv"


def format_predictions(rows: list[dict], kind: str) -> str:
    """``rows`` (dicts with the same keys, in order) as CSV/TSV with a header row, or as JSON
    lines."""
    if kind == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), delimiter="\t" if kind == "tsv"
                            else ",", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    elif path.lower().endswith(".gz"):
        with atomic_path(path) as tmp, gzip.open(tmp, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        write_text(path, text)


def classify(cfg: ClassifyConfig) -> dict | None:
    """Run ``hvd-lm classify`` (see the module docstring); returns the summary on rank 0 and
    None on the other ranks.

    Raises:
        ClassifierError: bad classifier files, or a checkpoint other than the classifier's.
        DatasetError: bad input (file, line and field named).
        FileNotFoundError: no checkpoint. ValueError: bad option.
    """
    if cfg.input == "-" and world_size() > 1:
        raise ValueError("--input - (standard input) reaches rank 0 only: give a file when "
                         "launching several ranks")
    saved = load_classifier(cfg.classifier)
    feat = saved.features
    inp = datasets.load_texts(cfg.input, cfg.format, cfg.text_field, cfg.label_field or None)
    lm = open_lm(cfg.checkpoint, cfg.device, cfg.precision or feat["precision"], cfg.threads)
    is_root = lm.ctx is None or lm.ctx.rank == 0
    digest = file_sha256(lm.path) if is_root else None
    if lm.ctx is not None:
        digest = comm.broadcast_object(digest, name="classify_checkpoint_sha256")
    check_checkpoint(saved, lm.path, digest)
    if lm.model.config.hidden_size != len(saved.model.coef):
        raise ClassifierError(f"{saved.path}: {len(saved.model.coef)} inputs, but the model has "
                              f"H={lm.model.config.hidden_size}")
    res = featurize(lm.model, inp.texts, feat["kind"], feat["max_chars"], cfg.batch_size,
                    lm.device, lm.ctx, progress=is_root and cfg.progress, desc="classify",
                    time_chunk=cfg.time_chunk, precision=cfg.precision or feat["precision"],
                    normalize=feat["normalize"])
    if not is_root:
        return None
    prob = saved.model.predict_proba(res.features)
    pred = saved.model.predict(res.features)
    rows = []
    for i in range(len(inp.texts)):
        row = {"line": inp.lines[i], "probability": round(float(prob[i]), 6),
               "label": int(pred[i])}
        if inp.labels is not None:
            row["true_label"] = int(inp.labels[i])
        if cfg.keep_text:
            row["text"] = inp.texts[i]
        rows.append(row)
    _write(cfg.output, format_predictions(rows, _output_kind(cfg.output)))
    return {"n": len(inp.texts), "positive": int(pred.sum()),
            "accuracy": (float((pred == inp.labels).mean()) if inp.labels is not None
                         else None),
            "chars": res.chars, "seconds": res.seconds, "chars_per_s": res.chars_per_s,
            "truncated": res.truncated, "world_size": lm.ctx.size if lm.ctx else 1,
            "device": str(lm.device), "input": inp.source, "output": cfg.output,
            "classifier": str(saved.path), "time": time.time()}


def classify_command(cfg: ClassifyConfig) -> int:
    """``hvd-lm classify``: run and print one summary line (on standard error when the
    predictions go to standard output)."""
    s = classify(cfg)
    if s is not None:
        acc = f", accuracy {100 * s['accuracy']:.2f}% against --label-field" \
            if s["accuracy"] is not None else ""
        cut = f", {s['truncated']:,} texts cut to max chars" if s["truncated"] else ""
        where = "standard output" if s["output"] == "-" else s["output"]
        print(f"classified {s['n']:,} texts: {s['positive']:,} positive "
              f"({100 * s['positive'] / s['n']:.1f}%){acc}; {s['chars']:,} chars at "
              f"{s['chars_per_s']:,.0f} chars/s on {s['world_size']} rank(s), {s['device']}{cut}; "
              f"wrote {where}", file=sys.stderr if s["output"] == "-" else sys.stdout)
    return 0


CLASSIFY = Command(
    ClassifyConfig, classify_command,
    usage_errors=USAGE_ERRORS,
    description="Apply a classifier saved by hvd-lm transfer to new texts: probability and "
    "label per text as CSV/TSV/JSON lines (NVIDIA/sentiment-discovery run_classifier.py). The "
    "checkpoint must be the one the classifier was fit on (sha256).")

