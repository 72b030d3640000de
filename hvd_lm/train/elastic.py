"""Horovod elastic training (``run.elastic``; Horovod docs, "Elastic Horovod"; launched by
``horovodrun --min-np/--max-np --host-discovery-script``): the trainer's elastic state, a
component :class:`hvd_lm.train.loop.Trainer` holds (:class:`Elastic`).

The loop runs under ``hvd.elastic.run`` (:meth:`Elastic.train`): every ``run.commit_every``
applied steps the model, optimizer, LR schedule, loss scaler, data position, character count and
divergence counters are committed in memory (``hvd.elastic.TorchState``, :meth:`Elastic.commit`).
A lost worker rolls every rank back to the last commit; a changed world size re-cuts the streams
at the same fraction of the epoch (:func:`hvd_lm.train.data.window_in_new_cut`), rescales the LR
for the new global batch (the :class:`hvd_lm.train.schedule.LRPlan`'s peak) and starts the recurrent
state of the re-cut rows from zero (:meth:`Elastic.on_reset`, :meth:`Elastic.restore`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hvd_lm.comm import engine
from hvd_lm.train.checkpointer import Checkpointer
from hvd_lm.train.counting import CharCount
from hvd_lm.train.data import window_in_new_cut
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.resume import Position, load_train_state, train_state
from hvd_lm.train.rundir import RunFolder
from hvd_lm.train.startup import RunParts
from hvd_lm.train.step import State


class Elastic:
    """The elastic state of a training run (module docstring).

    Args:
        parts: the run's parts (:class:`hvd_lm.train.startup.RunParts`): its model, optimizer,
            schedule and scaler are committed and restored; its world (``ctx``, the streams, rank
            0's folder) is re-formed on a reset.
        folder: the run folder, which moves with rank 0 on a reset.
        checkpointer: a write in flight finishes before a reset.
        metrics: ``commit`` and ``resize`` records; rank 0's log moves with rank 0.
        guard: the divergence counters, committed and restored.

    Attributes:
        parts: the parts given.
        committed_rows: (rank, size, (h, c)) of this rank at the last commit, or None: the
            recurrent rows are per rank, kept beside the state.
        commit_seconds: each commit's seconds.
    """

    def __init__(self, parts: RunParts, folder: RunFolder, checkpointer: Checkpointer,
                 metrics: Metrics, guard: DivergenceGuard):
        self.parts, self.folder, self.checkpointer = parts, folder, checkpointer
        self.metrics, self.guard = metrics, guard
        self.committed_rows: tuple | None = None
        self.commit_seconds: list[float] = []

    def train(self, pos: Position, loop: Callable, on_reset: Callable) -> None:
        """Run ``loop(state)`` under ``hvd.elastic.run`` until it returns, starting from
        ``pos``; the state is created without a collective (a joining worker gets it at the
        first sync); ``on_reset(state)`` runs after every reset (it should call
        :meth:`on_reset`)."""
        r = self.parts
        # Horovod: the state committed in memory and synced from rank 0 after every reset; its
        # train field what a checkpoint holds too (all ranks agree on it; the recurrent rows are
        # per rank and kept beside, committed_rows)
        state = engine.elastic_state(r.model, r.optimizer, train=train_state(
            pos, r.lr_plan, r.scaler, self.guard, r.ctx.size, r.windows_per_epoch))
        state.register_reset_callbacks([lambda: on_reset(state)])
        engine.elastic_run(loop)(state)  # Horovod: re-forms the world on failures

    def commit(self, state, pos: Position, rnn_state: State, chars: CharCount) -> None:
        """Commit the run in memory (every rank, same step): ``pos`` with the exact character
        count (Horovod: a sum; ``chars`` counts on from it), schedule, scaler, this rank's
        recurrent rows ``rnn_state``, then ``state.commit()`` (copies of the model's and
        optimizer's state; may raise ``HostsUpdatedInterrupt``)."""
        t0, r = time.perf_counter(), self.parts
        pos.chars_trained = chars.total()  # Horovod: sum over ranks
        chars.rebase(pos.chars_trained)
        state.train = train_state(pos, r.lr_plan, r.scaler, self.guard, r.ctx.size,
                                  r.windows_per_epoch)
        self.committed_rows = (r.ctx.rank, r.ctx.size, tuple(s.detach().clone() for s in rnn_state))
        state.commit()  # Horovod: may raise HostsUpdatedInterrupt
        self.commit_seconds.append(time.perf_counter() - t0)
        if len(self.commit_seconds) == 1 or pos.step % r.cfg.run.log_every == 0:
            self.metrics.record("commit", pos.step, seconds=self.commit_seconds[-1])

    def restore(self, state, chars: CharCount) -> tuple[Position, State]:
        """Take the (synced) committed position, schedule, scaler and divergence counters;
        ``chars`` counts on from the committed count. When the world size changed since that
        commit, the window index is moved to the same fraction of the epoch in the new cut
        (done here, after Horovod's sync: ``sync`` re-sets every field from rank 0's last
        commit, so a change made in the reset callback would be lost).

        Returns:
            the position to go on from, and the recurrent state: this rank's committed rows
            when it kept its place in the same world, else zeros.
        """
        r = self.parts
        pos = load_train_state(state.train, r.lr_plan, r.scaler, self.guard)
        pos.window = window_in_new_cut(pos.window, state.train["windows_per_epoch"],
                                       r.windows_per_epoch)
        chars.rebase(pos.chars_trained)
        r.lr_plan.peak = r.peak_lr  # the rule's peak for the new world's global batch
        rows = self.committed_rows
        if rows and rows[:2] == (r.ctx.rank, r.ctx.size):
            return pos, tuple(t.clone() for t in rows[2])
        return pos, r.model.init_state(r.B, r.device)

    def on_reset(self, state, step: int) -> None:
        """After Horovod re-formed the world (a worker lost or added): the new rank and size, the
        streams re-cut, rank 0's duties (``step``: applied steps before the reset, for the
        bar), and a ``resize`` record (peak LR for the new global batch; the window
        :meth:`restore` will continue from). A checkpoint write in flight finishes first: this
        rank may hand the run folder to another."""
        r = self.parts
        self.checkpointer.wait()
        old_size, committed = state.train["world_size"], state.train
        r.reform()  # Horovod: this rank in the re-formed world, its streams cut again
        self.folder.take(r.ctx, r.ctx.size * r.B, step, r.total_steps)  # rank 0's duties
        window = window_in_new_cut(committed["window"], committed["windows_per_epoch"],
                                   r.windows_per_epoch)
        self.metrics.record("resize", committed["step"], world_size=r.ctx.size,
                            previous_world_size=old_size, global_batch=r.global_batch,
                            peak_lr=r.peak_lr, window=window)
