"""LR rules against the reference talk's table, and the warmup/decay schedule."""
import warnings

import pytest
import torch

from hvd_lm.train.schedule import lr_factor, make_scheduler, scaled_lr, set_peak_lr


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


def test_scheduler_drives_optimizer():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, warmup_steps=0, total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_set_peak_lr_rescales_at_the_same_point_of_the_schedule():
    """An elastic resize or a resume with another global batch: the new peak times the schedule's
    factor at the current step (lr_factor, computed by hand here), in the optimizer and in
    get_last_lr; the step count and the following steps go on from there."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, warmup_steps=2, total_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # set_peak_lr itself must not warn
        set_peak_lr(sched, 4.0)
    want = 4.0 * (1 - (5 - 2) / 8)  # step 5 of a warmup 2, decay to 0 at 10
    assert sched.last_epoch == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(want)
    assert sched.get_last_lr() == pytest.approx([want])
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(4.0 * (1 - (6 - 2) / 8))
