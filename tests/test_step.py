"""The pieces of the training step (hvd_lm.train.step): unscale and clip, step or skip, the
re-cut window index and the fault hooks, each against a computation done here by hand (numpy or
plain arithmetic)."""
import math

import numpy as np
import pytest
import torch

from hvd_lm.train import faults, step
from hvd_lm.train.data import window_in_new_cut

#: fp32/bf16's loss scaler: disabled, every call passes through
NO_SCALING = torch.amp.GradScaler("cpu", enabled=False)


def _params(grads):
    ps = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g, dtype=torch.float32)
        ps.append(p)
    return ps


def test_unscale_and_clip_returns_the_norm_before_clipping_and_clips_to_max_norm():
    grads = [[3.0, 4.0], [12.0]]
    ps = _params(grads)
    norm = step.unscale_and_clip(torch.optim.SGD(ps, lr=1.0), ps, 1.0, NO_SCALING)
    want = float(np.linalg.norm(np.concatenate([np.array(g) for g in grads])))  # 13
    assert norm == pytest.approx(want)
    clipped = np.concatenate([p.grad.numpy() for p in ps])
    assert np.linalg.norm(clipped) == pytest.approx(1.0, rel=1e-5)
    assert clipped == pytest.approx(np.array([3, 4, 12]) / 13, rel=1e-5)


def test_unscale_and_clip_with_zero_max_norm_only_measures():
    ps = _params([[3.0, 4.0]])
    assert step.unscale_and_clip(torch.optim.SGD(ps, lr=1.0), ps, 0.0, NO_SCALING) == pytest.approx(5.0)
    assert ps[0].grad.tolist() == [3.0, 4.0]


def test_unscale_and_clip_takes_the_optimizers_agreed_norm():
    """A 1-bit optimiser's compressed phase: the norm every rank agrees on is the one returned."""
    ps = _params([[3.0, 4.0]])
    opt = torch.optim.SGD(ps, lr=1.0)
    seen = []
    opt.agree_grad_norm = lambda local: seen.append(local) or 7.0
    assert step.unscale_and_clip(opt, ps, 0.0, NO_SCALING) == 7.0
    assert seen == [pytest.approx(5.0)]


def test_step_or_skip_skips_a_non_finite_step_and_applies_a_finite_one():
    ps = _params([[1.0, -2.0]])
    opt = torch.optim.SGD(ps, lr=0.5)
    assert step.step_or_skip(opt, NO_SCALING, math.inf) is False
    assert ps[0].tolist() == [0.0, 0.0]  # untouched
    assert step.step_or_skip(opt, NO_SCALING, math.inf, check_finite=False) is True
    assert ps[0].tolist() == [-0.5, 1.0]  # x - lr g
    assert step.step_or_skip(opt, NO_SCALING, 2.2) is True
    assert ps[0].tolist() == [-1.0, 2.0]


@pytest.mark.parametrize("window,old,new,want", [
    (7, 10, 10, 7),     # same cut: unchanged
    (25, 10, 5, 12),    # 2 epochs + 5/10 of one -> 2 x 5 + round(2.5) (banker's: 2)
    (13, 10, 20, 26),   # 1 epoch + 3/10 -> 20 + 6
    (0, 4, 9, 0),
])
def test_window_in_new_cut_keeps_epochs_and_the_fraction_of_the_epoch(window, old, new, want):
    assert window_in_new_cut(window, old, new) == want


def test_faults_are_a_no_op_object_unless_a_test_asks(monkeypatch):
    for name in ("HVD_LM_FAULT_RANK", "HVD_LM_FAULT_STEP", "HVD_LM_STEP_SLEEP"):
        monkeypatch.delenv(name, raising=False)
    none = faults.for_rank(0, "")
    assert type(none) is faults.NoFaults
    x = torch.tensor(1.5)
    assert none.loss(x, 0) is x
    some = faults.for_rank(0, "1,3")
    assert isinstance(some, faults.Faults)
    assert math.isnan(float(some.loss(x, 3))) and float(some.loss(x, 2)) == 1.5
    assert float(faults.for_rank(1, "3").loss(x, 3)) == 1.5  # rank 0 only
    monkeypatch.setenv("HVD_LM_STEP_SLEEP", "0.001")
    assert isinstance(faults.for_rank(0, ""), faults.Faults)
