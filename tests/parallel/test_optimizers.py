"""Inside the ranks: the gradient allreduce on 2 ranks equals one process on the concatenated batch
(Horovod's ``DistributedOptimizer`` under horovodrun's Gloo controller and under mpirun; the
torch engine's DistributedDataParallel under torchrun), with fp16/bf16 on the wire, several
backward passes per step (DDP: ``no_sync``) and one bucket (fusion buffer) per tensor; the 1-bit
compressed allreduce equals a numpy implementation of Tang et al. 2021, Algorithm 1, every
round, on every rank.

Tolerances: fp32 allreduce of two addends differs from the one-process gradient only by rounding
(1e-6); fp16 compression rounds each gradient to 11 significant bits (relative 2^-11 ~ 5e-4)
before the average, and 5 steps of lr 0.1 keep the drift below 2e-3; bf16 keeps 8 (relative
2^-9): the 5 steps move a parameter by at most 0.07, so to first order the rounding shifts it by
0.07 x 2^-9 = 1.4e-4, and 2e-3 leaves 14x for what the first order leaves out (measured: 6.9e-5
bf16, 7.6e-6 fp16)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from hvd_lm.comm import engine
from hvd_lm.comm.onebit_compression import ErrorFeedback, Layout, compressed_allreduce
from tests.parallel.conftest import ENGINE
from tests.scripts.onebit_rounds import inputs as round_inputs
from tests.scripts.problem import make_problem, train_steps
from tests.test_onebit import np_onebit_rounds

LAUNCHES = [("horovodrun-gloo", "horovod"), ("mpirun", "horovod"), ("torchrun", "torch")]

TOL = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-3}


def flat(model) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()


def one_process(steps: int, global_batch: int) -> np.ndarray:
    """The reference: plain SGD on the whole batch in this process, no collective."""
    model, x, y = make_problem(global_batch)
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, steps)
    return flat(model)


@pytest.mark.parametrize("compression,k", [("none", 1), ("fp16", 1), ("bf16", 1),
                                           ("none", 2)])
def test_two_ranks_equal_one_process_on_the_double_batch(ctx, compression, k):
    """Rank r takes rows [8r, 8r+8) of a batch of 16 (in k slices, each loss divided by k, as the
    trainer's windows), through the training step's path: backward (the hooks start the
    allreduces), synchronize(), step() inside skip_synchronize(); after 5 steps every rank holds
    the one-process parameters."""
    if compression == "bf16" and ENGINE == "horovod":
        pytest.skip("Horovod 0.28.1 has no bfloat16 compression (the torch engine's)")
    b = 8
    model, x, y = make_problem(global_batch=ctx.size * b)
    xs, ys = x[ctx.rank * b:(ctx.rank + 1) * b], y[ctx.rank * b:(ctx.rank + 1) * b]
    net = engine.wrap_model(model, compression)  # the torch engine: DDP; Horovod: model
    opt = engine.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                     compression, k)
    engine.broadcast_state(model)
    for _ in range(5):
        for part in range(k):
            rows = slice(part * b // k, (part + 1) * b // k)
            with engine.no_sync(net) if part + 1 < k else contextlib.nullcontext():
                (torch.nn.functional.mse_loss(net(xs[rows]), ys[rows]) / k).backward()
        engine.synchronize(opt)
        with engine.skip_synchronize(opt):
            opt.step()
        opt.zero_grad()
    got, want = flat(model), one_process(5, ctx.size * b)
    np.testing.assert_allclose(got, want, atol=TOL[compression], rtol=0)
    init = flat(make_problem(ctx.size * b)[0])
    assert np.abs(got - init).max() > max(10 * TOL[compression], 1e-2)  # the steps moved them
    assert np.array_equal(np.stack(engine.allgather_object(got, name=f"params.{compression}.{k}")),
                          np.stack([got, got]))  # every rank the same, bit for bit


def test_one_bucket_per_tensor_equals_one_fused_buffer(ctx):
    """Fusion (one buffer) and none (a collective per tensor; Horovod: HOROVOD_FUSION_THRESHOLD=0
    read at init, so the torch engine's bucket size stands in for both) give the same steps."""
    if ENGINE != "torch":
        pytest.skip("Horovod reads its fusion threshold once, at hvd.init()")
    from hvd_lm.comm import torch_engine
    results = []
    for mb in (25.0, 0.0):
        torch_engine.configure(bucket_mb=mb)
        model, x, y = make_problem(global_batch=16)
        xs, ys = x[ctx.rank * 8:(ctx.rank + 1) * 8], y[ctx.rank * 8:(ctx.rank + 1) * 8]
        net = engine.wrap_model(model, "none")
        opt = engine.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                         "none", 1)
        for _ in range(3):
            torch.nn.functional.mse_loss(net(xs), ys).backward()
            engine.synchronize(opt)
            with engine.skip_synchronize(opt):
                opt.step()
            opt.zero_grad()
        # DDP's own record (bytes), of the buckets it rebuilt after the first step
        buckets = net._get_ddp_logging_data()["rebuilt_bucket_sizes"]
        assert len(str(buckets).split(",")) == (1 if mb else 4), buckets
        results.append(flat(model))
    torch_engine.configure()
    np.testing.assert_allclose(results[0], results[1], atol=1e-7, rtol=0)


def test_compressed_allreduce_equals_numpy_every_round(ctx):
    """hvd.alltoall + hvd.allgather (or torch.distributed's) on 2 real ranks: both ranks get
    numpy's output every round, their error buffers are numpy's, and the running mean approaches
    the exact mean within the error-feedback bound."""
    numel, chunk, T, seed = 1001, 64, 30, 7
    errors = ErrorFeedback(Layout(numel, ctx.size, chunk), ctx.rank)
    outs = np.stack([compressed_allreduce(round_inputs(seed, t, ctx.rank, numel), errors,
                                               name=f"rounds.{t}").numpy() for t in range(T)])
    xs = np.stack([np.stack([round_inputs(seed, t, r, numel).numpy() for r in range(ctx.size)])
                   for t in range(T)])
    want, we, se = np_onebit_rounds(xs, chunk)
    np.testing.assert_allclose(outs, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(errors.worker_error.numpy(), we[ctx.rank], atol=1e-5)
    np.testing.assert_allclose(errors.server_error.numpy(), se[ctx.rank], atol=1e-5)
    exact = xs.mean(1)
    werr, serr = we.mean(0)[:numel], np.concatenate(se)[:numel]
    np.testing.assert_allclose(outs.sum(0), exact.sum(0) - werr - serr, atol=1e-3)
    gap = np.abs(outs.mean(0) - exact.mean(0)).max()
    assert gap <= (np.abs(werr).max() + np.abs(serr).max()) / T + 1e-5
    assert gap < 0.1 * np.abs(outs[0] - exact[0]).max()  # one round's error
