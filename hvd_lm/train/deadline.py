"""When a run stops: at a deadline (``--time-limit``), at the end of a time budget across
allocations (``--time-budget``), or on the scheduler's signal (:class:`StopSignals`:
SIGTERM/SIGINT/SIGUSR1 from SLURM preemption, ``scancel --signal`` or Ctrl-C -> a stop flag the
loop allreduces, so every rank checkpoints at the same step; a line on stderr at once says
when). For the deadline and the budget: how many optimizer steps fit, measured as the run goes,
so that the LR schedule reaches 0 when the time is spent whatever the hardware.

A job's walltime (SLURM ``--time``, PBS ``walltime``) or a lent machine's minutes bound a run in
seconds, while the LR schedule (:mod:`hvd_lm.train.schedule`: warmup, then linear decay to 0,
Puri et al. 2018) is laid out in steps. The reference runs set their step counts by hand from a
throughput measured beforehand (Megatron-LM plans by iterations, ``--train-iters``, and stops a
job by ``--exit-duration-in-mins``); :class:`DeadlinePlanner` measures it in the run itself:

* the time of every step attempt (the loop's iteration less the evaluations and checkpoints in
  it, data waits and small allreduces included), the first :data:`SKIP_ATTEMPTS` left out
  (kernel compilation, CUDA-graph capture, caches filling);
* each evaluation and checkpoint, timed when they happen; before the first, estimated: an
  evaluation from two windows of its forward pass timed on the spot and scaled to the split's
  windows, a checkpoint from its size (:func:`hvd_lm.formats.checkpoint.estimate_bytes`) at
  :data:`CHECKPOINT_BYTES_PER_S`.

Two times bound a run, and the planner keeps them apart:

* **the plan's end** (:meth:`DeadlinePlanner.plan`), where the LR reaches 0: ``--time-limit``
  seconds after this process started, or with ``--time-budget`` the budget less the seconds
  already trained in earlier allocations (:attr:`hvd_lm.train.resume.Position.trained_s`, kept
  in the checkpoint), counted from the loop's first step. The last step is the time left, less a
  reserve for the final evaluation, the final checkpoint (written completely) and a margin,
  divided by a step's time with the periodic evaluations' and checkpoints' share added.
* **the allocation's stop** (:meth:`DeadlinePlanner.stop_step`): with ``--time-budget`` and a
  ``--time-limit`` that comes first (a 40-hour plan in 4-hour jobs), the step after which no
  other fits before the limit with its checkpoint: the run stops there with a checkpoint
  (``stop: time-limit``), and the next allocation's ``--resume auto`` continues the same line.
  A step whose end the measured step time puts past the limit never starts, without a budget too:
  a run that cannot fit one more step says so and checkpoints.

The loop asks for both at its control exchanges (rank 0 plans; the allreduce hands every rank
the same steps) and moves the schedule's end (:meth:`hvd_lm.train.schedule.LRPlan.replan`:
the LR stays continuous and falls to 0 at the new end), so a re-estimate as the run goes (a
slower epoch start, the first real checkpoint) bends the line without a jump.

Time is the wall clock, except under the test hook ``HVD_LM_VIRTUAL_STEP_S`` (environment,
:func:`virtual_step_s`): then every step attempt takes exactly that many seconds of a virtual
clock and nothing else takes any (start-up, evaluations, checkpoints), so that a test of the plan
(three allocations equal one run) does not depend on the machine's speed.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from hvd_lm.comm.world import env_seconds, horovodrun_mpi_shell, under_openmpi
from hvd_lm.util.lock import pid_alive

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
#: The margin kept before a deadline: 2 s + 1% of the span it ends, at most this (seconds).
MAX_MARGIN_S = 60.0


def virtual_step_s() -> float | None:
    """Seconds every step attempt takes on the planner's virtual clock (the test hook
    ``HVD_LM_VIRTUAL_STEP_S``), or None: the wall clock.

    Raises:
        ValueError: the variable is set but not a positive number (naming it).
    """
    return env_seconds("HVD_LM_VIRTUAL_STEP_S", None)


def margin_for(span_s: float) -> float:
    """Seconds kept free before a deadline ``span_s`` seconds away: 2 s + 1%, at most
    :data:`MAX_MARGIN_S`."""
    return min(2.0 + 0.01 * span_s, MAX_MARGIN_S)


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
    """The steps that fit before the plan's end and before the allocation's stop, from measured
    step, evaluation and checkpoint times (module docstring).

    Args:
        limit_s: seconds from ``started`` to the allocation's deadline (``--time-limit``), or
            None.
        budget_s: seconds of training the whole run may take over every allocation
            (``--time-budget``), or None: then the plan ends at the limit.
        trained_s: seconds of training before this allocation (the checkpoint's).
        started: Unix time the limit counts from (default: this process's start, psutil's
            ``create_time``).
        cadence: the periodic evaluations and checkpoints.
        eval_estimate: () -> seconds one validation takes, asked once before one is measured
            (None: 0).
        checkpoint_estimate_s: seconds one checkpoint write takes before one is measured.
        margin_s: seconds kept free before the plan's end (default :func:`margin_for` the budget,
            or the limit); the stop keeps :func:`margin_for` the limit.
        clock: the Unix-time clock (tests pass a fake one).
        virtual_step_s: every step attempt takes exactly this many seconds of a virtual clock
            that nothing else advances (the test hook :func:`virtual_step_s`); None: ``clock``.

    Raises:
        ValueError: neither a limit nor a budget, or one that is not positive.
    """

    def __init__(self, limit_s: float | None, budget_s: float | None = None, trained_s: float = 0.0,
                 started: float | None = None, cadence: Cadence | None = None, eval_estimate=None,
                 checkpoint_estimate_s: float = 0.0, margin_s: float | None = None,
                 clock=time.time, virtual_step_s: float | None = None):
        if limit_s is None and budget_s is None:
            raise ValueError("a deadline needs a time limit or a time budget")
        for name, value in (("time limit", limit_s), ("time budget", budget_s)):
            if value is not None and not value > 0:
                raise ValueError(f"the {name} must be positive, got {value}")
        self.virtual, self.virtual_now = virtual_step_s, 0.0
        self.clock = (lambda: self.virtual_now) if virtual_step_s else clock
        if started is None:
            started = 0.0 if virtual_step_s else psutil.Process().create_time()
        self.limit_s = None if limit_s is None else float(limit_s)
        self.budget_s = None if budget_s is None else float(budget_s)
        self.trained_before = float(trained_s)
        self.stop_at = None if limit_s is None else started + self.limit_s
        self.loop_started: float | None = None
        self.cadence = cadence or Cadence()
        self.eval_estimate = None if virtual_step_s else eval_estimate
        # (the stop's margin matters only with a limit)
        self.margin_s = margin_for(self.budget_s or self.limit_s) if margin_s is None else margin_s
        self.stop_margin_s = margin_for(self.limit_s or 0.0) if margin_s is None else margin_s
        self.steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.skip = SKIP_ATTEMPTS
        self.slowest_s = 0.0  # the slowest attempt seen (the skipped ones too)
        self.eval_s: float | None = None  # the newest validation's seconds
        estimate = 0.0 if virtual_step_s else checkpoint_estimate_s
        # a whole write (the final one waits for it), and what the loop waits (async: the copy)
        self.ckpt_write_s = self.ckpt_block_s = estimate
        self.ckpt_measured = False

    # ---- the clock -------------------------------------------------------------------------------

    def start(self) -> None:
        """The training loop starts now: trained time counts from here, and with a budget the
        plan ends when the budget left is spent."""
        if self.loop_started is None:
            self.loop_started = self.clock()

    @property
    def end_at(self) -> float:
        """Clock time at which the plan ends (the LR reaches 0)."""
        if self.budget_s is None:
            return self.stop_at
        self.start()
        return self.loop_started + self.budget_s - self.trained_before

    @property
    def stops_first(self) -> bool:
        """Whether the allocation's limit comes before the plan's end (the run then stops with
        a checkpoint, the LR above 0, for the next allocation to continue)."""
        return self.stop_at is not None and self.stop_at < self.end_at

    def trained_s(self) -> float:
        """Seconds trained over every allocation so far (this one's from the loop's start)."""
        if self.loop_started is None:
            return self.trained_before
        return self.trained_before + max(0.0, self.clock() - self.loop_started)

    # ---- measurements ----------------------------------------------------------------------------

    def attempt_begins(self) -> None:
        """A step attempt starts: the virtual clock (the test hook) moves past it, as the wall
        clock will have by the time the loop asks for a plan in it."""
        if self.virtual:
            self.virtual_now += self.virtual

    def step_done(self, seconds: float) -> None:
        """One step attempt's seconds (without evaluations and checkpoints; the virtual clock's
        step under the test hook)."""
        if self.virtual:
            seconds = self.virtual
        self.slowest_s = max(self.slowest_s, seconds)
        if self.skip > 0:
            self.skip -= 1
            return
        self.steps.append(seconds)

    def eval_done(self, seconds: float) -> None:
        """A validation took ``seconds`` (none on the virtual clock)."""
        self.eval_s = 0.0 if self.virtual else seconds

    def checkpoint_done(self, write_s: float, blocked_s: float) -> None:
        """A checkpoint was written in ``write_s`` seconds, the loop blocked ``blocked_s``."""
        if self.virtual:
            write_s = blocked_s = 0.0
        self.ckpt_write_s, self.ckpt_block_s, self.ckpt_measured = write_s, blocked_s, True

    # ---- the plan --------------------------------------------------------------------------------

    def left(self) -> float:
        """Seconds to the plan's end (negative once past)."""
        return self.end_at - self.clock()

    def stop_left(self) -> float | None:
        """Seconds to the allocation's limit (None without one)."""
        return None if self.stop_at is None else self.stop_at - self.clock()

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
        if self.eval_s is None:  # estimated once
            self.eval_s = self.eval_estimate() if self.eval_estimate is not None else 0.0
        return self.eval_s

    def reserve_s(self) -> float:
        """Seconds kept for the end: the final validation, the final checkpoint's whole write
        and the margin."""
        return self.validation_s() + self.ckpt_write_s + self.margin_s

    def fit(self, available: float, step_s: float) -> int:
        """Steps of ``step_s`` seconds that fit in ``available`` seconds, with the periodic
        evaluations' and checkpoints' share added to each step and the timed checkpoints'
        share of the wall time taken out."""
        c = self.cadence
        if c.eval_every:
            step_s += self.validation_s() / c.eval_every
        if c.checkpoint_every:
            step_s += self.ckpt_block_s / c.checkpoint_every
        if c.checkpoint_minutes > 0:  # the share of wall time timed checkpoints take
            available *= max(0.0, 1.0 - self.ckpt_block_s / (60.0 * c.checkpoint_minutes))
        return max(0, math.floor(available / step_s))

    def plan(self, step: int, total: int, cap: int | None = None) -> int | None:
        """The run's new last step (where the LR reaches 0), or None to keep ``total``.

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
        if self.step_s is None:  # the step time is not measured yet
            return None
        fit = self.fit(self.left() - self.reserve_s(), self.step_s)
        new = step + fit if cap is None else min(step + fit, cap)
        if new == total or (fit > 0 and abs(new - total) <= HYSTERESIS * max(total - step, 0)):
            return None
        return new

    def stop_step(self, step: int, running_s: float = 0.0) -> int | None:
        """The last step this allocation may reach before its limit, or None: no limit, or no
        attempt timed yet. ``running_s``: seconds the attempt that just ended took (the loop
        times an attempt when the next begins; this one counts at once). ``step`` itself once
        the limit has passed: a step that ended past it (a slow first step, a straggler) stops
        the run there, the step time measured or not. Before the step time is measured the
        slowest attempt so far stands for it (a first step slower than the limit stops the run
        after it). Kept free after it: the checkpoint's whole write and the limit's margin, and
        the final validation too when the limit is also the plan's end (then only until the
        step time is measured: from there :meth:`plan` ends the run before the limit)."""
        left = self.stop_left()
        if left is None:
            return None
        self.slowest_s = max(self.slowest_s, self.virtual or running_s)
        if left <= 0:
            return step
        if self.slowest_s <= 0 or (self.step_s and not self.stops_first):
            return None  # a limit that is the plan's end: the measured plan ends before it
        t = self.step_s or self.slowest_s
        reserve = self.ckpt_write_s + self.stop_margin_s
        if not self.stops_first:
            reserve += self.validation_s()
        return step + self.fit(left - reserve, t)

    def describe(self) -> dict:
        """The plan's inputs, for the ``plan`` record of ``metrics.jsonl``: seconds."""
        d = {"step_time": self.step_s, "eval_s": self.validation_s(),
             "checkpoint_write_s": self.ckpt_write_s, "checkpoint_measured": self.ckpt_measured,
             "reserve_s": self.reserve_s(), "left_s": self.left()}
        if self.budget_s is not None:
            d.update(budget_s=self.budget_s, trained_s=self.trained_s(),
                     stop_left_s=self.stop_left())
        return d

    def summary(self) -> dict:
        """What ``summary.json`` gets (seconds): the limit, the seconds left before it (before
        the plan's end without one, or when the plan ended first), and with a budget the
        budget, the seconds trained and the budget left."""
        left = self.stop_left() if self.stops_first or self.budget_s is None else self.left()
        out = {"time_limit_s": self.limit_s, "deadline_left_s": round(left, 3)}
        if self.budget_s is not None:
            trained = self.trained_s()
            out.update(time_budget_s=self.budget_s, trained_s=round(trained, 3),
                       budget_left_s=round(self.budget_s - trained, 3))
        return out

    def stopped_text(self, step: int, run_cfg) -> str:
        """The line a run stopped at its allocation's limit before its plan's end prints:
        where, why, and how the plan continues (``run_cfg``: the run's settings, for the flags
        as given)."""
        t = self.step_s or self.slowest_s
        why = (f"the --time-limit {run_cfg.time_limit} leaves no time for step {step + 1:,} "
               f"(a step ~{t:.3g} s, the checkpoint ~{self.ckpt_write_s:.3g} s, "
               f"{self.stop_margin_s:.3g} s kept)")
        if self.limit_s is not None and t >= self.limit_s:
            why = (f"the --time-limit {run_cfg.time_limit} ({self.limit_s:.0f} s) is shorter than "
                   f"one step (~{t:.3g} s): the run ended past it")
        if self.budget_s is not None and self.stops_first:
            then = (f"{self.trained_s():,.0f} s of the --time-budget {run_cfg.time_budget} "
                    "trained: run again with --resume auto to continue the plan (the launch "
                    "templates requeue the job)")
        else:
            then = ("the LR did not reach 0: give a longer --time-limit, or --resume auto "
                    "with --time-budget to plan over several allocations")
        return f"stopped at step {step:,} with a checkpoint: {why}; {then}"


