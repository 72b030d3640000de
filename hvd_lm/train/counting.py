"""The loop's step count without a host sync per step, for a step that decides its skip on the
device (:func:`hvd_lm.train.step.decides_on_device`).

:meth:`StepCounter.count_step` counts a step once its outcome (applied or skipped) is known on
the host: the step count advances on applied steps only (and with it the learning rate, a
function of the count: :class:`hvd_lm.train.schedule.LRPlan`, set by the loop before each
update). Reading the outcome right after the step would drain the device's queue every step (the
host would wait for the update to finish before queuing the next step's forward). Instead
(:class:`StepCounter`, a component the trainer holds):

* at a step where the count decides something (a log, a validation, a checkpoint or commit,
  the last step or the last windows, the control exchange of stop signals and timed
  checkpoints, a skip streak one short of ``--max-skipped-steps``), the outcome is read at once
  and counted exactly (:meth:`StepCounter.count`); with ``--log-every 1`` that is every
  step;
* at any other step the step is counted as applied, speculatively (the step count
  advances; the loop's conditions at such a step are false either way), and its
  outcome is read during the next step, after that step's forward and backward are queued and
  before its update (:meth:`StepCounter.settle`, called by the loop between the step's halves): the
  read waits for the decision alone (:class:`hvd_lm.train.step.DeviceOutcome`), never for
  queued work. A skipped step is then un-counted (the step count back, and with it the learning
  rate the loop sets next) and counted as a skip (the skip record, the skipped-step count, the
  divergence guard) before the next update runs, so every update uses the learning rate of the
  exact count, as when each step was read at once.

The speculation never outlives one step, every rank speculates and settles alike (the outcome
comes from the allreduced gradients), and the count at every checkpoint, log and stop is exact:
a run, its resume and its records are those of a run that read every step at once. An elastic
rollback to a commit (a new position) drops a pending step: it was undone with the rest.

:class:`CharCount`: the characters trained on, by all ranks, exact across world-size changes
(a sum over ranks when asked for: at a checkpoint, an elastic commit and the summary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from hvd_lm.comm import engine
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.resume import Position
from hvd_lm.train.settings import RunConfig
from hvd_lm.train.step import State, StepResult


class CharCount:
    """Characters trained on: ``base`` by all ranks before this count started (a resume's, a
    commit's), plus ``local``, this rank's since.

    Args:
        base: the characters already trained on (``Position.chars_trained``).
    """

    def __init__(self, base: int):
        self.base, self.local = base, 0

    def add(self, chars: int) -> None:
        """This rank trained on ``chars`` more characters."""
        self.local += chars

    def total(self) -> int:
        """Characters trained on by all ranks (every rank calls it at the same point)."""
        return self.base + int(engine.allreduce_sum([float(self.local)],  # collective: sum
                                                  name="chars_total")[0])

    def rebase(self, total: int) -> None:
        """Count from ``total`` (a commit's exact count, or a rolled-back one)."""
        self.base, self.local = total, 0


class StepCounter:
    """The trainer's step counting, with the outcome read a step late where nothing depends on
    it (module docstring). The position it counts in (:class:`hvd_lm.train.resume.Position`)
    and the loop's current bounds are arguments of each call; what it advances besides is held.

    Args:
        settings: the run's settings (``cfg.run``: the log, eval, checkpoint and commit
            cadences, ``elastic``).
        k: windows per step (``backward_passes_per_step``).
        total_windows: the windows this run may read (a non-elastic run stops before it).
        scaler: the loss scaler (its scale is in the ``skip`` record).
        guard: the divergence guard, told of every attempt.
        metrics: the progress bar ticks an applied step; a skip is a ``skip`` record.
        restart_state: () -> the recurrent state to restart from, zeros (``init_state``).
    """

    def __init__(self, settings: RunConfig, k: int, total_windows: int, scaler,
                 guard: DivergenceGuard, metrics: Metrics, restart_state: Callable[[], State]):
        self.settings, self.k, self.total_windows = settings, k, total_windows
        self.scaler = scaler
        self.guard, self.metrics, self.restart_state = guard, metrics, restart_state
        #: (the step's result, the position it was counted in)
        self.pending: tuple | None = None

    def count_step(self, pos: Position, applied: bool, grad_norm: float,
                   state: State | None = None) -> State | None:
        """Count one attempt in ``pos``: an applied step advances the step count (and so the
        LR); a skipped one is counted (and logged as a ``skip`` record).

        Returns:
            ``state`` (the recurrent state after the attempt), or zeros in its place when the
            attempt was skipped and it is not finite (None stays None).
        """
        self.guard.attempt(applied)
        self.metrics.tick(1 if applied else 0)
        if applied:
            pos.step += 1
            return state
        pos.skipped_steps += 1
        if state is not None and not all(bool(torch.isfinite(s).all()) for s in state):
            state = self.restart_state()
        self.metrics.record("skip", pos.step, skipped_steps=pos.skipped_steps, grad_norm=grad_norm,
                            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled()
                            else None)
        return state

    def count(self, r: StepResult, pos: Position, total_steps: int,
              next_control: int) -> StepResult:
        """Count step ``r`` in ``pos``: at once, from its outcome read on the host, where the
        count decides something at this step (:meth:`counts_now`) or the outcome is already on
        the host; else as applied, to be settled by :meth:`settle`.

        Returns:
            ``r`` with ``applied`` (bool) and ``grad_norm`` (float) read and ``state`` the one
            to continue from (:meth:`count_step`), or, when counted speculatively, with
            ``applied`` True and ``grad_norm`` still a device tensor (the loop reads neither at
            such a step).
        """
        if r.outcome is None or self.counts_now(pos, total_steps, next_control):
            r = r.read()
            state = self.count_step(pos, r.applied, r.grad_norm, r.state)
            return r if state is r.state else dataclasses.replace(r, state=state)
        self.pending = (r, pos)
        pos.step += 1
        return dataclasses.replace(r, applied=True)

    def counts_now(self, pos: Position, total_steps: int, next_control: int) -> bool:
        """Whether the step just taken must be counted exactly now: were it applied, the count
        would reach a multiple of ``log_every``, ``eval_every``, ``checkpoint_every`` or
        ``commit_every`` or the last step (``total_steps``); or this attempt exchanges the
        control flags (the attempt ``next_control``: about once a second of steps); or the next
        step cannot run for lack of windows; or one more skip would end the run
        (``max_skipped_steps``)."""
        run = self.settings
        step = pos.step + 1
        if step >= total_steps or pos.attempts + 1 >= next_control:
            return True  # the last step, or a control exchange (a stop, a checkpoint, a plan)
        if any(n and step % n == 0 for n in (run.log_every, run.eval_every, run.checkpoint_every,
                                             run.commit_every if run.elastic else 0)):
            return True
        if not run.elastic and pos.window + self.k > self.total_windows:
            return True
        return self.guard.one_skip_from_the_end()

    def settle(self, pos: Position) -> None:
        """Count the pending step exactly (the loop calls it between
        :func:`~hvd_lm.train.step.backward` and :func:`~hvd_lm.train.step.update`: before the next
        update, so that it uses the learning rate of the exact count): applied, its
        speculation stands; skipped, it is undone and counted as a skip. ``pos``: the loop's
        position now (another one than the pending step's after an elastic rollback: the step went
        with it). A skip is counted without restarting the recurrent state: the step in progress
        already started from it, and a step decided on the device zeroed a skipped step's non-finite
        state itself (:func:`hvd_lm.train.step.train_step`)."""
        if self.pending is None:
            return
        r, counted_in = self.pending
        self.pending = None
        if counted_in is not pos:  # an elastic rollback since: the step went with it
            return
        r = r.read()
        pos.step -= 1  # the speculative count taken back, then counted exactly
        self.count_step(pos, r.applied, r.grad_norm)
