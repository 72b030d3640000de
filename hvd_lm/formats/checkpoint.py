"""Checkpoint files: plain dicts of tensors and Python scalars, written atomically, and what a
run's ``checkpoints/`` folder holds.

A checkpoint holds everything an exact resume needs (:mod:`hvd_lm.train.resume` builds it): model,
optimiser, loss scaler and LR plan state, the data position (epoch, window), every rank's
carried recurrent state (gathered to rank 0), the RNG states and the resolved config. Only
tensors, numbers, strings, lists, tuples and dicts are stored, so ``torch.load(path,
weights_only=True)`` reads it (PyTorch "Serialization semantics").

Files: ``<run>/checkpoints/step_00001234.pt`` and ``<run>/checkpoints/latest`` (the newest file's
name). Written to a temporary file in the same directory, fsync'd, then renamed over.

This module is the one owner of what a checkpoint folder holds and which file is newest:

* ``latest`` names the checkpoint the run wrote last, always a bare ``step_NNNNNNNN.pt`` of the
  same folder (:func:`latest_path`): a ``latest`` naming a path, ``..`` or anything else is
  refused, never followed;
* :func:`save` points ``latest`` at the file it has just written and prunes only checkpoints of
  lower steps (the run's earlier ones): a file of a higher step (a stray copy, a damaged file,
  the rest of a timeline the run was rewound from) is neither pruned nor made ``latest``, and
  the file just written is never pruned;
* :func:`save` also removes the temporary files a killed save left (``.step_*.pt.*.tmp``,
  ``.latest.*.tmp``: :func:`hvd_lm.util.atomic.remove_stale_temps`), nothing else;
* :func:`describe` says which run a folder holds (``hvd-lm train`` refuses to start a fresh run
  over another run's checkpoints, :mod:`hvd_lm.train.rundir`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import sys
import zipfile
from pathlib import Path

import torch

from hvd_lm.util.atomic import remove_stale_temps, write_bytes, write_text
from hvd_lm.util.files import LINE_CHARS, FileRefused, open_regular, shown

CHECKPOINT_FORMAT = 1
_STEP_FILE = re.compile(r"^step_(\d{8})\.pt\Z")  # \Z: "$" would match before a final newline


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
    ``latest``. The caller owns the folder (holds the run folder's lock): temporary files that a
    killed save left in ``checkpoints/`` are removed first.

    Pruning trusts only the run's own history: it considers the checkpoints of steps below
    ``step`` (the run's earlier ones) and keeps the newest ``keep - 1`` of them besides the one
    just written, which is never pruned; a checkpoint of a higher step is left alone (it is not
    this run's: a stray or damaged file, or the rest of a timeline resumed from an older point).

    Args:
        keep: step checkpoints kept, newest first, the one written included (0 = all).
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
    remove_stale_temps(d, lambda name: name == "latest" or bool(_STEP_FILE.match(name)))
    path = d / f"step_{step:08d}.pt"
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **payload}, buf)
    write_bytes(path, buf.getbuffer())
    write_text(d / "latest", path.name + "\n")
    if keep > 0:
        older = [p for p in list_checkpoints(run_dir) if step_of(p) < step]
        confirmed = [p for p in older if protect_below is not None and step_of(p) < protect_below]
        for old in older[:max(0, len(older) - (keep - 1))]:
            if not (confirmed and old == confirmed[-1]):
                old.unlink(missing_ok=True)
    return path


#: Bytes of a checkpoint besides its tensors' data: the RNG states (Python's, numpy's and torch's
#: Mersenne Twister states, ~13 kB), the config, the pickled structure and the zip directory
#: (torch.save's container: one entry per tensor, data aligned to 64 bytes), rounded up from
#: what docs/reliability.md records.
CHECKPOINT_REST = 28 * 1024


def estimate_bytes(model: torch.nn.Module, optimizer_states: int, rnn_rows: int) -> int:
    """Bytes of a checkpoint of ``model`` (float32 weights) with ``optimizer_states`` tensors
    of the parameters' size (Adam 2, SGD with momentum 1) and ``rnn_rows`` recurrent-state rows
    (h and c, float32), plus :data:`CHECKPOINT_REST`: at most 3% above the real file
    (``tests/test_reliability_preflight.py`` compares it with checkpoints ``hvd-lm train``
    wrote)."""
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
    """Step checkpoints of a run, oldest first; a step file that is a link leading out of the
    folder is none of them (as ``latest`` is never followed out, :func:`latest_path`)."""
    d = checkpoint_dir(run_dir)
    return sorted(p for p in (d.iterdir() if d.is_dir() else ()) if _STEP_FILE.match(p.name)
                  and (not p.is_symlink() or p.resolve().parent == d.resolve()))


def latest_path(run_dir: str | Path) -> Path | None:
    """The checkpoint a run folder's ``latest`` names, or None when there is no ``latest`` or
    the file it names is gone.

    ``latest`` must hold one bare step file name (``step_00000030.pt``) of the same
    ``checkpoints/`` folder; it is never followed elsewhere.

    Raises:
        CheckpointError: ``latest`` holds a path, ``..``, or anything but a step file's name
            (naming the file and what it holds), or the name leads out of the folder (a link).
    """
    d = checkpoint_dir(run_dir)
    latest = d / "latest"
    if not latest.is_file():
        return None
    with open(latest, "rb") as f:
        name = f.read(256).decode("utf-8", "replace").strip()
    if not _STEP_FILE.match(name):
        raise CheckpointError(f"{latest}: names {name[:80]!r}, not a checkpoint of this folder "
                              "(latest holds one file name, step_NNNNNNNN.pt); fix or remove it, "
                              "or give a checkpoint file")
    target = d / name
    if not target.is_file():
        return None
    if target.resolve().parent != d.resolve():
        raise CheckpointError(f"{latest}: {name} leads out of {d} ({target.resolve()}); "
                              "checkpoints of a run are files in its checkpoints/ folder")
    return target


def resolve(path_or_run: str | Path) -> Path:
    """A checkpoint file from a file path or a run directory (its ``latest``,
    :func:`latest_path`; without one, its newest step file).

    Raises:
        FileNotFoundError: naming what was looked for.
        CheckpointError: a ``latest`` that names something other than a step file of its folder.
    """
    p = Path(path_or_run)
    if p.exists() and not p.is_dir():  # a file; a FIFO or device is named by load()
        return p
    target = latest_path(p) or (list_checkpoints(p) or [None])[-1]
    if target is None:
        d = checkpoint_dir(p)
        raise FileNotFoundError(f"no checkpoint at {p} (looked for a file, {d / 'latest'} and "
                                f"{d}/step_*.pt)")
    return target


def newest_complete(run_dir: str | Path) -> Path | None:
    """The checkpoint a user resumes from after a failure (:func:`resolve`'s choice: the one
    ``latest`` names, else the newest step file), or None when there is none or ``latest`` is
    unreadable; never raises (failure messages call it)."""
    with contextlib.suppress(OSError, CheckpointError):
        return resolve(run_dir) if checkpoint_dir(run_dir).is_dir() else None
    return None


def describe(run_dir: str | Path) -> str | None:
    """What run a folder's checkpoints are, in words (for refusing to mix two runs): the newest
    step, how many step checkpoints, and the folder's ``config.yaml`` when present; a run that
    diverged before any checkpoint was confirmed (every one set aside in
    ``checkpoints/diverged/``, ``latest`` removed) counts too; None when ``checkpoints/`` holds
    neither."""
    found = list_checkpoints(run_dir)
    if not found:
        aside = sorted((checkpoint_dir(run_dir) / "diverged").glob("step_*.pt"))
        return (f"a run that diverged ({len(aside)} checkpoint{'s' * (len(aside) > 1)} set "
                f"aside in {aside[0].parent})") if aside else None
    newest = found[-1]
    with contextlib.suppress(CheckpointError):
        newest = latest_path(run_dir) or newest
    config = Path(run_dir) / "config.yaml"
    return (f"a run at step {step_of(newest)} ({newest}; {len(found)} step checkpoint"
            f"{'s' * (len(found) > 1)}" + (f"; its settings: {config}" if config.is_file()
                                            else "") + ")")


def remove_all(run_dir: str | Path) -> list[Path]:
    """Delete a run's checkpoints (``hvd-lm train --overwrite``): its step files, ``latest``,
    ``diverged/`` step files and the temporary files of killed saves; any other file of
    ``checkpoints/`` stays (and the folder with it).

    Returns:
        The removed paths.
    """
    d = checkpoint_dir(run_dir)
    removed = remove_stale_temps(d, lambda name: name == "latest" or bool(_STEP_FILE.match(name)))
    for folder in (d, d / "diverged"):
        for p in folder.iterdir() if folder.is_dir() else ():
            if (_STEP_FILE.match(p.name) or (folder == d and p.name == "latest")) \
                    and not p.is_dir():
                p.unlink()
                removed.append(p)
    for folder in (d / "diverged", d):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
    return removed


def to_host(obj):
    """A copy of ``obj`` (nested dicts, lists and tuples of tensors and plain values) whose
    tensors are new CPU tensors: cloned from CPU tensors, copied from CUDA ones into pinned
    memory (asynchronously; call ``torch.cuda.synchronize()`` before reading them). Dict types
    (``OrderedDict``) and a state dict's ``_metadata`` are kept."""
    if torch.is_tensor(obj):
        if obj.device.type == "cuda":
            out = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
            return out.copy_(obj.detach(), non_blocking=True)
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)((k, to_host(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, (list, tuple)):
        return [to_host(v) for v in obj] if isinstance(obj, list) else tuple(map(to_host, obj))
    return obj


def load(path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict:
    """Read a checkpoint with ``weights_only=True``; with ``mmap`` its tensors are mapped from
    the file (``torch.load(mmap=True)``) and read only when touched: what a rank that needs a
    few entries (its own recurrent rows) uses instead of reading the whole file.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: not an hvd_lm checkpoint (another file type, another format version,
            a FIFO, device or folder), or truncated/damaged, naming the file.
    """
    path = Path(path)
    try:  # a FIFO or device is refused unopened (a FIFO blocks), as a damaged file would be
        with open_regular(path, "checkpoints are torch.save zip files") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown(path)}: no such checkpoint file") from None
    except FileRefused as e:
        raise CheckpointError(str(e)) from None
    if head != b"PK\x03\x04":  # torch.save's zip container (PyTorch "Serialization semantics")
        kind = {b"\x89HDF": "an HDF5 file (a shard?)", b"{": "JSON"}.get(
            head if head == b"\x89HDF" else head[:1], f"starts with {head!r}")
        raise CheckpointError(f"{path}: not an hvd_lm checkpoint ({kind}; checkpoints are "
                              "torch.save zip files, e.g. runs/NAME/checkpoints/step_N.pt)")
    _check_stored(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: truncated or damaged checkpoint "
                              f"({first_sentence(e)})") from None
    except Exception as e:  # noqa: BLE001 - e.g. pickle.UnpicklingError from a foreign object
        raise CheckpointError(f"{path}: not a loadable hvd_lm checkpoint "
                              f"({type(e).__name__}: {first_sentence(e)})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not an hvd_lm checkpoint (format {CHECKPOINT_FORMAT})")
    _check_fields(ckpt, path)
    return ckpt


def _check_stored(path: Path) -> None:
    """torch.save stores every zip entry uncompressed, so a checkpoint's entries add up to its
    size; a compressed entry (one 260 kB file inflated to 200 MB inside torch.load) is not one
    torch.save wrote. A zip too damaged to list is left to torch.load's own message.

    Raises:
        CheckpointError: naming the file and the entry.
    """
    packed = []
    with contextlib.suppress(zipfile.BadZipFile, OSError, ValueError), zipfile.ZipFile(path) as zf:
        packed = [i for i in zf.infolist() if i.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise CheckpointError(f"{path}: zip entry {packed[0].filename} is compressed "
                              f"({packed[0].compress_size:,} -> {packed[0].file_size:,} bytes); "
                              "torch.save stores its entries as they are: not an hvd_lm "
                              "checkpoint")


#: Counters a checkpoint holds (:class:`hvd_lm.train.resume.Position`): ints >= 0 when present.
_COUNTERS = ("step", "window", "skipped_steps", "chars_trained")


def _check_fields(ckpt: dict, path: Path) -> None:
    """The fields readers use, where present, have their types: ``model``, ``config``,
    ``config.model`` and ``config.data`` dicts, ``step`` and the other counters ints >= 0 (a bad
    one would otherwise surface as a bare TypeError, or, resuming, after training began).

    Raises:
        CheckpointError: naming the file and the field.
    """
    def bad(field: str, value, want: str) -> CheckpointError:
        return CheckpointError(f"{path}: field {field} is {str(value)[:60]!r}, expected {want}")

    config = ckpt.get("config", {})
    for field, value in (("model", ckpt.get("model", {})), ("config", config)):
        if not isinstance(value, dict):
            raise bad(field, value, "a dict")
    for field in ("model", "data"):
        if not isinstance(config.get(field, {}), dict):
            raise bad(f"config.{field}", config[field], "a dict")
    for field in _COUNTERS:
        value = ckpt.get(field, 0)
        if type(value) is not int or value < 0:
            raise bad(field, value, "an int >= 0")
    value = ckpt.get("trained_s", 0.0)  # seconds trained (--time-budget)
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        raise bad("trained_s", value, "seconds >= 0")


def first_sentence(e: BaseException, limit: int = 200) -> str:
    """The first sentence of an exception's message (its type's name when empty), whole: torch's
    zip reader appends a paragraph of advice to its one-line reason; cut at a word boundary with
    "..." only when that sentence alone is longer than ``limit`` characters."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0].rstrip(".")
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return text


def load_newest(run_dir: str | Path, map_location: str | torch.device = "cpu",
                warn: bool = True, mmap: bool = False) -> tuple[Path, dict]:
    """The newest checkpoint of a run that loads (``--resume auto``): ``latest`` first, then the
    step files of lower steps, newest first (without a usable ``latest``: every step file); each
    damaged one is skipped with a warning on stderr; ``mmap``: as :func:`load`.

    Raises:
        FileNotFoundError: no checkpoint at all. CheckpointError: none of them loads.
    """
    errors = []

    def skip(e: CheckpointError, then: str) -> None:
        errors.append(str(e))
        if warn:
            print(f"warning: {shown(str(e), LINE_CHARS)}; trying {then}", file=sys.stderr)

    try:
        first = latest_path(run_dir)
    except CheckpointError as e:
        first = None
        skip(e, "the step checkpoints")
    found = list_checkpoints(run_dir)
    if first is None and not found:
        if errors:
            raise CheckpointError(errors[0])
        resolve(run_dir)  # raises FileNotFoundError naming what was looked for
    older = [c for c in reversed(found) if first is None or step_of(c) < step_of(first)]
    for c in ([first] if first is not None else []) + older:
        try:
            return c, load(c, map_location, mmap)
        except CheckpointError as e:
            skip(e, "an older checkpoint")
    raise CheckpointError(f"{run_dir}: no checkpoint loads: " + "; ".join(errors))
