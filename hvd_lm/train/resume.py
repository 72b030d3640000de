"""Resuming training exactly: the position, the RNG states and what a checkpoint of a run
holds, and :class:`Resume`, which applies a checkpoint to a job being built (the file format
and the checkpoint folder are :mod:`hvd_lm.formats.checkpoint`'s).

One save protocol: every part of the run's state is an object with ``state_dict()`` and
``load_state_dict()`` (``torch.distributed.checkpoint.stateful.Stateful``'s protocol: the
model, the optimizer, :class:`Position`, the LR plan, the loss scaler, the divergence guard).
:func:`train_state` gathers the small ones, what a checkpoint (:func:`payload`, written by the
async writer) and an elastic commit (:class:`hvd_lm.train.elastic.Elastic`) both hold, and
:func:`load_train_state` gives each its own back.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch

from hvd_lm.formats.checkpoint import load, load_newest, resolve
from hvd_lm.model.load import load_state
from hvd_lm.train.schedule import saved_factor


def rng_state(device: torch.device | None = None) -> dict:
    """Python, numpy and torch RNG states as weights_only-loadable values, and on a GPU the
    generator of ``device`` (this rank's GPU) alone: saving every visible GPU's would create a
    CUDA context on each (memory taken from the other ranks' GPUs) and tie the checkpoint to
    that many GPUs."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` returned, wherever its tensors were loaded (torch takes
    generator states as CPU ByteTensors only, so each is moved to the CPU first); the CUDA state
    goes to ``device`` when that is a GPU (a checkpoint of an earlier version, which held a list
    of every visible GPU's, gives that GPU's index's entry when it has one)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if device is None or device.type != "cuda" or cuda is None:
        return
    if isinstance(cuda, (list, tuple)):  # every visible GPU's, as written before
        index = device.index or 0
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda.cpu(), device)


@dataclasses.dataclass
class Position:
    """Where training stands: what a resume continues from.

    Attributes:
        step: optimizer steps applied.
        window: TBPTT windows consumed per row (epoch x windows per epoch + window in epoch).
        skipped_steps: steps skipped for non-finite gradients.
        chars_trained: characters (bytes) trained on, summed over all ranks.
        trained_s: seconds of training over every allocation of the run: each one's training
            loop, from its first step to the checkpoint (start-up and the time between jobs
            not counted); what ``--time-budget`` spends.
    """

    step: int = 0
    window: int = 0
    skipped_steps: int = 0
    chars_trained: int = 0
    trained_s: float = 0.0

    @property
    def attempts(self) -> int:
        """Optimizer step attempts, applied and skipped (the fault hooks and the control
        allreduce count these: the same on every rank)."""
        return self.step + self.skipped_steps

    def state_dict(self) -> dict:
        """The five fields (``trained_s`` a float)."""
        return {**dataclasses.asdict(self), "trained_s": float(self.trained_s)}

    def load_state_dict(self, state: dict) -> None:
        """Take :meth:`state_dict`'s fields (``trained_s`` 0 when a checkpoint predates it)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, state.get(f.name, f.default))


def train_state(position: Position, lr_plan, scaler, guard, world_size: int,
                windows_per_epoch: int | None) -> dict:
    """What a checkpoint and an elastic commit both hold besides the model, the optimizer and
    the recurrent rows: the ``state_dict()`` of the position (its fields at the top level, as
    checkpoints have always had them), the LR plan, the loss scaler (None when off) and the
    divergence guard, the world size and the windows per epoch of that world's streams (what a
    resume or a resize needs to find the same point of the epoch)."""
    return {**position.state_dict(), "lr_plan": lr_plan.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "guard": guard.state_dict(), "world_size": world_size,
            "windows_per_epoch": windows_per_epoch}


def load_train_state(state: dict, lr_plan, scaler=None, guard=None) -> Position:
    """Give each part its state back from :func:`train_state`'s dict (a checkpoint's ``lr_plan``
    may be an older ``scheduler``: a LambdaLR's state; a part given as None is left as it is: a
    resumed run starts its divergence counters afresh); returns the :class:`Position`."""
    lr_plan.load_state_dict(state.get("lr_plan", state.get("scheduler")))
    if scaler is not None and scaler.is_enabled() and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if guard is not None and state.get("guard"):
        guard.load_state_dict(state["guard"])
    pos = Position()
    pos.load_state_dict(state)
    return pos


def payload(position: Position, model, optimizer, lr_plan, scaler, guard, rnn_state,
            config: dict, world_size: int, windows_per_epoch: int | None = None) -> dict:
    """The dict :func:`save` writes: :func:`train_state`, the model's and the optimizer's
    ``state_dict()`` (``optimizer``: the optimizer or its ``state_dict()``), every rank's
    recurrent state ``rnn_state`` = (h, c) each [world x B, H] (gathered to rank 0 in rank
    order), the RNG states and the config."""
    return {**train_state(position, lr_plan, scaler, guard, world_size, windows_per_epoch),
            "model": model.state_dict(),
            "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
            "rnn_state": tuple(rnn_state),
            "rng": rng_state(next(model.parameters()).device), "config": config}


class Resume:
    """A checkpoint being resumed from, applied in the order training builds its objects (the
    model first; the optimizer and the LR plan once Horovod has wrapped the optimizer, because
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
        root: this rank reads the weights and the optimizer state (rank 0, which broadcasts
            them next: :func:`hvd_lm.comm.engine.broadcast_state`); another rank only its own
            B recurrent rows, the RNG, the LR plan and the counters (kilobytes), its model's
            weights checked by name and shape alone. Every rank maps the file
            (``torch.load(mmap=True)``) and reads what it touches: rank 0 one copy of the model
            and optimizer state and its own rows (not every rank's), the others a few pages,
            whatever the world size (``benchmarks/control_plane.py`` measures it).

    Raises:
        FileNotFoundError / CheckpointError: as :func:`resolve` / :func:`load`.
    """

    def __init__(self, source: str | Path, device: str | torch.device = "cpu",
                 fallback: bool = False, warn: bool = True, root: bool = True):
        self.device, self.root = torch.device(device), root
        if fallback:
            self.path, self.ckpt = load_newest(source, "cpu", warn, mmap=True)
        else:
            self.path = resolve(source)
            self.ckpt = load(self.path, "cpu", mmap=True)

    @property
    def position(self) -> Position:
        """The saved :class:`Position`."""
        pos = Position()
        pos.load_state_dict(self.ckpt)
        return pos

    @property
    def windows_per_epoch(self) -> int | None:
        """Windows per epoch of the streams the saving job had (None: written before this was
        saved)."""
        return self.ckpt.get("windows_per_epoch")

    def lr_factor(self) -> float | None:
        """The saved job's LR multiplier at its step (its last LR / its peak): where a run
        re-planned to a deadline continues the schedule from; None when not saved."""
        # ("scheduler": a LambdaLR's state, in checkpoints written before the LR plan)
        return saved_factor(self.ckpt.get("lr_plan", self.ckpt.get("scheduler")), self.ckpt["step"])

    def restore_model(self, model: torch.nn.Module) -> None:
        """Load the model's weights (on a non-root rank: check their names and shapes only,
        the weights come from rank 0's broadcast).

        Raises:
            CheckpointError: the checkpoint is for a model of another shape."""
        load_state(model, self.ckpt["model"], self.path, copy=self.root)

    @property
    def rows(self) -> int:
        """Rows of the saved recurrent state: the saving job's world size x batch."""
        return int(self.ckpt["rnn_state"][0].shape[0])

    def rnn_rows(self, rank: int, size: int, batch_size: int):
        """This rank's B rows of the saved recurrent state (h, c) each [B, H] on the job's
        device, or None when the checkpoint was written by a job with another number of rows
        (world size x batch): its streams are then cut differently (the caller says so)."""
        if self.rows != size * batch_size:
            return None
        h, c = self.ckpt["rnn_state"]
        rows = slice(rank * batch_size, (rank + 1) * batch_size)  # (mapped: these rows read)
        return h[rows].clone().to(self.device), c[rows].clone().to(self.device)

    def restore_rng(self) -> None:
        """Python, numpy and torch RNG states (the GPU's: this job's device)."""
        set_rng_state(self.ckpt["rng"], self.device)

    def restore_optimizer(self, optimizer, lr_plan, scaler=None) -> None:
        """Optimizer state, the LR plan (:class:`hvd_lm.train.schedule.LRPlan`: the caller
        then sets its peak for this job's global batch) and the loss scaler's state when both
        exist; on a non-root rank the plan's and the scaler's alone (a few numbers): the
        optimizer's comes from rank 0 (:func:`hvd_lm.comm.engine.broadcast_state`)."""
        if self.root:
            optimizer.load_state_dict(self.ckpt["optimizer"])
        load_train_state(self.ckpt, lr_plan, scaler)

    def release(self) -> None:
        """Drop the loaded tensors (the model and optimizer hold their own copies)."""
        self.ckpt = {k: v for k, v in self.ckpt.items()
                     if k in ("step", "window", "windows_per_epoch")}
