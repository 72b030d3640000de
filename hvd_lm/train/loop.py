"""The training loop: data-parallel TBPTT training of the byte-level LM with Horovod.

One optimizer step (per rank, B rows x T bytes per window, ``backward_passes_per_step`` = k) is
:func:`hvd_lm.train.step.train_step` (forward, loss, backward, Horovod's synchronize, unscale and
clip, step or skip: the same function every benchmark times); :meth:`Trainer.steps` is the loop
around it: count the step (the LR schedule advances on applied steps only), one tiny allreduce
of control flags about once a second of steps (at most every ``run.control_every`` attempts,
every attempt when steps are slow: a preemption signal or a due time-based checkpoint on any rank
stops or checkpoints every rank at the same step; with ``--time-limit`` rank 0's plan of the
last step, :mod:`hvd_lm.train.deadline`), log, validate, stop a diverged run, checkpoint. Each
line of it that is a collective says so (``# Horovod:``): every rank must reach it at the same
step.

The host does not wait on the device per step: the next window is read ahead on a thread
(``train.data.Prefetcher``), the loss is summed on the device and read at log time, and with
torch's fused optimizers the skip of a non-finite step is decided on the device and read a step
late where nothing depends on it (:mod:`hvd_lm.train.counting`; the 1-bit optimizers and fp16's
GradScaler read the norm on the host). Under Horovod on CUDA the stream is drained just before
the allreduce wait, which costs nothing (the host then blocks on the allreduce, which needs the
backward done) and splits each step's time into device compute and wait
(``compute_time_max``, a slow GPU's straggling).

Rank 0 logs (tqdm bar, a line every ``log_every`` steps, ``metrics.jsonl``, TensorBoard with
``--tensorboard true``) and writes checkpoints; metrics are sums over ranks but
``compute_time_max`` (each step's slowest rank). Every Horovod call is marked ``# Horovod:``
where it happens (as Horovod's ``examples/pytorch`` scripts do).

With ``run.elastic`` (Horovod elastic) the same loop runs under ``hvd.elastic.run``, with a
commit in memory every ``run.commit_every`` steps: :mod:`hvd_lm.train.elastic`.

Without ``run.elastic``, a lost peer (its host's link down, the host or the process gone) fails
the collective it was in after Gloo's ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (``comm.gloo_timeout_s``);
each surviving node's first rank then probes the others (:mod:`hvd_lm.comm.peers`) and the job
stops with one line naming the lost rank's host and the newest complete checkpoint
(:class:`LostPeer`), from which ``--resume auto`` continues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time

import torch

from hvd_lm import comm
from hvd_lm.comm.peers import LostPeer, lost_peers_text
from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.model.mfu import rate_against
from hvd_lm.options import Command, error_text
from hvd_lm.train import resume as resume_io
from hvd_lm.train.counting import LazyCounting
from hvd_lm.train.data import Prefetcher
from hvd_lm.train.elastic import ElasticTraining
from hvd_lm.train.evaluate import bpc as eval_bpc
from hvd_lm.train.guard import TrainingDiverged
from hvd_lm.train.log import StepMeter, write_failure
from hvd_lm.train.schedule import refresh_lr, schedule_of
from hvd_lm.train.settings import TrainConfig
from hvd_lm.train.startup import TrainingRun
from hvd_lm.train.step import StepSpec, train_step
from hvd_lm.util.atomic import write_text

LN2 = math.log(2.0)
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
    return Trainer(cfg).run()


class Trainer(TrainingRun, ElasticTraining, LazyCounting):
    """One training run: built by :class:`hvd_lm.train.startup.TrainingRun` (no collective in
    elastic mode, where a joining worker gets the state from the others); :meth:`run` trains.

    Raises:
        as :func:`train`.
    """

    # ---- collectives used by the loop ------------------------------------------------------------

    def chars_total(self) -> int:
        """Characters trained on by all ranks, exact across world-size changes (Horovod: sum)."""
        return self.chars_base + int(comm.allreduce_sum([float(self.chars_local)],
                                                        name="chars_total")[0])

    def save_checkpoint(self) -> None:
        """Every rank: gather the recurrent state rows; rank 0 writes the checkpoint. Held
        (nothing written) while the newest logged loss is above the divergence bound."""
        if not self.guard.may_checkpoint():
            self.log.record("checkpoint_held", self.pos.step,
                            loss=self.guard.above[-1][1] if self.guard.above else None)
            return
        t0 = time.perf_counter()
        # Horovod: gather every rank's recurrent state rows (rank order) for an exact resume.
        h = comm.allgather(self.rnn_state[0].detach().float().cpu(), name="ckpt_h")
        c = comm.allgather(self.rnn_state[1].detach().float().cpu(), name="ckpt_c")
        pos = dataclasses.replace(self.pos, chars_trained=self.chars_total())  # Horovod: sum
        opt_state = self.optimizer.state_dict()  # every rank: 1-bit optimizers gather errors
        if self.ctx.is_root:  # written on a thread unless --async-checkpoint false
            self.writer.submit(resume_io.payload(pos, self.model, opt_state, self.scheduler,
                                                 self.scaler, (h, c), self.cfg.to_dict(),
                                                 self.ctx.size, self.windows_per_epoch),
                               self.out_dir, pos.step, self.cfg.run.keep_checkpoints,
                               self.guard.confirmed_below())
        self.guard.wrote(pos.step)
        self.saved_step = pos.step  # every rank: the end does not write (or print) it again
        self.extra_s += time.perf_counter() - t0  # not a step's time (the deadline's plan)

    def checkpoint_written(self, w) -> None:
        """The writer's report of a finished checkpoint (rank 0): logged, and timed for the
        deadline's plan."""
        self.log.record("checkpoint", w.step, path=str(w.path), write_s=w.write_s,
                        blocked_s=w.blocked_s)
        if self.planner is not None:
            self.planner.checkpoint_done(w.write_s, w.blocked_s)

    def validate(self) -> None:
        """Validation BPC over all ranks (Horovod: sums bits and chars), logged by rank 0."""
        if self.val is None:
            return
        t0 = time.perf_counter()
        v_bpc, v_chars = eval_bpc(self.model, self.val, self.device, self.cfg.run.precision)
        self.model.train()
        seconds = time.perf_counter() - t0
        self.extra_s += seconds
        if self.planner is not None:
            self.planner.eval_done(seconds)
        self.log.record("eval", self.pos.step, val_bpc=v_bpc, val_chars=v_chars,
                        seconds=seconds)

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> dict:
        """Train to the end (or a stop signal), then validate, checkpoint and write the summary."""
        if self.summary is not None:  # nothing to train (preflight.resume_end)
            return self.summary
        try:
            if self.cfg.run.elastic:
                self.run_elastic()  # hvd_lm.train.elastic
            else:
                try:
                    self.loop()
                    self.finish()
                except Exception as e:
                    if self.peers and comm.is_collective_failure(e):
                        raise self.lost_peer(e) from e
                    raise
            return self.end()
        except Exception as e:
            # the rank that prints the one-line cause records it for the launch's summary (a
            # divergence, the same on every rank: rank 0 alone)
            if (e.report if isinstance(e, LostPeer) else
                    self.ctx.is_root or not isinstance(e, TrainingDiverged)):
                with contextlib.suppress(Exception):  # a write in flight is the newest
                    self.writer.wait()
                last = ckpt_io.newest_complete(self.out_dir)
                write_failure(self.out_dir, self.pos.step, self.ctx.rank, error_text(e),
                              str(last) if last else None)
            raise

    def lost_peer(self, error: BaseException) -> LostPeer:
        """The one-line error of a collective that lost a peer: who (probed, at most 3 s), when,
        after which timeout, and the newest complete checkpoint to resume from."""
        with contextlib.suppress(Exception):  # the newest checkpoint: the one in flight too
            self.writer.wait()
        # how long the failed collective waited (from its step's start, an upper bound): Gloo's
        # timeout is named only when it is what ended it (a killed peer fails at once)
        waited = time.monotonic() - self.step_started
        timeout = comm.gloo_timeout_s()
        bound = (f" ({comm.timeout_phrase(timeout)})"
                 if timeout and waited >= 0.8 * timeout else
                 f" after {waited:.1f} s (its peer's connection closed)")
        last = ckpt_io.newest_complete(self.out_dir)
        return LostPeer(
            f"{lost_peers_text(self.peers, self.ctx.rank)}: a collective failed at step "
            f"{self.pos.step + 1}{bound}; the newest complete checkpoint is "
            f"{last or 'none (no step was saved)'}; bring the host back or leave "
            "it out, and run again with --resume auto (the launch templates add it)",
            report=self.ctx.local_rank == 0)

    def loop(self, state=None) -> None:
        """Optimizer steps until ``total_steps``, a stop signal or divergence."""
        # window i+1's bytes are read on a background thread while window i trains (elastic
        # runs wrap around epochs, so no read-ahead limit there)
        batches = Prefetcher(self.streams, limit=None if state is not None else self.total_windows,
                             pin_memory=self.device.type == "cuda")
        try:
            self.steps(batches, state)
        finally:
            batches.close()

    def steps(self, batches: Prefetcher, state=None) -> None:
        """The body of :meth:`loop`: one iteration per optimizer step (attempt)."""
        cfg, k, pos = self.cfg, self.k, self.pos
        self.meter = StepMeter()
        self.model.train()

        spec = StepSpec(self.device, cfg.run.precision, cfg.optim.grad_clip, cfg.run.nan_check, k,
                        loss_hook=lambda loss: self.faults.loss(loss, pos.attempts),
                        before_update=self.settle_step)  # the previous step's count
        last_start = None  # perf_counter s: the previous attempt's start
        while pos.step < self.total_steps and (state is not None
                                               or pos.window + k <= self.total_windows):
            t_step = time.perf_counter()
            if last_start is not None:  # the previous attempt, less its validation/checkpoint
                self.attempt_done(t_step - last_start - self.extra_s)
            last_start, self.extra_s = t_step, 0.0
            self.step_started = time.monotonic()  # what a failed collective waited: lost_peer
            self.faults.before_step(pos.step)

            # forward, loss, backward, Horovod: synchronize, unscale and clip, step or skip
            # (hvd_lm.train.step, the one training step); its k windows read ahead on a thread
            windows = (batches.get(w) for w in range(pos.window, pos.window + k))
            r = train_step(self.model, self.optimizer, self.scaler, windows, self.rnn_state, spec)
            self.rnn_state = r.state
            pos.window += k

            # count it (the LR schedule advances on applied steps only), then log and validate;
            # where nothing here depends on it, read its outcome during the next step
            # (hvd_lm.train.counting: no host sync per step)
            r = self.count_lazily(r)
            self.chars_local += r.chars
            self.meter.add(r.nats, r.chars, r.wait_s, time.perf_counter() - t_step)
            stop_flag, due_flag = self.control_flags()  # Horovod: allreduce (at most every
            # control_every attempts; with --time-limit it may move total_steps)
            if r.applied and (pos.step % cfg.run.log_every == 0 or pos.step == self.total_steps):
                self.log_train(r.grad_norm)  # Horovod: allreduce of the metrics
            if r.applied and cfg.run.eval_every and pos.step % cfg.run.eval_every == 0:
                self.validate()  # Horovod: allreduce of bits and chars

            # stop a diverged run (every rank decides alike: global skips, allreduced losses)
            if self.guard.reason:
                self.stop_reason = "diverged"
                break
            self.writer.poll()  # log a finished background write (raise a failed one's error)
            # checkpoint: on a stop signal (then leave), every checkpoint_every steps, or when due
            if stop_flag > 0:
                self.stop_reason = "signal"
                if self.saved_step != pos.step:  # a skipped attempt: this step's may be saved
                    self.save_checkpoint()  # Horovod: allgather of the recurrent state
                break
            if r.applied and ((cfg.run.checkpoint_every
                               and pos.step % cfg.run.checkpoint_every == 0) or due_flag > 0):
                self.save_checkpoint()  # Horovod: allgather of the recurrent state
                self.last_ckpt_time = time.time()
            # elastic: commit in memory every commit_every steps (Horovod: may raise
            # HostsUpdatedInterrupt when workers are added or removed, after saving)
            if state is not None and r.applied and pos.step % cfg.run.commit_every == 0:
                self.commit(state)

    def count_step(self, applied: bool, grad_norm: float) -> None:
        """An applied step advances the step count and the LR schedule; a skipped one is counted
        (and logged), and a non-finite recurrent state restarts from zero."""
        pos = self.pos
        self.guard.attempt(applied)
        self.log.tick(1 if applied else 0)
        if applied:
            self.scheduler.step()
            pos.step += 1
            return
        pos.skipped_steps += 1
        if not all(bool(torch.isfinite(s).all()) for s in self.rnn_state):
            self.rnn_state = self.model.init_state(self.B, self.device)
        self.log.record("skip", pos.step, skipped_steps=pos.skipped_steps, grad_norm=grad_norm,
                        loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None)

    def attempt_done(self, seconds: float) -> None:
        """One step attempt took ``seconds`` (validation and checkpoint left out)."""
        self.attempt_times.append(seconds)
        if self.planner is not None:
            self.planner.step_done(seconds)

    def stop_eta(self) -> str:
        """When a stop signal received now is acted on (the line :class:`StopSignals` prints):
        after the step in progress for one process, else at the next control exchange."""
        step = self.pos.step + 1
        who = "stopping" if self.ctx.size == 1 else "every rank stops"
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
        step count is exact at an exchange (:meth:`counts_now`); between them it may be read a
        step late (:mod:`hvd_lm.train.counting`)."""
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
        root = self.ctx.is_root
        due = (cfg.run.checkpoint_minutes > 0 and root
               and time.time() - self.last_ckpt_time >= 60 * cfg.run.checkpoint_minutes)
        plan = None  # rank 0's new last step (sent + 1: 0 means none)
        if root and self.planner is not None:
            plan = self.planner.plan(self.pos.step, self.total_steps, self.step_cap)
        stop, due_flag, plan_flag, interval = comm.allreduce_sum(  # Horovod: sums over ranks
            [1.0 if self.signals.received else 0.0, 1.0 if due else 0.0,
             0.0 if plan is None else plan + 1.0,
             float(self.control_interval()) if root else 0.0], name="control")
        self.next_control = self.pos.attempts + max(1, int(interval))
        if plan_flag > 0:
            self.set_total_steps(int(plan_flag) - 1)
        return stop, due_flag

    def set_total_steps(self, total: int) -> None:
        """Move the run's last step to ``total`` (every rank: the control exchange's plan): the
        LR schedule's line to 0 bends there without a jump; logged (rank 0) as a ``plan``
        record with what it was computed from."""
        schedule_of(self.scheduler).replan(self.pos.step, total)
        refresh_lr(self.scheduler)  # the next step's LR on the new line (0 when it is the end)
        previous, self.total_steps = self.total_steps, max(self.pos.step, total)
        if self.ctx.is_root:
            self.log.set_total(self.total_steps)
            left = previous - self.pos.step
            # printed when it is the first plan, the end, or moves the end by over 5%
            shown = (previous >= sys.maxsize // 2 or self.total_steps == self.pos.step
                     or abs(self.total_steps - previous) > 0.05 * left)
            self.log.record("plan", self.pos.step, printed=shown, total_steps=self.total_steps,
                            previous_total_steps=previous if previous < sys.maxsize // 2
                            else None, **self.planner.describe())

    def log_train(self, grad_norm: float) -> None:
        """A ``train`` record (rank 0) of the steps since the last one, over all ranks; the loss
        goes to the divergence guard (the same float on every rank)."""
        m, pos = self.meter, self.pos
        # Horovod: metrics summed over ranks (float(): the device sum, read now)
        nats, chars, waits, busy = comm.allreduce_sum([float(m.nats), m.chars, m.wait, m.busy],
                                                      name="log")
        # Horovod: each step's slowest rank outside the allreduce wait, which sets the step (a
        # straggler shows as its mean well above the mean rank's)
        slowest = comm.allreduce_max_each(m.compute, name="log.compute")
        wall = time.perf_counter() - m.t0
        loss = nats / max(1.0, chars)
        self.guard.logged(pos.step, loss)
        scaler = self.scaler
        # per rank: TFLOP/s and MFU against one device's peak (hvd_lm.model.mfu)
        rate, self.peak = rate_against(chars / wall / self.ctx.size,
                                       self.model.flops_per_char(), self.peak)
        self.log.record("train", pos.step, loss=loss, bpc=loss / LN2,
                        lr=self.scheduler.get_last_lr()[0],
                        loss_scale=scaler.get_scale() if scaler.is_enabled() else None,
                        chars_per_s=chars / wall, step_time=wall / m.steps,
                        **rate,
                        allreduce_wait=waits / max(busy, 1e-9),
                        compute_time_max=sum(slowest) / m.steps,
                        compute_time_mean=(busy - waits) / (self.ctx.size * m.steps),
                        grad_norm=grad_norm,
                        skipped_steps=pos.skipped_steps,
                        epoch=pos.window / self.windows_per_epoch, world_size=self.ctx.size,
                        **comm.comm_stats(self.optimizer))  # bytes on the wire (and 1-bit phase)
        self.meter = StepMeter()

    def finish(self) -> None:
        """Final validation and checkpoint of a run that reached its end (unless its newest
        logged loss is above the divergence bound: then it diverged)."""
        if self.stop_reason == "done":
            self.guard.at_end()
            self.stop_reason = "diverged" if self.guard.reason else "done"
        self.step_started = time.monotonic()  # the final validation's and save's collectives
        if self.stop_reason == "done":
            if not (self.cfg.run.eval_every and self.pos.step % self.cfg.run.eval_every == 0):
                self.validate()  # Horovod: allreduce of bits and chars
            if self.saved_step != self.pos.step:  # --checkpoint-every may have saved it
                self.save_checkpoint()  # Horovod: allgather of the recurrent state
        self.summary = {"stop": self.stop_reason, "step": self.pos.step,
                        "skipped_steps": self.pos.skipped_steps,
                        "chars_trained": self.chars_total(),  # Horovod: sum over ranks
                        "world_size": self.ctx.size}
        if self.planner is not None:  # seconds to the deadline once everything was written
            self.writer.wait()
            self.summary.update(time_limit_s=self.time_limit_s,
                                deadline_left_s=round(self.planner.left(), 3))

    def end(self) -> dict:
        """The summary (and ``summary.json``) once the checkpoint in flight is written, released
        folder; raise on divergence."""
        self.writer.wait()  # before the summary, the guard's settling and the lock's release
        summary = self.summary
        if self.ctx.is_root:
            self.log.record("end", self.pos.step,
                            **{k: v for k, v in summary.items() if k != "step"})
            write_text(self.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self.log.close()
        settled = self.guard.settle(self.out_dir) if (
            self.stop_reason == "diverged" and self.ctx.is_root) else None
        if self.lock is not None:
            self.lock.release()
        if self.stop_reason == "diverged":
            raise self.guard.error(self.pos.step, settled)
        return summary


def train_command(cfg: TrainConfig) -> int:
    """``hvd-lm train``: 0 when training finished, stopped on a signal (checkpointed) or had
    nothing left to train."""
    try:
        summary = train(cfg)
    except LostPeer as e:
        if e.report:
            raise
        return 1
    return 0 if summary["stop"] in ("done", "signal", "nothing-to-train") else 1


TRAIN = Command(TrainConfig, train_command,
                description="Train the LM. Flags override --config; each names its YAML field "
                "and default in brackets.")
