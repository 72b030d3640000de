"""The closing block a launch template prints when its job failed: its cause, on the last lines
the user sees (torchrun ends a failed job with "Root Cause (first observed
failure)" the same way).

A failed multi-rank job buries its one good line: after a lost peer, ``hvd-lm train: ERROR:
lost rank 1 on host n2 ...`` stands in the middle of the output, tagged ``[0]<stderr>:`` and
followed by horovodrun's traceback. The rank that has the cause writes a ``failure`` record to
``<out-dir>/metrics.jsonl`` (:meth:`hvd_lm.train.loop.Trainer.train` with
:func:`hvd_lm.train.log.write_failure`: rank, host, step, the one-line error, the newest complete
checkpoint, the command that resumes); the templates
(``launch/lib.sh``: ``hvd_lm_failure_summary``) call this module after the launcher exits
non-zero, and it prints::

    ==== hvd-lm: the job failed (exit status 1) ====
    where: rank 0 on host n1, after step 57 (recorded in runs/x/metrics.jsonl)
    newest complete checkpoint: runs/x/checkpoints/step_00000040.pt
    resume: run the same launch again (OUT_DIR=runs/x); it continues with --resume auto
    cause: lost rank 1 on host n2 (10.77.0.2 does not answer within 3 s: ...): ...

A rank the launcher saw killed by a signal is the first failure, ahead of any record (it could
record nothing itself; what the others recorded followed from it, e.g. a probe that ran while
the launcher was stopping them): srun's ``srun: error: n2: task 1: Killed``, OpenMPI's ``mpirun
noticed that process rank 1 ... on node n2 exited on signal 9``, horovodrun's ``Process 1 exit
with status code 137.`` and torchrun's "Root Cause (first observed failure)" block, the host
from the run's ``start`` record when the launcher names none (:func:`launcher_first`). Records
of lost peers from several hosts' probers are joined. Without a record newer than the launch
(an error before the run folder was opened, a rank that exited with an error and was not
recorded) the cause is what the launcher said of the rank that failed first or of a start it
refused (OpenMPI as root, with the fix), else the first ``ERROR:`` line the launch printed
(kept by the template, launcher tags such as ``[1]<stderr>:`` removed), else what the exit
status says.

A launch whose ranks all stopped on a signal and checkpointed (the run's ``end`` record since the
launch says ``stop: signal``) is a clean stop whatever the launcher's exit status (horovodrun
across hosts exits 255 or 0 after its ranks stopped cleanly, from one run to the next):
:func:`clean_stop` says so, and the templates print that line after every signal they passed on
(and instead of a failure's block) and exit 0.

``metrics.jsonl`` is read here from its end, its last :data:`METRICS_TAIL_BYTES` (the records
since the launch are the last ones it appended), skipping a line that is not JSON (the last one
may be cut short by a kill), instead of through :func:`hvd_lm.train.log.read_metrics`, which
reads it whole and imports torch: this runs at the end of every failed job and must not fail
itself, nor wait: a ``metrics.jsonl`` that is a FIFO or a device is never opened (the ``where``
line names it), and the ``--errors`` file is read in its first :data:`ERRORS_HEAD_BYTES`.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from hvd_lm.options import Command, error_text, option
from hvd_lm.util.files import FileRefused, head_lines, tail_lines

#: launcher tags in front of a rank's line: horovodrun ``[1]<stderr>:``, mpirun
#: ``--tag-output`` ``[1,0]<stderr>:``, srun ``--label`` ``1: ``
_TAG = re.compile(r"^(\[[\d,]+\]<std(?:out|err)>:|\d+: )\s*")


#: Bytes of ``metrics.jsonl`` read from its end (:func:`run_records`): the records a failed
#: launch appended last (its ``failure`` and ``end`` records: a few hundred bytes each), whatever
#: the file's size.
METRICS_TAIL_BYTES = 16 << 20
#: Bytes of the launch's kept ``ERROR:`` lines read from the start (``--errors``): the first
#: ones are the cause.
ERRORS_HEAD_BYTES = 16 << 20


def _lines(path: str | Path, tail: bool) -> tuple[list[bytes], str]:
    """(the lines of the last :data:`METRICS_TAIL_BYTES` of ``path`` (``tail``) or of its first
    :data:`ERRORS_HEAD_BYTES`, why none could be read: '' when the file was read or is absent).
    Never raises: the summary must print whatever happened."""
    try:
        return (tail_lines(path, METRICS_TAIL_BYTES) if tail
                else head_lines(path, ERRORS_HEAD_BYTES)), ""
    except FileNotFoundError:
        return [], ""
    except (OSError, FileRefused) as e:  # a FIFO, a device: named, never opened
        return [], error_text(e)


def run_records(out_dir: str | Path, kind: str, since: float = 0.0) -> list[dict]:
    """The ``kind`` records of ``<out_dir>/metrics.jsonl`` written at or after ``since``, in file
    order, from the file's last :data:`METRICS_TAIL_BYTES` (:func:`hvd_lm.util.files.tail_lines`:
    a FIFO or a device is never opened, a file of any size is read in that many bytes); [] when
    there is no such file or it cannot be read (lines that are not JSON skipped)."""
    out = []
    for line in _lines(Path(out_dir) / "metrics.jsonl", tail=True)[0]:
        try:
            rec = json.loads(line)
            if isinstance(rec, dict) and rec.get("kind") == kind and \
                    float(rec.get("time", 0)) >= since:
                out.append(rec)
        except (ValueError, TypeError, RecursionError):
            continue
    return out


def _kept_lines(path: str | Path | None) -> list[str]:
    """The lines of the launch's kept output (``--errors``), its first :data:`ERRORS_HEAD_BYTES`;
    [] when there is none or it cannot be read (the summary must print whatever happened)."""
    return [x.decode("utf-8", "replace") for x in _lines(path, tail=False)[0]] if path else []


def clean_stop(out_dir: str | Path, since: float = 0.0) -> str:
    """The line saying the launch stopped cleanly (every rank checkpointed on a signal, no
    failure recorded), or '' when it did not."""
    end = (run_records(out_dir, "end", since) or [{}])[-1]  # the launch's last end record
    if end.get("stop") != "signal" or run_records(out_dir, "failure", since):
        return ""
    return (f"==== hvd-lm: stopped on a signal: every rank checkpointed at step {end['step']} "
            f"({end.get('world_size', '?')} ranks; {Path(out_dir) / 'summary.json'}): "
            "a clean stop, whatever the launcher's exit status; continue it with the same "
            "launch (it adds --resume auto) ====")


#: What launchers print about a rank they lost or a start they refused, and what it means:
#: (pattern, cause). Named groups: rank, host, what.
LAUNCHER_LINES = (
    (re.compile(r"srun: error: (?P<host>[\w.-]+): tasks? (?P<rank>[\d,-]+): (?P<what>.+)"),
     "srun: rank {rank} on host {host}: {what}"),
    (re.compile(r"mpirun noticed that process rank (?P<rank>\d+) with PID \d+ on node "
                r"(?P<host>[\w.-]+) exited on signal (?P<what>\d+ \(\w+\))"),
     "mpirun: rank {rank} on host {host} was killed by signal {what}"),
    (re.compile(r"mpirun has detected an attempt to run as root"),
     "mpirun refused to start: OpenMPI does not run as root unless told to; set "
     "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (the launch templates do it "
     "for root themselves) or run as a user"),
)


#: horovodrun's line about a rank that ended with a non-zero status (its index is the rank; a
#: status of 128 + N is signal N); torchrun's is its "Root Cause (first observed failure)" block
#: (``rank : 7 (local_rank: 7)``, ``host : n2``, ``exitcode : -9 (pid: 123)``: -N is signal N).
_HOROVODRUN_EXIT = re.compile(r"^Process (?P<rank>\d+) exit with status code (?P<status>\d+)\.")


def launcher_first(path: str | Path | None, hosts: list | None = None) -> tuple[str, bool]:
    """The rank the launcher saw fail first, in its words, and whether a signal killed it (then
    it could record nothing itself, and what the other ranks recorded followed from it):
    horovodrun's and torchrun's with the host from ``hosts[rank]`` (the run's ``start``
    record), mpirun's and srun's and a refused start through :data:`LAUNCHER_LINES`; ('',
    False) when none."""
    lines = [_TAG.sub("", x) for x in _kept_lines(path)]
    for i, line in enumerate(lines):
        rank, status, launcher = None, 0, ""
        if "Root Cause (first observed failure)" in line:  # torchrun's block: the next fields
            f = dict(re.findall(r"^\s*(host|rank|exitcode)\s*: (\S+)", "\n".join(lines[i:i + 8]),
                                re.M))
            if re.fullmatch(r"-?\d+", f.get("exitcode", "")) and f.get("rank", "").isdigit():
                code = int(f["exitcode"])
                rank, status, launcher = int(f["rank"]), 128 - code if code < 0 else code, \
                    "torchrun"
        elif m := _HOROVODRUN_EXIT.search(line):
            rank, status, launcher = int(m["rank"]), int(m["status"]), "horovodrun"
        if rank is not None:
            host = hosts[rank] if hosts and 0 <= rank < len(hosts) else None
            where = f"{launcher}: rank {rank}{f' on host {host}' if host else ''}"
            if status > 128 and status - 128 in {int(x) for x in signal.Signals}:
                return (f"{where} was killed by signal {status - 128} "
                        f"({signal.Signals(status - 128).name})"), True
            return f"{where} exited with status {status}", False
    for line in lines:  # else what it said of a lost rank or a refused start
        for pattern, text in LAUNCHER_LINES:
            if m := pattern.search(line):
                said = text.format(**m.groupdict())
                return said, bool(re.match(r"mpirun: rank |srun: rank .*: (Killed|Terminated)",
                                           said))
    return "", False


def first_error_line(path: str | Path | None) -> str:
    """The first line holding ``ERROR:`` in the launch's kept output, launcher tags removed;
    '' when none."""
    return next((_TAG.sub("", x).strip() for x in _kept_lines(path) if "ERROR:" in x and
                 not any(p.search(x) for p, _ in LAUNCHER_LINES)), "")


def exit_text(rc: int) -> str:
    """What an exit status says: ``exit status 1``, ``killed by SIGKILL, exit status 137``."""
    if rc - 128 in {int(s) for s in signal.Signals}:
        return f"killed by {signal.Signals(rc - 128).name}, exit status {rc}"
    return f"exit status {rc}"


def newest_checkpoint(out_dir: str | Path) -> str:
    """The newest complete checkpoint of a run folder (:mod:`hvd_lm.formats.checkpoint`, read
    only when no failure record names one), or 'none'."""
    try:
        from hvd_lm.formats.checkpoint import newest_complete

        return str(newest_complete(out_dir) or "none")
    except Exception:  # noqa: BLE001 - the summary must print whatever happened
        return "none"


def summary(out_dir: str, rc: int, since: float = 0.0, errors: str = "",
            resume: str = "") -> str:
    """The closing block (see the module docstring); its last line is the cause.

    Args:
        out_dir: the run folder (``metrics.jsonl``, ``checkpoints/``).
        rc: the launcher's exit status.
        since: Unix seconds the launch started (older failure records belong to earlier runs).
        errors: a file holding the ``ERROR:`` lines the launch printed ('' = none kept).
        resume: how to run this launch again ('' = the record's training command).
    """
    recs = run_records(out_dir, "failure", since)
    lines = [f"==== hvd-lm: the job failed ({exit_text(rc)}) ===="]
    starts = run_records(out_dir, "start", since)
    said, killed = launcher_first(errors, starts[-1].get("hosts") if starts else None)
    line = first_error_line(errors)
    if recs and not killed:
        # rank 0's view when it recorded one (the launcher runs beside it: a host cut off from
        # the others may still reach the shared disk and record the mirror image), else the first
        r = next((x for x in recs if x.get("rank") == 0), recs[0])
        recorded = {x.get("rank") for x in recs}
        others = sorted(recorded - {r.get("rank")}, key=str)
        also = (f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} recorded "
                "one too" if others else "")
        lines.append(f"where: rank {r.get('rank')} on host {r.get('host')}, after step "
                     f"{r.get('step')} (recorded in {Path(out_dir) / 'metrics.jsonl'}{also})")
        ckpt = r.get("checkpoint") or "none (no step was saved)"
        cause = r.get("error") or line
        # each host's first rank probed two hosts: every host's findings joined, rank 0's view
        # first (a host cut off records the mirror image: rank 0 lost, though it recorded too)
        lost = [p for x in recs for p in x.get("lost") or [] if isinstance(p, dict)
                and (x is r or p.get("rank") not in recorded)]
        if lost:
            from hvd_lm.comm.peers import lost_text
            unique = list({p.get("rank"): p for p in lost}.values())
            # what the collective said, after the lost peers
            cause = lost_text(unique) + "".join(cause.partition(": a collective failed")[1:])
        again = resume or (f"the same launcher with `{r['resume']}`" if r.get("resume") else "")
    else:
        unread = _lines(Path(out_dir) / "metrics.jsonl", tail=True)[1]
        lines.append(("where: the launcher saw a rank killed first (what the other ranks "
                      "recorded followed from it)" if recs else
                      f"where: no rank recorded a failure in {Path(out_dir) / 'metrics.jsonl'}")
                     + (f" (unreadable: {unread})" if unread else "")
                     + ("; the launcher's own words follow" if said else
                        "; the first ERROR line of the launch follows" if line else ""))
        ckpt = newest_checkpoint(out_dir)
        cause = said or line or (f"no rank reported an error ({exit_text(rc)}): a rank killed "
                                 "outright (out of memory, kill -9, its node lost?); the "
                                 "launcher's output above says which")
        again = resume
    lines += [f"newest complete checkpoint: {ckpt}", *([f"resume: {again}"] if again else []),
              f"cause: {cause}"]
    return "\n".join(lines)


@dataclass
class SummaryConfig:
    """``python -m hvd_lm.jobs.failure_summary OUT_DIR --rc N``: what the templates call."""

    out_dir: str = option("", "the run folder", positional=True, required=True)
    rc: int = option(1, "the launcher's exit status")
    since: float = option(0.0, "Unix seconds the launch started")
    errors: str = option("", "file with the ERROR lines the launch printed")
    resume: str = option("", "how to run the launch again")
    clean_only: bool = option(False, "say only whether the launch was a clean stop (exit 3 and "
                              "its line), print nothing otherwise", switch=True)


def main(cfg: SummaryConfig) -> int:
    """Print the block on stdout (the templates send it to stderr): 0 for a failure's block, 3
    for a clean stop's line (:func:`clean_stop`: the template then exits 0)."""
    if stopped := clean_stop(cfg.out_dir, cfg.since):
        print(stopped, flush=True)
        return CLEAN_STOP
    if not cfg.clean_only:
        print(summary(cfg.out_dir, cfg.rc, cfg.since, cfg.errors, cfg.resume), flush=True)
    return 0


#: main's exit status for a clean stop.
CLEAN_STOP = 3


SUMMARY = Command(SummaryConfig, main, config_flag=False)

if __name__ == "__main__":
    sys.exit(SUMMARY.main(None, "python -m hvd_lm.jobs.failure_summary"))
