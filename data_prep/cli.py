"""Command line of ``data_prep``: ``prepare``, ``verify`` and ``bench``.

:func:`add_subcommands` registers the three sub-commands on any argparse sub-parser collection;
``python -m data_prep`` (:func:`build_parser`) and ``hvd-lm`` both use it. Each sub-command's
``func`` takes the parsed ``argparse.Namespace`` and returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_EPILOG_PREPARE = """\
examples:
  python -m data_prep prepare ../shared/data/amazon/mcauley2014_5core/*.json.gz --out data/amazon
  python -m data_prep prepare a.csv.gz b.tsv.gz --out data/x --split 98,1,1 \
      --shard-size 16M --workers 2
  mpirun -np 4 python -m data_prep prepare FILES... --out /shared/fs/data   (ranks share the work)
exit status: 0 done, 1 error (message names file and line), 130 interrupted (rerun with --resume)
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _size(text: str) -> int:
    from data_prep.pipeline import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _split(text: str) -> tuple:
    from data_prep.pipeline import parse_split

    try:
        return parse_split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_prepare(args: argparse.Namespace) -> int:
    """``prepare``: run :func:`data_prep.pipeline.prepare`; print the summary on rank 0."""
    from data_prep.dist import Context, PhaseError
    from data_prep.pipeline import PrepareConfig, PrepareError, format_summary, prepare
    from data_prep.readers import BadRecord, InputError

    cfg = PrepareConfig(
        inputs=list(args.inputs), out=args.out, format=args.format, text_field=args.text_field,
        normalize=args.normalize, min_chars=args.min_chars, dedup=not args.no_dedup,
        seed=args.seed, split=args.split, shard_size=args.shard_size,
        compression=args.compression, workers=args.workers, max_memory_mb=args.max_memory_mb,
        resume=args.resume, overwrite=args.overwrite, skip_bad=args.skip_bad,
        utf8_errors=args.utf8_errors, keep_work=args.keep_work, progress=not args.no_progress,
        command=list(sys.argv))
    ctx = None
    try:
        ctx = Context(cfg.workers, cfg.progress)
        summary = prepare(cfg, ctx)
    except (PrepareError, PhaseError, InputError, BadRecord, OSError, ValueError) as e:
        if ctx is None or ctx.is_root:
            print(f"data_prep prepare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("data_prep prepare: interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130
    if ctx.is_root:
        print(format_summary(summary))
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify DIR``: exit 0 when every shard matches the manifest, else print each mismatch
    and exit 1."""
    from data_prep.dist import Context
    from data_prep.verify import verify_directory

    ctx = Context(args.workers, progress=not args.no_progress)
    checked, problems = verify_directory(args.directory, ctx)
    if not ctx.is_root:
        return 1 if problems else 0
    for p in problems:
        print(f"MISMATCH {p}")
    if problems:
        print(f"verify: {len(problems)} problem(s) in {args.directory}", file=sys.stderr)
        return 1
    print(f"verify: {len(checked)} shard(s) in {args.directory} match the manifest "
          f"({sum(s.tokens for s in checked):,} tokens, "
          f"{sum(s.documents for s in checked):,} documents)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``bench``: build the scaled-up corpus and print raw vs pipeline MB/s."""
    from data_prep.bench import run_bench

    try:
        result = run_bench(data_dir=Path(args.data), workdir=args.workdir, size_mb=args.size_mb,
                           seed=args.seed, workers=tuple(args.workers), dedup=args.dedup,
                           max_memory_mb=args.max_memory_mb)
    except FileNotFoundError as e:
        print(f"data_prep bench: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def add_subcommands(subparsers, bench_subparsers=None, bench_name: str = "bench") -> None:
    """Register ``prepare``, ``verify`` and ``bench`` on ``subparsers`` (the object returned by
    ``ArgumentParser.add_subparsers``); each sets ``func`` to a ``(Namespace) -> int``.

    ``hvd-lm`` passes its ``bench`` group as ``bench_subparsers`` with ``bench_name="prepare"``,
    so the benchmark is ``hvd-lm bench prepare`` there and ``python -m data_prep bench`` here."""
    from data_prep.bench import DEFAULT_DATA
    from data_prep.readers import FORMATS
    from hvd_lm.shards import COMPRESSIONS

    p = subparsers.add_parser(
        "prepare", help="turn review text files into shuffled, split, checksummed HDF5 shards",
        description="Read review text (JSON lines, loose JSON, CSV, TSV, Blitzer .review, plain "
        "text; gzip or not), drop exact duplicates and short documents, shuffle by --seed, "
        "split, and write byte-level token shards plus manifest.json. See docs/data_prep.md.",
        epilog=_EPILOG_PREPARE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="input files (.gz or not)")
    p.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="input format of every INPUT (default: inferred from each file name)")
    p.add_argument("--text-field", default=None,
                   help="JSON key / CSV column / .review tag holding the text (default: "
                   "reviewText, review_body, Text, ... whichever the file has; review_text)")
    p.add_argument("--normalize", action="store_true",
                   help="collapse whitespace runs to one space and strip (Radford et al. 2017); "
                   "off by default, recorded in the manifest")
    p.add_argument("--min-chars", type=int, default=1,
                   help="drop documents with fewer characters (after --normalize; default 1)")
    p.add_argument("--no-dedup", action="store_true", help="keep exact duplicates")
    p.add_argument("--seed", type=int, default=1234, help="shuffle seed (default 1234)")
    p.add_argument("--split", type=_split, default=(1000.0, 1.0, 1.0), metavar="TRAIN,VAL,TEST",
                   help="split ratios (default 1000,1,1 as in sentiment-discovery)")
    p.add_argument("--shard-size", type=_size, default=64 << 20, metavar="BYTES",
                   help="target bytes per shard, suffixes K/M/G (default 64M)")
    p.add_argument("--compression", choices=COMPRESSIONS, default="none",
                   help="HDF5 compression of the datasets (default none)")
    p.add_argument("--workers", type=_positive_int, default=1,
                   help="local worker processes per rank (default 1)")
    p.add_argument("--max-memory-mb", type=_positive_int, default=1024,
                   help="memory budget per rank in MiB, shared by its workers (default 1024)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue an interrupted run in --out: keep finished work and verified "
                   "shards, redo the rest")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run in --out")
    p.add_argument("--skip-bad", action="store_true",
                   help="count and sample malformed records instead of stopping at the first")
    p.add_argument("--utf8-errors", choices=("replace", "strict"), default="replace",
                   help="invalid UTF-8: replace with U+FFFD and count (default), or treat the "
                   "record as malformed")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the work directory (OUT/.prepare) after success")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--summary-json", default=None, metavar="FILE",
                   help="also write the summary as JSON to FILE")
    p.set_defaults(func=cmd_prepare)

    v = subparsers.add_parser(
        "verify", help="re-check a shard directory against its manifest",
        description="Recompute every shard's SHA-256 and check token/document counts, structure "
        "and format_version against manifest.json. Exit 1 and print each mismatch if any.")
    v.add_argument("directory", help="directory holding manifest.json")
    v.add_argument("--workers", type=_positive_int, default=1, help="parallel processes")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(func=cmd_verify)

    b = (bench_subparsers or subparsers).add_parser(
        bench_name, help="measure prepare's MB/s against the raw read rate",
        description="Build a >= --size-mb MB gzip'd JSON-lines corpus by repeating the shared "
        "Amazon reviews with a seeded shuffle, then print the raw inflate+read rate and "
        "prepare's MB/s for each --workers count, with the per-worker/raw ratio.")
    b.add_argument("--data", default=str(DEFAULT_DATA),
                   help=f"shared Amazon data directory (default {DEFAULT_DATA})")
    b.add_argument("--workdir", type=Path, default=None,
                   help="keep the corpus here and reuse it (default: a temporary directory, "
                   "removed afterwards)")
    b.add_argument("--size-mb", type=float, default=200, help="corpus size, MB (default 200)")
    b.add_argument("--seed", type=int, default=0, help="shuffle seed of the corpus")
    b.add_argument("--workers", type=_positive_int, nargs="+", default=[1, 2],
                   help="worker counts to time (default 1 2)")
    b.add_argument("--dedup", action="store_true",
                   help="de-duplicate as prepare does by default (off here so every byte is "
                   "sorted and written)")
    b.add_argument("--max-memory-mb", type=_positive_int, default=1024)
    b.add_argument("--json", default=None, metavar="FILE", help="also write results as JSON")
    b.set_defaults(func=cmd_bench)


def build_parser(prog: str = "python -m data_prep") -> argparse.ArgumentParser:
    """The ``python -m data_prep`` parser: the sub-commands of :func:`add_subcommands`."""
    parser = argparse.ArgumentParser(prog=prog, description="Prepare, verify and benchmark "
                                     "byte-level token shards of review text.")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv=None) -> int:
    """Entry point of ``python -m data_prep``; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
