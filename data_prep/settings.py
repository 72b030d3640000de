"""``prepare``'s settings: :class:`PrepareConfig` (the ``prepare`` flags and the ``prepare:`` YAML
section, through :mod:`hvd_lm.options`), the size and split parsers, and the checks that
need no input file (:func:`check_config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from data_prep.inputs import FORMATS
from hvd_lm.formats import shards
from hvd_lm.options import option, validate
from hvd_lm.util.units import MIB, parse_bytes, parse_split

#: A document (record line) may use at most 1/8 of a worker's memory budget: reading, decoding,
#: encoding and spilling it holds several copies at once (docs/data_prep.md), so larger ones are
#: refused with their file, line and size.
DOC_BUDGET_SHARE = 8


class PrepareError(RuntimeError):
    """The run cannot proceed (bad settings, output directory in use, no documents)."""


@dataclass
class PrepareConfig:
    """Settings of one ``prepare`` run: the ``prepare`` flags, the ``prepare:`` YAML section
    (:mod:`hvd_lm.options`), and what the manifest records.

    Attributes:
        inputs: input file paths.
        out: output directory.
        format, text_field: ``--format`` / ``--text-field`` for every input (``None``: inferred
            per file).
        tar_members: ``--tar-members``: which members of a ``tar`` input are documents
            (``None``: :data:`data_prep.inputs.TAR_DEFAULT_MEMBERS`); never those named in
            :data:`data_prep.inputs.TAR_NOT_DOCUMENTS`.
        normalize: collapse whitespace (:func:`hvd_lm.formats.tokenizer.normalize_text`) before
            encoding and de-duplication.
        min_chars: drop documents with fewer characters (after normalisation).
        dedup: drop exact duplicates (same bytes after normalisation).
        seed: shuffle seed (keys the document hash).
        split: train, val, test ratios (e.g. ``(1000, 1, 1)``).
        shard_size: target bytes (tokens) per shard; a shard holds whole documents and exceeds
            this only when one document does.
        compression: ``"none"``, ``"gzip"`` or ``"lzf"``.
        workers: local processes per rank.
        max_memory_mb: memory budget per rank in MiB, shared by its workers.
        resume, overwrite: how to treat an output directory that holds an earlier run.
        skip_bad: count and sample malformed records instead of stopping.
        utf8_errors: ``"replace"`` or ``"strict"`` (see :mod:`data_prep.readers`).
        keep_work: leave ``OUT/.prepare`` in place after success.
        progress: tqdm bars on rank 0.
        summary_json: also write the summary as JSON to this file ('' = no).
        command: the command line, recorded in the manifest (set by the program).
    """

    inputs: list[str] = option(default_factory=list, help="input files (.gz or not)",
                               positional=True, required=True, metavar="INPUT")
    out: str = option("", "output directory for shards and manifest.json", required=True)
    format: Optional[str] = option(None, "input format of every INPUT (default: inferred from "
                                   "each file name)", choices=FORMATS)
    text_field: Optional[str] = option(
        None, "JSON key / CSV column / .review tag holding the text (default: reviewText, "
        "review_body, Text, ... whichever the file has; review_text); several, comma-separated: "
        "each file reads the first it has; #N: column N of a CSV without a header row",
        metavar="FIELD[,FIELD...]")
    tar_members: Optional[str] = option(
        None, "tar inputs: the members read as documents, comma-separated globs over their paths "
        "in the archive (default: *.txt; IMDB: '*/train/pos/*.txt,*/train/neg/*.txt'); never its "
        "urls_*.txt lists nor imdbEr.txt", metavar="GLOBS")
    normalize: bool = option(False, "collapse whitespace runs to one space and strip (Radford "
                             "et al. 2017); recorded in the manifest", switch=True)
    min_chars: int = option(1, "drop documents with fewer characters (after --normalize)",
                            ge=0)
    dedup: bool = option(True, "drop exact duplicates (--no-dedup keeps them)", switch=False,
                         flag="--no-dedup")
    seed: int = option(1234, "shuffle seed", ge=0)
    split: tuple[float, ...] = option((1000.0, 1.0, 1.0), "split ratios TRAIN,VAL,TEST (as in "
                                      "sentiment-discovery)", parse=parse_split,
                                      metavar="TRAIN,VAL,TEST")
    shard_size: int = option(64 * MIB, "target bytes per shard, suffixes K/M/G",
                             parse=parse_bytes, metavar="BYTES", ge=1)
    compression: str = option("none", "HDF5 compression of the datasets",
                              choices=shards.COMPRESSIONS)
    workers: int = option(1, "local worker processes per rank", ge=1)
    max_memory_mb: int = option(1024, "memory budget per rank in MiB, shared by its workers",
                                ge=1)
    resume: bool = option(False, "continue an interrupted run in --out: keep finished work and "
                          "verified shards, redo the rest", switch=True)
    overwrite: bool = option(False, "replace an earlier run in --out", switch=True)
    skip_bad: bool = option(False, "count and sample malformed records instead of stopping at "
                            "the first", switch=True)
    utf8_errors: str = option("replace", "invalid UTF-8: replace with U+FFFD and count, or "
                              "treat the record as malformed", choices=("replace", "strict"))
    keep_work: bool = option(False, "keep the work directory (OUT/.prepare) after success",
                             switch=True)
    progress: bool = option(True, "progress bars (--no-progress: none)", switch=False,
                            flag="--no-progress")
    summary_json: str = option("", "also write the summary as JSON to FILE", metavar="FILE")
    command: list[str] = option(default_factory=list, help="command line (recorded)", cli=False)

    def check(self) -> None:
        """--resume and --overwrite exclude each other; the split ratios are well formed."""
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        self.split = parse_split(self.split)


def check_config(cfg: PrepareConfig) -> None:
    """The checks of a :class:`PrepareConfig` built in code (the flags' own, through
    :func:`hvd_lm.options.validate`), inputs given, and a shard fitting the memory budget.

    Raises:
        hvd_lm.options.ConfigError: a value out of its range or choices.
        PrepareError: no inputs, or ``--shard-size`` over the budget.
    """
    validate(cfg, "prepare")
    if not cfg.inputs:
        raise PrepareError("no input files")
    if 2 * cfg.shard_size > cfg.max_memory_mb * MIB // max(1, cfg.workers):  # per process
        raise PrepareError(f"--shard-size {cfg.shard_size / MIB:.1f} MiB needs --max-memory-mb >= "
                           f"{math.ceil(2 * cfg.shard_size * cfg.workers / MIB)} with "
                           f"{cfg.workers} worker(s) (a shard is assembled in memory)")
