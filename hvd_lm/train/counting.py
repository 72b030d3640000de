"""The loop's step count without a host sync per step, for a step that decides its skip on the
device (:func:`hvd_lm.train.step.decides_on_device`).

:meth:`hvd_lm.train.loop.Trainer.count_step` counts a step once its outcome (applied or skipped)
is known on the host: the step count and the learning-rate schedule advance on applied steps
only. Reading the outcome right after the step would drain the device's queue every step (the
host would wait for the update to finish before queuing the next step's forward). Instead
(:class:`LazyCounting`, a mixin of the trainer):

* at a step where the count decides something (a log, a validation, a checkpoint or commit,
  the last step or the last windows, the control exchange of stop signals and timed
  checkpoints, a skip streak one short of ``--max-skipped-steps``), the outcome is read at once
  and counted exactly (:meth:`LazyCounting.count_lazily`); with ``--log-every 1`` that is every
  step;
* at any other step the step is counted as applied, speculatively (the step count and the
  schedule advance; the loop's conditions at such a step are false either way), and its
  outcome is read during the next step, after that step's forward and backward are queued and
  before its update (:meth:`LazyCounting.settle_step`, train_step's ``before_update``): the
  read waits for the decision alone (:class:`hvd_lm.train.step.DeviceOutcome`), never for
  queued work. A skipped step is then un-counted (the step count back, the schedule restored
  from its state before the speculation, the parameter groups' learning rate with it) and
  counted as a skip (the skip record, the skipped-step count, the divergence guard) before the
  next update runs, so every update uses the learning rate of the exact count, as when each
  step was read at once.

The speculation never outlives one step, every rank speculates and settles alike (the outcome
comes from the allreduced gradients), and the count at every checkpoint, log and stop is exact:
a run, its resume and its records are those of a run that read every step at once. An elastic
rollback to a commit (a new position) drops a pending step: it was undone with the rest.
"""

from __future__ import annotations

import copy
import dataclasses

from hvd_lm.train.step import StepResult


class LazyCounting:
    """The trainer's step counting with the outcome read a step late where nothing depends on
    it (module docstring). Uses the trainer's ``pos``, ``scheduler``, ``optimizer``, ``guard``,
    ``log``, ``cfg``, ``k``, ``total_steps``, ``total_windows``, ``next_control`` and its
    ``count_step(applied, grad_norm)``."""

    #: (the step's result, the position it was counted in, the schedule's state before it)
    pending: tuple | None = None

    def count_lazily(self, r: StepResult) -> StepResult:
        """Count step ``r``: at once, from its outcome read on the host, where the count decides
        something at this step (:meth:`counts_now`) or the outcome is already on the host;
        else as applied, to be settled by :meth:`settle_step`.

        Returns:
            ``r`` with ``applied`` (bool) and ``grad_norm`` (float) read, or, when counted
            speculatively, with ``applied`` True and ``grad_norm`` still a device tensor (the
            loop reads neither at such a step).
        """
        if r.outcome is None or self.counts_now():
            r = r.read()
            self.count_step(r.applied, r.grad_norm)
            return r
        self.pending = (r, self.pos, copy.deepcopy(self.scheduler.state_dict()))
        self.pos.step += 1
        self.scheduler.step()
        return dataclasses.replace(r, applied=True)

    def counts_now(self) -> bool:
        """Whether the step just taken must be counted exactly now: were it applied, the count
        would reach a multiple of ``log_every``, ``eval_every``, ``checkpoint_every`` or
        ``commit_every`` or the last step; or this attempt exchanges the control flags
        (``next_control``: about once a second of steps); or the next step cannot run for lack
        of windows; or one more skip would end the run (``max_skipped_steps``)."""
        run, pos = self.cfg.run, self.pos
        step = pos.step + 1
        if step >= self.total_steps or pos.attempts + 1 >= self.next_control:
            return True  # the last step, or a control exchange (a stop, a checkpoint, a plan)
        if any(n and step % n == 0 for n in (run.log_every, run.eval_every, run.checkpoint_every,
                                             run.commit_every if run.elastic else 0)):
            return True
        if not run.elastic and pos.window + self.k > self.total_windows:
            return True
        guard = self.guard
        return bool(guard.max_skipped and guard.skipped_in_a_row + 1 >= guard.max_skipped)

    def settle_step(self) -> None:
        """Count the pending step exactly (``train_step``'s ``before_update``: before the next
        update, so that it uses the schedule's learning rate of the exact count): applied, its
        speculation stands; skipped, it is undone and counted as a skip."""
        if self.pending is None:
            return
        r, pos, schedule = self.pending
        self.pending = None
        if pos is not self.pos:  # an elastic rollback since: the step went with it
            return
        r = r.read()
        if r.applied:
            self.guard.attempt(True)
            self.log.tick(1)
            return
        pos.step -= 1
        self.scheduler.load_state_dict(schedule)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        self.count_step(False, r.grad_norm)
