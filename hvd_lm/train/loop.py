"""The training loop: data-parallel TBPTT training of the byte-level LM with Horovod.

One optimizer step (per rank, B rows x T bytes per window, ``backward_passes_per_step`` = k) is
:func:`hvd_lm.train.step.backward` (forward, loss, backward, Horovod's synchronize) then
:func:`hvd_lm.train.step.update` (unscale and clip, step or skip), the two halves of the
``train_step`` every benchmark times; :meth:`Trainer.steps` is the loop around them: count the
previous step between the halves, count the step (the LR schedule advances on applied steps only),
one tiny allreduce of control flags about once a second of steps (at most every
``run.control_every`` attempts, every attempt when steps are slow: a preemption signal or a due
time-based checkpoint on any rank stops or checkpoints every rank at the same step; with
``--time-limit`` rank 0's plan of the last step, :mod:`hvd_lm.train.deadline`), log, validate, stop
a diverged run, checkpoint. Each line of it that is a collective says so (``# collective:``): every
rank must reach it at the same step.

The host does not wait on the device per step: the next window is read ahead on a thread
(``train.data.Prefetcher``), the loss is summed on the device and read at log time, and with
torch's fused optimizers the skip of a non-finite step is decided on the device and read a step
late where nothing depends on it (:mod:`hvd_lm.train.counting`; the 1-bit optimizers and fp16's
GradScaler read the norm on the host). Under Horovod on CUDA the stream is drained just before
the allreduce wait, which costs nothing (the host then blocks on the allreduce, which needs the
backward done) and splits each step's time into device compute and wait
(``compute_time_max``, a slow GPU's straggling).

The :class:`Trainer` is the loop, and it holds its parts, as torchtitan's trainer does, each in its
own module, given what it needs when built or called, none reading the trainer: the run's parts
(:class:`hvd_lm.train.startup.RunParts`: model, optimizer, schedule, scaler, streams, world), its
folder (:class:`hvd_lm.train.rundir.RunFolder`), the metrics (:class:`hvd_lm.train.metrics.Metrics`:
sums over ranks, rank 0 logs), the checkpointer (:class:`hvd_lm.train.checkpointer.Checkpointer`),
the step count (:class:`hvd_lm.train.counting.StepCounter`, ``CharCount``), with ``run.elastic`` the
elastic state (:class:`hvd_lm.train.elastic.Elastic`: the same loop under ``hvd.elastic.run``), the
divergence guard (:mod:`hvd_lm.train.guard`), the ``--time-limit`` planner and the stop signals
(:mod:`hvd_lm.train.deadline`).

Every collective is marked ``# collective:`` where it is reached, in the loop and in the part that
makes it (Horovod's ``examples/pytorch`` mark theirs ``# Horovod:``, here kept for elastic).

Without ``run.elastic``, a lost peer (its host's link down, the host or the process gone) fails
the collective it was in after Gloo's ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (``engine.gloo_timeout_s``);
each surviving node's first rank then probes the others (:mod:`hvd_lm.comm.peers`) and the job
stops with one line naming the lost rank's host and the newest complete checkpoint
(:class:`~hvd_lm.comm.peers.LostPeer`), from which ``--resume auto`` continues.
"""

from __future__ import annotations

import collections
import json
import sys
import time

from hvd_lm.comm import engine, peers
from hvd_lm.model.mfu import device_peak
from hvd_lm.options import Command, error_text
from hvd_lm.train import deadline, faults, step
from hvd_lm.train.checkpointer import Checkpointer
from hvd_lm.train.counting import CharCount, StepCounter
from hvd_lm.train.data import Prefetcher
from hvd_lm.train.deadline import Cadence, DeadlinePlanner, StopSignals, virtual_step_s
from hvd_lm.train.elastic import Elastic
from hvd_lm.train.evaluate import bpc as eval_bpc
from hvd_lm.train.evaluate import estimate_seconds
from hvd_lm.train.guard import DivergenceGuard, TrainingDiverged
from hvd_lm.train.log import write_failure
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.rundir import RunFolder, checkpoint_bytes
from hvd_lm.train.settings import TrainConfig
from hvd_lm.train.startup import RunParts
from hvd_lm.util.atomic import write_text

