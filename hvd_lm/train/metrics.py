"""Rank 0's outputs of a training run and what they are computed from: the trainer's metrics
component (:class:`Metrics`), as torchtitan's trainer holds a metrics processor.

* :class:`Metrics`: the component the trainer (:class:`hvd_lm.train.loop.Trainer`) holds: rank
  0's log (opened and handed back as rank 0 changes, :meth:`Metrics.open`,
  :meth:`Metrics.close`): ``<out-dir>/metrics.jsonl`` (one JSON record per line: ``kind`` =
  start, train, eval, skip, checkpoint, plan, commit, resize, end; ``step``; ``time`` in Unix
  seconds; the values; a ``failure`` record comes from :func:`hvd_lm.train.log.write_failure`), a
  stdout line per record, a tqdm bar on a terminal, TensorBoard events with ``--tensorboard
  true`` (a warning instead when the ``tensorboard`` package is missing); the step meter; and
  the ``train`` record, summed over ranks (:meth:`Metrics.log_train`, two collectives, each
  marked ``# collective:``). Every rank holds one; on ranks other than 0 its records are not
  written. :func:`hvd_lm.train.log.read_metrics` is the one reader of that file.
* :class:`StepMeter`: what the loop sums on each rank between two ``train`` records.
"""

from __future__ import annotations

import errno
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from hvd_lm.comm import engine
from hvd_lm.model.mfu import Peak, rate_against
from hvd_lm.util.atomic import DiskFullError, free_bytes, human
from hvd_lm.util.files import open_append

try:  # optional: TensorBoard events only when the package is installed
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # pragma: no cover - depends on the environment
    SummaryWriter = None

def fmt(v) -> str:
    """A metric value for a log line (floats to 4 significant digits)."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


@dataclass
class StepMeter:
    """What the next ``train`` record sums, on this rank: nats (a 0-d device tensor until read),
    characters, seconds waiting on the allreduce and busy, steps, since ``t0``; ``compute``: each
    step's busy less its wait, seconds."""

    nats: float | torch.Tensor = 0.0
    chars: float = 0.0
    wait: float = 0.0
    busy: float = 0.0
    steps: int = 0
    compute: list[float] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)


