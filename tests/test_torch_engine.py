"""The torch engine (``--backend torch``: hvd_lm.comm.torch_engine on torch.distributed, with
hvd_lm.comm.grad_buckets) in one process: the gradient buckets start in order from the backward
hooks, the rendezvous, ``--backend auto``. On 2 real ranks (under torchrun, as Horovod's under
horovodrun and mpirun): tests/parallel/test_optimizers.py; training through the CLI, resume
across engines and failures: tests/test_torch_engine_train.py."""
from __future__ import annotations

import sys

import pytest
import torch

from hvd_lm.comm import grad_buckets
from hvd_lm.comm.world import first_slurm_host, rendezvous_endpoint

# ---- the buckets, in one process (a stand-in allreduce) ------------------------------------------

class _Recorder:
    """A stand-in for the engine's asynchronous sum-allreduce over ``n`` identical ranks: each
    started buffer is multiplied by n (the sum of n equal addends) when waited for; the buffers
    are recorded in the order started."""

    def __init__(self, n: int = 2):
        self.n, self.started = n, []

    def __call__(self, flat: torch.Tensor):
        self.started.append(flat)
        rec = self

        class Work:
            def wait(self):
                flat.mul_(rec.n)

        return Work()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def test_buckets_start_in_order_from_the_hooks_and_average():
    """Buckets of at most 100 bytes over the parameters in reverse order; backward starts each
    as its last gradient completes, in bucket order; synchronize() writes the average (the sum
    of 2 identical ranks / 2 = the local gradient); with 2 backward passes per step nothing
    starts before the second; fp16/bf16 put 2-byte values on the wire."""
    model, ref = _mlp(), _mlp()
    x = torch.randn(4, 6)
    ref(x).pow(2).mean().backward()
    rec = _Recorder()
    opt = grad_buckets.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        grad_buckets.Compression.none, 1, rec, size=2, bucket_bytes=100)
    # 2.bias (12 B), 2.weight (60 B), 0.bias (20 B) | 0.weight (120 B: alone)
    assert opt.bucket_sizes() == [92, 120]
    model(x).pow(2).mean().backward()
    assert [t.numel() for t in rec.started] == [23, 30]  # both started during backward
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()

    rec2 = _Recorder()
    m2 = _mlp()
    opt2 = grad_buckets.distributed_optimizer(
        torch.optim.SGD(m2.parameters(), lr=0.1), m2.named_parameters(),
        grad_buckets.Compression.bf16, 2, rec2, size=2, bucket_bytes=0)
    assert len(opt2.bucket_sizes()) == 4  # 0 bytes: one bucket per tensor
    m2(x).pow(2).mean().backward()
    assert rec2.started == []  # 1 of 2 passes: accumulating locally
    m2(x).pow(2).mean().backward()
    assert len(rec2.started) == 4 and all(t.dtype == torch.bfloat16 for t in rec2.started)
    with pytest.raises(AssertionError, match="zero_grad"):
        opt2.zero_grad()  # allreduces in flight
    opt2.synchronize()
    for p, q in zip(m2.parameters(), ref.parameters()):  # 2 passes of the same batch = 2 x grad
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=2 ** -7, atol=1e-6)
    assert isinstance(opt2, torch.optim.SGD) and opt2.state_dict()["param_groups"][0]["lr"] == 0.1


def test_a_bucket_ready_early_waits_for_the_ones_before_it():
    """Hooks firing out of bucket order (here the first layer's gradients made first, by a
    backward of its output alone) start nothing until bucket 0 is ready: every rank issues the
    same collectives in the same order; parameters that got no gradient go as zeros."""
    model = _mlp()
    rec = _Recorder()
    opt = grad_buckets.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        grad_buckets.Compression.fp16, 1, rec, size=2, bucket_bytes=0)
    model[0](torch.randn(2, 6)).sum().backward()  # only the first layer: buckets 2 and 3
    assert rec.started == []
    opt.synchronize()  # buckets 0, 1 (no gradient: zeros), then 2, 3
    assert [t.numel() for t in rec.started] == [3, 15, 5, 30]
    assert rec.started[0].dtype == torch.float16
    assert float(model[2].weight.grad.abs().max()) == 0.0


