"""A trained model from a checkpoint: what every command that uses a model (eval, transfer,
generate, visualize, classify) loads it with, below both training and transfer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hvd_lm.formats.checkpoint import CheckpointError, load, resolve
from hvd_lm.model.lm import LanguageModel, ModelConfig


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
    """The :class:`~hvd_lm.model.lm.LanguageModel` stored in a checkpoint, on
    ``map_location``, in eval mode, and the checkpoint dict.

    Args:
        rnn_kernels: the fused mLSTM's cell kernels for this device
            (:data:`hvd_lm.model.mlstm_kernels.KERNELS`; ``auto``: the device's default). Not
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
