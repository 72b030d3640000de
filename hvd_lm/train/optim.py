"""The optimiser, built at the peak LR the large-batch rule gives
(:func:`hvd_lm.train.schedule.scaled_lr`), and its Horovod wrapper (:func:`distributed`): Adam
(the reference's, Radford et al. 2017 / Puri et al. 2018), SGD with momentum, LAMB (You et al.
2019, from ``pytorch_optimizer``), or the communication-compressed 1-bit Adam / 1-bit LAMB,
whose compression phase communicates compressed momentum (below). Adam is
``torch.optim.Adam(fused=True)`` on CUDA and CPU: one fused kernel updates every parameter
(torch.optim docs, "Algorithms": fused > foreach > for-loop). Measured here (CPU, one thread,
the H=1024 mLSTM's 5.9M parameters): 8-12 ms per step fused, 35-55 ms foreach.

* :class:`OnebitAdam` (Tang et al. 2021, "1-bit Adam", arXiv:2102.02888, Algorithm 1). Warmup
  (the first ``warmup_steps`` steps): exactly ``torch.optim.Adam`` (L2 weight decay added to the
  gradient, bias correction, eps outside the square root) on gradients Horovod's
  ``DistributedOptimizer`` has averaged. Then the variance v is frozen and each step is, per
  rank i with its *local* gradient g_i::

      m_i = beta1 m + (1 - beta1) (g_i + wd x)       (m: the previous step's synchronised momentum)
      m   = compressed_allreduce(m_i)                  (1-bit, error feedback; same on every rank)
      x  <- x - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^T_w)) + eps)

  i.e. momentum SGD preconditioned by the frozen (bias-corrected) variance of step T_w.
* :class:`OnebitLamb` (Li et al. 2021, "1-bit LAMB", arXiv:2104.06069, Algorithm 1; DeepSpeed's
  ``OnebitLamb``, by the same authors). Warmup: LAMB (You et al. 2019, arXiv:1904.00962, as
  ``pytorch_optimizer.Lamb`` computes it: no bias correction, L2 decay inside the trust ratio,
  ratio ``min(||x||, 10) / (||u|| + eps)``, 1 when either norm is 0), recording per layer an
  exponential moving average (``coeff_beta``) of the trust ratio. Compression phase: variance
  frozen, each layer's momentum scaled to a common magnitude (``scaling_coeff``, fixed at the
  first compressed step) before the compressed allreduce and back after, a *fresh* variance kept
  from the reconstructed global gradient ``(m - beta1 m_prev) / (1 - beta1)``, and the layer's
  step scaled by the frozen trust ratio times ``factor = max(sqrt-denominator ratio frozen /
  fresh)``, clipped to [factor_min, factor_max] and to +-factor_threshold of the previous factor.

The optimisers do not communicate themselves: in the compression phase :meth:`step` hands the
flat momentum (float32 [N], parameters in order) to ``self.reduce_momentum``, which
:class:`OnebitDistributedOptimizer` (below, the optimisers on Horovod: the warmup through
``hvd.DistributedOptimizer``, then ``onebit_compression.compressed_allreduce``; every
Horovod call through :mod:`hvd_lm.comm.engine`) sets; None = one process, no compression, as
DeepSpeed does on one rank. The phase follows from the step count in the state: a checkpoint
restores it. Settings every step needs live in the param groups (``hvd.DistributedOptimizer``
rebuilds the optimiser from its param groups).
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager, nullcontext
from typing import Callable, Optional

import torch

from hvd_lm.comm import engine
from hvd_lm.comm import onebit_compression as ob
from hvd_lm.train.settings import OptimConfig

#: pytorch_optimizer.Lamb's cap on the weight norm in the trust ratio (its ``Lamb.clamp``).
LAMB_WEIGHT_NORM_CAP = 10.0


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
    * ``onebit-adam`` / ``onebit-lamb``: :class:`OnebitAdam` /
      :class:`OnebitLamb` with ``onebit_warmup_steps`` and
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
    :class:`OnebitDistributedOptimizer`.

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


class _Onebit(torch.optim.Optimizer):
    """What 1-bit Adam and 1-bit LAMB share: the phase, the flat momentum, the reducer slot."""

    #: Marks optimisers that :func:`distributed` wraps in :class:`OnebitDistributedOptimizer`.
    onebit = True

    def __init__(self, params, **defaults):
        if defaults["warmup_steps"] < 1:
            raise ValueError(f"optim.onebit_warmup_steps must be >= 1 (the variance is frozen at "
                             f"the end of the warmup), got {defaults['warmup_steps']}")
        super().__init__(params, {**defaults, "betas": tuple(defaults["betas"])})
        #: Flat momentum float32 [N] -> its compressed average over ranks (None: one process).
        self.reduce_momentum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied so far (0 before the first)."""
        for p in (p for g in self.param_groups for p in g["params"]):
            if "step" in self.state.get(p, {}):
                return int(self.state[p]["step"])
        return 0

    @property
    def warmup_steps(self) -> int:
        """T_w: steps of the uncompressed warmup."""
        return int(self.param_groups[0]["warmup_steps"])

    @property
    def compressing(self) -> bool:
        """True once the warmup is over: the next step is a compressed one."""
        return self.steps_taken >= self.warmup_steps

    def _reduce(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """The compressed average of the per-parameter local momenta, as per-parameter views."""
        flat = torch.cat([m.reshape(-1).float() for m in local])
        if self.reduce_momentum is not None:
            flat = self.reduce_momentum(flat)
        return [f.view_as(m).to(m.dtype)
                for f, m in zip(flat.split([m.numel() for m in local]), local)]

    @torch.no_grad()
    def step(self, closure=None):
        """One step: warmup (uncompressed) or compressed, by the step count (see the module)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compressing:
            self._compressed_step()
        else:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._warmup_update(p, group)
        return loss

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        # A parameter without a gradient still takes part in the collective (zeros), so every
        # rank's flat momentum has the same layout.
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _state(self, p: torch.Tensor) -> dict:
        """``p``'s state, made at its first step: the step count and the two moments."""
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st


class OnebitAdam(_Onebit):
    """1-bit Adam (see the module docstring for the update).

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: (beta1, beta2).
        eps: added to the denominator, outside the square root (as torch.optim.Adam).
        weight_decay: L2 penalty added to the gradient (as torch.optim.Adam).
        warmup_steps: T_w, uncompressed Adam steps before the variance is frozen (>= 1).
        chunk: elements per fp32 scale of the compressed momentum (0: one per rank's part).

    Raises:
        ValueError: ``warmup_steps`` < 1.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 100, chunk: int = ob.DEFAULT_CHUNK):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         warmup_steps=warmup_steps, chunk=chunk)

    def _warmup_update(self, p, group) -> None:
        # torch.optim.Adam's single-tensor update (torch/optim/adam.py), operation for operation.
        beta1, beta2 = group["betas"]
        st = self._state(p)
        st["step"] += 1
        grad = p.grad
        if group["weight_decay"] != 0:
            grad = grad.add(p, alpha=group["weight_decay"])
        st["exp_avg"].lerp_(grad, 1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self._apply(p, group, st, float(st["step"]))

    @staticmethod
    def _apply(p, group, st: dict, variance_step: float) -> None:
        """x <- x - lr / (1 - beta1^t) m / (sqrt(v / (1 - beta2^variance_step)) + eps)."""
        beta1, beta2 = group["betas"]
        step_size = group["lr"] / (1 - beta1 ** float(st["step"]))
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** variance_step)
                 ).add_(group["eps"])
        p.addcdiv_(st["exp_avg"], denom, value=-step_size)

    def _compressed_step(self) -> None:
        params, local = [(p, g) for g in self.param_groups for p in g["params"]], []
        for p, group in params:
            grad = self._grad(p)
            if group["weight_decay"] != 0:
                grad = grad.add(p, alpha=group["weight_decay"])
            local.append(self.state[p]["exp_avg"].lerp(grad, 1 - group["betas"][0]))
        for (p, group), m in zip(params, self._reduce(local)):
            st = self.state[p]
            st["step"] += 1
            st["exp_avg"].copy_(m)
            # the variance and its bias correction stay those of step T_w
            self._apply(p, group, st, group["warmup_steps"])


class OnebitLamb(_Onebit):
    """1-bit LAMB (see the module docstring for the update).

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: (beta1, beta2).
        eps: added to sqrt(v) and to the update norm (pytorch_optimizer.Lamb's default 1e-6).
        weight_decay: L2 decay added to the update inside the trust ratio (You et al. 2019).
        warmup_steps: T_w, uncompressed LAMB steps before variance and trust ratios freeze.
        chunk: elements per fp32 scale of the compressed momentum (0: one per rank's part).
        coeff_beta: EMA coefficient of the warmup trust ratios (DeepSpeed default 0.9).
        factor_max / factor_min: bounds of the compression phase's ratio factor (4.0 / 0.5).
        factor_threshold: largest relative change of the factor per step (0.1).

    Raises:
        ValueError: ``warmup_steps`` < 1.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, warmup_steps: int = 100,
                 chunk: int = ob.DEFAULT_CHUNK, coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         warmup_steps=warmup_steps, chunk=chunk, coeff_beta=coeff_beta,
                         factor_max=factor_max, factor_min=factor_min,
                         factor_threshold=factor_threshold)

    @staticmethod
    def trust_ratio(weight: torch.Tensor, update: torch.Tensor, eps: float) -> float:
        """LAMB's layerwise ratio as pytorch_optimizer.Lamb computes it:
        ``min(||x||, 10) / (||u|| + eps)``, 1.0 when either norm is 0."""
        wn = float(torch.linalg.vector_norm(weight).clamp(max=LAMB_WEIGHT_NORM_CAP))
        un = float(torch.linalg.vector_norm(update))
        return 1.0 if wn == 0 or un == 0 else wn / (un + eps)

    def _warmup_update(self, p, group) -> None:
        beta1, beta2 = group["betas"]
        st = self._state(p)
        # Python floats, not tensors: Optimizer.load_state_dict would cast float64 tensors to
        # the parameter's dtype, and the resume would no longer be exact.
        st.setdefault("ratio_ema", 0.0)
        st.setdefault("ratio_weight", 0.0)
        st["step"] += 1
        grad = p.grad
        st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = st["exp_avg"] / st["exp_avg_sq"].sqrt().add_(group["eps"])
        if group["weight_decay"] > 0:
            update.add_(p, alpha=group["weight_decay"])
        ratio = self.trust_ratio(p, update, group["eps"])
        if ratio != 1.0:  # a zero norm says nothing about the layer's scale (as DeepSpeed)
            b = group["coeff_beta"]
            st["ratio_ema"] = b * st["ratio_ema"] + (1 - b) * ratio
            st["ratio_weight"] = b * st["ratio_weight"] + (1 - b)
        p.add_(update, alpha=-group["lr"] * ratio)

    def frozen_ratio(self, p: torch.Tensor) -> float:
        """The layer's warmup trust-ratio EMA, bias-corrected (divided by the EMA of ones over
        the same steps); 1.0 when every warmup ratio was undefined."""
        st = self.state[p]
        return st["ratio_ema"] / st["ratio_weight"] if st["ratio_weight"] > 0 else 1.0

    def _compressed_step(self) -> None:
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        if "scaling_coeff" not in self.state[params[0][0]]:
            self._freeze(params)
        prev, local = [], []
        for p, group in params:
            st = self.state[p]
            prev.append(st["exp_avg"].clone())
            m = st["exp_avg"].mul(group["betas"][0]).add_(self._grad(p),
                                                           alpha=1 - group["betas"][0])
            local.append(m.mul_(st["scaling_coeff"]))
        for (p, group), m, m_prev in zip(params, self._reduce(local), prev):
            beta1, beta2 = group["betas"]
            st = self.state[p]
            st["step"] += 1
            st["exp_avg"].copy_(m.div(st["scaling_coeff"]))
            g_rec = (st["exp_avg"] - beta1 * m_prev) / (1 - beta1)
            st["exp_avg_sq_fresh"].mul_(beta2).addcmul_(g_rec, g_rec, value=1 - beta2)
            denom = st["exp_avg_sq"].sqrt().add_(group["eps"])
            prelim = st["exp_avg"] / denom
            update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0 else prelim
            factor = float((denom / st["exp_avg_sq_fresh"].sqrt().add_(group["eps"])).max())
            if group["weight_decay"] > 0:
                un = float(torch.linalg.vector_norm(update))
                r = min(1.0, float(torch.linalg.vector_norm(prelim)) / un) if un > 0 else 1.0
                factor = factor * r + (1.0 - r)
            factor = min(max(factor, group["factor_min"]), group["factor_max"])
            last, th = st["last_factor"], group["factor_threshold"]
            factor = min(max(factor, last * (1 - th)), last * (1 + th))
            st["last_factor"] = factor
            st["last_coeff"] = st["frozen_ratio"] * factor
            p.add_(update, alpha=-group["lr"] * st["last_coeff"])

    def _freeze(self, params) -> None:
        """At the first compressed step: the frozen trust ratios, the fresh variance (from the
        frozen one) and each layer's momentum scaling to the layers' mean RMS (1-bit LAMB)."""
        rms = [float(torch.linalg.vector_norm(self.state[p]["exp_avg"])) / math.sqrt(p.numel())
               for p, _ in params]
        united = sum(rms) / len(rms)
        for (p, _), r in zip(params, rms):
            st = self.state[p]
            st["frozen_ratio"] = self.frozen_ratio(p)
            st["scaling_coeff"] = united / r if r > 0 else 1.0
            st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
            st["last_factor"] = 1.0
            st["last_coeff"] = st["frozen_ratio"]


# ---- on Horovod ---------------------------------------------------------------------------------

class OnebitDistributedOptimizer(torch.optim.Optimizer):
    """A 1-bit optimiser (:class:`OnebitAdam` / :class:`OnebitLamb`) on Horovod,
    with the interface the training loop uses for ``hvd.DistributedOptimizer``: ``synchronize()``,
    ``skip_synchronize()``, ``step()``, ``zero_grad()``, ``state_dict()`` / ``load_state_dict()``,
    ``param_groups`` (it passes ``isinstance(.., torch.optim.Optimizer)`` for LR schedulers).

    * Warmup (the optimiser's first ``warmup_steps`` steps): ``hvd.DistributedOptimizer`` with
      ``compression`` averages the gradients (its hooks and ``synchronize()``; the torch
      engine: DDP inside backward), then the uncompressed Adam / LAMB step.
    * Compressed phase: gradients stay local (:func:`hvd_lm.comm.engine.keep_gradients_local`:
      Horovod's hooks silenced, DDP's hook hands the buckets back; ``synchronize()`` returns at
      once); the optimiser's step hands its flat momentum to
      ``onebit_compression.compressed_allreduce`` with this rank's
      :class:`~hvd_lm.comm.onebit_compression.ErrorFeedback` (created at the first compressed step).
      With one rank there is nothing to communicate and the momentum is used as is (as DeepSpeed
      does).

    :meth:`state_dict` leaves the per-rank error buffers out (a checkpoint's bytes do not grow
    with the world size); :meth:`load_state_dict` restarts the error feedback from zero (with a
    warning: the resume is then not bit-exact), as DeepSpeed does.

    Args:
        optimizer: a 1-bit optimiser (``optimizer.onebit``), unwrapped.
        model: its model (parameter names for Horovod).
        compression: the warmup's gradient compression, ``"fp16"`` or ``"none"``.
        backward_passes_per_step: local accumulation steps per step.
    """

    def __init__(self, optimizer, model: torch.nn.Module, compression: str = "fp16",
                 backward_passes_per_step: int = 1):
        # torch.optim.Optimizer.__init__ is not called: param_groups, state and defaults are the
        # Horovod-wrapped optimiser's own (load_state_dict replaces its param group dicts).
        # collective: the warmup's gradient allreduce (hooks, fusion, compression)
        self._opt = engine.distributed_optimizer(optimizer, model, compression,
                                               backward_passes_per_step, "average")
        ctx = engine.rank_context()
        self._size, self._rank = ctx.size, ctx.rank
        self._warmup_wire = self._opt.hvd_lm_wire_bytes
        self.errors: ob.ErrorFeedback | None = None
        self.wire_bytes = 0
        self.phase = "compressed" if self.compressing else "warmup"
        self._opt.reduce_momentum = self._reduce if self._size > 1 else None
        self._silence_hooks_if_compressing()

    # -- what torch.optim.Optimizer users read --------------------------------------------------
    def __getattr__(self, name: str):
        """The wrapped optimiser's attributes: ``param_groups`` (LR schedulers write ``lr``
        there), ``state``, ``defaults``, ``compressing`` (the compressed phase)."""
        return getattr(self.__dict__.get("_opt"), name)  # (None while being built)

    # -- the step -------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Warmup: wait for the gradient allreduce. Compressed phase: nothing (local gradients)."""
        self.phase = "compressed" if self.compressing else "warmup"
        self.wire_bytes = 0 if self.compressing else self._warmup_wire
        if not self.compressing:
            engine.synchronize(self._opt)

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside it does not synchronize (Horovod's context manager)."""
        with engine.skip_synchronize(self._opt):
            yield

    def step(self, closure=None):
        """One optimiser step (warmup: after the gradient allreduce; compressed: the compressed
        allreduce of the momentum happens inside)."""
        with engine.skip_synchronize(self._opt) if self.compressing else nullcontext():
            loss = self._opt.step(closure)
        self._silence_hooks_if_compressing()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (in the compressed phase bypassing Horovod's check for allreduces
        in flight: its silenced hooks leave empty handles behind, nothing is in flight)."""
        if self.compressing:
            torch.optim.Optimizer.zero_grad(self._opt, set_to_none)
        else:
            self._opt.zero_grad()

    def comm_stats(self) -> dict:
        """The last step's ``wire_bytes`` (warmup: the gradient allreduce's; compressed phase:
        :meth:`hvd_lm.comm.onebit_compression.Layout.wire_bytes` of the buffers handed to
        ``alltoall`` and
        ``allgather``, plus the gradient-norm allreduce) and ``onebit_phase`` (``warmup`` /
        ``compressed``), for :func:`hvd_lm.comm.engine.comm_stats`."""
        return {"wire_bytes": self.wire_bytes, "onebit_phase": self.phase}

    def agree_grad_norm(self, local_norm: float) -> float:
        """The gradient norm every rank reports and tests for inf/NaN: warmup, ``local_norm`` (the
        gradients are already averaged); compressed phase, sqrt(mean over ranks of each rank's
        squared local norm) by one tiny allreduce, so a non-finite gradient on any rank makes
        every rank skip the step."""
        if not self.compressing or self._size == 1:
            return local_norm
        self.wire_bytes += engine.ring_allreduce_wire_bytes(8, self._size)
        # collective: the mean of the ranks' squared norms
        return math.sqrt(engine.allreduce_sum([local_norm ** 2], name="onebit.gradnorm")[0]
                         / self._size)

    def _reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.errors is None:
            layout = ob.Layout(flat.numel(), self._size, int(self.param_groups[0]["chunk"]))
            self.errors = ob.ErrorFeedback(layout, self._rank, flat.device)
        out = ob.compressed_allreduce(flat, self.errors, name="onebit.momentum")  # collective
        self.wire_bytes += self.errors.layout.wire_bytes()
        return out

    def _silence_hooks_if_compressing(self) -> None:
        if self.compressing:
            engine.keep_gradients_local(self._opt)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The optimiser's ``state_dict()`` (no collective: any one rank may call it). The error
        buffers are per-rank state and are not saved: gathered, they would add 4 bytes x
        parameters per rank to every checkpoint (~44 GB at 128 ranks of the 86M-parameter
        default); DeepSpeed's 1-bit Adam and LAMB reset them on load as well
        (``deepspeed/runtime/fp16/onebit/adam.py``, ``load_state_dict``)."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s output (and with it the phase); the error feedback starts
        from zero (a resume in the compressed phase is not bit-exact; rank 0 says so in one
        line). A checkpoint of an earlier version, which held every rank's error buffers
        (``"onebit_errors"``), loads the same way."""
        sd = dict(state_dict)
        sd.pop("onebit_errors", None)
        self._opt.load_state_dict(sd)
        self.errors = None
        self._silence_hooks_if_compressing()
        if self.compressing and self._size > 1 and self._rank == 0:
            print("warning: 1-bit error feedback restarts from zero on resume (error buffers are "
                  "per rank, not checkpointed, as in DeepSpeed): resume is not exact",
                  file=sys.stderr)
