"""A few hvd.DistributedOptimizer steps on a fixed problem; rank 0 saves the final parameters.

Run under `horovodrun -np N` or `mpirun -np N`: rank r takes rows [r*b, (r+1)*b) of a fixed
global batch of N*b rows, so N ranks with per-rank batch b see the same data as one process
with batch N*b. tests/test_foundation.py compares the result with that single-process run.

usage: dopt_steps.py OUT.npy --steps K --per-rank-batch B --compression {none,fp16}
"""
import argparse

import horovod.torch as hvd
import numpy as np
import torch

from tests.scripts.problem import make_problem, train_steps

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--per-rank-batch", type=int, default=8)
ap.add_argument("--compression", choices=["none", "fp16"], default="fp16")
args = ap.parse_args()

hvd.init()
torch.set_num_threads(1)
model, x, y = make_problem(global_batch=hvd.size() * args.per_rank_batch)
b = args.per_rank_batch
xs, ys = x[hvd.rank() * b:(hvd.rank() + 1) * b], y[hvd.rank() * b:(hvd.rank() + 1) * b]
opt = torch.optim.SGD(model.parameters(), lr=0.1)
comp = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
train_steps(model, opt, xs, ys, args.steps)
if hvd.rank() == 0:
    np.save(args.out, torch.cat([p.detach().flatten() for p in model.parameters()]).numpy())
print(f"rank {hvd.rank()}/{hvd.size()} done", flush=True)
