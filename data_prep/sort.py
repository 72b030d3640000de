"""Phases 1 and 2 of ``prepare``: an external MSD radix sort of the documents by their keyed
hash, through bucket spill files (:mod:`data_prep.pipeline` has the phases' overview).

1. **map** (:func:`map_unit`, one task per unit): read, filter, encode and key the documents of
   one input file or stripe, and append each record (key, bytes + EOD) to the spill files of
   its bucket (the key's top bits), through buffers bounded by the memory budget.
2. **sort** (:func:`sort_bucket`, one task per bucket): load the bucket's spill files from every
   unit (a bucket larger than the budget is first split 16 ways by the next key bits,
   recursively), sort by key, drop exact duplicates, write the bucket's sorted bytes and
   document lengths.

Both write into ``.partial`` folders of the work directory renamed when complete
(:mod:`data_prep.resume`), so a resumed run redoes only unfinished units and buckets.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from data_prep import inputs, readers
from data_prep.resume import finish_dir, fresh_dir
from data_prep.settings import PrepareConfig
from hvd_lm.formats.tokenizer import EOD, encode_bytes, normalize_text
from hvd_lm.util.atomic import write_text
from hvd_lm.util.units import MIB

#: Testing aid: seconds every map task sleeps first (a test acts while prepare still runs).
SLEEP_HOOK_ENV = "HVD_LM_PREP_TASK_SLEEP"
_REC = np.dtype([("k0", ">u8"), ("k1", ">u8"), ("n", "<u8")])  # spill index record, 24 bytes
MAX_BUCKET_BITS = 10  # at most 1024 buckets
_EOD_BYTE = bytes([EOD])
_SPLIT_BITS = 4


@dataclass
class UnitStats(inputs.ReadStats):
    """Map-phase counters of one unit: :class:`data_prep.inputs.ReadStats` plus
    ``too_short`` (documents under ``--min-chars``), ``nul_removed`` (NUL characters deleted),
    ``kept`` (documents passed to the sort) and ``kept_bytes`` (their bytes incl. EOD)."""

    too_short: int = 0
    nul_removed: int = 0
    kept: int = 0
    kept_bytes: int = 0


@dataclass(frozen=True)
class MapTask:
    """Phase-1 task: read stripe ``stripe`` of ``n_stripes`` of one input into ``2**bits``
    bucket spill files under ``work``, buffering at most ``buffer_bytes`` bytes, as ``cfg``
    says (its seed, normalize, min_chars, skip_bad and utf8_errors)."""

    unit: int
    spec: inputs.InputSpec
    stripe: int
    n_stripes: int
    work: str
    bits: int
    cfg: PrepareConfig
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


def _nibble(recs: np.ndarray, pos: int) -> np.ndarray:
    """The 4 key bits after the first ``pos`` bits (``pos`` <= 124) of each :data:`_REC`
    record's 128-bit key, read from its 16 big-endian bytes."""
    key = np.zeros((len(recs), 17), np.uint16)  # a zero byte after the last (pos 120..124)
    key[:, :16] = recs.view(np.uint8).reshape(len(recs), _REC.itemsize)[:, :16]
    i = pos // 8
    return ((key[:, i] << 8 | key[:, i + 1]) >> (12 - pos % 8) & 15).astype(np.intp)


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
                    f.write(_EOD_BYTE.join([*data, b""]))  # each document, then EOD
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
    final = Path(task.work) / "map" / f"u{task.unit:05d}"
    part = fresh_dir(final.with_name(final.name + ".partial"))
    stats = UnitStats()
    spill = _Spill(part, 1 << task.bits, task.buffer_bytes)
    cfg = task.cfg
    keyed = hashlib.blake2b(digest_size=16, key=str(cfg.seed).encode())
    normalize, min_chars, limit = cfg.normalize, cfg.min_chars, spill.limit
    shift = 16 - task.bits  # bucket = top ``bits`` bits of the key (bits <= MAX_BUCKET_BITS)
    keys, dats = spill.keys, spill.data
    try:
        batches = readers.read_document_batches(
            task.spec, task.stripe, task.n_stripes, stats=stats, skip_bad=cfg.skip_bad,
            utf8_errors=cfg.utf8_errors, progress=progress, max_line_bytes=task.max_doc_bytes)
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
    except inputs.CorruptInput as e:
        if not cfg.skip_bad:
            raise
        part = fresh_dir(part)  # drop everything read from this file
        stats = UnitStats()
        spill = None
        if task.stripe == 0:
            stats.corrupt_files = 1
            stats.add_bad(e.path, e.line, e.reason + " (file dropped)")
    if spill is not None:
        spill.flush()
    write_text(part / "stats.json", json.dumps(asdict(stats), indent=1))
    finish_dir(part, final)


