"""The step counting alone (hvd_lm.train.counting): counting each step's outcome a step late
(settled before the next update) gives, at every update, the step count, the learning rate the
loop sets from it and the skip records of counting each step at once; the exact count at the
steps where it decides something; a skipped step's non-finite recurrent state restarts from
zeros; the characters over ranks (one rank here: the torch engine's world of one)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hvd_lm.comm import engine, torch_engine
from hvd_lm.train.counting import CharCount, StepCounter
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.log import read_metrics
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.resume import Position
from hvd_lm.train.schedule import LRPlan
from hvd_lm.train.step import StepResult

OUTCOMES = [True, True, False, True, True, True, False, False, True, True]  # applied?


class Outcome:
    """A decision made on the device, read when asked (DeviceOutcome's interface)."""

    def __init__(self, applied: bool, norm: float):
        self.applied, self.norm, self.reads = applied, norm, 0

    def read(self):
        self.reads += 1
        return self.applied, self.norm


def settings(**kw):
    base = dict(log_every=1000, eval_every=0, checkpoint_every=0, commit_every=0, elastic=False)
    return SimpleNamespace(**{**base, **kw})


def counter(tmp_path, run=None, guard=None, restart=None):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = LRPlan(1.0, 2, 20)
    metrics = Metrics(tmp_path, tensorboard=False)
    metrics.open(None, 0)
    c = StepCounter(run or settings(), 1, 10**9, torch.amp.GradScaler("cpu", enabled=False),
                    guard or DivergenceGuard(10.0, 0, 0), metrics,
                    restart_state=restart or (lambda: (torch.zeros(1), torch.zeros(1))))
    return c, opt, sched, metrics


def result(applied, norm, outcome=None, state=(torch.ones(1), torch.ones(1))):
    return StepResult(applied, norm, torch.tensor(0.0), 4, 0.0, state, outcome)


def test_a_step_late_equals_at_once_at_every_update(tmp_path):
    at_once, lazy = tmp_path / "a", tmp_path / "b"
    at_once.mkdir(), lazy.mkdir()
    ca, opt_a, sched_a, ma = counter(at_once)
    cl, opt_l, sched_l, ml = counter(lazy)
    pa, pl = Position(), Position()
    big = 10**9
    for i, applied in enumerate(OUTCOMES):
        cl.settle(pl)  # between backward() and update(): the previous step counted exactly
        assert (pl.step, pl.skipped_steps) == (pa.step, pa.skipped_steps), i
        # the loop's update: the LR from the exact count
        assert sched_l.apply(opt_l, pl.step) == sched_a.apply(opt_a, pa.step), i
        ca.count(result(applied, float(i)), pa, big, big)
        out = Outcome(applied, float(i))
        r = cl.count(result(torch.tensor(applied), torch.tensor(float(i)), out), pl, big, big)
        assert r.applied is True and out.reads == 0  # counted as applied, read later
    cl.settle(pl)
    ma.close(), ml.close()
    assert (pl.step, pl.skipped_steps) == (pa.step, pa.skipped_steps) == (7, 3)
    skips = [(r["step"], r["skipped_steps"], r["grad_norm"])
             for r in read_metrics(lazy / "metrics.jsonl")]
    assert skips == [(r["step"], r["skipped_steps"], r["grad_norm"])
                     for r in read_metrics(at_once / "metrics.jsonl")]
    assert skips == [(2, 1, 2.0), (5, 2, 6.0), (5, 3, 7.0)]


def test_the_count_is_exact_where_it_decides_something(tmp_path):
    c, *_ = counter(tmp_path, run=settings(log_every=5, checkpoint_every=7),
                    guard=DivergenceGuard(10.0, 0, 3))
    pos = Position(step=3, window=3)
    assert not c.counts_now(pos, total_steps=100, next_control=50)
    assert c.counts_now(Position(step=4), 100, 50)  # step 5: a log
    assert c.counts_now(Position(step=6), 100, 50)  # step 7: a checkpoint
    assert c.counts_now(pos, total_steps=4, next_control=50)  # the last step
    assert c.counts_now(pos, total_steps=100, next_control=4)  # a control exchange
    c.total_windows = 3
    assert c.counts_now(pos, 100, 50)  # no window for another step
    c.total_windows = 10**9
    c.guard.skipped_in_a_row = 2  # one more skip ends the run
    assert c.counts_now(pos, 100, 50)
    out = Outcome(False, 1.0)
    r = c.count(result(torch.tensor(False), torch.tensor(1.0), out), pos, 100, 50)
    assert (r.applied, out.reads, pos.step, pos.skipped_steps) == (False, 1, 3, 1)


def test_a_skipped_step_restarts_a_state_that_is_not_finite(tmp_path):
    zeros = (torch.zeros(1), torch.zeros(1))
    c, *_ = counter(tmp_path, restart=lambda: zeros)
    pos = Position()
    nan = (torch.tensor([float("nan")]), torch.ones(1))
    assert c.count(result(False, 1.0, state=nan), pos, 99, 99).state is zeros
    fine = (torch.ones(1), torch.ones(1))
    assert c.count(result(False, 1.0, state=fine), pos, 99, 99).state is fine
    assert c.count(result(True, 1.0, state=nan), pos, 99, 99).state is nan  # applied: kept
    assert (pos.step, pos.skipped_steps) == (1, 2)


def test_a_rolled_back_position_drops_the_pending_step(tmp_path):
    c, *_ = counter(tmp_path)
    old = Position()
    out = Outcome(False, 1.0)
    c.count(result(torch.tensor(False), torch.tensor(1.0), out), old, 99, 99)
    c.settle(Position())  # an elastic restore made a new position: the step went with it
    assert out.reads == 0 and c.pending is None and old.skipped_steps == 0


def test_the_characters_over_ranks(monkeypatch, request):
    monkeypatch.setattr(engine, "_hvd", lambda: torch_engine)
    torch_engine.init()
    request.addfinalizer(torch_engine.shutdown)
    chars = CharCount(1000)
    chars.add(30)
    chars.add(12)
    assert chars.total() == 1042
    chars.rebase(2000)
    chars.add(1)
    assert (chars.base, chars.local, chars.total()) == (2000, 1, 2001)


@pytest.mark.parametrize("applied", [True, False])
def test_an_outcome_on_the_host_is_counted_at_once(tmp_path, applied):
    c, *_ = counter(tmp_path)
    pos = Position()
    r = c.count(result(applied, 2.0), pos, 99, 99)
    assert c.pending is None and r.applied is applied
    assert (pos.step, pos.skipped_steps) == ((1, 0) if applied else (0, 1))
