"""Rounds of hvd_lm.comm.horovod.compressed_allreduce on 2+ ranks; each rank saves its inputs,
outputs and final error buffers. tests/test_onebit.py checks them against a numpy implementation
of the algorithm and against the exact average.

Rank r's input in round t is drawn from a generator seeded with (seed, t, r), so the test can
rebuild every rank's inputs.

usage: onebit_rounds.py OUT_DIR --numel N --chunk C --rounds T [--seed S]
"""
import argparse
from pathlib import Path

import numpy as np
import torch

from hvd_lm import comm
from hvd_lm.comm.onebit_compression import ErrorFeedback, Layout


def inputs(seed: int, t: int, r: int, numel: int) -> torch.Tensor:
    """Rank r's tensor of round t: a common drift plus rank noise (float32 [numel])."""
    g = np.random.default_rng([seed, t, r])
    base = np.random.default_rng([seed, t]).standard_normal(numel)
    return torch.from_numpy((base + 0.5 * g.standard_normal(numel)).astype(np.float32))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ctx = comm.init()
    torch.set_num_threads(1)
    errors = ErrorFeedback(Layout(args.numel, ctx.size, args.chunk), ctx.rank)
    outs = [comm.compressed_allreduce(inputs(args.seed, t, ctx.rank, args.numel), errors,
                                      name=f"rounds.{t}").numpy() for t in range(args.rounds)]
    np.savez(Path(args.out) / f"rank{ctx.rank}.npz", outputs=np.stack(outs),
             worker_error=errors.worker_error.numpy(), server_error=errors.server_error.numpy())
    print(f"rank {ctx.rank}/{ctx.size} done", flush=True)
