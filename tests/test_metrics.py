"""The trainer's metrics component alone (hvd_lm.train.metrics), on one process with the one-rank
engine (comm.torch_engine): the ``train`` record that ``read_metrics`` parses back holds the
sums of the steps given, computed here by hand (loss, BPC, wait share, compute time, TFLOP/s and
MFU), in the order the printed line shows them, and the meter starts again after it; a rank that
is not rank 0 writes nothing but gets the same loss; TensorBoard gets one scalar per value; a log
handed back and opened again appends."""
from __future__ import annotations

import math

import pytest
import torch

from hvd_lm.comm import engine, torch_engine
from hvd_lm.model.mfu import Peak
from hvd_lm.train import metrics as metrics_mod
from hvd_lm.train.log import read_metrics
from hvd_lm.train.metrics import Metrics

STEPS = [(torch.tensor(30.0, dtype=torch.float64), 20, 0.25, 1.0),  # nats, chars, wait, busy
         (torch.tensor(12.0, dtype=torch.float64), 20, 0.5, 2.0)]


@pytest.fixture
def one_rank(monkeypatch):
    """Collectives on the one-rank engine (what a process without Horovod runs on)."""
    monkeypatch.setattr(engine, "_hvd", lambda: torch_engine)
    torch_engine.init()
    yield
    torch_engine.shutdown()


def fed(metrics: Metrics) -> Metrics:
    metrics.peak = Peak(2.0, "a test's peak")
    for s in STEPS:
        metrics.add_step(*s)
    return metrics


def test_the_train_record_holds_the_sums_of_its_steps(one_rank, tmp_path, capsys):
    m = fed(Metrics(tmp_path, tensorboard=False))
    m.open(10, 0)
    loss = m.log_train(2, 1, 1e9, 0.01, None, grad_norm=0.5, skipped_steps=0, epoch=0.25,
                       world_size=1, wire_bytes=64)
    m.close()
    assert loss == 42.0 / 40
    [rec] = read_metrics(tmp_path / "metrics.jsonl")
    assert (rec["kind"], rec["step"], rec["loss"], rec["lr"]) == ("train", 2, 42.0 / 40, 0.01)
    assert rec["bpc"] == pytest.approx(42.0 / 40 / math.log(2), rel=1e-15)
    assert rec["loss_scale"] is None
    assert rec["allreduce_wait"] == 0.75 / 3.0
    assert rec["compute_time_max"] == ((1.0 - 0.25) + (2.0 - 0.5)) / 2  # one rank: its own
    assert rec["compute_time_mean"] == (3.0 - 0.75) / 2
    wall = rec["step_time"] * 2
    assert rec["chars_per_s"] == pytest.approx(40 / wall, rel=1e-9)
    assert rec["tflops"] == pytest.approx(rec["chars_per_s"] * 1e9 / 1e12, rel=1e-9)
    assert rec["mfu"] == pytest.approx(rec["tflops"] / 2.0, rel=1e-9)
    keys = ["loss", "bpc", "lr", "loss_scale", "chars_per_s", "step_time", "tflops", "mfu",
            "allreduce_wait", "compute_time_max", "compute_time_mean", "grad_norm",
            "skipped_steps", "epoch", "world_size", "wire_bytes"]
    assert list(rec) == ["kind", "step", "time", *keys]
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[train]")]
    assert len(line) == 1 and line[0].startswith("[train] step=2 loss=1.05 bpc=1.515 lr=0.01 ")
    assert [w.split("=")[0] for w in line[0].split()[2:]] == keys
    assert m.meter.steps == 0 and m.meter.chars == 0  # a new meter for the next record


def test_a_rank_other_than_0_writes_nothing_but_gets_the_loss(one_rank, tmp_path):
    m = fed(Metrics(tmp_path, tensorboard=False))  # never opened: not rank 0
    assert not m.enabled
    m.record("start", 0, world_size=2)
    assert m.log_train(2, 1, 1e9, 0.01, None) == 42.0 / 40
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_gets_each_value_and_a_handed_back_log_appends(one_rank, tmp_path,
                                                                   monkeypatch):
    seen = []

    class Writer:
        def __init__(self, folder):
            seen.append(("folder", folder))

        def add_scalar(self, tag, value, step):
            seen.append((tag, value, step))

        def close(self):
            seen.append(("closed",))

    monkeypatch.setattr(metrics_mod, "SummaryWriter", Writer)
    m = Metrics(tmp_path, tensorboard=True)
    m.open(None, 0)
    m.record("eval", 5, val_bpc=1.5, val_chars=100, note="text")
    m.close()  # no longer rank 0 (an elastic reset)
    m.record("eval", 6, val_bpc=9.0)
    m.open(None, 6)  # rank 0 again
    m.record("end", 7)
    m.close()
    assert seen == [("folder", str(tmp_path / "tensorboard")), ("eval/val_bpc", 1.5, 5),
                    ("eval/val_chars", 100, 5), ("closed",),
                    ("folder", str(tmp_path / "tensorboard")), ("closed",)]
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        ("eval", 5), ("end", 7)]

