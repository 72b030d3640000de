"""``hvd-lm bench train``: training throughput measured side by side in one run.

In one invocation (so that a shared, noisy machine affects every figure alike):

1. the machine's fp32 matmul rate with one thread (``torch.mm`` of 2048^3, best of 5), GFLOP/s;
2. the training step of :mod:`hvd_lm.train` (same model, same window loss, same
   ``clip_and_step``) under ``mpirun -np N`` with Horovod for each N in ``--ranks`` (weak scaling:
   the per-rank batch is fixed), one thread per rank;
3. the same model and data with ``torch.nn.parallel.DistributedDataParallel`` (gloo backend) as the
   peer, at the largest N.

Each configuration runs ``--repeats`` times, interleaved with the others, and the median run is
reported with the spread. It prints chars/s per rank and in total, weak-scaling efficiency (chars/s at N / (N x chars/s at
1)), model FLOPs per char (:meth:`LanguageModel.flops_per_char`), achieved GFLOP/s per rank and its
fraction of the measured matmul rate, the share of step time Horovod waited on the allreduce, and
the Horovod/DDP throughput ratio. ``--json FILE`` saves everything.

The workers (``python -m hvd_lm.bench worker ...``) train on seeded random bytes (throughput does
not depend on the values) or, with ``--shards``, on a shard directory's train split.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from hvd_lm.model import LanguageModel, ModelConfig


def matmul_gflops(n: int = 2048, repeats: int = 5, threads: int = 1) -> float:
    """Best-of-``repeats`` fp32 ``torch.mm`` rate for n x n x n with ``threads`` threads, GFLOP/s."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(old)
    return 2 * n ** 3 / best / 1e9


# ---- worker (one rank) -------------------------------------------------------------------------

def _worker(args: argparse.Namespace) -> int:
    from hvd_lm import distributed as dist
    from hvd_lm.data import Batch
    from hvd_lm.train import window_nll

    torch.set_num_threads(args.threads)
    if args.backend == "horovod":
        ctx = dist.init(args.fusion_threshold_mb, args.cycle_time_ms)
        rank, size = ctx.rank, ctx.size
    else:
        import torch.distributed as tdist

        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
        size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        tdist.init_process_group("gloo", rank=rank, world_size=size)
    torch.manual_seed(0)
    cfg = ModelConfig(cell=args.cell, hidden_size=args.hidden_size, embed_dim=args.embed_dim)
    model = LanguageModel(cfg)
    device = torch.device("cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    if args.backend == "horovod":
        opt = dist.distributed_optimizer(opt, model, args.compression)
        dist.broadcast_state(model)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)

    B, T = args.batch_size, args.seq_len
    if args.shards:
        from hvd_lm.data import RankStreams
        from hvd_lm.shards import load_manifest

        streams = RankStreams(load_manifest(args.shards), "train", rank, size, B, T)
        batches = [streams.window(0, i % streams.steps_per_epoch)
                   for i in range(args.warmup + args.steps)]
    else:
        g = torch.Generator().manual_seed(1000 + rank)
        data = torch.randint(0, 256, (args.warmup + args.steps, B, T + 1), generator=g)
        batches = [Batch(d[:, :-1].contiguous(), d[:, 1:].contiguous(),
                         torch.zeros(B, T, dtype=torch.bool), B * T) for d in data]

    state = model.init_state(B, device)
    times, waits = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        if args.backend == "horovod":
            nats, state = window_nll(net, batch, state, device, "fp32")
            (nats / batch.chars).backward()
            _, _, wait = dist.clip_and_step(opt, params, 1.0)
        else:
            nats, state = window_nll(net, batch, state, device, "fp32")
            (nats / batch.chars).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            wait = 0.0
        opt.zero_grad()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            waits.append(wait)
    step_time = sum(times) / len(times)
    per_rank = B * T / step_time
    if args.backend == "horovod":
        tot, wait_sum, time_sum = dist.allreduce_sum([per_rank, sum(waits), sum(times)], "bench")
    else:
        import torch.distributed as tdist

        t = torch.tensor([per_rank, 0.0, sum(times)], dtype=torch.float64)
        tdist.all_reduce(t)
        tot, wait_sum, time_sum = t.tolist()
    if rank == 0:
        print("BENCH " + json.dumps({
            "backend": args.backend, "ranks": size, "hidden_size": args.hidden_size,
            "batch_size": B, "seq_len": T, "step_time_s": step_time,
            "chars_per_s_per_rank": tot / size, "chars_per_s_total": tot,
            "allreduce_wait_share": wait_sum / time_sum if args.backend == "horovod" else None,
            "flops_per_char": model.flops_per_char()}), flush=True)
    return 0


# ---- driver -----------------------------------------------------------------------------------

