"""``prepare``: review text files -> shuffled, de-duplicated, split, sharded token streams.

Phases (each a list of independent tasks run by :class:`data_prep.parallel.Context` over
``--workers`` processes and MPI ranks):

1. **map** -- one task per *unit*: an input file, or one stripe of a one-record-per-line file
   when there are fewer files than processes (:func:`data_prep.lines.iter_lines`). Documents
   come in lists (:func:`data_prep.readers.read_document_batches`: JSON lines are parsed from
   raw bytes with orjson); each is optionally normalised, encoded (UTF-8, as
   :func:`hvd_lm.formats.tokenizer.encode_bytes`), dropped when shorter than ``--min-chars``
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
   (:func:`hvd_lm.formats.shards.write_shard`).
5. rank 0 writes ``manifest.json`` last, then removes the work directory.

So the same inputs and settings give byte-identical shards for any number of workers, ranks or
memory budget. Work lives in ``OUT/.prepare/``; every unit and bucket is written to a
``.partial`` directory renamed when complete, so ``--resume`` reuses finished units and buckets
and keeps shards that verify, and redoes the rest.

This module runs the phases (:func:`prepare`); each lives in the module of its concern:
:mod:`data_prep.settings` (settings), :mod:`data_prep.sort` (phases 1-2: the external radix sort
and its spill files), :mod:`data_prep.plan` (phases 3-4: shard plan and writing),
:mod:`data_prep.resume` (the work directory, fingerprints, the output folder).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter as now
from typing import Optional

import h5py
import numpy as np

import hvd_lm
from data_prep import inputs, resume, sniff
from data_prep.parallel import Context
from data_prep.plan import WriteTask, plan_shards, split_counts, write_task
from data_prep.settings import DOC_BUDGET_SHARE, PrepareConfig, PrepareError, check_config
from data_prep.sort import MAX_BUCKET_BITS, MapTask, SortTask, UnitStats, map_unit, sort_bucket
from data_prep.verify import verify_directory
from hvd_lm.formats import manifest as manifests
from hvd_lm.formats import shards
from hvd_lm.formats.tokenizer import TOKENIZER_NAME
from hvd_lm.util.lock import FolderLock
from hvd_lm.util.units import MIB


def _estimate_bytes(spec: inputs.InputSpec) -> int:
    """Uncompressed size estimate: gzip ISIZE trailer (size mod 2**32), at least 3x on disk."""
    if not spec.compressed:
        return spec.size
    isize = 0
    with contextlib.suppress(OSError), open(spec.path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        isize = int.from_bytes(f.read(4), "little")
    return max(isize, 3 * spec.size)


def _summary(manifest: dict, out: Path) -> dict:
    """The manifest without its shard lists, with per-split totals and ``output``."""
    return dict(manifest, output=str(out), splits={
        k: {"shards": len(v["shards"]), "documents": v["documents"], "tokens": v["tokens"]}
        for k, v in manifest["splits"].items()})


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
        inputs.InputError: an input cannot be read as asked.
        hvd_lm.util.lock.FolderBusyError: another live ``prepare`` is writing ``cfg.out``.
    """
    check_config(cfg)
    ctx = ctx or Context(cfg.workers, cfg.progress)
    out = Path(cfg.out).resolve()
    # one prepare per output folder: rank 0 holds its lock for the whole run (every rank learns
    # whether it got it; the lock object itself stays on rank 0); a folder of other files is
    # refused before the lock touches it
    held: list = []
    ctx.root_call(lambda: (resume.check_out(cfg.out),
                           held.append(FolderLock(out, "prepare output folder"))))
    with held[0] if held else contextlib.nullcontext():  # released however the run ends
        return _prepare(cfg, ctx, out)


