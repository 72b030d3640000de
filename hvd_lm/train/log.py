"""The records of ``metrics.jsonl`` any rank or reader touches outside rank 0's log
(:class:`hvd_lm.train.metrics.Metrics` writes the rest), and the progress of long commands.

* :func:`write_failure`: a ``failure`` record appended by the rank that prints a run's one-line
  cause, with :func:`resume_command`, what continues the run.
* :func:`read_metrics` / :func:`iter_metrics`: the one reader of ``metrics.jsonl`` (reports,
  scaling report, tests), streamed and bounded.
* :class:`Progress`: the progress of a long command (eval, transfer, classify, generate,
  visualize): a tqdm bar on a terminal, a line every :data:`PROGRESS_EVERY_S` seconds in a log.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from hvd_lm.comm.world import env_seconds
from hvd_lm.util.files import FileRefused, iter_lines, open_append, shown


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
                  checkpoint: str | None, lost: list[dict] | None = None) -> None:
    """Append a ``failure`` record (``rank``, ``host``, ``error``: the one line the rank prints,
    ``checkpoint``: the newest complete one or None, ``resume``: :func:`resume_command`, and
    after a lost peer ``lost``: ``[{rank, host, why}]`` this rank's probes found) to
    ``<out_dir>/metrics.jsonl``: what ``hvd_lm.jobs.failure_summary`` shows as the last lines
    of a failed launch. Any rank may call it (an appended line, not rank 0's open log); it never
    raises (the error it records is the one to report)."""
    rec = {"kind": "failure", "step": step, "time": time.time(), "rank": rank,
           "host": socket.gethostname(), "error": error, "checkpoint": checkpoint,
           "resume": resume_command(), **({"lost": lost} if lost is not None else {})}
    with contextlib.suppress(OSError, FileRefused), open_append(out_dir, "metrics.jsonl") as f:
        f.write(json.dumps(rec) + "\n")


#: Largest ``metrics.jsonl`` a reader takes (:func:`iter_metrics`): about 2.5 million records of
#: a few hundred bytes (a run logging every 10 steps for 25 million steps); larger is refused
#: from its size, before a byte is read.
METRICS_MAX_BYTES = 1 << 30
#: Longest record read (:func:`iter_metrics`): a record is a few hundred bytes, a ``start``
#: record with its settings a few kB; a longer line is skipped with a warning, never held.
METRICS_LINE_MAX_BYTES = 1 << 20
_METRICS_WHAT = ("a run's metrics.jsonl holds a few hundred bytes per logged step "
                 "(hvd_lm.train.log.METRICS_MAX_BYTES)")


def iter_metrics(path: str | Path) -> Iterator[dict]:
    """Records of a ``metrics.jsonl`` file, in order, streamed in 1 MiB reads
    (:func:`hvd_lm.util.files.iter_lines`: memory of one record, whatever the file's size). Several
    ranks append ``failure`` records to it when a job fails (:func:`write_failure`), and on a
    shared filesystem (NFS) appends from several hosts are not atomic: a line that is not JSON,
    or longer than :data:`METRICS_LINE_MAX_BYTES`, is skipped with one warning on stderr naming
    the file and line, instead of making every reader of the run fail.

    Raises:
        FileNotFoundError / FileRefused: not a regular file (a FIFO, a device: named, never
            opened), or more than :data:`METRICS_MAX_BYTES` bytes.
    """
    for i, raw in iter_lines(path, METRICS_MAX_BYTES, _METRICS_WHAT, METRICS_LINE_MAX_BYTES):
        if raw is None:
            print(f"warning: {shown(path)}:{i}: a line of more than {METRICS_LINE_MAX_BYTES:,} "
                  "bytes, not a record, skipped", file=sys.stderr)
            continue
        line = raw.decode("utf-8", "replace")
        if line.strip():
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                print(f"warning: {shown(path)}:{i}: not a JSON record, skipped "
                      f"({shown(str(e), 120)})", file=sys.stderr)


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a ``metrics.jsonl`` file, in order (:func:`iter_metrics`: torn lines
    skipped with a warning; at most :data:`METRICS_MAX_BYTES`).

    Raises:
        FileNotFoundError / FileRefused: as :func:`iter_metrics`.
    """
    return list(iter_metrics(path))


#: Seconds between two progress lines when stderr is not a terminal (a redirected log, a batch
#: job's output); ``HVD_LM_PROGRESS_EVERY_S`` sets it (the tests: 1e-9, a line per update).
PROGRESS_EVERY_S = 10.0


class Progress(tqdm):
    """A long command's progress on stderr: tqdm's bar on a terminal; elsewhere one line every
    :data:`PROGRESS_EVERY_S` seconds and one at the end, e.g. ``hvd-lm eval (rank 0): 52,431 of
    133,753 chars (39%), 8,123 chars/s, 00:06 elapsed, 00:10 left`` (a log gets lines, not a bar's
    carriage returns: a redirected long command would otherwise say nothing until its end).

    Args:
        desc: what is counted, e.g. ``"hvd-lm eval (rank 0)"``. total: the count at the end
            (None: unknown). unit: ``"char"``, ``"window"``... (plural taken with an ``s``).
        enabled: False draws nothing (ranks other than 0, ``--no-progress``).
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "char",
                 enabled: bool = True, file=None):
        file = file or sys.stderr
        self.lines = enabled and not (hasattr(file, "isatty") and file.isatty())
        self._shown = 0  # the count the last line gave
        every = env_seconds("HVD_LM_PROGRESS_EVERY_S", PROGRESS_EVERY_S)
        super().__init__(total=total, desc=desc, unit=unit, file=file, disable=not enabled,
                         dynamic_ncols=True, leave=False, unit_scale=not self.lines,
                         **({"mininterval": every, "maxinterval": every, "miniters": 1}
                            if self.lines else {}))

    def line(self) -> str:
        """The progress as one line of a log (see the class docstring)."""
        d, units = self.format_dict, f"{self.unit}s"
        count = (f"{d['n']:,} of {d['total']:,} {units} ({100 * d['n'] / d['total']:.0f}%)"
                 if d["total"] else f"{d['n']:,} {units}")
        rate = d["rate"] or (d["n"] / d["elapsed"] if d["elapsed"] else 0.0)
        left = (f", {self.format_interval(max(0, d['total'] - d['n']) / rate)} left"
                if d["total"] and rate else "")
        return (f"{d['prefix']}: {count}, {rate:,.0f} {units}/s, "
                f"{self.format_interval(d['elapsed'])} elapsed{left}")

    def display(self, msg=None, pos=None):
        """One line per refresh in a log (none before the first unit, none repeated); tqdm's own
        drawing on a terminal."""
        if not self.lines:
            return super().display(msg, pos)
        if msg == "":  # tqdm clearing its line: nothing to clear in a log (and no "\r" after it)
            return False
        if self.n != self._shown:
            self._shown = self.n
            self.fp.write(self.line() + "\n")
            self.fp.flush()
        return True

    def close(self):
        """The last line in a log (the count at the end), then tqdm's close."""
        if self.lines and not self.disable:
            self.display()
        super().close()
