"""The optimiser: Adam (the reference's, Radford et al. 2017 / Puri et al. 2018) or SGD with
momentum, built at the peak LR the large-batch rule gives (:func:`hvd_lm.train.schedule.scaled_lr`).
"""

from __future__ import annotations

import torch

from hvd_lm.train.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """Adam or SGD with momentum over ``model``'s parameters at peak LR ``lr``.

    Raises:
        ValueError: an unknown ``cfg.optimizer``.
    """
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.optimizer must be adam or sgd, got {cfg.optimizer!r}")
