"""The ``hvd-lm`` command line: one argparse parser, one sub-command per concept.

Each sub-command lives in the module that owns its concept; this file only wires them up.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_check_build(args: argparse.Namespace) -> int:
    from hvd_lm.stack import check_build

    try:
        info = check_build(need_nccl=True if args.nccl else None)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"hvd-lm check-build: ERROR: {e}", file=sys.stderr)
        return 1
    built = [n for sec in (info.frameworks, info.controllers, info.tensor_operations)
             for n, ok in sec.items() if ok]
    print(f"Horovod {info.version}: built with {', '.join(dict.fromkeys(built))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full ``hvd-lm`` parser (sub-commands register themselves here)."""
    p = argparse.ArgumentParser(prog="hvd-lm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check-build", help="verify Horovod has PyTorch, MPI and Gloo built in")
    c.add_argument("--nccl", action="store_true", help="also require NCCL (default: on CUDA hosts)")
    c.set_defaults(func=_cmd_check_build)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hvd-lm`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
