"""Command line of ``data_prep``: ``prepare`` and ``verify``.

Each command is a :class:`hvd_lm.options.Command`: its settings are one dataclass
(:class:`data_prep.settings.PrepareConfig`, :class:`data_prep.verify.VerifyConfig`) whose flags
and YAML layout come from :mod:`hvd_lm.options`; ``hvd-lm prepare|verify`` (:mod:`hvd_lm.cli`) and
``python -m data_prep`` (:func:`build_parser`) run the same objects.
"""

from __future__ import annotations

import argparse
import json
import sys

from data_prep.inputs import BadRecord, InputError
from data_prep.parallel import Context, PhaseError
from data_prep.pipeline import format_summary, prepare
from data_prep.resume import owned_by_prepare
from data_prep.settings import PrepareConfig, PrepareError
from data_prep.verify import VerifyConfig, verify_directory
from hvd_lm.options import ArgumentParser, Command, error_text
from hvd_lm.util.atomic import write_text
from hvd_lm.util.files import check_output, shown

_EPILOG_PREPARE = """\
examples:
  python -m data_prep prepare ../shared/data/amazon/mcauley2014_5core/*.json.gz --out data/amazon
  python -m data_prep prepare a.csv.gz b.tsv.gz --out data/x --split 98,1,1 \\
      --shard-size 16M --workers 2
  mpirun -np 2 python -m data_prep prepare FILES... --out /shared/fs/data   (ranks share the work)
exit status: 0 done, 1 error (message names file and line), 2 bad settings,
             130 interrupted (rerun with --resume)
"""


def prepare_command(cfg: PrepareConfig) -> int:
    """``prepare``: run :func:`data_prep.pipeline.prepare`; print the summary on rank 0 (errors:
    one line from rank 0, exit 1; interrupted: 130)."""
    cfg.command = list(sys.argv)
    ctx = None
    try:
        if cfg.summary_json:  # before any work: not an input, not a file of --out
            check_output(cfg.summary_json, "--summary-json", *cfg.inputs,
                         writes=[lambda p: owned_by_prepare(p, cfg.out)
                                 and f"{p.name} of --out {shown(cfg.out)}"])
        ctx = Context(cfg.workers, cfg.progress)
        summary = prepare(cfg, ctx)
    except (PrepareError, PhaseError, InputError, BadRecord, OSError, ValueError) as e:
        if ctx is None or ctx.is_root:  # one line: a newline in a path is escaped
            print(f"data_prep prepare: ERROR: {error_text(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("data_prep prepare: interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130
    if ctx.is_root:
        print(format_summary(summary))
        if cfg.summary_json:
            write_text(cfg.summary_json, json.dumps(summary, indent=1) + "\n")
    return 0


def verify_command(cfg: VerifyConfig) -> int:
    """``verify DIR``: exit 0 when every shard matches the manifest, else print each mismatch
    and exit 1."""
    ctx = Context(cfg.workers, progress=cfg.progress)
    checked, problems = verify_directory(cfg.directory, ctx)
    if not ctx.is_root:
        return 1 if problems else 0
    for p in problems:
        print(f"MISMATCH {p}")
    if problems:
        print(f"verify: {len(problems)} problem(s) in {cfg.directory}", file=sys.stderr)
        return 1
    print(f"verify: {len(checked)} shard(s) in {cfg.directory} match the manifest "
          f"({sum(s.tokens for s in checked):,} tokens, "
          f"{sum(s.documents for s in checked):,} documents)")
    return 0


PREPARE = Command(
    PrepareConfig, prepare_command, epilog=_EPILOG_PREPARE,
    description="Read review text (JSON lines, loose JSON, CSV, TSV, Blitzer .review, plain "
    "text; gzip or not), drop exact duplicates and short documents, shuffle by --seed, split, "
    "and write byte-level token shards plus manifest.json. See docs/data_prep.md.")
VERIFY = Command(
    VerifyConfig, verify_command, config_flag=False,
    description="Recompute every shard's SHA-256 and check token/document counts, structure "
    "and format_version against manifest.json. Exit 1 and print each mismatch.")
#: ``python -m data_prep`` command -> (command, help); ``hvd-lm`` lists the same objects.
COMMANDS = {
    "prepare": (PREPARE, "turn review text files into shuffled, split, checksummed HDF5 shards"),
    "verify": (VERIFY, "re-check a shard directory against its manifest"),
}


def build_parser(prog: str = "python -m data_prep") -> argparse.ArgumentParser:
    """The ``python -m data_prep`` parser: ``prepare``, ``verify``."""
    parser = ArgumentParser(prog=prog, description="Prepare and verify "
                                     "byte-level token shards of review text.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (command, text) in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=text))
        sub.choices[name].set_defaults(command_obj=command)
    return parser


def main(argv=None) -> int:
    """Entry point of ``python -m data_prep``; returns the exit status (2: bad settings)."""
    args = build_parser().parse_args(argv)
    return args.command_obj.invoke(args, f"data_prep {args.command}")
