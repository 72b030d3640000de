"""The elastic state alone (hvd_lm.train.elastic.Elastic), without Horovod's driver: a commit
then a restore in the same world gives back the committed position (its character count exact),
schedule, scaler, divergence counters and this rank's recurrent rows; in another world the rows
start from zero and the window moves to the same fraction of the epoch (by hand); a reset waits
for the checkpoint in flight, re-forms the run's world and says so in a ``resize`` record. The
state is a stand-in with hvd.elastic.TorchState's interface (attributes and ``commit()``);
collectives run on the torch engine's world of one. The whole of elastic training on
real workers: tests/test_elastic.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hvd_lm.comm import engine, torch_engine
from hvd_lm.comm.world import RankContext
from hvd_lm.train.counting import CharCount
from hvd_lm.train.elastic import Elastic
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.log import read_metrics
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.resume import Position
from hvd_lm.train.schedule import LRPlan

B, H = 2, 3


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    monkeypatch.setattr(engine, "_hvd", lambda: torch_engine)
    torch_engine.init()
    yield
    torch_engine.shutdown()


class State:
    """hvd.elastic.TorchState's part the component uses: fields set as attributes, commit()."""

    def __init__(self):
        self.commits = 0

    def commit(self):
        self.commits += 1


class Model(torch.nn.Linear):
    def init_state(self, batch, device):
        return torch.zeros(batch, H), torch.zeros(batch, H)


def elastic(tmp_path, ctx=RankContext(rank=1, size=2)):
    model = Model(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    calls = []
    run = SimpleNamespace(model=model, optimizer=opt, lr_plan=LRPlan(0.5, 0, 100),
                          scaler=torch.amp.GradScaler("cpu", enabled=False), ctx=ctx,
                          windows_per_epoch=40, peak_lr=0.5, global_batch=4, B=B, device="cpu",
                          total_steps=100,
                          cfg=SimpleNamespace(run=SimpleNamespace(log_every=10)))

    def reform():  # RunParts.reform: the new place, the streams cut again
        run.ctx = engine.rank_context()
        calls.append("cut")
        run.windows_per_epoch = 20

    run.reform = reform
    folder = SimpleNamespace(take=lambda ctx, rows, step, total: calls.append(("root", step)))
    checkpointer = SimpleNamespace(wait=lambda: calls.append("wait"))
    metrics = Metrics(tmp_path, tensorboard=False)
    metrics.open(None, 0)
    guard = DivergenceGuard(10.0, 3, 5)
    return Elastic(run, folder, checkpointer, metrics, guard), run, calls


def test_commit_then_restore_in_the_same_world(tmp_path):
    e, run, _ = elastic(tmp_path)
    state, chars = State(), CharCount(500)
    chars.add(25)
    pos = Position(step=10, window=30, skipped_steps=2, chars_trained=500)
    rows = (torch.randn(B, H), torch.randn(B, H))
    kept = tuple(t.clone() for t in rows)
    e.guard.logged(10, 11.0)  # a loss above the bound, committed with the rest
    e.commit(state, pos, rows, chars)
    assert state.commits == 1 and pos.chars_trained == 525 and chars.total() == 525
    committed_plan = run.lr_plan.state_dict()
    run.lr_plan.replan(15, 40)  # training goes on past the commit (a --time-limit plan moved),
    run.lr_plan.peak = 9.0      # then a worker is lost
    chars.add(99)
    e.guard.logged(15, 1.0)
    rows[0].add_(1.0)

    new_pos, new_rows = e.restore(state, chars)
    assert new_pos == Position(step=10, window=30, skipped_steps=2, chars_trained=525)
    assert chars.total() == 525
    assert run.lr_plan.state_dict() == committed_plan  # the committed line, the rule's peak
    assert e.guard.above == [(10, 11.0)]
    assert torch.equal(new_rows[0], kept[0]) and torch.equal(new_rows[1], kept[1])
    assert new_rows[1] is not rows[1]  # a copy: the loop's rows change in place
    e.metrics.close()
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        ("commit", 10)]


def test_restore_in_another_world_starts_the_rows_from_zero(tmp_path):
    e, run, _ = elastic(tmp_path)
    state = State()
    e.commit(state, Position(step=4, window=90), (torch.ones(B, H), torch.ones(B, H)),
             CharCount(0))
    run.ctx, run.windows_per_epoch = RankContext(rank=0, size=4), 20  # after a reset
    pos, rows = e.restore(state, CharCount(0))
    assert pos.window == 2 * 20 + 5  # 90 = 2 epochs of 40 + 10: a quarter of the new epoch
    assert all(torch.equal(t, torch.zeros(B, H)) for t in rows)


def test_a_reset_reforms_the_world_after_the_write_in_flight(tmp_path):
    e, run, calls = elastic(tmp_path)
    state = State()
    e.commit(state, Position(step=6, window=50), (torch.ones(B, H), torch.ones(B, H)),
             CharCount(0))
    e.on_reset(state, step=8)
    assert calls == ["wait", "cut", ("root", 8)]
    assert run.ctx == single_context()
    e.metrics.close()
    resize = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert (resize["kind"], resize["step"], resize["world_size"], resize["previous_world_size"],
            resize["window"], resize["peak_lr"]) == ("resize", 6, 1, 2, 20 + 5, 0.5)


def single_context() -> RankContext:
    return RankContext(0, 1, 0, 1, torch_engine.LAUNCHER)
