"""Horovod elastic training for :class:`hvd_lm.train.loop.Trainer` (``run.elastic``; Horovod docs,
"Elastic Horovod"; launched by ``horovodrun --min-np/--max-np --host-discovery-script``).

The loop runs under ``hvd.elastic.run``: every ``run.commit_every`` applied steps the model,
optimizer, LR schedule, loss scaler, data position, character count and divergence counters are
committed in memory (``hvd.elastic.TorchState``, :meth:`ElasticTraining.commit`). A lost worker
rolls every rank back to the last commit; a changed world size re-cuts the streams at the same
fraction of the epoch (:func:`hvd_lm.train.data.window_in_new_cut`), rescales the LR for the new
global batch (:func:`hvd_lm.train.schedule.set_peak_lr`) and starts the recurrent state of the
re-cut rows from zero (:meth:`ElasticTraining.on_reset`, :meth:`ElasticTraining.from_state`).
"""

from __future__ import annotations

import dataclasses
import time

from hvd_lm import comm
from hvd_lm.train import faults
from hvd_lm.train.data import window_in_new_cut
from hvd_lm.train.resume import Position
from hvd_lm.train.schedule import set_peak_lr


class ElasticTraining:
    """The elastic half of :class:`hvd_lm.train.loop.Trainer` (a mixin: it works on the trainer's
    own attributes: model, optimizer, scheduler, scaler, pos, rnn_state, guard, ctx, log and the
    checkpoint writer)."""

    def run_elastic(self) -> None:
        """Train under ``hvd.elastic.run`` until the end, a stop signal or divergence; the state
        is created without a collective (a joining worker gets it at the first sync)."""
        # Horovod: the state committed in memory and synced from rank 0 after every reset
        state = comm.elastic_state(self.model, self.optimizer, **self.commit_fields())
        state.register_reset_callbacks([lambda: self.on_reset(state)])
        comm.elastic_run(self.elastic_loop)(state)  # Horovod: re-forms the world on failures

    def elastic_loop(self, state) -> None:
        """The loop under ``hvd.elastic.run``: the state (synced from rank 0) is where this rank
        starts; a commit every ``run.commit_every`` applied steps."""
        self.from_state(state)
        self.loop(state)
        self.finish()

    def commit_fields(self) -> dict:
        """What an elastic commit holds besides model and optimizer (all ranks agree on it; the
        recurrent rows are per rank and kept beside, :attr:`committed_rows`)."""
        return {"position": dataclasses.asdict(self.pos),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "world": self.ctx.size, "windows_per_epoch": self.windows_per_epoch,
                "guard": self.guard.state_dict()}

    def commit(self, state) -> None:
        """Commit the run in memory (every rank, same step): position with the exact character
        count (Horovod: a sum), schedule, scaler, then ``state.commit()`` (copies of the model's
        and optimizer's state; may raise ``HostsUpdatedInterrupt``)."""
        t0 = time.perf_counter()
        self.pos.chars_trained = self.chars_total()
        self.chars_base, self.chars_local = self.pos.chars_trained, 0
        for name, value in self.commit_fields().items():
            setattr(state, name, value)
        self.committed_rows = (self.ctx.rank, self.ctx.size,
                               tuple(s.detach().clone() for s in self.rnn_state))
        state.commit()
        self.commit_seconds.append(time.perf_counter() - t0)
        if len(self.commit_seconds) == 1 or self.pos.step % self.cfg.run.log_every == 0:
            self.log.record("commit", self.pos.step, seconds=self.commit_seconds[-1])

    def from_state(self, state) -> None:
        """Take the (synced) committed position, schedule and scaler; the recurrent rows are this
        rank's committed ones when it kept its place in the same world, else zero. When the world
        size changed since that commit, the window index is moved to the same fraction of the
        epoch in the new cut (done here, after Horovod's sync: ``sync`` re-sets every field from
        rank 0's last commit, so a change made in the reset callback would be lost)."""
        position = dict(state.position)
        position["window"] = window_in_new_cut(position["window"], state.windows_per_epoch,
                                               self.windows_per_epoch)
        self.pos = Position(**position)
        self.saved_step = None  # rolled back: the last step's weights are not saved yet
        self.next_control = self.pos.attempts + 1  # every rank alike, a new worker too
        self.chars_base, self.chars_local = self.pos.chars_trained, 0
        self.scheduler.load_state_dict(state.scheduler)
        self.guard.load_state_dict(state.guard)
        set_peak_lr(self.scheduler, self.peak_lr)
        if self.scaler.is_enabled() and state.scaler:
            self.scaler.load_state_dict(state.scaler)
        rows = self.committed_rows
        if rows and rows[:2] == (self.ctx.rank, self.ctx.size):
            self.rnn_state = tuple(t.clone() for t in rows[2])
        else:
            self.rnn_state = self.model.init_state(self.B, self.device)

    def on_reset(self, state) -> None:
        """After Horovod re-formed the world (a worker lost or added): the new rank and size, the
        streams re-cut, rank 0's duties, and a ``resize`` record (peak LR for the new global
        batch; the window :meth:`from_state` will continue from). A checkpoint write in flight
        finishes first: this rank may hand the run folder to another."""
        self.writer.wait()
        old_size = state.world
        self.ctx = comm.rank_context()
        self.cut_streams()
        window = window_in_new_cut(state.position["window"], state.windows_per_epoch,
                                   self.windows_per_epoch)
        self.take_root()
        self.faults = faults.for_rank(self.ctx.rank, self.cfg.run.inject_nan_steps)
        self.log.record("resize", state.position["step"], world_size=self.ctx.size,
                        previous_world_size=old_size, global_batch=self.global_batch,
                        peak_lr=self.peak_lr, window=window)
