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
from pathlib import Path

import numpy as np
import torch

from hvd_lm.atomic import atomic_path, write_text

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
    """The :class:`~hvd_lm.model.LanguageModel` stored in a checkpoint (eval mode) and the
    checkpoint dict."""
    from hvd_lm.model import LanguageModel, ModelConfig

    ckpt = load(resolve(path), map_location)
    model = LanguageModel(ModelConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, ckpt