def _launch(backend: str, ranks: int, args: argparse.Namespace) -> dict:
    import subprocess

    argv = [sys.executable, "-m", "hvd_lm.bench", "worker", "--backend", backend,
            "--hidden-size", str(args.hidden_size), "--embed-dim", str(args.embed_dim),
            "--cell", args.cell, "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--threads", str(args.threads),
            "--compression", args.compression]
    if args.shards:
        argv += ["--shards", args.shards]
    cmd = ["mpirun", "-np", str(ranks), "-bind-to", "none", "-map-by", "slot",
           "-mca", "pml", "ob1", "-mca", "btl", "^openib", *argv]
    from hvd_lm.launch import local_mpi_env

    env = local_mpi_env(OMP_NUM_THREADS=str(args.threads), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(29500 + ranks + (7 if backend == "ddp" else 0)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[6:])
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")


def _bench_train(args: argparse.Namespace) -> int:
    ranks = sorted({int(r) for r in args.ranks.split(",")})
    peak = matmul_gflops(threads=args.threads)
    print(f"matmul peak (fp32, {args.threads} thread(s), 2048^3): {peak:.1f} GFLOP/s per rank")
    configs = [("horovod", n) for n in ranks] + [("ddp", ranks[-1])]
    trials: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits every config alike
        for backend, n in configs:
            trials[(backend, n)].append(_launch(backend, n, args))
    runs = []
    for c in configs:  # the median run of each config by total chars/s, with the spread
        ts = sorted(trials[c], key=lambda r: r["chars_per_s_total"])
        med = dict(ts[len(ts) // 2])
        med["chars_per_s_total_trials"] = [r["chars_per_s_total"] for r in trials[c]]
        runs.append(med)
    peak_after = matmul_gflops(threads=args.threads)
    base = runs[0]["chars_per_s_per_rank"]
    print(f"model: {args.cell} H={args.hidden_size} E={args.embed_dim}, per-rank batch "
          f"{args.batch_size} x {args.seq_len} chars, {runs[0]['flops_per_char'] / 1e6:.2f} "
          "MFLOP/char (fwd+bwd)")
    head = (f"{'backend':8} {'ranks':>5} {'s/step':>8} {'chars/s/rank':>13} {'chars/s':>10} "
            f"{'weak eff':>8} {'GFLOP/s/rank':>12} {'of peak':>7} {'ar wait':>7}")
    print(head)
    for r in runs:
        gf = r["chars_per_s_per_rank"] * r["flops_per_char"] / 1e9
        r["weak_scaling_efficiency"] = r["chars_per_s_per_rank"] / base
        r["gflops_per_rank"] = gf
        r["fraction_of_matmul_peak"] = gf / peak
        wait = r["allreduce_wait_share"]
        print(f"{r['backend']:8} {r['ranks']:>5} {r['step_time_s']:>8.3f} "
              f"{r['chars_per_s_per_rank']:>13.0f} {r['chars_per_s_total']:>10.0f} "
              f"{r['weak_scaling_efficiency']:>8.3f} {gf:>12.1f} {gf / peak:>7.1%} "
              f"{'-' if wait is None else f'{wait:.1%}':>7}")
    hvd_n = [r for r in runs if r["backend"] == "horovod" and r["ranks"] == ranks[-1]][0]
    ratio = hvd_n["chars_per_s_total"] / runs[-1]["chars_per_s_total"]
    print(f"Horovod / DDP throughput at {ranks[-1]} ranks: {ratio:.3f}x (medians of "
          f"{args.repeats} interleaved runs; per-run totals, chars/s: "
          + "; ".join(f"{r['backend']} x{r['ranks']} "
                      + ",".join(f"{v:.0f}" for v in r["chars_per_s_total_trials"])
                      for r in runs) + ")")
    print(f"matmul peak re-measured after the runs: {peak_after:.1f} GFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"matmul_gflops": peak, "matmul_gflops_after": peak_after, "runs": runs,
                       "horovod_over_ddp": ratio, "args": vars(args) | {"func": None}}, f,
                      indent=2, default=str)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden-size", type=int, default=1024, help="mLSTM width H")
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--cell", default="mlstm", choices=["mlstm", "lstm"])
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch (weak scaling)")
    p.add_argument("--seq-len", type=int, default=64, help="TBPTT window, chars")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--compression", default="fp16", choices=["none", "fp16"])
    p.add_argument("--shards", default="", help="train on a shard directory instead of random bytes")


def add_bench_subcommands(subparsers) -> None:
    """Register ``train`` in the ``hvd-lm bench`` group (``hvd-lm bench train``)."""
    p = subparsers.add_parser("train", help="training throughput: 1 vs N ranks, Horovod vs "
                              "DDP, fraction of matmul peak")
    _common(p)
    p.add_argument("--ranks", default="1,2", help="rank counts to run, e.g. 1,2")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per config; the "
                   "median is reported")
    p.add_argument("--timeout", type=float, default=900, help="per-run limit, s")
    p.add_argument("--json", default="", help="write the results here")
    p.set_defaults(func=_bench_train)


def main(argv: list[str] | None = None) -> int:
    """``python -m hvd_lm.bench worker ...`` (one rank) or ``... train ...`` (the driver)."""
    p = argparse.ArgumentParser(prog="python -m hvd_lm.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    _common(w)
    w.add_argument("--backend", choices=["horovod", "ddp"], required=True)
    w.add_argument("--fusion-threshold-mb", type=float, default=None)
    w.add_argument("--cycle-time-ms", type=float, default=None)
    w.set_defaults(func=_worker)
    add_bench_subcommands(sub)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
