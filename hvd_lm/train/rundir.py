"""The run folder: owned by one job, checked before anything is written into it.

:func:`open_run_folder` runs on rank 0 once the configuration, the shards and the resume source
have been checked: it takes the folder's lock (:class:`hvd_lm.util.lock.FolderLock`, so a second
job into the same ``--out-dir`` fails naming the first), refuses a folder that holds another run's
checkpoints (a fresh run, or one resumed from elsewhere, would overwrite and mix them) unless
``--overwrite`` deletes them, checks that the file system has room for a checkpoint (size
estimated from the model and optimizer, :func:`hvd_lm.formats.checkpoint.estimate_bytes`), and
only then writes ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from hvd_lm import options
from hvd_lm.comm import engine
from hvd_lm.formats import checkpoint as ckpt_io
from hvd_lm.options import ConfigError
from hvd_lm.train.settings import TrainConfig
from hvd_lm.util.atomic import DiskFullError, free_bytes, human
from hvd_lm.util.lock import FolderLock

#: Files of a run besides its checkpoints that ``--overwrite`` deletes (``config.yaml`` is
#: rewritten anyway; ``metrics.jsonl`` is appended to, so an old one would mix two runs).
RUN_FILES = ("metrics.jsonl", "summary.json")


def checkpoint_bytes(cfg: TrainConfig, model: torch.nn.Module, rows: int) -> int:
    """A checkpoint's estimated size, bytes (:func:`hvd_lm.formats.checkpoint.estimate_bytes`):
    ``model``'s weights, its optimizer state (one tensor per parameter for SGD's momentum, two
    for the others' moments) and ``rows`` recurrent-state rows (world size x batch)."""
    return ckpt_io.estimate_bytes(model, 1 if cfg.optim.optimizer == "sgd" else 2, rows)


class RunFolderError(ConfigError):
    """The out-dir holds another run's checkpoints; the message names the folder, that run and
    the ways on (``--resume auto``, ``--overwrite``, another ``--out-dir``)."""


def check_other_run(cfg: TrainConfig, resumed_from: str | Path | None) -> None:
    """Refuse (or with ``run.overwrite`` delete) another run's checkpoints in the out-dir.

    A job that resumed from one of the folder's own checkpoints continues that run; any other
    job (a fresh one, or one resumed from a checkpoint elsewhere) would overwrite the folder's
    step files with its own and leave a mix of two runs.

    Raises:
        RunFolderError: the folder holds step checkpoints and neither applies (nothing is
            touched).
    """
    out_dir = Path(cfg.run.out_dir)
    if resumed_from is not None and (Path(resumed_from).resolve().parent
                                     == ckpt_io.checkpoint_dir(out_dir).resolve()):
        return  # a checkpoint of this folder: the run continues
    other = ckpt_io.describe(out_dir)
    if other is None:
        return
    if not cfg.run.overwrite:
        how = "" if resumed_from is None else f" (this job resumed from {resumed_from})"
        resumable = bool(ckpt_io.list_checkpoints(out_dir))  # not only diverged/ ones
        raise RunFolderError(
            f"{out_dir} holds the checkpoints of another run{how}: {other}; "
            + ("continue it with --resume auto, " if resumable else "")
            + "start over with --overwrite (deletes them), or use another --out-dir")
    removed = ckpt_io.remove_all(out_dir)
    for p in (out_dir / name for name in RUN_FILES):
        if p.is_file():
            p.unlink()
            removed.append(p)
    print(f"--overwrite: deleted {len(removed)} file(s) of the earlier run in {out_dir} "
          f"({other})", file=sys.stderr)


