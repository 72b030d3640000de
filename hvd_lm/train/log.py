"""Rank 0's outputs of a training run, and the stop signals every rank listens for.

* :class:`MetricsLog`: ``<out-dir>/metrics.jsonl`` (one JSON record per line: ``kind`` = start,
  train, eval, skip, checkpoint, plan, end, failure (:func:`write_failure`); ``step``; ``time``
  in Unix seconds; the values), a stdout line per record, a tqdm bar on a terminal, TensorBoard
  events with ``--tensorboard true`` (a warning instead when the ``tensorboard`` package is
  missing).
  :func:`read_metrics` is the one reader of that file (reports, scaling report, tests).
* :class:`StepMeter`: what the loop sums on each rank between two ``train`` records.
* :class:`StopSignals`: SIGTERM/SIGINT/SIGUSR1 (SLURM preemption, ``scancel --signal``, Ctrl-C)
  -> a stop flag the loop allreduces, so every rank checkpoints at the same step; a line on
  stderr at once says when.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from hvd_lm.comm.world import horovodrun_mpi_shell, under_openmpi
from hvd_lm.util.atomic import DiskFullError, free_bytes, human
from hvd_lm.util.files import FileRefused, open_append
from hvd_lm.util.lock import pid_alive

try:  # optional: TensorBoard events only when the package is installed
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # pragma: no cover - depends on the environment
    SummaryWriter = None


class StopSignals:
    """Turns SIGTERM/SIGINT/SIGUSR1 into a stop flag (:attr:`received` = the signal number):
    the loop checkpoints on every rank at the same step and exits 0.

    Under ``horovodrun --mpi`` a signal to horovodrun kills only the ``/bin/sh -c mpirun`` it
    became (:func:`hvd_lm.comm.world.horovodrun_mpi_shell`); a daemon thread watches that
    shell once a second and raises the flag (as SIGTERM) when it is gone.

    Under OpenMPI's ``mpirun`` a SIGTERM/SIGINT reaching a rank means mpirun is tearing the job
    down: it has stopped reading the ranks' stdout/stderr and sends SIGKILL after
    ``odls_base_sigkill_timeout``. A rank that kept printing (a log line per step, the progress
    bar) would block on the full pipe and be killed before its checkpoint, so the ranks then send
    their console to /dev/null (``metrics.jsonl`` still gets every record).
    """

    def __init__(self, watch_interval_s: float = 1.0, describe=None) -> None:
        self.received: int | None = None
        #: () -> str: when the stop happens (set by the loop: the step, the steps to go)
        self.describe = describe
        self.mpirun_tears_down = under_openmpi()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._handler)
        self._watch_wakeups()
        shell = horovodrun_mpi_shell()
        if shell is not None:
            threading.Thread(target=self._watch, args=(shell, watch_interval_s), daemon=True,
                             name="launcher-watchdog").start()

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
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread (tests building a trainer in one)
            return
        threading.Thread(target=self._acknowledge, args=(r,), daemon=True,
                         name="stop-acknowledge").start()

    def _acknowledge(self, fd: int) -> None:
        said = False
        stops = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGUSR1)}
        while True:
            data = os.read(fd, 64)
            if not data:
                return
            signum = next((b for b in data if b in stops), None)
            if signum is None or said:
                continue
            said = True
            if self.mpirun_tears_down and signum != signal.SIGUSR1:
                continue  # mpirun stopped reading our output: a line could block (above)
            when = ""
            if self.describe is not None:
                with contextlib.suppress(Exception):
                    when = self.describe()
            print(f"hvd-lm train: {signal.Signals(signum).name} received: {when or 'stopping'}"
                  "; the checkpoint is written, then the run exits 0 (--resume auto continues "
                  "it)", file=sys.stderr, flush=True)

    def _watch(self, pid: int, interval: float) -> None:
        while self.received is None:
            if not pid_alive(pid):
                print(f"horovodrun (pid {pid}) is gone: checkpointing and stopping",
                      file=sys.stderr, flush=True)
                self.received = signal.SIGTERM
                return
            time.sleep(interval)


def fmt(v) -> str:
    """A metric value for a log line (floats to 4 significant digits)."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class MetricsLog:
    """Rank 0's outputs: metrics.jsonl, stdout lines, tqdm bar, TensorBoard (when asked for).

    Args:
        out_dir: the run directory.
        enabled: False on ranks other than 0 (every method is then a no-op).
        total / initial: optimizer steps of the whole run (None: not known yet) / already done
            (the bar).
        tensorboard: write ``<out_dir>/tensorboard`` events (one warning line on stderr when
            the ``tensorboard`` package is missing).
    """

    def __init__(self, out_dir: Path, enabled: bool, total: int | None, initial: int,
                 tensorboard: bool):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        if not enabled:
            return
        # never through a link out of the run folder, never a FIFO (hvd_lm.util.files)
        self.file = open_append(out_dir, "metrics.jsonl", buffering=1)
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=None, file=sys.stderr)
        if tensorboard and SummaryWriter is not None:
            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        elif tensorboard:
            print("hvd-lm train: WARNING: --tensorboard true, but the tensorboard package is not "
                  "installed (pip install tensorboard): no TensorBoard events are written; "
                  f"{out_dir / 'metrics.jsonl'} has every record", file=sys.stderr, flush=True)

    def record(self, kind: str, step: int, printed: bool = True, **values) -> None:
        """Append ``{"kind", "step", "time", **values}`` and (``printed``) print it as one
        line."""
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
        shown = " ".join(f"{k}={fmt(v)}" for k, v in values.items())
        msg = f"[{kind}] step={step} {shown}"
        if self.bar is not None and not self.bar.disable:  # a terminal: keep the bar below
            self.bar.write(msg, file=sys.stdout)
        else:  # one write per line: launchers tag each write (stdout may be unbuffered)
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()

    def set_total(self, total: int) -> None:
        """The run's last step moved (``--time-limit``): the bar's total."""
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def tick(self, n: int = 1, **postfix) -> None:
        """Advance the bar by ``n`` steps."""
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: fmt(v) for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        """Close the bar, TensorBoard writer and file."""
        if self.enabled:
            if self.bar is not None:
                self.bar.close()
            if self.tb is not None:
                self.tb.close()
            self.file.close()


