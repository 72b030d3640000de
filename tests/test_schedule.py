"""LR rules against the reference talk's table, and the warmup/decay schedule."""

import pytest
import torch

from hvd_lm.train.schedule import LRPlan, lr_factor, saved_factor, scaled_lr


@pytest.mark.parametrize("rule,batch,want", [
    ("sqrt", 128, 5e-4), ("sqrt", 512, 1e-3),      # "Example LR scaling", square root column
    ("linear", 256, 1e-3), ("linear", 512, 2e-3),  # linear column
    ("sqrt", 256, 7.07e-4),                        # the talk rounds this one to 7.2e-4
    ("linear", 2048, 8e-3), ("sqrt", 2048, 2e-3),  # LR-schedule table, batch 2048
    ("sqrt", 8192, 4e-3), ("linear", 32768, 0.128),
])
def test_reference_table(rule, batch, want):
    assert scaled_lr(5e-4, 128, batch, rule) == pytest.approx(want, rel=2e-3)


def test_cap_and_none():
    assert scaled_lr(5e-4, 128, 32768, "linear", cap=3e-3) == 3e-3
    assert scaled_lr(5e-4, 128, 4096, "none") == 5e-4
    with pytest.raises(ValueError, match="rule"):
        scaled_lr(5e-4, 128, 256, "cubic")


def test_warmup_then_linear_decay_to_zero():
    f = [lr_factor(s, 4, 12) for s in range(13)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[8] == pytest.approx(0.5) and f[12] == 0.0
    assert all(a >= b for a, b in zip(f[4:], f[5:]))


def test_the_plan_sets_the_optimizer_lr_from_the_step():
    """The LR is a pure function of the applied-step count (as nanoGPT's get_lr): the loop sets
    it before each update; the same step gives the same LR whatever came before (a count undone
    after a skip needs nothing restored)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plan = LRPlan(1.0, warmup_steps=0, total_steps=4)
    lrs = [plan.apply(opt, step) for step in (0, 1, 2, 3)]
    assert lrs == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert opt.param_groups[0]["lr"] == 0.25 and plan.apply(opt, 1) == pytest.approx(0.75)


def test_a_new_peak_rescales_at_the_same_point_of_the_line():
    """An elastic resize or a resume with another global batch: the new peak times the plan's
    factor at the current step (lr_factor, computed by hand here)."""
    plan = LRPlan(1.0, warmup_steps=2, total_steps=10)
    plan.peak = 4.0
    assert plan.lr(5) == pytest.approx(4.0 * (1 - (5 - 2) / 8))  # warmup 2, 0 at 10
    assert plan.lr(6) == pytest.approx(4.0 * (1 - (6 - 2) / 8))


def test_a_checkpoint_of_the_old_lambdalr_scheduler_loads_into_the_plan():
    """Checkpoints written before the plan hold torch's LambdaLR state: the same numbers
    (lr_lambdas[0] the plan's fields, base_lrs[0] the peak) give the same LR at every step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    old = {"warmup_steps": 3, "total_steps": 40, "decay": "linear", "anchor_step": 20,
           "anchor_factor": 0.5}
    legacy = {"base_lrs": [2.0], "last_epoch": 20, "_last_lr": [1.0], "lr_lambdas": [old],
              "verbose": False, "_step_count": 21}
    plan = LRPlan(9.0, 0, 1)
    plan.load_state_dict(legacy)
    assert plan.peak == 2.0 and plan.lr(20) == pytest.approx(1.0)
    assert plan.lr(30) == pytest.approx(2.0 * 0.5 * 10 / 20)
    assert saved_factor(legacy, 20) == pytest.approx(0.5) and saved_factor(None, 3) is None
    fresh = LRPlan(1.0, 0, 1)
    fresh.load_state_dict(plan.state_dict())
    assert fresh.state_dict() == plan.state_dict()
    assert opt.param_groups[0]["lr"] == 2.0  # (loading sets nothing: the loop applies it)