@dataclass
class _Run:
    """What the phases of one :func:`prepare` share: settings, ranks, folders, the resolved
    inputs with their names and fingerprints, and the layout of the work (``units``: (input,
    stripe, stripes) each; ``n_buckets`` = ``2**bits`` buckets; ``per_proc``: bytes of memory
    per process)."""

    cfg: PrepareConfig
    ctx: Context
    out: Path
    work: Path
    specs: list
    names: list
    config_fp: str
    inputs_fp: str
    units: list
    bits: int
    n_buckets: int
    per_proc: int


def _plan_run(cfg: PrepareConfig, ctx: Context, out: Path) -> _Run:
    """Resolve the inputs (rank 0), fingerprint them, and cut the work: units are whole files,
    or stripes of line-format files when processes outnumber files; enough buckets that one fits
    a third of a process's memory budget and every process gets several."""
    specs = ctx.root_call(lambda: [sniff.resolve_input(p, cfg.format, cfg.text_field,
                                                       cfg.tar_members) for p in cfg.inputs])
    config_fp, inputs_fp = resume.fingerprints(cfg, specs)
    slots = ctx.slots
    stripes = [slots if len(specs) < slots and s.format in inputs.LINE_FORMATS else 1
               for s in specs]
    units = [(i, k, n) for i, n in enumerate(stripes) for k in range(n)]
    per_proc = cfg.max_memory_mb * MIB // cfg.workers
    est = sum(_estimate_bytes(s) for s in specs)
    # a full disk names the folder and what the job needs there: the map spills and the sorted
    # buckets (each about the corpus) beside the shards (about the corpus again)
    ctx.disk = (out, 3 * est)
    bits = min(MAX_BUCKET_BITS, max(math.ceil(math.log2(max(1, 4 * slots))),
                                    math.ceil(math.log2(max(1.0, 1.2 * est / (per_proc / 3))))))
    return _Run(cfg, ctx, out, out / resume.WORK_DIR, specs,
                resume.input_names([s.path for s in specs]), config_fp, inputs_fp, units, bits,
                1 << bits, per_proc)


def _finished(run: _Run, prefix: str, n: int) -> set:
    """Which of the ``n`` units (``prefix`` ``map/u``) or buckets (``sorted/b``) an earlier run
    finished (rank 0 looks, every rank learns)."""
    return run.ctx.root_call(lambda: {i for i in range(n)
                                      if (run.work / f"{prefix}{i:05d}").is_dir()})


