"""The run folder: owned by one job, checked before anything is written into it.

:func:`open_run_folder` runs on rank 0 once the configuration, the shards and the resume source
have been checked: it takes the folder's lock (:class:`hvd_lm.util.lock.FolderLock`, so a second
job into the same ``--out-dir`` fails naming the first), checks that the file system has room
for a checkpoint (size estimated from the model and optimizer,
:func:`hvd_lm.formats.checkpoint.estimate_bytes`), and only then writes ``config.yaml``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hvd_lm.formats.checkpoint import estimate_bytes
from hvd_lm.train.settings import TrainConfig, save_yaml
from hvd_lm.util.atomic import DiskFullError, free_bytes, human
from hvd_lm.util.lock import FolderLock

#: Optimizer state tensors per parameter (for the checkpoint size estimate).
OPTIMIZER_STATES = {"adam": 2, "sgd": 1}


def open_run_folder(cfg: TrainConfig, model: torch.nn.Module, rows: int) -> FolderLock:
    """Lock ``cfg.run.out_dir``, check room for a checkpoint, write ``config.yaml``.

    Args:
        model: the model to be checkpointed (its parameter count sizes the estimate).
        rows: recurrent-state rows saved with each checkpoint (world size x batch).

    Returns:
        The held lock (release it when the run ends).

    Raises:
        hvd_lm.util.lock.FolderBusyError: another job holds the folder.
        hvd_lm.util.atomic.DiskFullError: less free space than one checkpoint needs (with
            ``run.check_free_space``), naming the folder, the bytes needed and free.
    """
    out_dir = Path(cfg.run.out_dir)
    lock = FolderLock(out_dir, "run folder")
    try:
        need = estimate_bytes(model, OPTIMIZER_STATES.get(cfg.optim.optimizer, 2), rows)
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
        save_yaml(cfg, out_dir / "config.yaml")
    except BaseException:
        lock.release()
        raise
    return lock
