"""The torch engine (``--backend torch``: hvd_lm.comm.torch_engine on torch.distributed and
DistributedDataParallel) in one process: the rendezvous, ``--backend auto``. On 2 real ranks
(under torchrun, as Horovod's under horovodrun and mpirun): tests/parallel/test_optimizers.py;
training through the CLI, resume across engines and failures: tests/test_torch_engine_train.py."""
from __future__ import annotations

import sys

import pytest

from hvd_lm.comm.world import first_slurm_host, rendezvous_endpoint

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
    from benchmarks.bench_train import summarize_train

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

    from hvd_lm.comm import engine

    try:
        engine.use_backend("auto")
        want = "horovod" if importlib.util.find_spec("horovod") else "torch"
        assert engine.engine_name() == want
        monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import fails
        engine._hvd.cache_clear()
        assert engine.engine_name() == "torch"
        with pytest.raises(ValueError, match="--backend must be one of horovod, torch, auto"):
            engine.use_backend("mpi")
    finally:
        engine.use_backend("horovod")
        engine._hvd.cache_clear()
