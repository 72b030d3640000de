"""The optimiser: Adam (the reference's, Radford et al. 2017 / Puri et al. 2018) or SGD with
momentum, built at the peak LR the large-batch rule gives (:func:`hvd_lm.train.schedule.scaled_lr`).

On CUDA, Adam is ``torch.optim.Adam(fused=True)``: one multi-tensor kernel updates every
parameter (torch.optim docs, "Algorithms": fused > foreach > for-loop); on CPU the default
(foreach where supported) is kept.
"""

from __future__ import annotations

import torch

from hvd_lm.train.config import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """Adam (fused when the parameters are on CUDA) or SGD with momentum over ``model``'s
    parameters at peak LR ``lr``.

    Raises:
        ValueError: an unknown ``cfg.optimizer``.
    """
    if cfg.optimizer == "adam":
        fused = all(p.is_cuda for p in model.parameters())
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay,
                                fused=True if fused else None)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.optimizer must be adam or sgd, got {cfg.optimizer!r}")