#: Seconds of steps between two control exchanges (at most ``run.control_every`` attempts).
CONTROL_TARGET_S = 1.0


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as configured; returns a summary dict (on every rank).

    Raises:
        ValueError: bad configuration or data (naming the field / file); a ConfigError when the
            shapes or the memory of a step do not fit (:mod:`hvd_lm.train.preflight`).
        ShardChecksumError: a shard does not match its manifest checksum.
        hvd_lm.train.guard.TrainingDiverged: the run diverged (:mod:`hvd_lm.train.guard`).
    """
    return Trainer(cfg).train()


class Trainer:
    """One training run: the loop, holding its parts (module docstring). Built from ``cfg``:
    the run's parts (no collective in elastic mode, where a joining worker gets the state from
    the others), its folder and start record, then the components; :meth:`train` trains.

    Attributes:
        parts: :class:`hvd_lm.train.startup.RunParts` (model, optimizer, schedule, data, world).
        folder: :class:`hvd_lm.train.rundir.RunFolder` (rank 0's lock and log).
        metrics: :class:`hvd_lm.train.metrics.Metrics` (rank 0's log, the ``train`` record).
        checkpointer: :class:`hvd_lm.train.checkpointer.Checkpointer`.
        counter / chars: :class:`hvd_lm.train.counting.StepCounter` and ``CharCount``.
        elastic: :class:`hvd_lm.train.elastic.Elastic` with ``run.elastic``, else None.
        guard / planner / signals / faults: the divergence guard, the ``--time-limit`` planner
            (None without), the stop signals, the test hooks.
        pos / rnn_state / total_steps: where the loop is: the position, this rank's recurrent
            state (h, c), each [B, H], and the run's last step (``--time-limit`` moves it).

    Raises:
        as :func:`train`.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.parts = parts = RunParts(cfg)
        self.summary = parts.summary
        if self.summary is not None:  # nothing to train (preflight.resume_end)
            return
        self.pos, self.rnn_state, self.total_steps = parts.start_pos, parts.start_state, \
            parts.total_steps  # summary.json's start_step: did this allocation train a step?
        self.start_step = self.pos.step
        # ---- the run folder, rank 0's log and the start record -----------------------------------
        # the peak the logged MFU is against (a CPU's: a matmul measured now)
        peak = device_peak(parts.device, cfg.run.precision, cfg.run.peak_tflops, parts.threads)
        self.metrics = Metrics(parts.out_dir, cfg.run.tensorboard, peak)
        self.folder = RunFolder(cfg, parts.model, parts.resumed_from, self.metrics)
        self.folder.open(parts.ctx, parts.ctx.size * parts.B, self.pos.step,  # collective
                         parts.total_steps)  # (not elastic): every rank learns rank 0's lot
        self.metrics.record("start", self.pos.step, **parts.start_values(peak))

        # ---- control -----------------------------------------------------------------------------
        self.signals = StopSignals(describe=self.stop_eta, announce=parts.ctx.local_rank == 0)
        self.faults = faults.for_rank(parts.ctx.rank, cfg.run.inject_nan_steps)  # tests only
        self.chars = CharCount(self.pos.chars_trained)  # all ranks before, + this one's
        self.guard = DivergenceGuard(cfg.run.divergence_loss, cfg.run.divergence_logs,
                                     cfg.run.max_skipped_steps, self.pos.step)
        self.last_ckpt_time = time.time()
        # the control exchange: after the first attempt, then every control_interval() attempts
        self.next_control = self.pos.attempts + 1
        self.attempt_times: collections.deque[float] = collections.deque(maxlen=20)  # seconds
        self.extra_s = 0.0  # seconds of validation and checkpoint in the current attempt
        # --time-limit/--time-budget: the steps that fit (hvd_lm.train.deadline)
        self.planner = DeadlinePlanner(
            parts.time_limit_s, parts.time_budget_s, trained_s=self.pos.trained_s,
            cadence=Cadence(cfg.run.eval_every, cfg.run.checkpoint_every,
                            cfg.run.checkpoint_minutes, parts.val is not None),
            # one validation: two windows timed now; one checkpoint write: its estimated size
            # at CHECKPOINT_BYTES_PER_S, plus 1 s
            eval_estimate=lambda: estimate_seconds(parts.model, parts.val, parts.device,
                                                   cfg.run.precision),
            checkpoint_estimate_s=1.0 + checkpoint_bytes(
                cfg, parts.model, parts.ctx.size * parts.B) / deadline.CHECKPOINT_BYTES_PER_S,
            virtual_step_s=virtual_step_s()) if cfg.timed else None
        self.stop_step = sys.maxsize  # the allocation's last step (--time-limit: planned)
        self.loop_started: float | None = None  # monotonic s: the first step's start
        self.trained_before = self.pos.trained_s  # seconds, the earlier allocations'
        self.step_started = time.monotonic()  # monotonic s: when the current step began
        self.stop_reason = "done"

        # ---- the components ----------------------------------------------------------------------
        self.checkpointer = Checkpointer(cfg, parts.model, parts.optimizer, parts.lr_plan,
                                         parts.scaler, self.guard, self.metrics, self.planner)
        self.counter = StepCounter(
            cfg.run, parts.k, parts.total_windows, parts.scaler, self.guard, self.metrics,
            restart_state=lambda: parts.model.init_state(parts.B, parts.device))
        self.elastic = (Elastic(parts, self.folder, self.checkpointer, self.metrics, self.guard)
                        if cfg.run.elastic else None)

    # ---- what the loop does besides the step -----------------------------------------------------

    def save_checkpoint(self) -> None:
        """Every rank: the checkpoint of the current step (:meth:`Checkpointer.save`: Horovod
        allgathers and a sum), with the seconds trained over every allocation of the run
        (``Position.trained_s``: the earlier ones' and this one's loop so far, on the planner's
        clock when it has one); its seconds are not a step's (the deadline's plan)."""
        started = self.loop_started
        self.pos.trained_s = (self.planner.trained_s() if self.planner is not None else
                              self.trained_before + (0.0 if started is None
                                                     else time.monotonic() - started))
        self.extra_s += self.checkpointer.save(self.pos, self.rnn_state, self.chars,
                                               self.parts.ctx, self.parts.windows_per_epoch)

    def validate(self) -> None:
        """Validation BPC over all ranks (Horovod: sums bits and chars), logged by rank 0."""
        parts = self.parts
        if parts.val is None:
            return
        t0 = time.perf_counter()
        v_bpc, v_chars = eval_bpc(parts.model, parts.val, parts.device, self.cfg.run.precision)
        parts.model.train()
        seconds = time.perf_counter() - t0
        self.extra_s += seconds
        if self.planner is not None:
            self.planner.eval_done(seconds)
        self.metrics.record("eval", self.pos.step, val_bpc=v_bpc, val_chars=v_chars,
                            seconds=seconds)

    def log_train(self, grad_norm: float) -> None:
        """A ``train`` record (rank 0) of the steps since the last one, over all ranks
        (:meth:`Metrics.log_train`, Horovod allreduces); the loss goes to the divergence guard
        (the same float on every rank)."""
        parts, pos, scaler = self.parts, self.pos, self.parts.scaler
        loss = self.metrics.log_train(  # collective: allreduces of the metrics
            pos.step, parts.ctx.size, parts.model.flops_per_char(),
            parts.lr_plan.lr(self.pos.step),
            scaler.get_scale() if scaler.is_enabled() else None,
            grad_norm=grad_norm, skipped_steps=pos.skipped_steps,
            epoch=pos.window / parts.windows_per_epoch, world_size=parts.ctx.size,
            **engine.comm_stats(parts.optimizer))  # bytes on the wire (and 1-bit phase)
        self.guard.logged(pos.step, loss)

    # ---- the loop --------------------------------------------------------------------------------

    def train(self) -> dict:
        """Train to the end (or a stop signal), then validate, checkpoint and write the summary."""
        if self.summary is not None:  # nothing to train (preflight.resume_end)
            return self.summary
        parts = self.parts
        engine.begin_steps()  # the torch engine's collectives: --gloo-timeout-s from here
        try:
            if self.elastic is not None:
                self.elastic.train(self.pos, self.elastic_loop, self.on_reset)
            else:
                try:
                    self.loop()
                    self.finish()
                except Exception as e:
                    if parts.peers and engine.is_collective_failure(e):
                        raise self.collective_failed() from e
                    raise
            return self.end()
        except Exception as e:
            # the rank that prints the one-line cause records it for the launch's summary (a
            # divergence, the same on every rank: rank 0 alone)
            if (e.report and e.record if isinstance(e, peers.LostPeer) else
                    parts.ctx.is_root or not isinstance(e, TrainingDiverged)):
                last = self.checkpointer.newest()  # (a write in flight is the newest)
                write_failure(parts.out_dir, self.pos.step, parts.ctx.rank, error_text(e),
                              str(last) if last else None, getattr(e, "lost", None))
                # its line now, before the handlers are restored below (a launcher's teardown
                # signal would end the process before the command line printed it: no copy)
                print(f"hvd-lm train: ERROR: {error_text(e)}", file=sys.stderr, flush=True)
                e.quiet = True
            raise
        finally:  # the run is over: a signal now ends the process again (mpirun's teardown)
            self.signals.restore()
            if getattr(parts, "peer_watch", None) is not None:
                parts.peer_watch.close()

    def collective_failed(self) -> peers.LostPeer:
        """The one-line error of a failed collective (:func:`hvd_lm.comm.peers.failure`): the
        lost peer, probed by each host's local rank 0, or after a stop signal the launcher's
        teardown (nothing probed); with the newest complete checkpoint to resume from."""
        newest = self.checkpointer.newest()  # the one in flight too
        return peers.failure(self.parts.peers, self.parts.ctx, self.pos.step + 1,
                            time.monotonic() - self.step_started, newest,
                            signalled=lambda: bool(self.signals.received))

    def elastic_loop(self, state) -> None:
        """The loop under ``hvd.elastic.run``: the state (synced from rank 0) is where this rank
        starts (:meth:`Elastic.restore`); a commit every ``run.commit_every`` applied steps."""
        self.pos, self.rnn_state = self.elastic.restore(state, self.chars)
        self.checkpointer.saved_step = None  # its weights are no longer the model's
        self.next_control = self.pos.attempts + 1  # every rank alike, a new worker too
        self.loop(state)
        self.finish()

    def on_reset(self, state) -> None:
        """After Horovod re-formed the world: :meth:`Elastic.on_reset`, and this rank's test
        hooks."""
        self.elastic.on_reset(state, self.pos.step)
        self.faults = faults.for_rank(self.parts.ctx.rank, self.cfg.run.inject_nan_steps)

    def loop(self, state=None) -> None:
        """Optimizer steps until ``total_steps``, a stop signal or divergence."""
        # window i+1's bytes are read on a background thread while window i trains (elastic
        # runs wrap around epochs, so no read-ahead limit there)
        parts = self.parts
        limit = None if state is not None else parts.total_windows
        batches = Prefetcher(parts.streams, limit=limit, pin_memory=parts.device.type == "cuda")
        try:
            self.steps(batches, state)
        finally:
            batches.close()

    def steps(self, batches: Prefetcher, state=None) -> None:
        """The body of :meth:`loop`: one iteration per optimizer step (attempt)."""
        cfg, parts, pos, counter = self.cfg, self.parts, self.pos, self.counter
        k = parts.k
        self.metrics.restart_meter()
        parts.model.train()

        spec = step.StepSpec(parts.device, cfg.run.precision, cfg.optim.grad_clip,
                             cfg.run.nan_check, k, lambda x: self.faults.loss(x, pos.attempts))
        last_start = None  # perf_counter s: the previous attempt's start
        if self.loop_started is None:  # trained time counts from here
            self.loop_started = time.monotonic()
        if self.planner is not None:
            self.planner.start()
        while pos.step < self.total_steps and (state is not None
                                               or pos.window + k <= parts.total_windows):
            t_step = time.perf_counter()
            if last_start is not None:  # the previous attempt, less its validation/checkpoint
                self.attempt_times.append(t_step - last_start - self.extra_s)
                if self.planner is not None:
                    self.planner.step_done(self.attempt_times[-1])
            last_start, self.extra_s = t_step, 0.0
            if self.planner is not None:
                self.planner.attempt_begins()  # (the test hook's virtual clock)
            self.step_started = time.monotonic()  # what a failed collective waited
            self.faults.before_step(pos.step)

            # forward, loss, backward, Horovod: synchronize, unscale and clip, step or skip
            # (hvd_lm.train.step, the one training step); its k windows read ahead on a thread
            windows = (batches.get(w) for w in range(pos.window, pos.window + k))
            g = step.backward(parts.train_model, parts.optimizer, parts.scaler, windows,
                              self.rnn_state, spec)
            # the previous step counted exactly (a step late where nothing depended on it,
            # hvd_lm.train.counting), so that this update's LR follows every skip
            counter.settle(self.pos)
            parts.lr_plan.apply(parts.optimizer, pos.step)  # the LR: a function of the step
            r = step.update(parts.optimizer, parts.scaler, g, spec)
            pos.window += k

            # count it (the LR schedule advances on applied steps only), then log and validate;
            # where nothing here depends on it, read its outcome during the next step
            # (hvd_lm.train.counting: no host sync per step)
            r = counter.count(r, pos, self.total_steps, self.next_control)
            self.rnn_state = r.state
            self.chars.add(r.chars)
            self.metrics.add_step(r.nats, r.chars, r.wait_s, time.perf_counter() - t_step)
            stop_flag, due_flag = self.control_flags()  # collective: allreduce (at most every
            # control_every attempts; with --time-limit it may move total_steps)
            if r.applied and (pos.step % cfg.run.log_every == 0 or pos.step == self.total_steps):
                self.log_train(r.grad_norm)  # collective: allreduce of the metrics
            if r.applied and cfg.run.eval_every and pos.step % cfg.run.eval_every == 0:
                self.validate()  # collective: allreduce of bits and chars

            # stop a diverged run (every rank decides alike: global skips, allreduced losses)
            if self.guard.reason:
                self.stop_reason = "diverged"
                break
            self.checkpointer.poll()  # log a finished background write (raise a failed one's)
            # checkpoint: on a stop signal (then leave), every checkpoint_every steps, or when due
            if stop_flag > 0:
                self.stop_reason = "signal"
                if self.checkpointer.saved_step != pos.step:  # a skipped attempt: may be saved
                    self.save_checkpoint()  # collective: allgather of the recurrent state
                break
            if self.stop_step <= pos.step < self.total_steps:  # no step fits before the limit:
                self.stop_reason = "time-limit"  # finish() checkpoints, for the next allocation
                break
            if r.applied and ((cfg.run.checkpoint_every
                               and pos.step % cfg.run.checkpoint_every == 0) or due_flag > 0):
                self.save_checkpoint()  # collective: allgather of the recurrent state
                self.last_ckpt_time = time.time()
            # elastic: commit in memory every commit_every steps (Horovod: may raise
            # HostsUpdatedInterrupt when workers are added or removed, after saving)
            if state is not None and r.applied and pos.step % cfg.run.commit_every == 0:
                self.elastic.commit(state, pos, self.rnn_state, self.chars)  # collective: sum

    def stop_eta(self) -> str:
        """When a stop signal received now is acted on (the line :class:`StopSignals` prints):
        after the step in progress for one process, else at the next control exchange."""
        step = self.pos.step + 1
        who = "stopping" if self.parts.ctx.size == 1 else "every rank stops"
        to_go = max(1, self.next_control - self.pos.attempts)
        if to_go == 1:
            return f"{who} after step {step:,} (in progress)"
        secs = (f", ~{to_go * sum(self.attempt_times) / len(self.attempt_times):.0f} s"
                if self.attempt_times else "")
        return (f"{who} at the next control exchange, within {to_go} step(s) of step "
                f"{step:,}{secs}")

    def control_interval(self) -> int:
        """Attempts until the next control exchange, as rank 0 proposes it: about
        :data:`CONTROL_TARGET_S` seconds of steps, at least 1 and at most
        ``run.control_every`` (every attempt before a step was timed; a step that takes a
        second or more: every attempt, so a stop signal acts after the step in progress). The
        step count is exact at an exchange (:meth:`StepCounter.counts_now`); between them it
        may be read a step late (:mod:`hvd_lm.train.counting`)."""
        if not self.attempt_times:
            return 1
        step_s = sum(self.attempt_times) / len(self.attempt_times)
        return max(1, min(self.cfg.run.control_every, int(CONTROL_TARGET_S / max(step_s, 1e-9))))

    def control_flags(self) -> tuple[float, float]:
        """(stop, checkpoint due) from one tiny allreduce at the control attempts (the same on
        every rank: the interval to the next is rank 0's :meth:`control_interval`, handed to
        all by the allreduce): any rank's signal stops all, rank 0's clock times checkpoints
        and, with ``--time-limit``, plans the run's last step (:meth:`set_total_steps`);
        (0, 0) between them."""
        cfg = self.cfg
        if self.pos.attempts < self.next_control:
            return 0.0, 0.0
        root = self.parts.ctx.is_root
        due = (cfg.run.checkpoint_minutes > 0 and root
               and time.time() - self.last_ckpt_time >= 60 * cfg.run.checkpoint_minutes)
        plan = stop_at = None  # rank 0's new last step and last step of this allocation (sent
        if root and self.planner is not None:  # + 1: 0 means none)
            plan = self.planner.plan(self.pos.step, self.total_steps, self.parts.step_cap)
            stop_at = self.planner.stop_step(self.pos.step, time.monotonic() - self.step_started)
        stop, due_flag, plan_flag, interval, stop_flag = engine.allreduce_sum(  # collective: sums
            [1.0 if self.signals.received else 0.0, 1.0 if due else 0.0,
             0.0 if plan is None else plan + 1.0,
             float(self.control_interval()) if root else 0.0,
             0.0 if stop_at is None else stop_at + 1.0], name="control")
        self.next_control = self.pos.attempts + max(1, int(interval))
        if plan_flag > 0:
            self.set_total_steps(int(plan_flag) - 1)
        self.stop_step = int(stop_flag) - 1 if stop_flag > 0 else sys.maxsize
        return stop, due_flag

    def set_total_steps(self, total: int) -> None:
        """Move the run's last step to ``total`` (every rank: the control exchange's plan): the
        LR schedule's line to 0 bends there without a jump; logged (rank 0) as a ``plan``
        record with what it was computed from."""
        self.parts.lr_plan.replan(self.pos.step, total)  # the next update's LR on the new line
        previous, self.total_steps = self.total_steps, max(self.pos.step, total)
        if self.parts.ctx.is_root:
            self.metrics.set_total(self.total_steps)
            # printed when it is the first plan, the end, or moves the end by over 5%
            shown = (previous >= sys.maxsize // 2 or self.total_steps == self.pos.step
                     or abs(self.total_steps - previous) > 0.05 * (previous - self.pos.step))
            self.metrics.record("plan", self.pos.step, printed=shown, total_steps=self.total_steps,
                                previous_total_steps=(previous if previous < sys.maxsize // 2
                                                      else None), **self.planner.describe())

    def finish(self) -> None:
        """Final validation and checkpoint of a run that reached its end (unless its newest
        logged loss is above the divergence bound: then it diverged)."""
        if self.stop_reason == "done":
            self.guard.at_end()
            self.stop_reason = "diverged" if self.guard.reason else "done"
        self.step_started = time.monotonic()  # the final validation's and save's collectives
        if self.stop_reason == "done":
            if not (self.cfg.run.eval_every and self.pos.step % self.cfg.run.eval_every == 0):
                self.validate()  # collective: allreduce of bits and chars
        if self.stop_reason in ("done", "time-limit"):
            if self.checkpointer.saved_step != self.pos.step:  # --checkpoint-every saved it?
                self.save_checkpoint()  # collective: allgather of the recurrent state
        self.summary = {"stop": self.stop_reason, "step": self.pos.step,  # collective: chars sum
                        "start_step": self.start_step, "skipped_steps": self.pos.skipped_steps,
                        "chars_trained": self.chars.total(), "world_size": self.parts.ctx.size}
        if self.planner is not None:  # seconds to the deadline once everything was written
            self.checkpointer.wait()
            self.summary.update(self.planner.summary())
            if self.stop_reason == "time-limit" and self.parts.ctx.is_root:
                print(f"hvd-lm train: {self.planner.stopped_text(self.pos.step, self.cfg.run)}",
                      file=sys.stderr, flush=True)

    def end(self) -> dict:
        """The summary (and ``summary.json``) once the checkpoint in flight is written, released
        folder; raise on divergence."""
        parts = self.parts
        self.checkpointer.wait()  # before the summary, the guard's settling, the lock's release
        summary = self.summary
        if parts.ctx.is_root:
            self.metrics.record("end", self.pos.step,
                                **{k: v for k, v in summary.items() if k != "step"})
            if self.stop_reason == "signal" and self.checkpointer.saved_step == self.pos.step:
                print(f"hvd-lm train: stopped on a signal: every rank checkpointed at step "
                      f"{self.pos.step:,} ({self.checkpointer.newest()}); --resume auto "
                      "continues it", file=sys.stderr, flush=True)
            write_text(parts.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self.metrics.close()
        settled = self.guard.settle(parts.out_dir) if (
            self.stop_reason == "diverged" and parts.ctx.is_root) else None
        self.folder.release()
        if self.stop_reason == "diverged":
            raise self.guard.error(self.pos.step, settled)
        return summary


def train_command(cfg: TrainConfig) -> int:
    """``hvd-lm train``: 0 when training finished, stopped on a signal (checkpointed) or had
    nothing left to train."""
    try:
        summary = train(cfg)
    except peers.LostPeer as e:
        if e.report:
            raise
        return 1
    return 0 if summary["stop"] in ("done", "signal", "time-limit", "nothing-to-train") else 1


TRAIN = Command(TrainConfig, train_command, description="Train the LM. Flags override --config; "
                "each names its YAML field and default in brackets.")
