"""Rank 0's outputs of a training run, and the stop signals every rank listens for.

* :class:`MetricsLog`: ``<out-dir>/metrics.jsonl`` (one JSON record per line: ``kind`` = start,
  train, eval, skip, checkpoint, end; ``step``; ``time`` in Unix seconds; the values), a stdout
  line per record, a tqdm bar on a terminal, TensorBoard events when ``tensorboard`` is installed.
  :func:`read_metrics` is the one reader of that file (reports, scaling report, tests).
* :class:`StopSignals`: SIGTERM/SIGUSR1 (SLURM preemption, ``scancel --signal``) -> a stop flag
  the loop allreduces, so every rank checkpoints at the same step.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

try:  # optional: TensorBoard events only when the package is installed
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # pragma: no cover - depends on the environment
    SummaryWriter = None


class StopSignals:
    """Turns SIGTERM/SIGUSR1 into a stop flag (:attr:`received` = the signal number)."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = signum


def fmt(v) -> str:
    """A metric value for a log line (floats to 4 significant digits)."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class MetricsLog:
    """Rank 0's outputs: metrics.jsonl, stdout lines, tqdm bar, TensorBoard (when installed).

    Args:
        out_dir: the run directory.
        enabled: False on ranks other than 0 (every method is then a no-op).
        total / initial: optimizer steps of the whole run / already done (the bar).
        tensorboard: write ``<out_dir>/tensorboard`` events when possible.
    """

    def __init__(self, out_dir: Path, enabled: bool, total: int, initial: int, tensorboard: bool):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        if not enabled:
            return
        self.file = open(out_dir / "metrics.jsonl", "a", buffering=1)
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=None, file=sys.stderr)
        if tensorboard and SummaryWriter is not None:
            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def record(self, kind: str, step: int, **values) -> None:
        """Append ``{"kind", "step", "time", **values}`` and print it as one line."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "time": time.time(), **values}
        self.file.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(f"{kind}/{k}", v, step)
        shown = " ".join(f"{k}={fmt(v)}" for k, v in values.items())
        msg = f"[{kind}] step={step} {shown}"
        if self.bar is not None and not self.bar.disable:  # a terminal: keep the bar below
            self.bar.write(msg, file=sys.stdout)
        else:  # one write per line: launchers tag each write (stdout may be unbuffered)
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()

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


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a ``metrics.jsonl`` file, in order.

    Raises:
        ValueError: a line that is not JSON (naming file and line number).
    """
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return out
