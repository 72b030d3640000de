"""The trainer's checkpointer: what a training checkpoint holds, when it is held back, and who
writes it (a component :class:`hvd_lm.train.loop.Trainer` holds, as torchtitan's trainer holds
its checkpoint manager).

:meth:`Checkpointer.save` is called by every rank at the same step. It gathers every rank's
recurrent state rows to rank 0 alone (``# collective:`` :func:`hvd_lm.comm.engine.gather`,
rank order: each rank sends its B rows, none receives another's) and the exact character count (a
sum over ranks, :meth:`hvd_lm.train.counting.CharCount.total`); rank 0 hands the payload
(:func:`hvd_lm.train.resume.payload`: position, model, optimizer, schedule, scaler, recurrent
state, RNG, configuration, world size, windows per epoch) to its :class:`CheckpointWriter`. While
the newest logged loss is above the divergence bound
(:meth:`hvd_lm.train.guard.DivergenceGuard.may_checkpoint`) nothing is gathered or written: a
``checkpoint_held`` record says so. A finished write is a ``checkpoint`` record (rank 0) and,
with ``--time-limit``, a measurement for the deadline's plan
(:meth:`hvd_lm.train.deadline.DeadlinePlanner.checkpoint_done`).

The writer (:class:`CheckpointWriter`) writes on a background thread (``--async-checkpoint``,
the default) or in the loop (``--async-checkpoint false``). Asynchronous, as
torch.distributed.checkpoint's ``async_save`` and Megatron-LM do:
:meth:`CheckpointWriter.submit` copies the payload's tensors to host memory
(:func:`hvd_lm.formats.checkpoint.to_host`: cloned on the CPU; from a GPU into pinned memory, one
device-to-host copy each, then one synchronize), starts a thread that writes the copy with
:func:`hvd_lm.formats.checkpoint.save` (the same serialisation, temporary file, fsync, rename
and ``latest`` update as a synchronous write) and returns: training
goes on while the file is written. The loop blocks only for the copy (and for a previous write
still in flight).

Ordering. At most one write is in flight. What depends on the files waits for it
(:meth:`CheckpointWriter.wait`): the next checkpoint (``submit`` waits first), the end of the run
(a stop signal's checkpoint included), the divergence guard's settling of the checkpoint folder,
an elastic reset (the rank may hand the run folder to another), and the lost-peer message that
names the newest checkpoint. :meth:`CheckpointWriter.poll`, once per step, logs a finished write.

Failures. A write that fails (a full disk: :class:`hvd_lm.util.atomic.DiskFullError`; non-finite
weights: :class:`hvd_lm.formats.checkpoint.NonFiniteError`) stores its exception, raised in the
loop's thread at the next ``poll`` or ``wait``: the same exception, so the same one ``ERROR:``
line and exit status as a synchronous failure, and the previous checkpoint stays ``latest``. A
process killed during a write leaves at most a ``.step_*.tmp`` file beside the checkpoints:
``latest`` and every ``step_*.pt`` are complete ones (atomic rename), so ``--resume auto``
continues from the previous checkpoint. The thread is not a daemon: a run that fails for another
reason still finishes the write in flight before the process exits.

Costs. Host memory for one more copy of the checkpoint's tensors while a write is in flight
(the serialised bytes, which a synchronous write holds too, come on top). The thread shares the
GIL with the loop: pickling holds it, the file write and fsync release it. ``python -m benchmarks
checkpoint`` measures the step time around a checkpoint both ways (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hvd_lm.comm import engine
from hvd_lm.comm.world import RankContext
from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.train import resume as resume_io
from hvd_lm.train.counting import CharCount
from hvd_lm.train.deadline import DeadlinePlanner
from hvd_lm.train.faults import checkpoint_write_delay
from hvd_lm.train.guard import DivergenceGuard
from hvd_lm.train.metrics import Metrics
from hvd_lm.train.settings import TrainConfig
from hvd_lm.train.step import State


@dataclasses.dataclass
class Written:
    """A finished checkpoint write: its ``step`` and ``path``; ``write_s``: seconds writing
    (serialise, write, fsync, rename, prune); ``blocked_s``: seconds the loop was blocked by
    it (the host copy and any wait for the previous write; the whole write when synchronous)."""

    step: int
    path: Path
    write_s: float
    blocked_s: float


class CheckpointWriter:
    """Writes checkpoints one at a time (module docstring).

    Args:
        asynchronous: write on a background thread (else in the caller, as ``save`` does).
        on_written: called in the caller's thread with each :class:`Written` (the
            checkpointer logs a ``checkpoint`` record), from :meth:`submit`, :meth:`poll` or
            :meth:`wait`.
    """

    def __init__(self, asynchronous: bool, on_written: Callable[[Written], None] | None = None):
        self.asynchronous = asynchronous
        self.on_written = on_written or (lambda w: None)
        self._thread: threading.Thread | None = None
        self._outcome: Written | BaseException | None = None

    @property
    def in_flight(self) -> bool:
        """A write has been submitted and not yet collected by :meth:`poll` or :meth:`wait`."""
        return self._thread is not None

    def submit(self, payload: dict, run_dir: str | Path, step: int, keep: int = 3,
               protect_below: int | None = None) -> None:
        """Write ``payload`` as the checkpoint of ``step`` (arguments as
        :func:`hvd_lm.formats.checkpoint.save`), after the write in flight; asynchronously, the
        payload's tensors are copied first, so the caller may change them as soon as this
        returns.

        Raises:
            the previous write's error (see :meth:`wait`); synchronously, this write's.
        """
        t0 = time.perf_counter()
        self.wait()
        if not self.asynchronous:  # written here: the loop blocked for the whole write
            self._write(payload, Path(run_dir), step, keep, protect_below, None)
            self._collect()
            return
        host = ckpt_io.to_host(payload)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the pinned copies are complete before the thread reads
        blocked = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._write, args=(host, Path(run_dir), step, keep, protect_below, blocked),
            name=f"checkpoint-writer-{step}", daemon=False)
        self._thread.start()

    def _write(self, payload: dict, run_dir: Path, step: int, keep: int,
               protect_below: int | None, blocked: float | None) -> None:
        """Write, and keep the outcome for :meth:`_collect` (``blocked`` None: the write's
        own seconds, a synchronous write)."""
        t0 = time.perf_counter()
        try:
            time.sleep(checkpoint_write_delay(step))  # a test's slow write (hvd_lm.train.faults)
            path = ckpt_io.save(payload, run_dir, step, keep, protect_below)
            seconds = time.perf_counter() - t0
            self._outcome = Written(step, path, seconds, seconds if blocked is None else blocked)
        except BaseException as e:  # noqa: BLE001 - raised in the loop's thread by _collect()
            self._outcome = e

    def poll(self) -> None:
        """Collect a write that has finished (nothing when it is still running).

        Raises:
            its error, as :meth:`wait`.
        """
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> Written | None:
        """Block until the write in flight (if any) is done, report it through ``on_written``
        and return it (None when nothing was in flight).

        Raises:
            hvd_lm.util.atomic.DiskFullError, hvd_lm.formats.checkpoint.NonFiniteError or any
            other error of that write, once (the writer is then idle).
        """
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        return self._collect()

    def _collect(self) -> Written:
        """Report the finished write through ``on_written`` and return it, or raise its error."""
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        self.on_written(outcome)
        return outcome


class Checkpointer(CheckpointWriter):
    """Saves the training checkpoints of one run (module docstring): the run's
    :class:`CheckpointWriter`, which it feeds (``poll`` and ``wait`` are the writer's).

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
        self.model, self.optimizer, self.lr_plan, self.scaler = model, optimizer, lr_plan, scaler
        self.guard, self.metrics, self.planner = guard, metrics, planner
        super().__init__(cfg.run.async_checkpoint, self.written)
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
            self.metrics.record("checkpoint_held", pos.step, loss=self.guard.newest_above())
            return 0.0
        t0 = time.perf_counter()
        # collective: every rank's recurrent state rows to rank 0 alone (rank order), for an
        # exact resume: each rank sends its B rows once, whatever the world size
        h = engine.gather(rnn_state[0].detach().float().cpu(), name="ckpt_h")
        c = engine.gather(rnn_state[1].detach().float().cpu(), name="ckpt_c")
        pos = dataclasses.replace(pos, chars_trained=chars.total())  # collective: sum
        if ctx.is_root:  # written on a thread unless --async-checkpoint false
            self.submit(resume_io.payload(pos, self.model, self.optimizer, self.lr_plan,
                                          self.scaler, self.guard, (h, c), self.config, ctx.size,
                                          windows_per_epoch),
                        self.out_dir, pos.step, self.keep, self.guard.confirmed_below())
        self.guard.wrote(pos.step)
        self.saved_step = pos.step  # every rank: the end does not write (or print) it again
        return time.perf_counter() - t0

    def written(self, w: Written) -> None:
        """The writer's report of a finished checkpoint (rank 0, in the loop's thread): a
        ``checkpoint`` record, and its times for the deadline's plan."""
        self.metrics.record("checkpoint", w.step, path=str(w.path), write_s=w.write_s,
                            blocked_s=w.blocked_s)
        if self.planner is not None:
            self.planner.checkpoint_done(w.write_s, w.blocked_s)

    def newest(self) -> Path | None:
        """The newest complete checkpoint in the run folder (None: none), once the write in
        flight (if any) is done: the newest is that one (a failed write's error is not raised
        here: the callers name the checkpoint a run that failed can resume from)."""
        with contextlib.suppress(Exception):
            self.wait()
        return ckpt_io.newest_complete(self.out_dir)
