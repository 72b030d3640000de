"""Training to a deadline (``--time-limit``): how many optimizer steps fit before it, measured as
the run goes, so that the LR schedule reaches 0 at the deadline whatever the hardware.

A job's walltime (SLURM ``--time``, PBS ``walltime``) or a lent machine's minutes bound a run in
seconds, while the LR schedule (:mod:`hvd_lm.train.schedule`: warmup, then linear decay to 0,
Puri et al. 2018) is laid out in steps. The reference runs set their step counts by hand from a
throughput measured beforehand; :class:`DeadlinePlanner` measures it in the run itself:

* the time of every step attempt (the loop's iteration less the evaluations and checkpoints in
  it, data waits and small allreduces included), the first :data:`SKIP_ATTEMPTS` left out
  (kernel compilation, CUDA-graph capture, caches filling);
* each evaluation and checkpoint, timed when they happen; before the first, estimated: an
  evaluation from two windows of its forward pass timed on the spot and scaled to the split's
  windows, a checkpoint from its size (:func:`hvd_lm.formats.checkpoint.estimate_bytes`) at
  :data:`CHECKPOINT_BYTES_PER_S`.

From these, :meth:`DeadlinePlanner.plan` gives the last step: the time left, less a reserve for
the final evaluation, the final checkpoint (written completely) and a margin, divided by a step's
time with the periodic evaluations' and checkpoints' share added. The loop asks for a plan at its
control exchanges (rank 0 plans; the allreduce hands every rank the same step count) and moves
the schedule's end there (:meth:`hvd_lm.train.schedule.Schedule.replan`: the LR stays continuous
and falls to 0 at the new end), so a re-estimate as the run goes (a slower epoch start, the first
real checkpoint) bends the line without a jump. When no step fits anymore, the plan is the
current step: the run ends, validates and checkpoints before the deadline.

The deadline is ``limit`` seconds after this process started (``psutil``: the interpreter's own
start, imports included), like a job's walltime: each invocation, a resumed one too, has its own.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import psutil

#: Step attempts left out of the step time at the start (compilation, graph capture, warm-up).
SKIP_ATTEMPTS = 2
#: Attempts measured before the first plan (fewer when they already took MIN_MEASURED_S).
MIN_ATTEMPTS = 3
#: ... or seconds of measured attempts, whichever comes first.
MIN_MEASURED_S = 10.0
#: Step attempts the step time is averaged over (the most recent ones).
WINDOW = 200
#: Assumed checkpoint write rate before one is measured, bytes/s (a slow shared file system).
CHECKPOINT_BYTES_PER_S = 100e6
#: A re-plan moves the end only by more than this fraction of the steps left (or one step).
HYSTERESIS = 0.01


def process_start_time() -> float:
    """Unix time (seconds) at which this process started."""
    return psutil.Process().create_time()


@dataclass
class Cadence:
    """What the run does periodically besides steps (from its configuration).

    Attributes:
        eval_every: a validation every N applied steps (0: none but the final one).
        checkpoint_every: a checkpoint every N applied steps (0: none but the final one).
        checkpoint_minutes: ... and every M minutes of wall time (0: off).
        has_val: the run has a validation split (a final validation).
    """

    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_minutes: float = 0.0
    has_val: bool = True


class DeadlinePlanner:
    """The steps that fit before a deadline, from measured step, evaluation and checkpoint times.

    Args:
        limit_s: seconds from ``started`` to the deadline (``--time-limit``).
        started: Unix time the clock starts from (default: this process's start).
        cadence: the periodic evaluations and checkpoints.
        eval_estimate: () -> seconds one validation takes, asked once before one is measured
            (None: 0).
        checkpoint_estimate_s: seconds one checkpoint write takes before one is measured.
        margin_s: seconds kept free before the deadline (default 2 s + 1% of the limit).
        clock: the Unix-time clock (tests pass a fake one).
    """

    def __init__(self, limit_s: float, started: float | None = None,
                 cadence: Cadence | None = None, eval_estimate=None,
                 checkpoint_estimate_s: float = 0.0, margin_s: float | None = None,
                 clock=time.time):
        self.limit_s = float(limit_s)
        self.started = process_start_time() if started is None else started
        self.deadline = self.started + self.limit_s
        self.cadence = cadence or Cadence()
        self.eval_estimate = eval_estimate
        self.margin_s = 2.0 + 0.01 * self.limit_s if margin_s is None else margin_s
        self.clock = clock
        self.steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.skip = SKIP_ATTEMPTS
        self.eval_s: float | None = None  # the newest validation's seconds
        self.eval_estimated = False
        self.ckpt_write_s = checkpoint_estimate_s  # a whole write (the final one waits for it)
        self.ckpt_block_s = checkpoint_estimate_s  # what the loop waits (async: the copy)
        self.ckpt_measured = False

    # ---- measurements ----------------------------------------------------------------------------

    def step_done(self, seconds: float) -> None:
        """One step attempt's seconds (without evaluations and checkpoints)."""
        if self.skip > 0:
            self.skip -= 1
            return
        self.steps.append(seconds)

    def restart_measurement(self) -> None:
        """Forget the step times (the world changed: another step time)."""
        self.steps.clear()
        self.skip = 1

    def eval_done(self, seconds: float) -> None:
        """A validation took ``seconds``."""
        self.eval_s = seconds

    def checkpoint_done(self, write_s: float, blocked_s: float) -> None:
        """A checkpoint was written in ``write_s`` seconds, the loop blocked ``blocked_s``."""
        self.ckpt_write_s, self.ckpt_block_s, self.ckpt_measured = write_s, blocked_s, True

    # ---- the plan --------------------------------------------------------------------------------

    def left(self) -> float:
        """Seconds to the deadline (negative once past)."""
        return self.deadline - self.clock()

    @property
    def step_s(self) -> float | None:
        """Mean seconds of the measured step attempts, or None before :data:`MIN_ATTEMPTS` of
        them (or :data:`MIN_MEASURED_S` seconds' worth)."""
        n, total = len(self.steps), sum(self.steps)
        if n == 0 or (n < MIN_ATTEMPTS and total < MIN_MEASURED_S):
            return None
        return total / n

    def validation_s(self) -> float:
        """Seconds one validation takes: measured, else estimated once (0 without a split)."""
        if not self.cadence.has_val:
            return 0.0
        if self.eval_s is None and not self.eval_estimated:
            self.eval_estimated = True
            self.eval_s = self.eval_estimate() if self.eval_estimate is not None else 0.0
        return self.eval_s or 0.0

    def reserve_s(self) -> float:
        """Seconds kept for the end: the final validation, the final checkpoint's whole write
        and the margin."""
        return self.validation_s() + self.ckpt_write_s + self.margin_s

    def steps_that_fit(self) -> int | None:
        """Optimizer step attempts that fit before the deadline from now, or None while the
        step time is not measured yet."""
        t = self.step_s
        if t is None:
            return None
        c = self.cadence
        per_step = t
        if c.eval_every:
            per_step += self.validation_s() / c.eval_every
        if c.checkpoint_every:
            per_step += self.ckpt_block_s / c.checkpoint_every
        available = self.left() - self.reserve_s()
        if c.checkpoint_minutes > 0:  # the share of wall time timed checkpoints take
            available *= max(0.0, 1.0 - self.ckpt_block_s / (60.0 * c.checkpoint_minutes))
        return max(0, math.floor(available / per_step))

    def plan(self, step: int, total: int, cap: int | None = None) -> int | None:
        """The run's new last step, or None to keep ``total``.

        Args:
            step: applied steps so far.
            total: the current last step.
            cap: an upper bound (``--max-steps``, ``--epochs``), or None.

        Returns:
            ``step`` + the steps that fit (at most ``cap``) when that differs from ``total`` by
            more than :data:`HYSTERESIS` of the steps left (or by one step when few are left,
            and always when nothing fits anymore); None while the step time is not measured, or
            when the change is smaller.
        """
        fit = self.steps_that_fit()
        if fit is None:
            return None
        new = step + fit
        if cap is not None:
            new = min(new, cap)
        if new == total:
            return None
        if fit > 0 and abs(new - total) <= HYSTERESIS * max(total - step, 0):
            return None
        return new

    def describe(self) -> dict:
        """The plan's inputs, for the ``plan`` record of ``metrics.jsonl``: seconds."""
        return {"step_time": self.step_s, "eval_s": self.validation_s(),
                "checkpoint_write_s": self.ckpt_write_s,
                "checkpoint_measured": self.ckpt_measured, "reserve_s": self.reserve_s(),
                "left_s": self.left()}
