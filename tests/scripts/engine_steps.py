"""A few distributed-optimizer steps on a fixed problem through hvd_lm.comm.horovod on an engine
(default the torch engine); rank 0 saves the final parameters, then the 1-bit compressed
allreduce runs a few rounds (--onebit-out).

Run under `torchrun --nproc-per-node N` or `mpirun -np N`: rank r takes rows [r*b, (r+1)*b) of a
fixed global batch of N*b rows, so N ranks with per-rank batch b see the same data as one process
with batch N*b (tests/test_torch_engine.py compares the two, as tests/test_foundation.py does
for Horovod). Every step goes through the training step's path: backward (the hooks start the
buckets' allreduces), synchronize(), step() inside skip_synchronize().

usage: engine_steps.py OUT.npy --steps K --per-rank-batch B --compression {none,fp16,bf16}
           [--backend torch] [--bucket-mb MB] [--backward-passes K]
"""
import argparse
from pathlib import Path

import numpy as np
import torch

from hvd_lm import comm
from hvd_lm.comm.onebit_compression import ErrorFeedback, Layout
from tests.scripts.onebit_rounds import inputs as round_inputs
from tests.scripts.problem import make_problem

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--per-rank-batch", type=int, default=8)
ap.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none")
ap.add_argument("--backend", default="torch")
ap.add_argument("--bucket-mb", type=float, default=None)
ap.add_argument("--backward-passes", type=int, default=1)
ap.add_argument("--onebit-out", default="")
args = ap.parse_args()

ctx = comm.init(fusion_threshold_mb=args.bucket_mb, backend=args.backend)
torch.set_num_threads(1)
model, x, y = make_problem(global_batch=ctx.size * args.per_rank_batch)
b = args.per_rank_batch
xs, ys = x[ctx.rank * b:(ctx.rank + 1) * b], y[ctx.rank * b:(ctx.rank + 1) * b]
opt = comm.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                 args.compression, args.backward_passes)
comm.broadcast_state(model)
k = args.backward_passes
for _ in range(args.steps):
    for part in range(k):  # k slices of this rank's rows, the loss of each divided by k
        rows = slice(part * b // k, (part + 1) * b // k)
        (torch.nn.functional.mse_loss(model(xs[rows]), ys[rows]) / k).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
if ctx.rank == 0:
    np.save(args.out, torch.cat([p.detach().flatten() for p in model.parameters()]).numpy())
if args.onebit_out:  # 1-bit compressed allreduce rounds (as tests/scripts/onebit_rounds.py)
    numel, chunk, rounds, seed = 1001, 64, 30, 7
    errors = ErrorFeedback(Layout(numel, ctx.size, chunk), ctx.rank)
    outs = [comm.compressed_allreduce(round_inputs(seed, t, ctx.rank, numel), errors,
                                      name=f"rounds.{t}").numpy() for t in range(rounds)]
    np.savez(Path(args.onebit_out) / f"rank{ctx.rank}.npz", outputs=np.stack(outs),
             worker_error=errors.worker_error.numpy(), server_error=errors.server_error.numpy())
print(f"rank {ctx.rank}/{ctx.size} done on {comm.engine()}: {comm.rank_context().launcher}",
      flush=True)
