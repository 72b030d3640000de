"""The optimiser, built at the peak LR the large-batch rule gives
(:func:`hvd_lm.train.schedule.scaled_lr`): Adam (the reference's, Radford et al. 2017 / Puri et al.
2018), SGD with momentum, LAMB (You et al. 2019, from ``pytorch_optimizer``), or the
communication-compressed 1-bit Adam / 1-bit LAMB (:mod:`hvd_lm.train.onebit_optimizers`).

Adam is ``torch.optim.Adam(fused=True)`` on CUDA and CPU: one fused kernel updates every
parameter (torch.optim docs, "Algorithms": fused > foreach > for-loop). Measured here (CPU, one
thread, the H=1024 mLSTM's 5.9M parameters): 8-12 ms per step fused, 35-55 ms foreach.
"""

from __future__ import annotations

import torch

from hvd_lm.comm import engine
from hvd_lm.train.onebit_optimizers import OnebitAdam, OnebitDistributedOptimizer, OnebitLamb
from hvd_lm.train.settings import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``model``'s parameters at peak LR ``lr``.

    * ``adam``: ``torch.optim.Adam`` (L2 ``weight_decay``; fused when every parameter is a float
      tensor on CUDA or CPU); ``sgd``: with ``momentum``.
    * ``lamb``: ``pytorch_optimizer.Lamb`` as You et al. 2019 (arXiv:1904.00962 v3, without
      bias correction): decay inside the trust ratio (``weight_decouple=False``) and
      ``adam_debias=True``. Without the latter that package divides every step by
      1 - beta1^t although the trust ratio already normalises the update (10x the paper's step
      at t = 1); the weight norm in the ratio is capped at 10 (its default).
      ``tests/test_onebit.py`` checks the update and the trust ratio against numpy.
    * ``onebit-adam`` / ``onebit-lamb``: :class:`~hvd_lm.train.onebit_optimizers.OnebitAdam` /
      :class:`~hvd_lm.train.onebit_optimizers.OnebitLamb` with ``onebit_warmup_steps`` and
      ``onebit_chunk`` (:func:`distributed` then wraps them for Horovod).

    Raises:
        ValueError: an unknown ``cfg.optimizer``.
    """
    if cfg.optimizer == "adam":
        fused = all(p.device.type in ("cuda", "cpu") and p.is_floating_point()
                    for p in model.parameters())
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay,
                                fused=True if fused else None)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lamb":
        # Imported here for start-up cost: pytorch_optimizer is slow to import, paid by lamb only.
        from pytorch_optimizer import Lamb

        return Lamb(model.parameters(), lr=lr, weight_decay=cfg.weight_decay,
                    weight_decouple=False, adam_debias=True)
    if cfg.optimizer in ("onebit-adam", "onebit-lamb"):
        cls = OnebitAdam if cfg.optimizer == "onebit-adam" else OnebitLamb
        return cls(model.parameters(), lr=lr, weight_decay=cfg.weight_decay,
                   warmup_steps=cfg.onebit_warmup_steps, chunk=cfg.onebit_chunk)
    raise ValueError("optim.optimizer must be adam, sgd, lamb, onebit-adam or onebit-lamb, got "
                     f"{cfg.optimizer!r}")


def distributed(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                compression: str = "fp16", backward_passes_per_step: int = 1,
                allreduce_op: str = "average") -> torch.optim.Optimizer:
    """``optimizer`` on Horovod: ``hvd.DistributedOptimizer``
    (:func:`hvd_lm.comm.engine.distributed_optimizer`: fp16 compression, tensor fusion, Average
    or Adasum), or for a 1-bit optimiser (``optimizer.onebit``)
    :class:`~hvd_lm.train.onebit_optimizers.OnebitDistributedOptimizer`.

    Raises:
        ValueError: an unknown compression or op; Adasum with a 1-bit optimiser.
    """
    if getattr(optimizer, "onebit", False):
        if allreduce_op != "average":
            raise ValueError("dist.allreduce_op must be average with a 1-bit optimizer (its "
                             "compressed allreduce averages the momentum)")
        return OnebitDistributedOptimizer(optimizer, model, compression, backward_passes_per_step)
    return engine.distributed_optimizer(optimizer, model, compression, backward_passes_per_step,
                                      allreduce_op)