def open_run_folder(cfg: TrainConfig, model: torch.nn.Module, rows: int,
                    resumed_from: str | Path | None = None, first: bool = True) -> FolderLock:
    """Lock ``cfg.run.out_dir``, refuse another run's checkpoints (:func:`check_other_run`, when
    ``first``), check room for a checkpoint, write ``config.yaml``.

    Args:
        model: the model to be checkpointed (its parameter count sizes the estimate).
        rows: recurrent-state rows saved with each checkpoint (world size x batch).
        resumed_from: the checkpoint this job resumed from (None: a fresh start).
        first: this job opens the folder for the first time (False: an elastic rank that became
            rank 0 later, when the checkpoints there are this job's own).

    Returns:
        The held lock (release it when the run ends).

    Raises:
        hvd_lm.util.lock.FolderBusyError: another job holds the folder.
        RunFolderError: another run's checkpoints are there (without ``run.overwrite``).
        hvd_lm.util.atomic.DiskFullError: less free space than one checkpoint needs (with
            ``run.check_free_space``), naming the folder, the bytes needed and free.
    """
    out_dir = Path(cfg.run.out_dir)
    lock = FolderLock(out_dir, "run folder")
    try:
        if first:
            check_other_run(cfg, resumed_from)
        need = checkpoint_bytes(cfg, model, rows)
        free = free_bytes(out_dir)
        if cfg.run.check_free_space and free < need:
            raise DiskFullError(28, f"{out_dir}: a checkpoint needs about {human(need)} but only "
                                f"{human(free)} is free; free some space or use another "
                                "--out-dir (--check-free-space false skips this check)")
        # the kept ones, the one being written, and the newest one the divergence guard
        # confirmed (hvd_lm.train.guard), which may be older than the kept ones
        keep = cfg.run.keep_checkpoints
        at_once = max(1, keep) + 1 + (1 if keep > 0 else 0)
        if cfg.run.check_free_space and free < at_once * need:
            print(f"warning: {out_dir}: {human(free)} free holds fewer than the {at_once} "
                  f"checkpoints of about {human(need)} that --keep-checkpoints {keep} needs at "
                  "once", file=sys.stderr)
        # --overwrite is an action on the folder, not a setting of the run: a config.yaml
        # given back with --resume auto must not carry it
        run = dataclasses.replace(cfg.run, overwrite=False)
        options.save_yaml(dataclasses.replace(cfg, run=run), out_dir / "config.yaml")
    except BaseException:
        lock.release()
        raise
    return lock


class RunFolder:
    """Rank 0's hold on the run folder (a component the trainer holds): the lock
    (:func:`open_run_folder`) and rank 0's log in ``metrics``.

    Args:
        cfg: the run's configuration (``run.out_dir``; ``timed``: the bar's total once planned).
        model: the model checkpointed (sizes the room check).
        resumed_from: the checkpoint this job resumed from (None: a fresh start).
        metrics: the :class:`hvd_lm.train.metrics.Metrics` whose log rank 0 opens.

    Attributes:
        lock: the folder's lock while this rank is rank 0 and holds it, else None.
    """

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 resumed_from: str | Path | None, metrics):
        self.cfg, self.model, self.resumed_from, self.metrics = cfg, model, resumed_from, metrics
        self.lock: FolderLock | None = None

    def open(self, ctx, rows: int, step: int, total_steps: int) -> None:
        """At the start: locked, checked for room, ``config.yaml`` written, rank 0's log opened.
        Elastic: by rank 0 alone, with no collective (a joining worker must not wait here);
        else rank 0 opens it and every rank learns whether it could.

        Args:
            ctx: this rank's place (:class:`hvd_lm.comm.world.RankContext`).
            rows: recurrent-state rows in a checkpoint (world size x batch).
            step: applied steps so far (the bar); total_steps: the bar's total.

        Raises:
            what :func:`open_run_folder` raises (on every rank).
        """
        if self.cfg.run.elastic:
            self.take(ctx, rows, step, total_steps, first=True)
            return
        self.lock = engine.root_call(  # collective: every rank learns whether rank 0 got it
            lambda: open_run_folder(self.cfg, self.model, rows, self.resumed_from))
        if ctx.is_root:  # --time-limit/--time-budget: the total once planned
            self.metrics.open(None if self.cfg.timed else total_steps, step)

    def take(self, ctx, rows: int, step: int, total_steps: int, first: bool = False) -> None:
        """Elastic, after a reset too: rank 0 owns the folder and the log; a rank that is no
        longer 0 hands them back. ``first``: at the job's start (another run's checkpoints are
        refused then; later the folder's checkpoints are this job's)."""
        if ctx.is_root and self.lock is None:
            self.lock = open_run_folder(self.cfg, self.model, rows, self.resumed_from, first=first)
            self.metrics.open(None if self.cfg.timed else total_steps, step)
        elif not ctx.is_root and self.lock is not None:
            self.metrics.close()
            self.release()

    def release(self) -> None:
        """Let the folder go (the run is over, or this rank is no longer rank 0)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