# ---- where the ranks meet --------------------------------------------------------------------

def test_the_rendezvous_comes_from_master_addr_or_the_slurm_step():
    assert rendezvous_endpoint({"MASTER_ADDR": "n7", "WORLD_SIZE": "2"}) == (
        "n7", 29500, "MASTER_ADDR")
    assert rendezvous_endpoint({"MASTER_ADDR": "n7", "MASTER_PORT": "1234"})[:2] == ("n7", 1234)
    slurm = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "123456",
             "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1"}
    assert rendezvous_endpoint(slurm) == ("gpu07", 29956, "SLURM_STEP_NODELIST")
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    assert rendezvous_endpoint(mpi) is None  # MPI tells the ranks
    assert first_slurm_host("n1") == "n1" and first_slurm_host("a[3],b") == "a3"
    with pytest.raises(ValueError, match="MASTER_PORT='x'"):
        rendezvous_endpoint({"MASTER_ADDR": "n7", "MASTER_PORT": "x"})


def test_bench_train_sets_the_engines_side_by_side():
    """``bench train``'s summary: each engine's weak scaling against its own one rank, the torch
    engine over Horovod at each rank count (of medians, and repeat by repeat: the two ran back
    to back), each engine over the DDP baseline."""
    from hvd_lm.perf.bench_train import summarize_train

    def rec(chars, ranks, backend="horovod"):
        return {"backend": backend, "ranks": ranks, "chars_per_s_total": chars,
                "chars_per_s_per_rank": chars / ranks, "flops_per_char": 1e6,
                "allreduce_wait_share": None}

    v = "fused/torch"
    s = summarize_train({(v, "horovod", 1): [rec(100, 1), rec(110, 1)],
                         (v, "torch", 1): [rec(105, 1, "torch"), rec(99, 1, "torch")],
                         (v, "horovod", 2): [rec(180, 2), rec(170, 2)],
                         (v, "torch", 2): [rec(190, 2, "torch"), rec(200, 2, "torch")],
                         (v, "ddp", 2): [rec(200, 2, "ddp"), rec(210, 2, "ddp")]}, peak=1.0)
    ratios = {x["ranks"]: x for x in s["torch_over_horovod"]}
    assert ratios[1]["ratio"] == pytest.approx(105 / 110)
    assert ratios[1]["paired_ratios"] == pytest.approx([1.05, 0.9])
    assert ratios[2]["ratio"] == pytest.approx(200 / 180)
    assert s["horovod_over_ddp"] == pytest.approx(180 / 210)
    assert s["torch_over_ddp"] == pytest.approx(200 / 210)
    eff = {(r["backend"], r["ranks"]): r["weak_scaling_efficiency"] for r in s["runs"]}
    assert eff[("torch", 2)] == pytest.approx(100 / 105)
    assert eff[("horovod", 2)] == pytest.approx(90 / 110)
    assert eff[("ddp", 2)] == pytest.approx(105 / 110)  # against the first engine's one rank


def test_auto_is_horovod_when_it_imports_else_torch(monkeypatch):
    """``--backend auto`` resolves once per process: Horovod when ``horovod.torch`` imports, the
    torch engine when it does not (nothing is initialised here: only which module answers)."""
    import importlib.util

    from hvd_lm import comm

    try:
        comm.use_backend("auto")
        want = "horovod" if importlib.util.find_spec("horovod") else "torch"
        assert comm.engine() == want
        monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import fails
        comm._hvd.cache_clear()
        assert comm.engine() == "torch"
        with pytest.raises(ValueError, match="--backend must be one of horovod, torch, auto"):
            comm.use_backend("mpi")
    finally:
        comm.use_backend("horovod")
        comm._hvd.cache_clear()
