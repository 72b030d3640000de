"""Checkpoint files: plain dicts of tensors and Python scalars, written atomically, and what a
run's ``checkpoints/`` folder holds.

A checkpoint holds everything an exact resume needs (:mod:`hvd_lm.train.resume` builds it): model,
optimiser, loss scaler and LR scheduler state, the data position (epoch, window), every rank's
carried recurrent state (gathered to rank 0), the RNG states and the resolved config. Only
tensors, numbers, strings, lists, tuples and dicts are stored, so ``torch.load(path,
weights_only=True)`` reads it (PyTorch "Serialization semantics").

Files: ``<run>/checkpoints/step_00001234.pt`` and ``<run>/checkpoints/latest`` (the newest file's
name). Written to a temporary file in the same directory, fsync'd, then renamed over.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import torch

from hvd_lm.util.atomic import write_bytes, write_text

CHECKPOINT_FORMAT = 1
_STEP_FILE = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


class CheckpointError(ValueError):
    """A file that cannot be resumed from or loaded: not a checkpoint, truncated or damaged, or
    written for a model of another shape; the message names the file and what is wrong."""


class NonFiniteError(RuntimeError):
    """The model's weights are not finite (the run diverged): nothing is written."""


def save(payload: dict, run_dir: str | Path, step: int, keep: int = 3,
         protect_below: int | None = None) -> Path:
    """Write ``payload`` as ``step_<step>.pt`` atomically, update ``latest``, prune to ``keep``.

    The checkpoint is serialised in memory first, so a full disk is reported with the exact bytes
    it needed (:class:`hvd_lm.util.atomic.DiskFullError`) and the previous checkpoint stays
    ``latest``.

    Args:
        keep: step checkpoints kept, newest first (0 = all).
        protect_below: the newest checkpoint of a step below this one is never pruned (the
            divergence guard's newest confirmed checkpoint,
            :meth:`hvd_lm.train.guard.DivergenceGuard.confirmed_below`).

    Returns:
        The checkpoint's path.

    Raises:
        NonFiniteError: a model weight is inf/NaN (a diverged run never writes a checkpoint).
        hvd_lm.util.atomic.DiskFullError: no space left.
    """
    bad = [k for k, v in payload.get("model", {}).items()
           if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteError(f"not writing a checkpoint of step {step}: non-finite weights in "
                             f"{', '.join(bad[:4])}")
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:08d}.pt"
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **payload}, buf)
    write_bytes(path, buf.getbuffer())
    write_text(d / "latest", path.name + "\n")
    if keep > 0:
        found = list_checkpoints(run_dir)
        confirmed = [p for p in found if protect_below is not None
                     and step_of(p) < protect_below]
        for old in found[:-keep]:
            if not (confirmed and old == confirmed[-1]):
                old.unlink(missing_ok=True)
    return path


#: Bytes of a checkpoint besides its tensors' data: the RNG states (Python's, numpy's and torch's
#: Mersenne Twister states, ~13 kB), the config, the pickled structure and the zip directory
#: (torch.save's container: one entry per tensor, data aligned to 64 bytes). Measured 26.3 kB
#: for an Adam checkpoint of any width (torch 2.13); rounded up to 28 KiB.
CHECKPOINT_REST = 28 * 1024


def estimate_bytes(model: torch.nn.Module, optimizer_states: int, rnn_rows: int) -> int:
    """Bytes of a checkpoint of ``model`` (float32 weights) with ``optimizer_states`` tensors
    of the parameters' size (Adam 2, SGD with momentum 1) and ``rnn_rows`` recurrent-state rows
    (h and c, float32), plus :data:`CHECKPOINT_REST`: at most 3% above the real file
    (``tests/test_reliability.py`` compares it with checkpoints ``hvd-lm train`` wrote)."""
    params = sum(p.numel() for p in model.parameters())
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0)
    return 4 * params * (1 + optimizer_states) + 2 * 4 * rnn_rows * hidden + CHECKPOINT_REST


def step_of(path: str | Path) -> int:
    """The step of a ``step_<N>.pt`` file name.

    Raises:
        ValueError: not a step checkpoint's name.
    """
    m = _STEP_FILE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path}: not a step checkpoint name (step_NNNNNNNN.pt)")
    return int(m.group(1))


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
        FileNotFoundError: no such file.
        CheckpointError: not an hvd_lm checkpoint (another file type, another format version),
            or truncated/damaged, naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04":  # torch.save's zip container (PyTorch "Serialization semantics")
        kind = {b"\x89HDF": "an HDF5 file (a shard?)", b"{": "JSON"}.get(
            head if head == b"\x89HDF" else head[:1], f"starts with {head!r}")
        raise CheckpointError(f"{path}: not an hvd_lm checkpoint ({kind}; checkpoints are "
                              "torch.save zip files, e.g. runs/NAME/checkpoints/step_N.pt)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: truncated or damaged checkpoint "
                              f"({first_sentence(e)})") from None
    except Exception as e:  # noqa: BLE001 - e.g. pickle.UnpicklingError from a foreign object
        raise CheckpointError(f"{path}: not a loadable hvd_lm checkpoint "
                              f"({type(e).__name__}: {first_sentence(e)})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not an hvd_lm checkpoint (format {CHECKPOINT_FORMAT})")
    return ckpt


def first_sentence(e: BaseException, limit: int = 200) -> str:
    """The first sentence of an exception's message (its type's name when empty), whole: torch's
    zip reader appends a paragraph of advice to its one-line reason; cut at a word boundary with
    "..." only when that sentence alone is longer than ``limit`` characters."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split(". ")[0].rstrip(".")
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return text


def load_newest(run_dir: str | Path, map_location: str | torch.device = "cpu",
                warn: bool = True) -> tuple[Path, dict]:
    """The newest checkpoint of a run that loads (``--resume auto``): ``latest`` first, then the
    step files newest first; each damaged one is skipped with a warning on stderr.

    Raises:
        FileNotFoundError: no checkpoint at all. CheckpointError: none of them loads.
    """
    first = resolve(run_dir)
    candidates = [first] + [c for c in reversed(list_checkpoints(run_dir)) if c != first]
    errors = []
    for c in candidates:
        try:
            return c, load(c, map_location)
        except CheckpointError as e:
            errors.append(str(e))
            if warn:
                print(f"warning: {e}; trying an older checkpoint", file=sys.stderr)
    raise CheckpointError(f"{run_dir}: no checkpoint loads: " + "; ".join(errors))
