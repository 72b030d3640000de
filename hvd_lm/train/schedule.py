"""Large-batch learning-rate rules and the warmup + linear-decay schedule.

From the reference talk (Puri et al. 2018, "Large Batch Training - LR scaling"): a base LR tuned at
a reference global batch (Radford et al.: Adam, 5e-4 at batch 128) is scaled to the actual global
batch B by

    none:    lr = base
    linear:  lr = base * B / B_ref          (Goyal et al. 2017)
    sqrt:    lr = base * sqrt(B / B_ref)    (Hoffer et al. 2017)

optionally capped (3e-3 did best across batch sizes in the reference), then warmed up linearly from
0 and decayed linearly to 0 at the last step ("decay to 0 over 100k steps or 3 epochs, whichever
comes first").
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch at call time only: `hvd-lm launch` plans LRs without it (0.8 s)
    import torch

LR_RULES = ("none", "linear", "sqrt")


def scaled_lr(base_lr: float, ref_batch: int, global_batch: int, rule: str,
              cap: float | None = None) -> float:
    """Peak learning rate for ``global_batch`` sequences per optimizer step.

    Args:
        base_lr: LR at ``ref_batch`` (e.g. 5e-4 at 128).
        ref_batch: reference global batch, in sequences.
        global_batch: actual global batch = world size x per-rank batch x backward passes per step.
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        cap: upper bound on the result, or None.

    Raises:
        ValueError: unknown rule or non-positive batch sizes / LR.
    """
    if rule not in LR_RULES:
        raise ValueError(f"lr rule must be one of {LR_RULES}, got {rule!r}")
    if ref_batch <= 0 or global_batch <= 0 or base_lr <= 0:
        raise ValueError(f"need positive base_lr/ref_batch/global_batch, got "
                         f"{base_lr}/{ref_batch}/{global_batch}")
    ratio = global_batch / ref_batch
    lr = base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
    return min(lr, cap) if cap is not None else lr


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str = "linear") -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based, counting applied steps only).

    Linear warmup over ``warmup_steps`` (step 0 gets 1/warmup), then with ``decay="linear"`` a
    linear fall to 0 at ``total_steps``; ``decay="none"`` holds the peak.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "none":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    return max(0.0, 1.0 - (step - warmup_steps) / span)


class Schedule:
    """The LR multiplier :class:`torch.optim.lr_scheduler.LambdaLR` calls with the applied-step
    count: :func:`lr_factor` until :meth:`replan` moves the last step, then from the step of the
    move a straight line from the multiplier it had there to 0 at the new last step, so the LR
    never jumps (a run trained to a deadline, ``--time-limit``, sets its length from measured
    step times and re-estimates it as it goes: :mod:`hvd_lm.train.deadline`).

    A callable object rather than a function: ``LambdaLR.state_dict()`` saves its attributes
    (plain ints and floats) and ``load_state_dict()`` restores them, so a checkpoint holds the
    plan.
    """

    def __init__(self, warmup_steps: int, total_steps: int, decay: str = "linear"):
        self.warmup_steps, self.total_steps, self.decay = warmup_steps, total_steps, decay
        self.anchor_step: int | None = None  # where the line to 0 starts after a replan
        self.anchor_factor = 1.0  # the multiplier there

    def __call__(self, step: int) -> float:
        if self.anchor_step is None or step < self.anchor_step or self.decay == "none":
            return lr_factor(step, self.warmup_steps, self.total_steps, self.decay)
        span = max(1, self.total_steps - self.anchor_step)
        return self.anchor_factor * max(0.0, (self.total_steps - step) / span)

    def replan(self, step: int, total_steps: int) -> None:
        """End the schedule at ``total_steps`` (>= ``step``, the applied steps so far): the
        multiplier at ``step`` stays what it was and falls linearly to 0 at ``total_steps``;
        during the warmup only the end moves (the warmup's line is the same)."""
        if step < self.warmup_steps and self.anchor_step is None:
            self.total_steps = total_steps
            return
        self.anchor_factor, self.anchor_step = self(step), step
        self.total_steps = max(step, total_steps)

    def reset(self, total_steps: int) -> None:
        """:func:`lr_factor` ending at ``total_steps`` again (no replan): a resumed run whose
        length comes from its configuration."""
        self.total_steps, self.anchor_step, self.anchor_factor = total_steps, None, 1.0


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                   decay: str = "linear") -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying a :class:`Schedule` (:func:`lr_factor` until replanned), reachable
    as :func:`schedule_of`. Call its ``step()`` only after an optimizer step that was applied
    (not one skipped for gradient overflow), so skipped steps do not advance it."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, Schedule(warmup_steps, total_steps, decay))


def schedule_of(scheduler: torch.optim.lr_scheduler.LambdaLR) -> Schedule:
    """The :class:`Schedule` a scheduler of :func:`make_scheduler` applies (every param group
    shares it)."""
    return scheduler.lr_lambdas[0]


def refresh_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Apply the scheduler's multiplier at its current step to the optimizer again (after its
    :class:`Schedule` was replanned): ``step()`` at the current step once more (``last_epoch``
    set back by one), which recomputes every group's ``lr`` and ``get_last_lr()``."""
    scheduler.last_epoch -= 1
    with warnings.catch_warnings():  # "step() before optimizer.step()": not a new step here
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def set_peak_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float) -> None:
    """Make ``peak_lr`` the scheduler's base LR and apply it to the optimiser at the current step
    (an elastic resize or a resume with another global batch: the rule's new peak, the same
    point of the schedule). Through the scheduler's public interface: ``base_lrs``, then
    ``step()`` at the current step again (``last_epoch`` set back by one; ``step()`` recomputes
    every group's ``lr`` and what ``get_last_lr()`` returns)."""
    scheduler.base_lrs = [peak_lr] * len(scheduler.optimizer.param_groups)
    refresh_lr(scheduler)
