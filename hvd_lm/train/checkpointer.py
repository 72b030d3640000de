"""The trainer's checkpointer: what a training checkpoint holds, when it is held back, and who
writes it (a component :class:`hvd_lm.train.loop.Trainer` holds, as torchtitan's trainer holds
its checkpoint manager).

:meth:`Checkpointer.save` is called by every rank at the same step. It gathers every rank's
recurrent state rows to rank 0 alone (``# collective:`` :func:`hvd_lm.comm.engine.gather`,
rank order: each rank sends its B rows, none receives another's) and the exact character count (a
sum over ranks, :meth:`hvd_lm.train.counting.CharCount.total`); rank 0 hands the payload
(:func:`hvd_lm.train.resume.payload`: position, model, optimizer, schedule, scaler, recurrent
state, RNG, configuration, world size, windows per epoch) to its
:class:`hvd_lm.train.async_checkpoint.CheckpointWriter` (on a thread unless
``--async-checkpoint false``). While the newest logged loss is above the divergence bound
(:meth:`hvd_lm.train.guard.DivergenceGuard.may_checkpoint`) nothing is gathered or written: a
``checkpoint_held`` record says so. A finished write is a ``checkpoint`` record (rank 0) and,
with ``--time-limit``, a measurement for the deadline's plan
(:meth:`hvd_lm.train.deadline.DeadlinePlanner.checkpoint_done`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from hvd_lm.comm import engine
from hvd_lm.comm.world import RankContext
from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.train import resume as resume_io
from hvd_lm.train.async_checkpoint import CheckpointWriter, Written
from hvd_lm.train.counting import CharCount
from hvd_lm.train.deadline import DeadlinePlanner
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.settings import TrainConfig
from hvd_lm.train.step import State


class Checkpointer:
    """Saves the training checkpoints of one run (module docstring).

    Args:
        cfg: the run's configuration (saved in each checkpoint): the run folder
            (``run.out_dir``; checkpoints in ``<out_dir>/checkpoints``), the newest kept
            (``run.keep_checkpoints``), written on a thread (``run.async_checkpoint``).
        model, optimizer, lr_plan, scaler: what is saved (the optimizer Horovod-wrapped; the
            scaler's state when it is enabled).
        guard: the divergence guard: it may hold a checkpoint back, it is told of each saved
            step, and the checkpoints it has not confirmed yet are kept from pruning.
        metrics: rank 0's ``checkpoint`` and ``checkpoint_held`` records.
        planner: with ``--time-limit``, told how long each write took (None without).

    Attributes:
        saved_step: the step of this run's newest checkpoint (None: none yet, or rolled back
            past it by an elastic reset).
    """

    def __init__(self, cfg: TrainConfig, model, optimizer, lr_plan, scaler,
                 guard: DivergenceGuard, metrics: Metrics, planner: DeadlinePlanner | None = None):
        self.out_dir, self.config = Path(cfg.run.out_dir), cfg.to_dict()
        self.keep = cfg.run.keep_checkpoints
        self.model, self.optimizer, self.lr_plan, self.scaler = (model, optimizer, lr_plan,
                                                                   scaler)
        self.guard, self.metrics, self.planner = guard, metrics, planner
        self.writer = CheckpointWriter(cfg.run.async_checkpoint, self.written)
        self.saved_step: int | None = None

    def save(self, pos: resume_io.Position, rnn_state: State, chars: CharCount, ctx: RankContext,
             windows_per_epoch: int) -> float:
        """Every rank, at the same step: save the checkpoint of ``pos`` (its character count
        made exact from ``chars``; ``pos`` itself unchanged), with this rank's recurrent state
        ``rnn_state`` (h, c), each [B, H], gathered to rank 0, which writes it (a non-root rank
        sends 2 x B x H x 4 bytes, whatever the world size). Held (nothing
        gathered or written, a ``checkpoint_held`` record) while the newest logged loss is
        above the divergence bound.

        Returns:
            seconds the caller spent here (0 when held): not a step's time.

        Raises:
            the previous background write's error (:meth:`CheckpointWriter.submit`).
        """
        if not self.guard.may_checkpoint():
            self.metrics.record("checkpoint_held", pos.step,
                                loss=self.guard.newest_above())
            return 0.0
        t0 = time.perf_counter()
        # collective: every rank's recurrent state rows to rank 0 alone (rank order), for an
        # exact resume: each rank sends its B rows once, whatever the world size
        h = engine.gather(rnn_state[0].detach().float().cpu(), name="ckpt_h")
        c = engine.gather(rnn_state[1].detach().float().cpu(), name="ckpt_c")
        pos = dataclasses.replace(pos, chars_trained=chars.total())  # collective: sum
        if ctx.is_root:  # written on a thread unless --async-checkpoint false
            self.writer.submit(resume_io.payload(pos, self.model, self.optimizer, self.lr_plan,
                                                 self.scaler, self.guard, (h, c), self.config,
                                                 ctx.size, windows_per_epoch),
                               self.out_dir, pos.step, self.keep, self.guard.confirmed_below())
        self.guard.wrote(pos.step)
        self.saved_step = pos.step  # every rank: the end does not write (or print) it again
        return time.perf_counter() - t0

    def rolled_back(self) -> None:
        """An elastic rollback: the weights of the step last saved are no longer the model's."""
        self.saved_step = None

    def written(self, w: Written) -> None:
        """The writer's report of a finished checkpoint (rank 0, in the loop's thread): a
        ``checkpoint`` record, and its times for the deadline's plan."""
        self.metrics.record("checkpoint", w.step, path=str(w.path), write_s=w.write_s,
                            blocked_s=w.blocked_s)
        if self.planner is not None:
            self.planner.checkpoint_done(w.write_s, w.blocked_s)

    def poll(self) -> None:
        """Log a finished background write (:meth:`CheckpointWriter.poll`; raises its error)."""
        self.writer.poll()

    def wait(self) -> None:
        """Block until the write in flight (if any) is done and logged
        (:meth:`CheckpointWriter.wait`; raises its error)."""
        self.writer.wait()

    def newest(self) -> Path | None:
        """The newest complete checkpoint in the run folder (None: none), once the write in
        flight (if any) is done: the newest is that one (a failed write's error is not raised
        here: the callers name the checkpoint a run that failed can resume from)."""
        with contextlib.suppress(Exception):
            self.writer.wait()
        return ckpt_io.newest_complete(self.out_dir)