def resume_command(argv: list[str] | None = None) -> str:
    """This process's training command with ``--resume auto`` in place of any ``--resume``:
    what continues a failed run (under the same launcher). ``argv`` defaults to
    ``sys.argv``."""
    argv = list(sys.argv if argv is None else argv)
    prog = "hvd-lm" if Path(argv[0]).name == "hvd-lm" else f"{sys.executable} -m hvd_lm"
    words, skip = [], False
    for w in argv[1:]:
        if skip:
            skip = False
        elif w == "--resume":
            skip = True
        elif not w.startswith("--resume="):
            words.append(w)
    return " ".join([prog, *map(shlex.quote, words), "--resume", "auto"])


def write_failure(out_dir: str | Path, step: int, rank: int, error: str,
                  checkpoint: str | None) -> None:
    """Append a ``failure`` record (``rank``, ``host``, ``error``: the one line the rank prints,
    ``checkpoint``: the newest complete one or None, ``resume``: :func:`resume_command`) to
    ``<out_dir>/metrics.jsonl``: what ``hvd_lm.jobs.failure_summary`` shows as the last lines
    of a failed launch. Any rank may call it (an appended line, not rank 0's open log); it never
    raises (the error it records is the one to report)."""
    rec = {"kind": "failure", "step": step, "time": time.time(), "rank": rank,
           "host": socket.gethostname(), "error": error, "checkpoint": checkpoint,
           "resume": resume_command()}
    try:
        with open_append(out_dir, "metrics.jsonl") as f:
            f.write(json.dumps(rec) + "\n")
    except (OSError, FileRefused):
        pass


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a ``metrics.jsonl`` file, in order. Several ranks append ``failure`` records
    to it when a job fails (:func:`write_failure`), and on a shared filesystem (NFS) appends from
    several hosts are not atomic: a line that is not JSON is skipped with one warning on stderr
    naming the file and line, instead of making every reader of the run fail."""
    out = []
    for i, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                print(f"warning: {path}:{i}: not a JSON record, skipped ({e})", file=sys.stderr)
    return out


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

    def add(self, nats, chars: int, wait: float, busy: float) -> None:
        """One step attempt's sums."""
        self.nats = self.nats + nats
        self.chars += chars
        self.wait += wait
        self.busy += busy
        self.steps += 1
        self.compute.append(busy - wait)
