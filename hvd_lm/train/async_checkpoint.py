"""Rank 0's checkpoint writer: on a background thread (``--async-checkpoint``, the default) or in
the loop (``--async-checkpoint false``).

Asynchronous, as torch.distributed.checkpoint's ``async_save`` and Megatron-LM do: the
trainer's checkpointer (:class:`hvd_lm.train.checkpointer.Checkpointer`, which holds this
writer) builds the checkpoint's payload (:func:`hvd_lm.train.resume.payload`) and
:meth:`CheckpointWriter.submit` copies its tensors to host memory (:func:`to_host`: cloned on the
CPU; from a GPU into pinned memory, one device-to-host copy each, then one synchronize), starts a
thread that writes the copy with :func:`hvd_lm.formats.checkpoint.save` (the same serialisation,
temporary file, fsync, rename and ``latest`` update as a synchronous write) and returns: training
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

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.formats.checkpoint import to_host
from hvd_lm.train.faults import checkpoint_write_delay


@dataclass
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
        if not self.asynchronous:
            time.sleep(checkpoint_write_delay(step))  # a test's slow write (hvd_lm.train.faults)
            path = ckpt_io.save(payload, run_dir, step, keep, protect_below)
            seconds = time.perf_counter() - t0
            self.on_written(Written(step, path, seconds, seconds))
            return
        host = to_host(payload)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the pinned copies are complete before the thread reads
        blocked = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._write, args=(host, Path(run_dir), step, keep, protect_below, blocked),
            name=f"checkpoint-writer-{step}", daemon=False)
        self._thread.start()

    def _write(self, payload: dict, run_dir: Path, step: int, keep: int,
               protect_below: int | None, blocked: float) -> None:
        """The thread: write, and keep the outcome for :meth:`wait`."""
        t0 = time.perf_counter()
        try:
            time.sleep(checkpoint_write_delay(step))  # a test's slow write (hvd_lm.train.faults)
            path = ckpt_io.save(payload, run_dir, step, keep, protect_below)
            self._outcome = Written(step, path, time.perf_counter() - t0, blocked)
        except BaseException as e:  # noqa: BLE001 - raised in the loop's thread by wait()
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
        self._thread, outcome, self._outcome = None, self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        self.on_written(outcome)
        return outcome