class Metrics:
    """The trainer's metrics and logging (module docstring): rank 0's outputs (``metrics.jsonl``,
    stdout lines, a tqdm bar, TensorBoard when asked for), this rank's :class:`StepMeter` and
    the ``train`` record over all ranks.

    Args:
        out_dir: the run folder (``metrics.jsonl``, ``tensorboard/``).
        tensorboard: rank 0 writes ``<out_dir>/tensorboard`` events too (``--tensorboard``; one
            warning line on stderr when the ``tensorboard`` package is missing).
        peak: the device's peak (:class:`hvd_lm.model.mfu.Peak`) the logged MFU is against
            (:func:`hvd_lm.model.mfu.rate_against` may raise a CPU's); required by
            :meth:`log_train`.

    Attributes:
        meter: the sums since the last ``train`` record (:meth:`add_step`).
        enabled: this process writes the log (it is rank 0 and :meth:`open` was called); on
            other ranks every output method is a no-op.
    """

    def __init__(self, out_dir: str | Path, tensorboard: bool, peak: Peak | None = None):
        self.out_dir, self.tensorboard, self.peak = Path(out_dir), tensorboard, peak
        self.meter = StepMeter()
        self.enabled, self.bar, self.tb = False, None, None

    def open(self, total: int | None, initial: int) -> None:
        """Open the log (rank 0, appending), once: ``total`` steps of the run for the bar (None:
        not known yet, ``--time-limit``), ``initial`` already done."""
        if self.enabled:
            return
        self.enabled = True
        # never through a link out of the run folder, never a FIFO (hvd_lm.util.files)
        self.file = open_append(self.out_dir, "metrics.jsonl", buffering=1)
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=None, file=sys.stderr)
        if self.tensorboard and SummaryWriter is not None:
            self.tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        elif self.tensorboard:
            print("hvd-lm train: WARNING: --tensorboard true, but the tensorboard package is not "
                  "installed (pip install tensorboard): no TensorBoard events are written; "
                  f"{self.out_dir / 'metrics.jsonl'} has every record", file=sys.stderr, flush=True)

    def record(self, kind: str, step: int, printed: bool = True, **values) -> None:
        """Append ``{"kind", "step", "time", **values}`` to ``metrics.jsonl`` and (``printed``)
        print it as one line (rank 0)."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "time": time.time(), **values}
        try:
            self.file.write(json.dumps(rec) + "\n")
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = human(free_bytes(Path(self.file.name).parent))
                raise DiskFullError(e.errno, f"{self.file.name}: no space left on the device "
                                    f"appending a metrics record ({free} free)") from None
            raise
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(f"{kind}/{k}", v, step)
        if not printed:
            return
        msg = f"[{kind}] step={step} " + " ".join(f"{k}={fmt(v)}" for k, v in values.items())
        if not self.bar.disable:  # a terminal: keep the bar below
            self.bar.write(msg, file=sys.stdout)
        else:  # one write per line: launchers tag each write (stdout may be unbuffered)
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()

    def tick(self, n: int = 1) -> None:
        """Advance the progress bar by ``n`` applied steps."""
        if self.bar is not None:
            self.bar.update(n)

    def set_total(self, total: int) -> None:
        """The run's last step moved (``--time-limit``): the bar's total."""
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        """Close the log (its bar, TensorBoard writer and file): the run is over, or this rank
        is no longer rank 0 (an elastic reset); records are then not written."""
        if self.enabled:
            self.bar.close()
            if self.tb is not None:
                self.tb.close()
            self.file.close()
        self.enabled, self.bar, self.tb = False, None, None

    def restart_meter(self) -> None:
        """Start the sums of the next ``train`` record now (the loop's start)."""
        self.meter = StepMeter()

    def add_step(self, nats, chars: int, wait_s: float, busy_s: float) -> None:
        """One step attempt on this rank: ``nats`` summed over its windows (a 0-d device tensor
        or a float), ``chars`` targets, seconds waiting on the allreduce and busy in all."""
        m = self.meter
        m.nats = m.nats + nats  # a device tensor stays one: no host sync
        m.chars += chars
        m.wait += wait_s
        m.busy += busy_s
        m.steps += 1
        m.compute.append(busy_s - wait_s)

    def log_train(self, step: int, ranks: int, flops_per_char: float, lr: float,
                  loss_scale: float | None, **tail) -> float:
        """The ``train`` record (rank 0) of the steps since the last one, summed over the
        ``ranks`` ranks (every rank calls it at the same step), then a new meter.

        Args:
            step: the applied step count.
            ranks: the world size.
            flops_per_char: the model's FLOPs per character (TFLOP/s and MFU per rank against
                :attr:`peak`, :func:`hvd_lm.model.mfu.rate_against`).
            lr: the learning rate; loss_scale: fp16's loss scale or None.
            tail: the record's last values, in order (grad_norm, skipped_steps, epoch,
                world_size, the optimizer's bytes on the wire).

        Returns:
            the loss over all ranks, nats per character (the same float on every rank).
        """
        m = self.meter
        # collective: metrics summed over ranks (float(): the device sum, read now)
        nats, chars, waits, busy = engine.allreduce_sum([float(m.nats), m.chars, m.wait, m.busy],
                                                      name="log")
        # collective: each step's slowest rank outside the allreduce wait, which sets the step (a
        # straggler shows as its mean well above the mean rank's)
        slowest = engine.allreduce_max_each(m.compute, name="log.compute")
        wall = time.perf_counter() - m.t0
        loss = nats / max(1.0, chars)
        # per rank: TFLOP/s and MFU against one device's peak (hvd_lm.model.mfu)
        rate, self.peak = rate_against(chars / wall / ranks, flops_per_char, self.peak)
        self.record("train", step, loss=loss, bpc=loss / math.log(2), lr=lr, loss_scale=loss_scale,
                    chars_per_s=chars / wall, step_time=wall / m.steps, **rate,
                    allreduce_wait=waits / max(busy, 1e-9), compute_time_max=sum(slowest) / m.steps,
                    compute_time_mean=(busy - waits) / (ranks * m.steps), **tail)
        self.meter = StepMeter()
        return loss