def _map(run: _Run) -> None:
    """Phase 1 on every rank: the units not finished by an earlier run."""
    done = _finished(run, "map/u", len(run.units))
    tasks = [MapTask(unit=u, spec=run.specs[i], stripe=k, n_stripes=n, work=str(run.work),
                     bits=run.bits, cfg=run.cfg, buffer_bytes=max(1 * MIB, run.per_proc // 4),
                     max_doc_bytes=run.per_proc // DOC_BUDGET_SHARE)
             for u, (i, k, n) in enumerate(run.units) if u not in done]
    run.ctx.run(map_unit, tasks, desc="read", weight=lambda t: t.spec.size)


def _sort(run: _Run) -> None:
    """Phase 2 on every rank: the buckets not finished by an earlier run."""
    done = _finished(run, "sorted/b", run.n_buckets)
    tasks = [SortTask(bucket=b, bits=run.bits, work=str(run.work), units=len(run.units),
                      budget=max(1 * MIB, run.per_proc // 3), dedup=run.cfg.dedup)
             for b in range(run.n_buckets) if b not in done]
    run.ctx.run(sort_bucket, tasks, desc="sort")


def _plan(run: _Run) -> tuple:
    """Phase 3 (rank 0): the map and sort counters, the documents per split and the shard plan.

    Returns:
        (UnitStats, duplicates dropped, documents per split, [ShardPlan]).
    Raises:
        PrepareError: no document survived the filters (the counts say why).
    """
    cfg, work = run.cfg, run.work
    stats = UnitStats()
    for u in range(len(run.units)):
        d = json.loads((work / "map" / f"u{u:05d}" / "stats.json").read_text())
        stats.merge(UnitStats(**d))
    bstats = [json.loads((work / "sorted" / f"b{b:05d}" / "stats.json").read_text())
              for b in range(run.n_buckets)]
    n_docs = sum(b["documents"] for b in bstats)
    if n_docs == 0:
        shutil.rmtree(work, ignore_errors=True)  # nothing worth resuming
        raise PrepareError(
            f"no documents to write: {stats.records} records read, {stats.too_short} "
            f"shorter than --min-chars {cfg.min_chars}, {stats.bad_records} bad, "
            f"{stats.blank_lines} blank lines (inputs: {', '.join(cfg.inputs)})")
    dups = sum(b["duplicates"] for b in bstats)
    try:
        counts = split_counts(n_docs, cfg.split)
    except PrepareError as e:
        shutil.rmtree(work, ignore_errors=True)  # nothing worth resuming either
        raise PrepareError(f"{e}; {stats.records} records read, {dups} duplicates dropped, "
                           f"{stats.too_short} shorter than --min-chars {cfg.min_chars}") from None
    return stats, dups, counts, plan_shards(work, run.n_buckets, counts, cfg.shard_size)


def _write(run: _Run, plans: list) -> list:
    """Phase 4 on every rank: every shard of the plan; [(sha256, kept)] in plan order."""
    attrs = {"tokenizer": TOKENIZER_NAME, "source_files": run.names, "config_sha256": run.config_fp}
    tasks = [WriteTask(plan=p, out=str(run.out), work=str(run.work), attrs=attrs,
                       compression=run.cfg.compression, resume=run.cfg.resume) for p in plans]
    return run.ctx.run(write_task, tasks, desc="write", weight=lambda w: w.plan.tokens)


def _finish(run: _Run, plans: list, results: list, stats: UnitStats, dups: int, counts: dict,
            seconds: dict, t0: float) -> dict:
    """Phase 5 (rank 0, last): remove shards of an earlier, larger run, write the manifest,
    remove the work directory; returns the summary."""
    cfg, out, specs = run.cfg, run.out, run.specs
    planned = {p.file for p in plans}
    for p in out.iterdir():
        if resume.SHARD_NAME.match(p.name) and p.name not in planned:
            p.unlink()  # left by an earlier, larger run
    entries = {s: [] for s in shards.SPLITS}
    for p, (digest, _) in zip(plans, results):
        entries[p.split].append(manifests.manifest_entry(p.file, p.tokens, p.documents, digest))
    elapsed = now() - t0
    settings = resume.shard_settings(cfg)
    counters = {k: v for k, v in asdict(stats).items() if k != "bad_samples"}
    counters.update(duplicates=dups, documents=sum(counts.values()),
                    tokens=sum(p.tokens for p in plans), shards_kept=sum(k for _, k in results))
    meta = {
        "created_by": "hvd_lm data_prep prepare", "command": list(cfg.command),
        "config_sha256": run.config_fp, "inputs_sha256": run.inputs_fp,
        **{k: v for k, v in settings.items() if k != "tokenizer"},
        "split_ratios": dict(zip(shards.SPLITS, settings["split"])), "split_documents": counts,
        "inputs": [{"path": s.path, "name": name, "bytes": s.size,
                    "gzip": s.compressed, "format": s.format,
                    "format_source": s.format_source, "text_field": s.text_field,
                    "field_source": s.field_source} for name, s in zip(run.names, specs)],
        "versions": {"hvd_lm": hvd_lm.__version__, "h5py": h5py.__version__,
                     "hdf5": h5py.version.hdf5_version, "numpy": np.__version__,
                     "python": platform.python_version()},
        "counters": counters, "bad_samples": [f"{p}:{n}: {r}" for p, n, r in stats.bad_samples],
        "run": {"world_size": run.ctx.size, "workers": cfg.workers,
                "max_memory_mb": cfg.max_memory_mb, "buckets": run.n_buckets,
                "units": len(run.units), "elapsed_s": round(elapsed, 3),
                "phase_s": {k: round(v, 3) for k, v in seconds.items()},
                "mb_per_s": round(stats.bytes_in / 1e6 / max(elapsed, 1e-9), 2)},
    }
    manifest = manifests.build_manifest(entries, TOKENIZER_NAME, **meta)
    manifests.write_manifest(out, manifest)
    if not cfg.keep_work:
        shutil.rmtree(run.work, ignore_errors=True)
    return _summary(manifest, out)


def _prepare(cfg: PrepareConfig, ctx: Context, out: Path) -> dict:
    """:func:`prepare` once the output folder is locked: the phases in order."""
    t0 = now()
    run = _plan_run(cfg, ctx, out)
    layout = {"units": run.units, "bits": run.bits}  # in state.json: resume reuses work cut alike

    # the output folder (rank 0): claimed, earlier work kept or dropped; a finished run with the
    # same settings and inputs whose shards all verify is the result as it stands
    complete = ctx.root_call(lambda: resume.setup_output(cfg, run.config_fp, run.inputs_fp,
                                                         layout))
    if complete is not None:
        if not verify_directory(out, ctx)[1]:  # every shard verifies
            return dict(_summary(complete, out), resumed_complete=True)
        # some shard fails: redo the run, keeping the shards that verify
        ctx.root_call(lambda: resume.setup_output(cfg, run.config_fp, run.inputs_fp, layout,
                                                  accept_complete=False))

    seconds = {}
    for name, phase in (("read", _map), ("sort", _sort)):  # phases 1-2: map, sort (every rank)
        t = now()
        phase(run)
        seconds[name] = now() - t
    stats, dups, counts, plans = ctx.root_call(lambda: _plan(run))  # phase 3: plan (rank 0)
    t = now()
    results = _write(run, plans)  # phase 4: write (every rank)
    seconds["write"] = now() - t
    # phase 5: manifest (rank 0, last)
    return ctx.root_call(lambda: _finish(run, plans, results, stats, dups, counts, seconds, t0))


def format_summary(summary: dict) -> str:
    """Human-readable summary of :func:`prepare`'s result (documents, bytes in/out, drops,
    MB/s, inferred formats, bad-record samples)."""
    c, run = summary["counters"], summary.get("run", {})
    lines = [f"prepared {summary['output']}"]
    if summary.get("resumed_complete"):
        lines.append("  already complete: every shard verified, nothing rewritten")
    lines += [
        f"  inputs: {len(summary['inputs'])} file(s)",
        *[f"    {i['name']}: {i['format']} ({i['format_source']})"
          + (f", {'members' if i['format'] == 'tar' else 'text field'} {i['text_field']!r} "
             f"({i['field_source']})" if i["text_field"] else "")
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
    if c.get("members_left_out"):
        lines.append(f"  tar members left out: {c['members_left_out']:,} (aclImdb's URL lists "
                     "and imdbEr.txt, never documents whatever --tar-members says; without "
                     "--tar-members, its held-out test/ reviews too)")
    sizes = {name: split["tokens"] for name, split in summary.get("splits", {}).items()}
    for name, split in summary.get("splits", {}).items():
        if name != "train" and 0 < split["tokens"] < shards.SMALL_SPLIT_BYTES:
            lines.append(f"  warning: split {name} holds {split['documents']:,} document(s), "
                         f"{split['tokens']:,} bytes: too few to measure BPC on (under "
                         f"{shards.SMALL_SPLIT_BYTES // 1024} KiB); "
                         + shards.small_split_advice(name, sizes, summary.get("split_ratios")))
    if c.get("shards_kept") and not summary.get("resumed_complete"):
        lines.append(f"  resumed: {c['shards_kept']} verified shard(s) kept")
    if summary.get("bad_samples"):
        lines.append("  first bad records:")
        lines += [f"    {s}" for s in summary["bad_samples"]]
    return "\n".join(lines)
