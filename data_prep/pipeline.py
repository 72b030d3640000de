"""``prepare``: review text files -> shuffled, de-duplicated, split, sharded token streams.

Phases (each a list of independent tasks run by :class:`data_prep.parallel.Context` over
``--workers`` processes and MPI ranks):

1. **map** -- one task per *unit*: an input file, or one stripe of a one-record-per-line file
   when there are fewer files than processes (:func:`data_prep.readers.iter_lines`). Documents
   come in lists (:func:`data_prep.readers.read_document_batches`: JSON lines are parsed from
   raw bytes with orjson); each is optionally normalised, encoded (UTF-8, as
   :func:`hvd_lm.core.tokenizer.encode_bytes`), dropped when shorter than ``--min-chars``
   characters, and given the key ``blake2b(bytes, key=seed, digest_size=16)``. Records (key,
   bytes + EOD) go to bucket spill files by the key's top bits (range partitioning), through
   buffers bounded by the memory budget.
2. **sort** -- one task per bucket: load its records (a bucket larger than the budget is first
   split 16 ways by the next key bits, recursively: an external MSD radix sort), sort by key,
   drop exact duplicates (equal key = equal bytes, up to a 2**-128 collision chance), write the
   bucket's sorted bytes and document lengths.
3. **plan** (rank 0) -- the buckets in key order are one global stream sorted by key: a seeded
   shuffle that does not depend on how the input was cut into units and buckets. The first
   ``n_train`` documents are train, the next ``n_val`` val, the rest test (counts from
   ``--split``); within a split, a shard is closed before a document that would take it past
   ``--shard-size`` bytes. Shards are pure functions of the ordered stream.
4. **write** -- one task per shard: gather its byte ranges, write it atomically
   (:func:`hvd_lm.core.shards.write_shard`).
5. rank 0 writes ``manifest.json`` last, then removes the work directory.

So the same inputs and settings give byte-identical shards for any number of workers, ranks or
memory budget. Work lives in ``OUT/.prepare/``; every unit and bucket is written to a
``.partial`` directory renamed when complete, so ``--resume`` reuses finished units and buckets
and keeps shards that verify, and redoes the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

import hvd_lm
from data_prep import readers
from data_prep.parallel import Context, PhaseError, now
from hvd_lm.core import shards
from hvd_lm.core.config import option
from hvd_lm.core.lock import FolderLock
from hvd_lm.core.atomic import write_text
from hvd_lm.core.tokenizer import EOD, TOKENIZER_NAME, encode_bytes, normalize_text
from hvd_lm.core.units import MIB, parse_bytes

MiB = MIB
WORK_DIR = ".prepare"
#: Environment hook for tests: after this many shards written by one process, it kills itself
#: with SIGKILL (simulates a crash midway; ``--resume`` must recover).
KILL_HOOK_ENV = "HVD_LM_PREP_KILL_AFTER_SHARDS"
#: Testing aid: seconds every map task sleeps first (a test acts while prepare still runs).
SLEEP_HOOK_ENV = "HVD_LM_PREP_TASK_SLEEP"
_SHARD_NAME = re.compile(r"^(train|val|test)-\d{5}\.h5$")
_REC = np.dtype([("k0", ">u8"), ("k1", ">u8"), ("n", "<u8")])  # spill index record, 24 bytes
_MAX_BUCKET_BITS = 10
_EOD_BYTE = bytes([EOD])
_SPLIT_BITS = 4
#: A document (record line) may use at most 1/8 of a worker's memory budget: reading, decoding,
#: encoding and spilling it holds about 5 copies at once (measured: an 18 MB JSON line peaked at
#: 5x its size), so larger ones are refused with their file, line and size.
DOC_BUDGET_SHARE = 8


class PrepareError(RuntimeError):
    """The run cannot proceed (bad settings, output directory in use, no documents)."""


def parse_size(text: str) -> int:
    """``"64M"``, ``"1.5G"``, ``"4096"``, ``"512K"`` -> bytes (binary units: K=1024;
    :func:`hvd_lm.core.units.parse_bytes`)."""
    return parse_bytes(text)


def parse_split(text) -> tuple:
    """``"1000,1,1"``, ``"0.9,0.05,0.05"`` or a sequence of numbers -> (train, val, test) ratios;
    missing ones are 0.

    Raises:
        ValueError: not 1-3 non-negative numbers with a positive sum.
    """
    try:
        parts = [float(x) for x in (str(text).split(",") if isinstance(text, str) else text)]
    except (TypeError, ValueError):
        raise ValueError(f"--split {text!r}: expected up to three numbers, e.g. 1000,1,1") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 or math.isnan(p) for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {text!r}: expected 1-3 non-negative numbers with a positive sum")
    return tuple(parts + [0.0] * (3 - len(parts)))


@dataclass
class PrepareConfig:
    """Settings of one ``prepare`` run: the ``prepare`` flags, the ``prepare:`` YAML section
    (:mod:`hvd_lm.core.config`), and what the manifest records.

    Attributes:
        inputs: input file paths.
        out: output directory.
        format, text_field: ``--format`` / ``--text-field`` for every input (``None``: inferred
            per file).
        normalize: collapse whitespace (:func:`hvd_lm.core.tokenizer.normalize_text`) before
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
                                   "each file name)", choices=readers.FORMATS)
    text_field: Optional[str] = option(None, "JSON key / CSV column / .review tag holding the "
                                       "text (default: reviewText, review_body, Text, ... "
                                       "whichever the file has; review_text)")
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
    shard_size: int = option(64 * MiB, "target bytes per shard, suffixes K/M/G",
                             parse=parse_size, metavar="BYTES", ge=1)
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