# ---- phase 2: sort -------------------------------------------------------------------------


def _load_sorted(pairs: list, dedup: bool):
    """Load spill files ``[(idx_path, dat_path)]``, sort by key, optionally de-duplicate.
    Returns (dat uint8 array, starts, lengths in sorted order, duplicates dropped)."""
    recs = np.concatenate([np.zeros(0, dtype=_REC)] + [np.fromfile(ix, dtype=_REC)
                                                       for ix, _ in pairs])
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
    starts = np.cumsum(lengths) - lengths
    if int(lengths.sum()) != len(dat):
        raise OSError(f"spill files of {pairs[0][0] if pairs else '?'} are inconsistent")
    k0, k1 = recs["k0"].astype(np.uint64), recs["k1"].astype(np.uint64)
    order = np.lexsort((k1, k0))
    dups = 0
    if dedup and len(order) > 1:
        s0, s1 = k0[order], k1[order]
        keep = np.r_[True, (s0[1:] != s0[:-1]) | (s1[1:] != s1[:-1])]  # first of equal keys
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
    sub = fresh_dir(scratch / f"p{pos:03d}")
    names = [(sub / f"s{k:02d}.idx", sub / f"s{k:02d}.dat") for k in range(16)]
    with contextlib.ExitStack() as files:
        handles = [(files.enter_context(open(ix, "wb")), files.enter_context(open(dt, "wb")))
                   for ix, dt in names]
        step = max(1, budget // (4 * 1024))  # records per chunk: bounded by the budget
        for ix_path, dt_path in pairs:
            with open(ix_path, "rb") as fi, open(dt_path, "rb") as fd:
                while True:
                    recs = np.fromfile(fi, dtype=_REC, count=step)
                    if not len(recs):
                        break
                    data = fd.read(int(recs["n"].sum()))
                    view = memoryview(data)
                    nib = _nibble(recs, pos)
                    offs = np.r_[0, np.cumsum(recs["n"].astype(np.int64))]
                    for k in np.unique(nib).tolist():
                        sel = np.flatnonzero(nib == k)
                        hi, hd = handles[k]
                        recs[sel].tofile(hi)
                        for j in sel.tolist():
                            hd.write(view[offs[j]:offs[j + 1]])
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
    part = fresh_dir(final.with_name(final.name + ".partial"))
    idx = [work / "map" / f"u{u:05d}" / f"b{task.bucket:05d}.idx" for u in range(task.units)]
    pairs = [(ix, ix.with_suffix(".dat")) for ix in idx if ix.exists()]
    lengths: list = []
    with open(part / "data.bin", "wb", buffering=4 * MIB) as out:
        dups = _sort_into(pairs, task.bits, task.budget, task.dedup, out, lengths, part)
    lens = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    np.save(part / "lengths.npy", lens)
    write_text(part / "stats.json", json.dumps({"documents": int(len(lens)), "duplicates": dups,
                                                "tokens": int(lens.sum())}, indent=1))
    finish_dir(part, final)
