"""``bench``: throughput of ``prepare`` against the raw read rate of the same input.

The real Amazon text in ``../shared/data/amazon`` is too small to time, so the benchmark builds
a synthetic scale-up: every real review (all five sources, read with :mod:`data_prep.readers`)
becomes a JSON line ``{"reviewText": ..., "source": ...}``, and the
lines are repeated, each round in a new seeded shuffle, into one gzip'd JSON-lines file of at
least ``--size-mb`` MB (uncompressed; default 200). It then measures, in one run:

* **raw**: inflating the file and splitting it into lines in one thread with nothing else,
  the ceiling of any reader of this file. Measured two ways, ``for line in gzip.open(path,
  "rb")`` and ``zlib.decompressobj`` with 1 MiB reads + ``bytes.split`` (faster: no
  ``GzipFile`` layers); raw is the faster of the two, so the ratio is not flattered by a
  slow baseline;
* **prepare** with each ``--workers`` count (default 1 and 2), end to end (read, sort, write,
  manifest), as MB/s of uncompressed input;
* the ratio (MB/s per worker) / raw;
* for context, the raw rate per process when that many processes inflate the file at once (how
  far the machine itself scales).

MB are 10**6 bytes. De-duplication is off by default (``--dedup`` turns it on), so every
repeated document flows through the sort and into the shards, the heavier case.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
import random
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter as now

from benchmarks.harness import save_json
from data_prep import readers, sniff
from data_prep.gzip_blocks import _inflate_blocks
from data_prep.parallel import Context
from data_prep.pipeline import prepare
from data_prep.settings import PrepareConfig
from hvd_lm.options import Command, option
from hvd_lm.util.atomic import atomic_path, write_text

#: Where the shared data lives beside the repository.
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "amazon"
_PATTERNS = ("*.json.gz", "*.review.gz", "*.tsv.gz", "*.csv.gz")


def real_documents(data_dir: Path) -> list:
    """``(source file name, text)`` of every review in the shared Amazon files, in file order.

    Raises:
        FileNotFoundError: no such directory or no review files in it.
    """
    files = sorted(p for pat in _PATTERNS for p in Path(data_dir).rglob(pat))
    if not files:
        raise FileNotFoundError(f"{data_dir}: no Amazon review files ({', '.join(_PATTERNS)})")
    docs = []
    for p in files:
        spec = sniff.resolve_input(p)
        docs.extend((p.name, text) for _, text in readers.read_documents(spec))
    return docs


def build_corpus(data_dir: Path, workdir: Path, size_mb: float, seed: int) -> tuple:
    """Write (or reuse) the benchmark corpus ``workdir/bench-{size}mb-seed{seed}.jsonl.gz``.

    Returns:
        ``(path, info)`` with ``info`` = records, uncompressed bytes, distinct documents,
        whether it was reused.
    """
    path = workdir / f"bench-{size_mb:g}mb-seed{seed}.jsonl.gz"
    meta_path = path.with_suffix(".meta.json")
    if path.exists() and meta_path.exists():
        info = json.loads(meta_path.read_text())
        return path, dict(info, reused=True)
    docs = real_documents(data_dir)
    lines = [(json.dumps({"reviewText": t, "source": s}) + "\n").encode() for s, t in docs]
    rng = random.Random(seed)
    target = int(size_mb * 1e6)
    written = records = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as raw, gzip.GzipFile(
            filename="", mode="wb", compresslevel=6, fileobj=raw, mtime=0) as gz:
        while written < target:
            order = list(range(len(lines)))
            rng.shuffle(order)
            for i in order:
                gz.write(lines[i])
                written += len(lines[i])
                records += 1
                if written >= target:
                    break
    info = {"records": records, "bytes": written, "distinct_documents": len({t for _, t in docs}),
            "real_documents": len(docs), "gzip_bytes": path.stat().st_size, "seed": seed}
    write_text(meta_path, json.dumps(info))
    return path, dict(info, reused=False)


def raw_rate(path: Path) -> tuple:
    """Inflate ``path`` and iterate over its lines (``for line in gzip.open(path, "rb")``), one
    thread, nothing else: the ceiling of any reader of this file. Returns (MB/s, bytes,
    seconds)."""
    t = now()
    with gzip.open(path, "rb") as f:
        n = sum(map(len, f))  # line by line
    dt = now() - t
    return n / 1e6 / dt, n, dt


def raw_rate_zlib(path: Path) -> tuple:
    """Inflate ``path`` as ``prepare``'s reader does (:func:`data_prep.gzip_blocks._inflate_blocks`:
    ``zlib.decompressobj``, 1 MiB reads, no ``GzipFile`` layers; concatenated members followed)
    and split the output into lines (``bytes.split``, iterating over them), one thread, nothing
    else: the same work as :func:`raw_rate` done the fastest simple way. Returns (MB/s, bytes,
    seconds)."""
    n = 0
    t = now()
    tail = b""
    for block in _inflate_blocks(str(path), 1 << 20, None):
        lines = (tail + block).split(b"\n")
        tail = lines.pop()
        for line in lines:
            n += len(line) + 1
    n += len(tail)
    dt = now() - t
    return n / 1e6 / dt, n, dt


def parallel_raw_rate(path: Path, processes: int) -> float:
    """Mean per-process raw rate (MB/s) when ``processes`` processes each inflate and iterate the
    whole file at the same time: how far the machine itself scales (shared cores, memory
    bandwidth), the ceiling per worker at that parallelism."""
    with ProcessPoolExecutor(processes, mp_context=mp.get_context("fork")) as ex:
        rates = [rate for rate, _, _ in ex.map(raw_rate, [path] * processes)]
    return sum(rates) / len(rates)


def pipeline_rate(path: Path, workers: int, out: Path, dedup: bool,
                  max_memory_mb: int) -> tuple:
    """Run ``prepare`` on ``path`` with ``workers`` processes. Returns (MB/s, summary)."""
    if out.exists():
        shutil.rmtree(out)
    cfg = PrepareConfig(inputs=[str(path)], out=str(out), workers=workers, dedup=dedup,
                        max_memory_mb=max_memory_mb, progress=False,
                        command=["bench", f"--workers={workers}"])
    t = now()
    summary = prepare(cfg, Context(workers, progress=False, use_mpi=False))
    dt = now() - t
    shutil.rmtree(out)
    return summary["counters"]["bytes_in"] / 1e6 / dt, summary


def run_bench(cfg: BenchPrepareConfig, echo=print) -> dict:
    """Build the corpus and measure raw and pipeline rates (see the module docstring); ``echo``
    prints each line.

    Returns:
        ``{"corpus": info, "raw_mb_s": float, "runs": [{"workers", "mb_s", "per_worker_mb_s",
        "ratio", "parallel_raw_mb_s", "phase_s"}]}``; ``ratio`` = per-worker MB/s / raw MB/s.
    """
    data_dir, seed, dedup = Path(cfg.data), cfg.seed, cfg.dedup
    own_dir = not cfg.workdir
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="hvd_lm_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        echo(f"building corpus in {workdir} from {data_dir} ...")
        path, info = build_corpus(data_dir, workdir, cfg.size_mb, seed)
        echo(f"corpus: {path}: {info['bytes'] / 1e6:.1f} MB uncompressed, "
             f"{info['gzip_bytes'] / 1e6:.1f} MB gzip, {info['records']:,} JSON lines"
             + (" (reused)" if info["reused"] else ""))
        echo(f"  synthetic scale-up: the {info['real_documents']:,} real Amazon reviews of the "
             f"shared data repeated with a seeded shuffle (seed {seed}); not new text")
        raw_gz, _, raw_gz_s = raw_rate(path)
        raw_zl, _, raw_zl_s = raw_rate_zlib(path)
        raw = max(raw_gz, raw_zl)
        echo(f"raw read (1 thread, inflate + split lines, nothing else): gzip.open iteration "
             f"{raw_gz:.1f} MB/s ({raw_gz_s:.2f} s); zlib.decompressobj + bytes.split "
             f"{raw_zl:.1f} MB/s ({raw_zl_s:.2f} s); raw = the faster, {raw:.1f} MB/s")
        runs = []
        for w in cfg.workers:
            par = raw if w == 1 else parallel_raw_rate(path, w)
            if w > 1:
                echo(f"raw read in {w} processes at once: {par:.1f} MB/s each "
                     f"({w * par / raw:.2f}x the 1-process total: the machine's own scaling)")
            rate, summary = pipeline_rate(path, w, workdir / f"out-w{w}", dedup,
                                          cfg.max_memory_mb)
            per = rate / w
            run = {"workers": w, "mb_s": round(rate, 2), "per_worker_mb_s": round(per, 2),
                   "ratio": round(per / raw, 3), "parallel_raw_mb_s": round(par, 2),
                   "phase_s": summary["run"]["phase_s"],
                   "documents": summary["counters"]["documents"]}
            runs.append(run)
            echo(f"prepare --workers {w}: {rate:.1f} MB/s, {per:.1f} MB/s per worker = "
                 f"{per / raw:.2f} x raw (target >= 0.5); phases (s): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in run["phase_s"].items()))
        echo(f"(dedup {'on' if dedup else 'off'}; {os.cpu_count()} CPU cores; MB = 10**6 bytes)")
        return {"corpus": dict(info), "corpus_path": str(path),
                "raw_mb_s": round(raw, 2), "raw_gzip_open_mb_s": round(raw_gz, 2),
                "raw_zlib_mb_s": round(raw_zl, 2), "runs": runs, "dedup": dedup,
                "cpu_count": os.cpu_count()}
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class BenchPrepareConfig:
    """``python -m benchmarks prepare`` / ``python -m benchmarks prepare``."""

    data: str = option(str(DEFAULT_DATA), "shared Amazon data directory")
    workdir: str = option("", "keep the corpus here and reuse it ('' = a temporary directory, "
                          "removed afterwards)")
    size_mb: float = option(200.0, "corpus size, MB", gt=0)
    seed: int = option(0, "shuffle seed of the corpus", ge=0)
    workers: list[int] = option(default_factory=lambda: [1, 2], help="worker counts to time, "
                                "e.g. 1 2", nargs="+", ge=1, required=True)
    dedup: bool = option(False, "de-duplicate as prepare does by default (off here so every "
                         "byte is sorted and written)", switch=True)
    max_memory_mb: int = option(1024, "memory budget per rank, MiB", ge=1)
    json: str = option("", "also write the results as JSON to FILE", metavar="FILE")


def bench_prepare_command(cfg: BenchPrepareConfig) -> int:
    """Run :func:`run_bench` with the parsed settings (missing data: one ERROR line, exit 1)."""
    save_json(cfg.json, run_bench(cfg), indent=1)
    return 0


BENCH_PREPARE = Command(
    BenchPrepareConfig, bench_prepare_command,
    description="Build a >= --size-mb MB gzip'd JSON-lines corpus by repeating the shared Amazon "
    "reviews with a seeded shuffle, then print the raw inflate+read rate and prepare's MB/s for "
    "each --workers count, with the per-worker/raw ratio.")