class StopSignals:
    """Turns SIGTERM/SIGINT/SIGUSR1 into a stop flag (:attr:`received` = the signal number):
    the loop checkpoints on every rank at the same step and exits 0. With ``announce`` (each
    host's local rank 0) the signal is acknowledged at once in one line: one line per host, not
    per rank.

    Under ``horovodrun --mpi`` a signal to horovodrun kills only the ``/bin/sh -c mpirun`` it
    became (:func:`hvd_lm.comm.world.horovodrun_mpi_shell`); a daemon thread watches that
    shell once a second and raises the flag (as SIGTERM) when it is gone.

    Under OpenMPI's ``mpirun`` a SIGTERM/SIGINT reaching a rank means mpirun is tearing the job
    down: it has stopped reading the ranks' stdout/stderr and sends SIGKILL after
    ``odls_base_sigkill_timeout``. A rank that kept printing (a log line per step, the progress
    bar) would block on the full pipe and be killed before its checkpoint, so the ranks then send
    their console to /dev/null (``metrics.jsonl`` still gets every record).
    """

    def __init__(self, watch_interval_s: float = 1.0, describe=None, announce: bool = True) -> None:
        self.received: int | None = None
        #: () -> str: when the stop happens (set by the loop: the step, the steps to go)
        self.describe = describe
        #: this rank says that a signal came (one rank per host: local rank 0)
        self.announce = announce
        self.mpirun_tears_down = under_openmpi()
        self.previous = {sig: signal.signal(sig, self._handler)
                         for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        self.wakeup_fd: int | None = None
        self._watch_wakeups()
        shell = horovodrun_mpi_shell()
        if shell is not None:
            threading.Thread(target=self._watch, args=(shell, watch_interval_s), daemon=True,
                             name="launcher-watchdog").start()

    def restore(self) -> None:
        """Put back the handlers there were before (the run is over: a signal from now on, e.g.
        mpirun tearing down a failed job, ends the process as it would have, instead of raising
        a flag no loop reads). After a stop on a signal, the run checkpointed and exits 0: a
        second SIGTERM/SIGINT of the same teardown (a launcher's, while this rank exits) is
        ignored, not taken as a kill (exit 143 turned horovodrun's clean stop into a failure)."""
        stopping = self.received is not None
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            for sig, handler in self.previous.items():
                ignore = stopping and sig in (signal.SIGTERM, signal.SIGINT)
                signal.signal(sig, signal.SIG_IGN if ignore else handler)
            if self.wakeup_fd is not None:
                signal.set_wakeup_fd(self.wakeup_fd)

    def _handler(self, signum, frame) -> None:
        self.received = signum
        if self.mpirun_tears_down and signum in (signal.SIGTERM, signal.SIGINT):
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):  # what Python, tqdm and Horovod's C++ write to
                os.dup2(devnull, fd)
            os.close(devnull)

    def _watch_wakeups(self) -> None:
        """Say at once that a stop signal arrived: Python runs signal handlers only between
        bytecodes of the main thread, which may be inside a long step or a collective, so the
        C-level handler's wakeup byte (``signal.set_wakeup_fd``) wakes a thread that prints."""
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            self.wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread (tests building a trainer in one)
            return
        threading.Thread(target=self._acknowledge, args=(r,), daemon=True,
                         name="stop-acknowledge").start()

    def _acknowledge(self, fd: int) -> None:
        said = False
        while True:
            data = os.read(fd, 64)
            if not data:
                return
            signum = next((b for b in data if b in self.previous), None)  # a stop signal
            if signum is None or said or not self.announce:
                continue
            said = True
            if self.mpirun_tears_down and signum != signal.SIGUSR1:
                continue  # mpirun stopped reading our output: a line could block (above)
            when = ""
            if self.describe is not None:
                with contextlib.suppress(Exception):
                    when = self.describe()
            # a promise, not a fact: the checkpoint's own line follows once it is written
            print(f"hvd-lm train: {signal.Signals(signum).name} received: {when or 'stopping'}"
                  f", to checkpoint there and exit 0 (host {socket.gethostname()}; rank 0 "
                  "confirms the checkpoint once saved)", file=sys.stderr, flush=True)

    def _watch(self, pid: int, interval: float) -> None:
        while self.received is None:
            if not pid_alive(pid):
                print(f"horovodrun (pid {pid}) is gone: checkpointing and stopping",
                      file=sys.stderr, flush=True)
                self.received = signal.SIGTERM
                return
            time.sleep(interval)