@dataclass
class UnitStats(readers.ReadStats):
    """Map-phase counters of one unit: :class:`data_prep.readers.ReadStats` plus
    ``too_short`` (documents under ``--min-chars``), ``nul_removed`` (NUL characters deleted),
    ``kept`` (documents passed to the sort) and ``kept_bytes`` (their bytes incl. EOD)."""

    too_short: int = 0
    nul_removed: int = 0
    kept: int = 0
    kept_bytes: int = 0

    def merge(self, other: "UnitStats") -> None:  # noqa: D102 - see ReadStats.merge
        super().merge(other)
        for name in ("too_short", "nul_removed", "kept", "kept_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class MapTask:
    """Phase-1 task: read stripe ``stripe`` of ``n_stripes`` of one input into ``2**bits``
    bucket spill files under ``work``, buffering at most ``buffer_bytes`` bytes."""

    unit: int
    spec: readers.InputSpec
    stripe: int
    n_stripes: int
    work: str
    bits: int
    seed: int
    normalize: bool
    min_chars: int
    skip_bad: bool
    utf8_errors: str
    buffer_bytes: int
    max_doc_bytes: Optional[int] = None


@dataclass(frozen=True)
class SortTask:
    """Phase-2 task: sort bucket ``bucket`` (of ``2**bits``) gathered from ``units`` map units,
    holding at most ``budget`` bytes of records in memory at once."""

    bucket: int
    bits: int
    work: str
    units: int
    budget: int
    dedup: bool


@dataclass(frozen=True)
class ShardPlan:
    """One output shard: its split, index, file name, counts, and the byte ranges of sorted
    buckets it is made of, ``(bucket, first_doc, stop_doc, first_byte, stop_byte)``."""

    split: str
    index: int
    file: str
    documents: int
    tokens: int
    pieces: tuple


@dataclass(frozen=True)
class WriteTask:
    """Phase-4 task: write shard ``plan`` into ``out`` from the sorted buckets in ``work``;
    with ``resume``, keep an existing file that verifies and matches the plan."""

    plan: ShardPlan
    out: str
    work: str
    attrs: dict
    compression: str
    resume: bool


# ---- helpers -------------------------------------------------------------------------------


def split_counts(n: int, ratios: tuple) -> dict:
    """Documents per split for ``n`` documents: val and test get ``floor(n * r / sum)`` but at
    least 1 when their ratio is positive; train gets the rest.

    Raises:
        PrepareError: too few documents to give every split with a positive ratio one.
    """
    total = sum(ratios)
    counts = {}
    for name, r in zip(shards.SPLITS[1:], ratios[1:]):
        counts[name] = max(1, int(n * r // total)) if r > 0 else 0
    counts["train"] = n - sum(counts.values())
    need = sum(1 for r in ratios if r > 0)
    if n < need or (ratios[0] > 0 and counts["train"] < 1):
        raise PrepareError(f"{n} documents are too few for the split {ratios} "
                           f"(every split with a positive ratio needs one)")
    return {name: counts[name] for name in shards.SPLITS}


def _nibble(k0: np.ndarray, k1: np.ndarray, pos: int) -> np.ndarray:
    """The 4 key bits after the first ``pos`` bits of the 128-bit keys (k0 high, k1 low)."""
    key_hi, key_lo = k0.astype(np.uint64), k1.astype(np.uint64)
    if pos + _SPLIT_BITS <= 64:
        return ((key_hi >> np.uint64(64 - pos - _SPLIT_BITS)) & np.uint64(15)).astype(np.intp)
    if pos >= 64:
        return ((key_lo >> np.uint64(128 - pos - _SPLIT_BITS)) & np.uint64(15)).astype(np.intp)
    hi_bits = 64 - pos  # bits taken from the end of k0
    lo_bits = _SPLIT_BITS - hi_bits
    hi = (key_hi & np.uint64((1 << hi_bits) - 1)) << np.uint64(lo_bits)
    return (hi | (key_lo >> np.uint64(64 - lo_bits))).astype(np.intp)


def _atomic_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=1))


def _finish_dir(partial: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)


def _fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# ---- phase 1: map --------------------------------------------------------------------------


class _Spill:
    """Per-bucket record buffers of one unit (lists of 16-byte keys and of document bytes),
    appended to ``b{bucket}.idx``/``.dat`` whenever their total passes ``limit`` bytes.

    ``.idx`` holds one :data:`_REC` record per document (key, then its byte count incl. EOD as
    little-endian uint64); ``.dat`` the documents, each followed by EOD, in the same order.
    """

    def __init__(self, directory: Path, n_buckets: int, limit: int):
        self.dir, self.limit, self.size = directory, limit, 0
        self.keys = [[] for _ in range(n_buckets)]
        self.data = [[] for _ in range(n_buckets)]

    def flush(self) -> None:
        for b, (keys, data) in enumerate(zip(self.keys, self.data)):
            if keys:
                recs = np.empty(len(keys), dtype=_REC)
                raw = recs.view(np.uint8).reshape(len(keys), _REC.itemsize)
                raw[:, :16] = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), 16)
                recs["n"] = np.fromiter(map(len, data), np.int64, len(data)) + 1
                with open(self.dir / f"b{b:05d}.idx", "ab") as f:
                    f.write(recs.tobytes())
                with open(self.dir / f"b{b:05d}.dat", "ab") as f:
                    f.write(_EOD_BYTE.join(data))
                    f.write(_EOD_BYTE)
                keys.clear()
                data.clear()
        self.size = 0


