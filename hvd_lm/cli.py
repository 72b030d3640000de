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


def _cmd_train(args: argparse.Namespace) -> int:
    from hvd_lm.config import from_args
    from hvd_lm.train import train

    try:
        cfg = from_args(args)
    except ValueError as e:
        print(f"hvd-lm train: ERROR: {e}", file=sys.stderr)
        return 2
    summary = train(cfg)
    return 0 if summary["stop"] in ("done", "signal") else 1


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from hvd_lm import distributed as dist
    from hvd_lm.checkpoint import load_model
    from hvd_lm.data import RankStreams
    from hvd_lm.evaluate import bpc
    from hvd_lm.shards import load_manifest
    from hvd_lm.train import resolve_device

    ctx = dist.init()
    device = resolve_device(args.device, ctx.local_rank)
    model, ck = load_model(args.checkpoint, map_location=device)
    seq_len = args.seq_len or ck["config"]["data"]["seq_len"]
    streams = RankStreams(load_manifest(args.shards), args.split, ctx.rank, ctx.size,
                          args.batch_size, seq_len, shuffle_shards=False, max_bytes=args.max_bytes,
                          verify=True)
    with torch.no_grad():
        value, chars = bpc(model, streams, device, args.precision)
    if ctx.is_root:
        import json

        sys.stdout.write(json.dumps({"checkpoint": str(args.checkpoint), "split": args.split,
                                     "bpc": value, "chars": chars, "step": ck["step"],
                                     "world_size": ctx.size}) + "\n")  # one write: one line
        sys.stdout.flush()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full ``hvd-lm`` parser (sub-commands register themselves here)."""
    from hvd_lm.config import add_arguments

    p = argparse.ArgumentParser(
        prog="hvd-lm", description="Horovod/MPI data-parallel training of byte-level mLSTM "
        "language models on review text, and sentiment transfer (see README.md).")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check-build", help="verify Horovod has PyTorch, MPI and Gloo built in")
    c.add_argument("--nccl", action="store_true", help="also require NCCL (default: on CUDA hosts)")
    c.set_defaults(func=_cmd_check_build)

    t = sub.add_parser("train", help="train the LM (under horovodrun/mpirun, or one process)",
                       description="Flags override --config; each names its YAML field and "
                       "default in brackets.")
    add_arguments(t)
    t.set_defaults(func=_cmd_train)

    e = sub.add_parser("eval", help="bits per character of a checkpoint on a shard split")
    e.add_argument("checkpoint", help="checkpoint file or run directory (its latest)")
    e.add_argument("shards", help="shard directory (with manifest.json)")
    e.add_argument("--split", default="val", help="manifest split")
    e.add_argument("--batch-size", type=int, default=16, help="rows per rank")
    e.add_argument("--seq-len", type=int, default=0, help="window, bytes (0 = the checkpoint's)")
    e.add_argument("--max-bytes", type=int, default=0, help="evaluate only the first N bytes")
    e.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    e.add_argument("--device", default="auto")
    e.set_defaults(func=_cmd_eval)

    from data_prep.cli import add_subcommands as add_data_prep
    from hvd_lm.demo import add_subcommands as add_demo
    from hvd_lm.launch import add_subcommands as add_launch
    from hvd_lm.transfer import add_subcommands as add_transfer

    bench = sub.add_parser("bench", help="benchmarks: train, allreduce, fusion, prepare")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from hvd_lm.bench import add_bench_subcommands as add_bench_train

    from hvd_lm.bench_allreduce import add_bench_subcommands as add_bench_allreduce
    from hvd_lm.scaling_model import add_subcommands as add_scaling_model

    add_bench_train(bench_sub)
    add_bench_allreduce(bench_sub)
    add_data_prep(sub, bench_subparsers=bench_sub, bench_name="prepare")
    add_transfer(sub)
    add_launch(sub)
    add_scaling_model(sub)
    add_demo(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hvd-lm`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
