"""Checkpoints: plain dicts of tensors and Python scalars, written atomically, last K kept.

A checkpoint holds everything an exact resume needs: model, optimiser, loss scaler and LR scheduler
state, the data position (epoch, window), every rank's carried recurrent state (gathered to rank 0),
the RNG states and the resolved config. Only tensors, numbers, strings, lists, tuples and dicts are
stored, so ``torch.load(path, weights_only=True)`` reads it (PyTorch "Serialization semantics").

Files: ``<run>/checkpoints/step_00001234.pt`` and ``<run>/checkpoints/latest`` (the newest file's
name). Written to a temporary file in the same directory, fsync'd, then renamed over.
"""

from __future__ import annotations

import io
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hvd_lm.core.atomic import write_bytes, write_text
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
    """Restore what :func:`rng_state` returned, wherever its tensors were loaded: the generator
    states are CPU ByteTensors for torch (``torch.set_rng_state`` and
    ``torch.cuda.set_rng_state_all`` take nothing else), so each is moved to the CPU first."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


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
    it needed (:class:`hvd_lm.core.atomic.DiskFullError`) and the previous checkpoint stays
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
        hvd_lm.core.atomic.DiskFullError: no space left.
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


def load_state(model: torch.nn.Module, state: dict, path: str | Path) -> None:
    """``model.load_state_dict(state)``, with a mismatch reported as one line.

    Raises:
        CheckpointError: the checkpoint was written for a model of another shape (names the
            first differing tensor and both shapes).
    """
    own = model.state_dict()
    for name, t in own.items():
        if name not in state:
            raise CheckpointError(f"{path}: written for another model (no {name}); check "
                                  "--cell/--hidden-size/--embed-dim/--weight-norm")
        if tuple(state[name].shape) != tuple(t.shape):
            raise CheckpointError(
                f"{path}: written for a model of another shape: {name} is "
                f"{list(state[name].shape)} there, {list(t.shape)} here (check --hidden-size, "
                "--embed-dim, --cell)")
    extra = sorted(set(state) - set(own))
    if extra:
        raise CheckpointError(f"{path}: written for another model (it has {extra[0]})")
    model.load_state_dict(state)


def load_model(path: str | Path, map_location: str | torch.device = "cpu",
               rnn_kernels: str = "auto"):
    """The :class:`~hvd_lm.core.model.LanguageModel` stored in a checkpoint, on
    ``map_location``, in eval mode, and the checkpoint dict.

    Args:
        rnn_kernels: the fused mLSTM's cell kernels for this device
            (:data:`hvd_lm.core.mlstm_kernels.KERNELS`; ``auto``: the device's default). Not
            the checkpoint's own: kernels are a property of the machine, not of the model, and
            a model trained with ``triton`` on a GPU must still load on a CPU.

    Raises:
        FileNotFoundError / CheckpointError: as :func:`resolve` / :func:`load`.
        ValueError: an unknown ``rnn_kernels``.
    """
    path = resolve(path)
    ckpt = load(path, map_location)
    model = LanguageModel(ModelConfig(**{**ckpt["config"]["model"], "rnn_kernels": rnn_kernels}))
    load_state(model, ckpt["model"], path)
    model.to(map_location)
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

    @property
    def attempts(self) -> int:
        """Optimizer step attempts, applied and skipped (the fault hooks and the control
        allreduce count these: the same on every rank)."""
        return self.step + self.skipped_steps


def payload(position: Position, model, optimizer, scheduler, scaler, rnn_state, config: dict,
            world_size: int, windows_per_epoch: int | None = None) -> dict:
    """The dict :func:`save` writes: ``position``'s fields, model/optimizer/scheduler/scaler
    state (``optimizer``: the optimizer or its ``state_dict()``, which for 1-bit optimizers every
    rank must call), every rank's recurrent state ``rnn_state`` = (h, c) each [world x B, H]
    (gathered in rank order), the RNG states, the config, the world size and the windows per
    epoch of that world's streams (what a resume on another world size needs to find the same
    point of the epoch)."""
    return {"step": position.step, "window": position.window,
            "skipped_steps": position.skipped_steps, "chars_trained": position.chars_trained,
            "model": model.state_dict(),
            "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rnn_state": tuple(rnn_state), "rng": rng_state(), "config": config,
            "world_size": world_size, "windows_per_epoch": windows_per_epoch}


class Resume:
    """A checkpoint being resumed from, applied in the order training builds its objects (the
    model first; the optimizer and scheduler once Horovod has wrapped the optimizer, because
    ``hvd.DistributedOptimizer`` builds a new optimizer over the same param groups).

    The checkpoint is read onto the CPU whatever device trains, so that one written on any
    device resumes on any other: the RNG states must be CPU tensors, and each restore moves the
    rest where it belongs (``load_state_dict`` copies into the model's and the optimizer's
    device; :meth:`rnn_rows` moves the recurrent state to ``device``).

    Args:
        source: checkpoint file or run directory (its ``latest``).
        device: where this job trains (the recurrent state rows go there).
        fallback: a run directory's newest checkpoint that loads (:func:`load_newest`, for
            ``--resume auto``) instead of failing on a damaged ``latest``.

    Raises:
        FileNotFoundError / CheckpointError: as :func:`resolve` / :func:`load`.
    """

    def __init__(self, source: str | Path, device: str | torch.device = "cpu",
                 fallback: bool = False, warn: bool = True):
        self.device = torch.device(device)
        if fallback:
            self.path, self.ckpt = load_newest(source, "cpu", warn)
        else:
            self.path = resolve(source)
            self.ckpt = load(self.path, "cpu")

    @property
    def position(self) -> Position:
        """The saved :class:`Position`."""
        c = self.ckpt
        return Position(c["step"], c["window"], c["skipped_steps"], c["chars_trained"])

    @property
    def windows_per_epoch(self) -> int | None:
        """Windows per epoch of the streams the saving job had (None: written before this was
        saved)."""
        return self.ckpt.get("windows_per_epoch")

    def restore_model(self, model: torch.nn.Module, scaler=None) -> None:
        """Load the model's weights (and the loss scaler's state when both exist).

        Raises:
            CheckpointError: the checkpoint is for a model of another shape."""
        load_state(model, self.ckpt["model"], self.path)
        if scaler is not None and self.ckpt.get("scaler"):
            scaler.load_state_dict(self.ckpt["scaler"])

    def rnn_rows(self, rank: int, size: int, batch_size: int, warn: bool = True):
        """This rank's B rows of the saved recurrent state (h, c) each [B, H] on the job's
        device, or None (and a warning on stderr when ``warn``) when the checkpoint was written
        by a job with another number of rows (world size x batch): its streams are then cut
        differently."""
        h, c = self.ckpt["rnn_state"]
        if h.shape[0] != size * batch_size:
            if warn:
                print(f"warning: {self.path} was written by {h.shape[0]} rows, this job has "
                      f"{size * batch_size}: recurrent state reset (resume is not exact)",
                      file=sys.stderr)
            return None
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return h[rows].to(self.device), c[rows].to(self.device)

    def restore_rng(self) -> None:
        """Python, numpy and torch RNG states."""
        set_rng_state(self.ckpt["rng"])

    def restore_optimizer(self, optimizer, scheduler) -> None:
        """Optimizer and LR-scheduler state (the caller then sets the param groups' LR through
        :func:`hvd_lm.train.schedule.set_peak_lr`, as the loop does)."""
        optimizer.load_state_dict(self.ckpt["optimizer"])
        scheduler.load_state_dict(self.ckpt["scheduler"])

    def release(self) -> None:
        """Drop the loaded tensors (the model and optimizer hold their own copies)."""
        self.ckpt = {k: v for k, v in self.ckpt.items()
                     if k in ("step", "window", "windows_per_epoch")}