def map_unit(task: MapTask, progress=None) -> None:
    """Phase 1 for one unit: read, filter, encode, key and spill its documents into
    ``WORK/map/u{unit}/`` (written as ``.partial`` and renamed when complete), with its
    :class:`UnitStats` in ``stats.json``.

    Documents come in lists (:func:`data_prep.readers.read_document_batches`); the key is the
    keyed BLAKE2b of the bytes, computed by copying a hash object that has absorbed the key
    (the same digest as ``blake2b(data, key=seed, digest_size=16)``).

    Raises:
        BadRecord: malformed record without ``skip_bad``. CorruptInput: damaged gzip stream
        without ``skip_bad`` (with it, the unit's output is dropped and counted).
    """
    time.sleep(float(os.environ.get(SLEEP_HOOK_ENV, "0") or 0))
    work = Path(task.work)
    final = work / "map" / f"u{task.unit:05d}"
    part = _fresh_dir(final.with_name(final.name + ".partial"))
    stats = UnitStats()
    n_buckets = 1 << task.bits
    spill = _Spill(part, n_buckets, task.buffer_bytes)
    keyed = hashlib.blake2b(digest_size=16, key=str(task.seed).encode())
    normalize, min_chars, limit = task.normalize, task.min_chars, spill.limit
    shift = 16 - task.bits  # bucket = top ``bits`` bits of the key (bits <= _MAX_BUCKET_BITS)
    keys, dats = spill.keys, spill.data
    try:
        batches = readers.read_document_batches(
            task.spec, task.stripe, task.n_stripes, stats=stats, skip_bad=task.skip_bad,
            utf8_errors=task.utf8_errors, progress=progress, max_line_bytes=task.max_doc_bytes)
        for texts in batches:
            kept = nbytes = too_short = 0
            for text in texts:
                if normalize:
                    text = normalize_text(text)
                if "\0" in text:
                    stats.nul_removed += text.count("\0")
                    text = text.replace("\0", "")
                if len(text) < min_chars:
                    too_short += 1
                    continue
                try:
                    data = text.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates: the tokenizer's replacement
                    data = encode_bytes(text)
                h = keyed.copy()
                h.update(data)
                key = h.digest()
                b = ((key[0] << 8) | key[1]) >> shift
                keys[b].append(key)
                dats[b].append(data)
                kept += 1
                nbytes += len(data)
            stats.kept += kept
            stats.kept_bytes += nbytes + kept
            stats.too_short += too_short
            spill.size += nbytes + 25 * kept
            if spill.size >= limit:
                spill.flush()
    except readers.CorruptInput as e:
        if not task.skip_bad:
            raise
        part = _fresh_dir(part)  # drop everything read from this file
        stats = UnitStats()
        spill = None
        if task.stripe == 0:
            stats.corrupt_files = 1
            stats.add_bad(e.path, e.line, e.reason + " (file dropped)")
    if spill is not None:
        spill.flush()
    _atomic_json(part / "stats.json", asdict(stats))
    _finish_dir(part, final)


# ---- phase 2: sort -------------------------------------------------------------------------


