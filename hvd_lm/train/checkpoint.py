"""Checkpoints: plain dicts of tensors and Python scalars, written atomically, last K kept.

A checkpoint holds everything an exact resume needs: model, optimiser, loss scaler and LR scheduler
state, the data position (epoch, window), every rank's carried recurrent state (gathered to rank 0),
the RNG states and the resolved config. Only tensors, numbers, strings, lists, tuples and dicts are
stored, so ``torch.load(path, weights_only=True)`` reads it (PyTorch "Serialization semantics").

Files: ``<run>/checkpoints/step_00001234.pt`` and ``<run>/checkpoints/latest`` (the newest file's
name). Written to a temporary file in the same directory, fsync'd, then renamed over.
"""

from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hvd_lm.core.atomic import atomic_path, write_text
from hvd_lm.core.model import LanguageModel, ModelConfig

CHECKPOINT_FORMAT = 1
_STEP_FILE = re.compile(r"^step_(\d{8})\.pt$")


def rng_state() -> dict:
    """Python, numpy and torch (CPU and CUDA) RNG states as weights_only-loadable values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def save(payload: dict, run_dir: str | Path, step: int, keep: int = 3) -> Path:
    """Write ``payload`` as ``step_<step>.pt`` atomically, update ``latest``, prune to ``keep``.

    Returns:
        The checkpoint's path.
    """
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:08d}.pt"
    with atomic_path(path) as tmp:
        torch.save({"format": CHECKPOINT_FORMAT, **payload}, tmp)
    write_text(d / "latest", path.name + "\n")
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Step checkpoints of a run, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _STEP_FILE.match(p.name))


def resolve(path_or_run: str | Path) -> Path:
    """A checkpoint file from a file path or a run directory (its ``latest``).

    Raises:
        FileNotFoundError: naming what was looked for.
    """
    p = Path(path_or_run)
    if p.is_file():
        return p
    latest = checkpoint_dir(p) / "latest"
    if latest.is_file():
        target = checkpoint_dir(p) / latest.read_text().strip()
        if target.is_file():
            return target
    found = list_checkpoints(p)
    if found:
        return found[-1]
    raise FileNotFoundError(f"no checkpoint at {p} (looked for a file, {latest} and "
                            f"{checkpoint_dir(p)}/step_*.pt)")


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Read a checkpoint with ``weights_only=True``.

    Raises:
        ValueError: not a checkpoint of this format (naming the file).
    """
    ckpt = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not an hvd_lm checkpoint (format {CHECKPOINT_FORMAT})")
    return ckpt


def load_model(path: str | Path, map_location: str | torch.device = "cpu"):
    """The :class:`~hvd_lm.core.model.LanguageModel` stored in a checkpoint (eval mode) and the
    checkpoint dict."""
    ckpt = load(resolve(path), map_location)
    model = LanguageModel(ModelConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, ckpt


@dataclass
class Position:
    """Where training stands: what a resume continues from.

    Attributes:
        step: optimizer steps applied.
        window: TBPTT windows consumed per row (epoch x windows per epoch + window in epoch).
        skipped_steps: steps skipped for non-finite gradients.
        chars_trained: characters (bytes) trained on, summed over all ranks.
    """

    step: int = 0
    window: int = 0
    skipped_steps: int = 0
    chars_trained: int = 0


def payload(position: Position, model, optimizer, scheduler, scaler, rnn_state, config: dict,
            world_size: int) -> dict:
    """The dict :func:`save` writes: ``position``'s fields, model/optimizer/scheduler/scaler
    state (``optimizer``: the optimizer or its ``state_dict()``, which for 1-bit optimizers every
    rank must call), every rank's recurrent state ``rnn_state`` = (h, c) each [world x B, H]
    (gathered in rank order), the RNG states, the config and the world size."""
    return {"step": position.step, "window": position.window,
            "skipped_steps": position.skipped_steps, "chars_trained": position.chars_trained,
            "model": model.state_dict(),
            "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rnn_state": tuple(rnn_state), "rng": rng_state(), "config": config,
            "world_size": world_size}


class Resume:
    """A checkpoint being resumed from, applied in the order training builds its objects (the
    model first; the optimizer and scheduler once Horovod has wrapped the optimizer, because
    ``hvd.DistributedOptimizer`` builds a new optimizer over the same param groups).

    Args:
        source: checkpoint file or run directory (its ``latest``).
        map_location: device the tensors are loaded to.

    Raises:
        FileNotFoundError / ValueError: as :func:`resolve` / :func:`load`.
    """

    def __init__(self, source: str | Path, map_location: str | torch.device = "cpu"):
        self.path = resolve(source)
        self.ckpt = load(self.path, map_location)

    @property
    def position(self) -> Position:
        """The saved :class:`Position`."""
        c = self.ckpt
        return Position(c["step"], c["window"], c["skipped_steps"], c["chars_trained"])

    def restore_model(self, model: torch.nn.Module, scaler=None) -> None:
        """Load the model's weights (and the loss scaler's state when both exist)."""
        model.load_state_dict(self.ckpt["model"])
        if scaler is not None and self.ckpt.get("scaler"):
            scaler.load_state_dict(self.ckpt["scaler"])

    def rnn_rows(self, rank: int, size: int, batch_size: int, device: torch.device,
                 warn: bool = True):
        """This rank's B rows of the saved recurrent state (h, c) each [B, H], or None (and a
        warning on stderr when ``warn``) when the checkpoint was written by a job with another
        number of rows (world size x batch): its streams are then cut differently."""
        h, c = self.ckpt["rnn_state"]
        if h.shape[0] != size * batch_size:
            if warn:
                print(f"warning: {self.path} was written by {h.shape[0]} rows, this job has "
                      f"{size * batch_size}: recurrent state reset (resume is not exact)",
                      file=sys.stderr)
            return None
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return h[rows].to(device), c[rows].to(device)

    def restore_rng(self) -> None:
        """Python, numpy and torch RNG states."""
        set_rng_state(self.ckpt["rng"])

    def restore_optimizer(self, optimizer, scheduler) -> None:
        """Optimizer and LR-scheduler state; the param groups' LR is set to the scheduler's
        (building the scheduler reset it to step 0's)."""
        optimizer.load_state_dict(self.ckpt["optimizer"])
        scheduler.load_state_dict(self.ckpt["scheduler"])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr

    def release(self) -> None:
        """Drop the loaded tensors (the model and optimizer hold their own copies)."""
        self.ckpt = {k: v for k, v in self.ckpt.items() if k in ("step", "window")}
