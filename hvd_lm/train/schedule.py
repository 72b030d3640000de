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


class LRPlan:
    """The learning rate as a pure function of the applied-step count (as nanoGPT's ``get_lr``):
    ``peak x`` :func:`lr_factor` until :meth:`replan` moves the last step, then from the step of
    the move a straight line from the multiplier it had there to 0 at the new last step, so the
    LR never jumps (a run trained to a deadline, ``--time-limit``, sets its length from measured
    step times and re-estimates it as it goes: :mod:`hvd_lm.train.deadline`). The loop sets the
    optimizer's LR from it before every update (:meth:`apply`), so a step counted late and then
    undone (:mod:`hvd_lm.train.counting`) or a rollback needs nothing restored but the count.

    Its state is six numbers (:meth:`state_dict`, ``torch.distributed.checkpoint``'s
    ``Stateful`` protocol) in the checkpoint and the elastic commit. ``peak`` is the configured
    rule's LR for the job's global batch (:func:`scaled_lr`): a resume or an elastic resize at
    another global batch sets it again, at the same point of the line.
    """

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, decay: str = "linear"):
        self.peak, self.warmup_steps, self.total_steps, self.decay = (
            peak, warmup_steps, total_steps, decay)
        self.anchor_step: int | None = None  # where the line to 0 starts after a replan
        self.anchor_factor = 1.0  # the multiplier there

    def factor(self, step: int) -> float:
        """The multiplier of the peak at applied step ``step`` (0-based)."""
        if self.anchor_step is None or step < self.anchor_step or self.decay == "none":
            return lr_factor(step, self.warmup_steps, self.total_steps, self.decay)
        span = max(1, self.total_steps - self.anchor_step)
        return self.anchor_factor * max(0.0, (self.total_steps - step) / span)

    def lr(self, step: int) -> float:
        """The learning rate of the update after ``step`` applied steps."""
        return self.peak * self.factor(step)

    def apply(self, optimizer, step: int) -> float:
        """Set every param group's ``lr`` to :meth:`lr` at ``step``; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def replan(self, step: int, total_steps: int) -> None:
        """End the line at ``total_steps`` (>= ``step``, the applied steps so far): the
        multiplier at ``step`` stays what it was and falls linearly to 0 at ``total_steps``;
        during the warmup only the end moves (the warmup's line is the same)."""
        if step < self.warmup_steps and self.anchor_step is None:
            self.total_steps = total_steps
            return
        self.anchor_factor, self.anchor_step = self.factor(step), step
        self.total_steps = max(step, total_steps)

    def reset(self, total_steps: int) -> None:
        """:func:`lr_factor` ending at ``total_steps`` again (no replan): a resumed run whose
        length comes from its configuration."""
        self.total_steps, self.anchor_step, self.anchor_factor = total_steps, None, 1.0

    _FIELDS = ("peak", "warmup_steps", "total_steps", "decay", "anchor_step", "anchor_factor")

    def state_dict(self) -> dict:
        """The plan's six numbers."""
        return {k: getattr(self, k) for k in self._FIELDS}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s numbers; a checkpoint written before the plan was a pure
        function holds a ``LambdaLR`` state (its ``lr_lambdas[0]`` the plan's fields,
        ``base_lrs[0]`` the peak), read the same way.

        Raises:
            KeyError: neither form."""
        if "lr_lambdas" in state:  # (written by torch.optim.lr_scheduler.LambdaLR)
            state = {**state["lr_lambdas"][0], "peak": state["base_lrs"][0]}
        for k in self._FIELDS:
            setattr(self, k, state[k])


def saved_factor(state: dict | None, step: int) -> float | None:
    """The LR multiplier a saved plan (:meth:`LRPlan.state_dict`, or an older ``LambdaLR``
    state) had at ``step``: where a run re-planned to a deadline continues from; None when
    nothing usable was saved."""
    try:
        plan = LRPlan(1.0, 0, 0)
        plan.load_state_dict(state)
        return plan.factor(step)
    except (TypeError, KeyError, IndexError, ValueError):
        return None