def _load_sorted(pairs: list, dedup: bool):
    """Load spill files ``[(idx_path, dat_path)]``, sort by key, optionally de-duplicate.
    Returns (dat uint8 array, starts, lengths in sorted order, duplicates dropped)."""
    recs = [np.fromfile(ix, dtype=_REC) for ix, _ in pairs]
    recs = np.concatenate(recs) if recs else np.zeros(0, dtype=_REC)
    sizes = [os.path.getsize(dt) for _, dt in pairs]
    dat = np.empty(sum(sizes), dtype=np.uint8)
    pos = 0
    view = memoryview(dat)
    for (_, dt), size in zip(pairs, sizes):
        with open(dt, "rb") as f:
            got = f.readinto(view[pos:pos + size])
        if got != size:
            raise OSError(f"{dt}: short read ({got} of {size} bytes)")
        pos += size
    lengths = recs["n"].astype(np.int64)
    starts = np.zeros(len(recs), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    if int(lengths.sum()) != len(dat):
        raise OSError(f"spill files of {pairs[0][0] if pairs else '?'} are inconsistent")
    k0, k1 = recs["k0"].astype(np.uint64), recs["k1"].astype(np.uint64)
    order = np.lexsort((k1, k0))
    dups = 0
    if dedup and len(order) > 1:
        s0, s1 = k0[order], k1[order]
        keep = np.ones(len(order), dtype=bool)
        keep[1:] = (s0[1:] != s0[:-1]) | (s1[1:] != s1[:-1])
        dups = int(len(order) - keep.sum())
        order = order[keep]
    return dat, starts[order], lengths[order], dups


def _sort_into(pairs: list, pos: int, budget: int, dedup: bool, out, lengths_out: list,
               scratch: Path) -> int:
    """Append the sorted records of ``pairs`` (all sharing their first ``pos`` key bits) to the
    open file ``out`` and their lengths to ``lengths_out``; returns duplicates dropped. Inputs
    larger than ``budget`` bytes are split 16 ways by the next 4 key bits first."""
    total = sum(os.path.getsize(ix) + os.path.getsize(dt) for ix, dt in pairs)
    if total <= budget or pos + _SPLIT_BITS > 128 or not pairs:
        dat, starts, lens, dups = _load_sorted(pairs, dedup)
        view = memoryview(dat)
        write = out.write
        for a, n in zip(starts.tolist(), lens.tolist()):
            write(view[a:a + n])
        lengths_out.append(lens)
        return dups
    sub = _fresh_dir(scratch / f"p{pos:03d}")
    names = [(sub / f"s{k:02d}.idx", sub / f"s{k:02d}.dat") for k in range(16)]
    handles = [(open(ix, "wb"), open(dt, "wb")) for ix, dt in names]
    try:
        step = max(1, budget // (4 * 1024))  # records per chunk: bounded by the budget
        for ix_path, dt_path in pairs:
            with open(ix_path, "rb") as fi, open(dt_path, "rb") as fd:
                while True:
                    recs = np.fromfile(fi, dtype=_REC, count=step)
                    if not len(recs):
                        break
                    data = fd.read(int(recs["n"].sum()))
                    view = memoryview(data)
                    nib = _nibble(recs["k0"], recs["k1"], pos)
                    offs = np.zeros(len(recs) + 1, dtype=np.int64)
                    np.cumsum(recs["n"].astype(np.int64), out=offs[1:])
                    for k in np.unique(nib).tolist():
                        sel = np.flatnonzero(nib == k)
                        hi, hd = handles[k]
                        recs[sel].tofile(hi)
                        for j in sel.tolist():
                            hd.write(view[offs[j]:offs[j + 1]])
    finally:
        for hi, hd in handles:
            hi.close()
            hd.close()
    dups = 0
    for ix, dt in names:
        if os.path.getsize(ix):
            dups += _sort_into([(ix, dt)], pos + _SPLIT_BITS, budget, dedup, out, lengths_out,
                               scratch)
        ix.unlink()
        dt.unlink()
    shutil.rmtree(sub, ignore_errors=True)
    return dups


def sort_bucket(task: SortTask, progress=None) -> None:
    """Phase 2 for one bucket: merge its spill files from every unit, sort by key, drop
    duplicates, and write ``WORK/sorted/b{bucket}/`` with ``data.bin`` (documents with their
    EOD, in key order), ``lengths.npy`` (int64 bytes per document incl. EOD) and ``stats.json``.
    """
    work = Path(task.work)
    final = work / "sorted" / f"b{task.bucket:05d}"
    part = _fresh_dir(final.with_name(final.name + ".partial"))
    pairs = []
    for u in range(task.units):
        ix = work / "map" / f"u{u:05d}" / f"b{task.bucket:05d}.idx"
        if ix.exists():
            pairs.append((ix, ix.with_suffix(".dat")))
    lengths: list = []
    with open(part / "data.bin", "wb", buffering=4 * MiB) as out:
        dups = _sort_into(pairs, task.bits, task.budget, task.dedup, out, lengths, part)
    lens = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    np.save(part / "lengths.npy", lens)
    _atomic_json(part / "stats.json", {"documents": int(len(lens)), "duplicates": dups,
                                       "tokens": int(lens.sum())})
    _finish_dir(part, final)


# ---- phase 3: plan -------------------------------------------------------------------------


def plan_shards(work: Path, n_buckets: int, counts: dict, shard_size: int) -> list:
    """Cut the key-ordered stream of all sorted buckets into splits and shards.

    Args:
        work: work directory with ``sorted/b*/lengths.npy``.
        n_buckets: number of buckets.
        counts: documents per split (:func:`split_counts`), taken in ``SPLITS`` order.
        shard_size: bytes per shard; a shard is closed before a document that would pass it
            (a document longer than ``shard_size`` gets a shard of its own).
    Returns:
        :class:`ShardPlan` list, splits in ``SPLITS`` order, shards by index.
    """
    plans: list = []
    order = [s for s in shards.SPLITS if counts[s] > 0]
    si = 0
    left = counts[order[0]] if order else 0
    index = {s: 0 for s in shards.SPLITS}
    cur: list = []
    cur_docs = cur_tokens = 0

    def close():
        nonlocal cur, cur_docs, cur_tokens
        if cur_docs:
            split = order[si]
            plans.append(ShardPlan(split=split, index=index[split],
                                   file=f"{split}-{index[split]:05d}.h5", documents=cur_docs,
                                   tokens=cur_tokens, pieces=tuple(cur)))
            index[split] += 1
        cur, cur_docs, cur_tokens = [], 0, 0

    for b in range(n_buckets):
        lens = np.load(work / "sorted" / f"b{b:05d}" / "lengths.npy")
        cum = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cum[1:])
        i = 0
        while i < len(lens):
            room = shard_size - cur_tokens
            j = int(np.searchsorted(cum, cum[i] + room, side="right")) - 1
            j = min(j, i + left, len(lens))
            if j <= i and cur_docs == 0:
                j = i + 1  # one document larger than a shard: a shard of its own
            if j > i:
                cur.append((b, i, j, int(cum[i]), int(cum[j])))
                cur_docs += j - i
                cur_tokens += int(cum[j] - cum[i])
                left -= j - i
                i = j
            if left == 0:
                close()
                si += 1
                if si >= len(order):
                    break
                left = counts[order[si]]
            elif i < len(lens):
                close()  # the next document does not fit
    close()
    return plans


# ---- phase 4: write ------------------------------------------------------------------------


def _kill_hook() -> None:
    limit = os.environ.get(KILL_HOOK_ENV)
    if limit:
        _kill_hook.count = getattr(_kill_hook, "count", 0) + 1
        if _kill_hook.count >= int(limit):
            os.kill(os.getpid(), signal.SIGKILL)


def write_task(task: WriteTask, progress=None) -> tuple:
    """Phase 4 for one shard: keep it when resuming and it verifies, else assemble and write it.

    Returns:
        ``(sha256 hex, kept)``.
    """
    plan = task.plan
    path = Path(task.out) / plan.file
    if task.resume and path.exists():
        try:
            attrs = shards.check_shard(path)
            if (attrs.get("config_sha256") == task.attrs["config_sha256"]
                    and attrs.get("split") == plan.split
                    and attrs.get("documents") == plan.documents
                    and attrs.get("bytes") == plan.tokens):
                return attrs["sha256"], True
        except (ValueError, OSError):
            pass  # rewritten below
    tokens = np.empty(plan.tokens, dtype=np.uint8)
    offsets = np.empty(plan.documents + 1, dtype=np.int64)
    offsets[0] = 0
    view = memoryview(tokens)
    pos = d = 0
    for b, i, j, a, z in plan.pieces:
        bdir = Path(task.work) / "sorted" / f"b{b:05d}"
        with open(bdir / "data.bin", "rb") as f:
            f.seek(a)
            got = f.readinto(view[pos:pos + z - a])
        if got != z - a:
            raise OSError(f"{bdir / 'data.bin'}: short read ({got} of {z - a} bytes)")
        lens = np.load(bdir / "lengths.npy", mmap_mode="r")[i:j]
        offsets[d + 1:d + 1 + len(lens)] = pos + np.cumsum(lens)
        pos += z - a
        d += len(lens)
    attrs = dict(task.attrs, split=plan.split, shard_index=plan.index)
    digest = shards.write_shard(path, tokens, offsets, attrs, compression=task.compression)
    _kill_hook()
    if progress is not None:
        progress(plan.tokens)
    return digest, False


# ---- driver --------------------------------------------------------------------------------


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _settings(cfg: PrepareConfig) -> dict:
    """The settings that decide the shards' bytes (hashed into the manifest's config_sha256)."""
    return {"tokenizer": TOKENIZER_NAME, "normalize": cfg.normalize,
            "min_chars": cfg.min_chars, "dedup": cfg.dedup, "seed": cfg.seed,
            "split": [float(r) for r in cfg.split], "shard_size": int(cfg.shard_size),
            "compression": cfg.compression, "utf8_errors": cfg.utf8_errors,
            "skip_bad": cfg.skip_bad}


def _fingerprints(cfg: PrepareConfig, specs: list) -> tuple:
    """(settings + input names/sizes, input paths/sizes/mtimes) hashes, as the manifest keeps."""
    names = input_names([s.path for s in specs])
    config_fp = _fingerprint({**_settings(cfg), "inputs": [
        [name, s.size, s.format, s.text_field] for name, s in zip(names, specs)]})
    inputs_fp = _fingerprint([[s.path, s.size, os.stat(s.path).st_mtime_ns] for s in specs])
    return config_fp, inputs_fp


def finished_with_other_inputs(cfg: PrepareConfig) -> bool:
    """Whether ``cfg.out`` holds a finished corpus of other settings or input file versions.

    That is the case in which ``prepare`` with ``resume`` refuses (a re-copied input has a new
    modification time even when its bytes are the same). False when there is no manifest.

    Raises:
        readers.InputError: an input is missing, unreadable or of an unknown format.
    """
    manifest_path = Path(cfg.out) / shards.MANIFEST_NAME
    if not manifest_path.exists():
        return False
    try:
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False          # unreadable: prepare redoes it anyway
    specs = [readers.resolve_input(p, cfg.format, cfg.text_field) for p in cfg.inputs]
    config_fp, inputs_fp = _fingerprints(cfg, specs)
    return bool(old.get("config_sha256")) and (old.get("config_sha256"), old.get(
        "inputs_sha256")) != (config_fp, inputs_fp)


def _versions() -> dict:
    return {"hvd_lm": hvd_lm.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "numpy": np.__version__,
            "python": platform.python_version()}


def input_names(paths: list) -> list:
    """Short, unique names of input files: paths relative to their common directory
    (``books/positive.review.gz``), a bare file name for a single input."""
    paths = [os.path.abspath(p) for p in paths]
    if not paths:
        return []
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    return [os.path.relpath(p, common) for p in paths]


def _estimate_bytes(spec: readers.InputSpec) -> int:
    """Uncompressed size estimate: gzip ISIZE trailer (size mod 2**32), at least 3x on disk."""
    if not spec.compressed:
        return spec.size
    try:
        with open(spec.path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
    except OSError:
        isize = 0
    return max(isize, 3 * spec.size)


def _check_config(cfg: PrepareConfig) -> None:
    if not cfg.inputs:
        raise PrepareError("no input files")
    if cfg.min_chars < 0:
        raise PrepareError(f"--min-chars must be >= 0, got {cfg.min_chars}")
    if cfg.shard_size < 1:
        raise PrepareError(f"--shard-size must be positive, got {cfg.shard_size}")
    if cfg.compression not in shards.COMPRESSIONS:
        raise PrepareError(f"--compression must be one of {shards.COMPRESSIONS}")
    if cfg.resume and cfg.overwrite:
        raise PrepareError("--resume and --overwrite exclude each other")
    per_proc = cfg.max_memory_mb * MiB // max(1, cfg.workers)
    if 2 * cfg.shard_size > per_proc:
        raise PrepareError(f"--shard-size {cfg.shard_size / MiB:.1f} MiB needs --max-memory-mb >= "
                           f"{math.ceil(2 * cfg.shard_size * cfg.workers / MiB)} with "
                           f"{cfg.workers} worker(s) (a shard is assembled in memory)")


def _setup_output(cfg: PrepareConfig, config_fp: str, inputs_fp: str, layout: dict,
                  accept_complete: bool = True) -> dict:
    """Rank 0: claim the output directory, decide what earlier work to reuse, record the state.

    Returns:
        ``{"reuse_work": bool, "complete": manifest dict or None}``; ``complete`` is the
        existing manifest when resuming a finished run with the same settings and inputs.
    Raises:
        PrepareError: the directory holds an earlier run and neither --resume nor --overwrite.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / shards.MANIFEST_NAME
    work = out / WORK_DIR
    ours = sorted(p for p in out.iterdir() if _SHARD_NAME.match(p.name))
    if not (cfg.resume or cfg.overwrite) and (manifest_path.exists() or ours):
        raise PrepareError(f"{out} already holds prepared data (manifest or shards); pass "
                           "--resume to continue it or --overwrite to replace it")
    # (a work directory alone, from a run that failed before writing shards, is redone)
    for p in out.glob(".*.tmp"):  # temp files of a killed writer
        p.unlink(missing_ok=True)
    state_path = work / "state.json"
    state = None
    if state_path.exists():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            state = None
    if cfg.resume and accept_complete and manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        if old.get("config_sha256") == config_fp and old.get("inputs_sha256") == inputs_fp:
            return {"reuse_work": False, "complete": old}
        if old.get("config_sha256"):  # a finished corpus of other inputs or settings
            what = ("settings or inputs" if old.get("config_sha256") != config_fp
                    else "versions of the input files (sizes or modification times)")
            raise PrepareError(
                f"{out} holds a finished corpus prepared with other {what}; --resume only "
                "continues the same run: pass --overwrite to replace it, or use another --out")
    if manifest_path.exists():  # never leave a manifest that lists shards being replaced
        manifest_path.unlink()
    same_inputs = bool(state) and state.get("config_sha256") == config_fp and \
        state.get("inputs_sha256") == inputs_fp
    if cfg.overwrite or (state is not None and not same_inputs):
        for p in ours:
            p.unlink()
    reuse = cfg.resume and same_inputs and state.get("layout") == layout
    if not reuse:
        if work.exists():
            shutil.rmtree(work)
    for sub in ("map", "sorted"):
        (work / sub).mkdir(parents=True, exist_ok=True)
        for p in (work / sub).glob("*.partial"):
            shutil.rmtree(p)
    _atomic_json(state_path, {"config_sha256": config_fp, "inputs_sha256": inputs_fp,
                              "layout": layout})
    return {"reuse_work": reuse, "complete": None}


def _verify_complete(ctx: Context, out: Path) -> bool:
    """Every shard of an existing manifest verifies (checked in parallel)."""
    manifest = shards.load_manifest(out)
    try:
        ctx.run(_verify_one, manifest.shards, desc="verify")
    except PhaseError:
        return False
    return True


def _verify_one(info: shards.ShardInfo, progress=None) -> None:
    shards.verify_shard(info)


def _summary(manifest: dict, out: Path) -> dict:
    """The manifest without its shard lists, with per-split totals and ``output``."""
    summary = {k: v for k, v in manifest.items() if k != "splits"}
    summary["output"] = str(out)
    summary["splits"] = {k: {"shards": len(v["shards"]), "documents": v["documents"],
                             "tokens": v["tokens"]} for k, v in manifest["splits"].items()}
    return summary


def prepare(cfg: PrepareConfig, ctx: Optional[Context] = None) -> dict:
    """Run the whole pipeline (see the module docstring) and return the summary.

    Args:
        cfg: settings.
        ctx: ranks and workers (default: ``Context(cfg.workers, cfg.progress)``, MPI when
            launched by ``mpirun``).
    Returns:
        The summary dict (the manifest minus its shard lists, plus ``output``), on every rank.
    Raises:
        PrepareError: bad settings, output directory in use, no documents.
        PhaseError: a task failed (malformed record, corrupt input, I/O error); the message
            names file and line.
        readers.InputError: an input cannot be read as asked.
        hvd_lm.core.lock.FolderBusyError: another live ``prepare`` is writing ``cfg.out``.
    """
    _check_config(cfg)
    ctx = ctx or Context(cfg.workers, cfg.progress)
    out = Path(cfg.out).resolve()
    # one prepare per output folder: rank 0 holds its lock for the whole run (every rank learns
    # whether it got it; the lock object itself stays on rank 0)
    held: list = []
    ctx.root_call(lambda: held.append(FolderLock(out, "prepare output folder")))
    lock = held[0] if held else None
    try:
        return _prepare(cfg, ctx, out)
    finally:
        if lock is not None:
            lock.release()


def _prepare(cfg: PrepareConfig, ctx: Context, out: Path) -> dict:
    """:func:`prepare` once the output folder is locked."""
    t0 = now()
    work = out / WORK_DIR

    specs = ctx.root_call(lambda: [readers.resolve_input(p, cfg.format, cfg.text_field)
                                   for p in cfg.inputs])
    names, settings = input_names([s.path for s in specs]), _settings(cfg)
    config_fp, inputs_fp = _fingerprints(cfg, specs)

    # units: whole files, or stripes of line-format files when processes outnumber files
    slots = ctx.slots
    units = []
    for i, s in enumerate(specs):
        n = slots if (len(specs) < slots and s.format in readers.LINE_FORMATS) else 1
        units.extend((i, k, n) for k in range(n))
    per_proc = cfg.max_memory_mb * MiB // cfg.workers
    est = sum(_estimate_bytes(s) for s in specs)
    # a full disk names the folder and what the job needs there: the map spills and the sorted
    # buckets (each about the corpus) beside the shards (about the corpus again)
    ctx.disk = (out, 3 * est)
    bits = max(math.ceil(math.log2(max(1, 4 * slots))),
               math.ceil(math.log2(max(1.0, 1.2 * est / (per_proc / 3)))))
    bits = min(bits, _MAX_BUCKET_BITS)
    n_buckets = 1 << bits
    layout = {"units": units, "bits": bits}

    setup = ctx.root_call(lambda: _setup_output(cfg, config_fp, inputs_fp, layout))
    if setup["complete"] is not None:
        if _verify_complete(ctx, out):
            return dict(_summary(setup["complete"], out), resumed_complete=True)
        # some shard fails: redo the run, keeping the shards that verify
        setup = ctx.root_call(lambda: _setup_output(cfg, config_fp, inputs_fp, layout,
                                                    accept_complete=False))

    # phase 1: map
    done_units = ctx.root_call(lambda: {u for u in range(len(units))
                                        if (work / "map" / f"u{u:05d}").is_dir()})
    buffer_bytes = max(1 * MiB, per_proc // 4)
    map_tasks = [MapTask(unit=u, spec=specs[i], stripe=k, n_stripes=n, work=str(work), bits=bits,
                         seed=cfg.seed, normalize=cfg.normalize, min_chars=cfg.min_chars,
                         skip_bad=cfg.skip_bad, utf8_errors=cfg.utf8_errors,
                         buffer_bytes=buffer_bytes,
                         max_doc_bytes=per_proc // DOC_BUDGET_SHARE)
                 for u, (i, k, n) in enumerate(units) if u not in done_units]
    mine = map_tasks[ctx.rank::ctx.size]
    t_map = now()
    ctx.run(map_unit, map_tasks, desc="read", total=sum(t.spec.size for t in mine))
    t_map = now() - t_map

    # phase 2: sort
    done_buckets = ctx.root_call(lambda: {b for b in range(n_buckets)
                                          if (work / "sorted" / f"b{b:05d}").is_dir()})
    sort_tasks = [SortTask(bucket=b, bits=bits, work=str(work), units=len(units),
                           budget=max(1 * MiB, per_proc // 3), dedup=cfg.dedup)
                  for b in range(n_buckets) if b not in done_buckets]
    t_sort = now()
    ctx.run(sort_bucket, sort_tasks, desc="sort")
    t_sort = now() - t_sort

    # phase 3: plan (rank 0)
    def _plan():
        stats = UnitStats()
        for u in range(len(units)):
            d = json.loads((work / "map" / f"u{u:05d}" / "stats.json").read_text())
            stats.merge(UnitStats(**d))
        bstats = [json.loads((work / "sorted" / f"b{b:05d}" / "stats.json").read_text())
                  for b in range(n_buckets)]
        n_docs = sum(b["documents"] for b in bstats)
        if n_docs == 0:
            shutil.rmtree(work, ignore_errors=True)  # nothing worth resuming
            raise PrepareError(
                f"no documents to write: {stats.records} records read, {stats.too_short} "
                f"shorter than --min-chars {cfg.min_chars}, {stats.bad_records} bad, "
                f"{stats.blank_lines} blank lines (inputs: {', '.join(cfg.inputs)})")
        counts = split_counts(n_docs, cfg.split)
        return stats, sum(b["duplicates"] for b in bstats), counts, \
            plan_shards(work, n_buckets, counts, cfg.shard_size)

    stats, dups, counts, plans = ctx.root_call(_plan)

    # phase 4: write
    base_attrs = {"tokenizer": TOKENIZER_NAME, "source_files": names,
                  "config_sha256": config_fp}
    write_tasks = [WriteTask(plan=p, out=str(out), work=str(work), attrs=base_attrs,
                             compression=cfg.compression, resume=cfg.resume) for p in plans]
    t_write = now()
    results = ctx.run(write_task, write_tasks, desc="write",
                      total=sum(w.plan.tokens for w in write_tasks[ctx.rank::ctx.size]))
    t_write = now() - t_write

    # phase 5: manifest (rank 0, last)
    def _finish():
        planned = {p.file for p in plans}
        for p in out.iterdir():
            if _SHARD_NAME.match(p.name) and p.name not in planned:
                p.unlink()  # left by an earlier, larger run
        entries = {s: [] for s in shards.SPLITS}
        for p, (digest, _) in zip(plans, results):
            entries[p.split].append(shards.manifest_entry(p.file, p.tokens, p.documents, digest))
        elapsed = now() - t0
        counters = {k: v for k, v in asdict(stats).items() if k != "bad_samples"}
        counters.update(duplicates=dups, documents=sum(counts.values()),
                        tokens=sum(p.tokens for p in plans),
                        shards_kept=sum(1 for _, kept in results if kept))
        meta = {
            "created_by": "hvd_lm data_prep prepare",
            "command": list(cfg.command),
            "config_sha256": config_fp,
            "inputs_sha256": inputs_fp,
            **{k: v for k, v in settings.items() if k != "tokenizer"},
            "split_ratios": dict(zip(shards.SPLITS, settings["split"])),
            "split_documents": counts,
            "inputs": [{"path": s.path, "name": name, "bytes": s.size,
                        "gzip": s.compressed, "format": s.format,
                        "format_source": s.format_source, "text_field": s.text_field,
                        "field_source": s.field_source} for name, s in zip(names, specs)],
            "versions": _versions(),
            "counters": counters,
            "bad_samples": [f"{p}:{n}: {r}" for p, n, r in stats.bad_samples],
            "run": {"world_size": ctx.size, "workers": cfg.workers,
                    "max_memory_mb": cfg.max_memory_mb, "buckets": n_buckets,
                    "units": len(units), "elapsed_s": round(elapsed, 3),
                    "phase_s": {"read": round(t_map, 3), "sort": round(t_sort, 3),
                                "write": round(t_write, 3)},
                    "mb_per_s": round(stats.bytes_in / 1e6 / max(elapsed, 1e-9), 2)},
        }
        manifest = shards.build_manifest(entries, TOKENIZER_NAME, **meta)
        shards.write_manifest(out, manifest)
        if not cfg.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        return _summary(manifest, out)

    return ctx.root_call(_finish)


def format_summary(summary: dict) -> str:
    """Human-readable summary of :func:`prepare`'s result (documents, bytes in/out, drops,
    MB/s, inferred formats, bad-record samples)."""
    c = summary["counters"]
    run = summary.get("run", {})
    lines = [f"prepared {summary['output']}"]
    if summary.get("resumed_complete"):
        lines.append("  already complete: every shard verified, nothing rewritten")
    lines += [
        f"  inputs: {len(summary['inputs'])} file(s)",
        *[f"    {i['name']}: {i['format']} ({i['format_source']})"
          + (f", text field {i['text_field']!r} ({i['field_source']})" if i["text_field"] else "")
          for i in summary["inputs"]],
        f"  records read: {c['records']:,}  (blank lines skipped {c['blank_lines']:,})",
        f"  dropped: {c['duplicates']:,} duplicates, {c['too_short']:,} shorter than "
        f"{summary['min_chars']} chars, {c['bad_records']:,} bad records, "
        f"{c['corrupt_files']} corrupt / {c['truncated_files']} truncated files",
        f"  lines with invalid UTF-8 replaced: {c['utf8_replaced']:,}; NULs removed: "
        f"{c['nul_removed']:,}",
        f"  documents out: {c['documents']:,}  "
        + ", ".join(f"{k} {v['documents']:,} in {v['shards']} shard(s)"
                    for k, v in summary.get("splits", {}).items()),
        f"  bytes in: {c['bytes_in']:,} (uncompressed)  bytes out: {c['tokens']:,} tokens",
    ]
    if run:
        lines.append(f"  time: {run['elapsed_s']:.2f} s ({run['mb_per_s']:.1f} MB/s of input; "
                     f"{run['world_size']} rank(s) x {run['workers']} worker(s))")
    if c.get("shards_kept") and not summary.get("resumed_complete"):
        lines.append(f"  resumed: {c['shards_kept']} verified shard(s) kept")
    if summary.get("bad_samples"):
        lines.append("  first bad records:")
        lines += [f"    {s}" for s in summary["bad_samples"]]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m data_prep prepare ...")
