"""Everything Horovod, in one place: the training loop calls only this module for collectives.

Follows Horovod's ``examples/pytorch`` scripts and its docs ("Horovod with PyTorch", "Tensor
Fusion", "Adasum"):

* :func:`init` maps our fusion/cycle-time settings onto ``HOROVOD_FUSION_THRESHOLD`` (bytes) and
  ``HOROVOD_CYCLE_TIME`` (ms), which Horovod reads at ``hvd.init()``, then calls it. Works under
  ``horovodrun`` (Gloo or MPI controller), plain ``mpirun``, and as one process with no launcher.
* :func:`distributed_optimizer` wraps the optimiser in ``hvd.DistributedOptimizer`` with fp16
  compression, ``backward_passes_per_step`` and Average or Adasum.
* :func:`broadcast_state` broadcasts parameters and optimiser state from rank 0.
* :func:`clip_and_step` is the documented way to clip with Horovod: ``synchronize()`` (wait for the
  allreduce), unscale (mixed precision), clip, then ``step()`` inside ``skip_synchronize()``.
* :func:`allreduce_sum` / :func:`allgather` for metrics and checkpointed per-rank state.
* :func:`compressed_allreduce`: the 1-bit compressed allreduce with error feedback (Tang et al.
  2021) on ``hvd.alltoall`` + ``hvd.allgather`` (the math: :mod:`hvd_lm.comm.onebit`), and
  :class:`OnebitDistributedOptimizer`, which runs 1-bit Adam / 1-bit LAMB
  (:mod:`hvd_lm.train.onebit`): warmup through ``hvd.DistributedOptimizer``, then the compressed
  allreduce of the momentum.
* :func:`comm_stats`: bytes this rank put on the wire in the last step (metrics).
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager

import torch

from hvd_lm.core.units import MIB
from hvd_lm.comm.launcher import RankContext
from hvd_lm.comm.onebit import ErrorFeedback, Layout, ring_allreduce_wire_bytes

#: Horovod 0.28.1's defaults (horovod/common/operations.cc): fusion threshold, bytes; cycle, ms.
HOROVOD_DEFAULT_FUSION_BYTES = 128 * MIB
HOROVOD_DEFAULT_CYCLE_MS = 1.0


def _hvd():
    # Imported on first use: `hvd-lm --help`, prepare, launch rendering and the CPU-only tools run
    # without loading Horovod's extension (and its MPI/Gloo libraries).
    import horovod.torch as hvd

    return hvd


#: Horovod 0.28.1's default for HOROVOD_GLOO_TIMEOUT_SECONDS (horovod/common/gloo/gloo_context.cc)
HOROVOD_DEFAULT_GLOO_TIMEOUT_S = 30


def init(fusion_threshold_mb: float | None = None, cycle_time_ms: float | None = None,
         gloo_timeout_s: float | None = None) -> RankContext:
    """Set Horovod's tensor-fusion knobs and Gloo's timeout, then ``hvd.init()``.

    Args:
        fusion_threshold_mb: fusion buffer size in MiB -> ``HOROVOD_FUSION_THRESHOLD`` in bytes
            (Horovod's default is 128 MiB; 0 disables fusion). None keeps the environment's value.
        cycle_time_ms: how long Horovod's background thread waits to batch tensors, in ms ->
            ``HOROVOD_CYCLE_TIME`` (default 1 ms in 0.28). None keeps the environment's value.
        gloo_timeout_s: seconds a Gloo operation (rendezvous, every collective of the Gloo
            controller) waits for a peer -> ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (whole seconds,
            rounded up; default 30). None keeps the environment's value.
    """
    if fusion_threshold_mb is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_threshold_mb * MIB))
    if cycle_time_ms is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = str(cycle_time_ms)
    if gloo_timeout_s is not None:
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(math.ceil(gloo_timeout_s))
    hvd = _hvd()
    hvd.init()
    return RankContext(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "horovod")


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                          compression: str = "fp16", backward_passes_per_step: int = 1,
                          allreduce_op: str = "average") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` in ``hvd.DistributedOptimizer``, or a 1-bit optimiser
    (``optimizer.onebit``, :mod:`hvd_lm.train.onebit`) in :class:`OnebitDistributedOptimizer`.

    Args:
        compression: ``"fp16"`` (gradients cast to fp16 for the allreduce, as the reference) or
            ``"none"`` (for 1-bit optimisers: during the warmup).
        backward_passes_per_step: local accumulation steps per allreduce.
        allreduce_op: ``"average"`` or ``"adasum"`` (Maleki et al. 2020; Horovod docs "AdaSum");
            1-bit optimisers average.

    Raises:
        ValueError: unknown compression or op; Adasum with a 1-bit optimiser.
    """
    hvd = _hvd()
    comps = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
    ops = {"average": hvd.Average, "adasum": hvd.Adasum}
    if compression not in comps:
        raise ValueError(f"dist.compression must be one of {list(comps)}, got {compression!r}")
    if allreduce_op not in ops:
        raise ValueError(f"dist.allreduce_op must be one of {list(ops)}, got {allreduce_op!r}")
    if getattr(optimizer, "onebit", False):
        if allreduce_op != "average":
            raise ValueError("dist.allreduce_op must be average with a 1-bit optimizer (its "
                             "compressed allreduce averages the momentum)")
        return OnebitDistributedOptimizer(optimizer, model, compression, backward_passes_per_step)
    wrapped = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=comps[compression],
        backward_passes_per_step=backward_passes_per_step, op=ops[allreduce_op])
    wrapped.hvd_lm_wire_bytes = _gradient_wire_bytes(model, compression, hvd.size())
    return wrapped


def _gradient_wire_bytes(model: torch.nn.Module, compression: str, size: int) -> int:
    """Bytes one rank sends per step allreducing every gradient (ring allreduce, fp16: 2 bytes per
    value, else the parameter's element size)."""
    nbytes = sum(p.numel() * (2 if compression == "fp16" else p.element_size())
                 for p in model.parameters() if p.requires_grad)
    return ring_allreduce_wire_bytes(nbytes, size)


def comm_stats(optimizer) -> dict:
    """``{"wire_bytes": bytes this rank sent through the gradient / momentum collectives in the
    last step}`` (set by ``synchronize()``; ring allreduce: 2(n-1)/n of the gradient bytes;
    compressed allreduce: :meth:`hvd_lm.comm.onebit.Layout.wire_bytes` of the buffers handed to
    ``alltoall`` and ``allgather``), plus ``"onebit_phase"`` (that step's: ``warmup`` /
    ``compressed``) for 1-bit optimisers. Empty for an optimiser this module did not wrap."""
    if isinstance(optimizer, OnebitDistributedOptimizer):
        return {"wire_bytes": optimizer.wire_bytes, "onebit_phase": optimizer.phase}
    wire = getattr(optimizer, "hvd_lm_wire_bytes", None)
    return {} if wire is None else {"wire_bytes": wire}


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    root_rank: int = 0) -> None:
    """Make every rank start from rank ``root_rank``'s parameters and optimiser state."""
    hvd = _hvd()
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    if isinstance(optimizer, OnebitDistributedOptimizer):
        optimizer = optimizer.horovod_optimizer  # error buffers are per rank: not broadcast
    if optimizer is not None:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Rank ``root_rank``'s ``obj`` (any picklable value) on every rank."""
    return _hvd().broadcast_object(obj, root_rank=root_rank, name=name)


def clip_and_step(optimizer, params, max_norm: float, scaler=None, check_finite: bool = True
                  ) -> tuple[bool, float, float]:
    """Finish one optimiser step the Horovod way, skipping it when gradients are not finite.

    Order (Horovod docs, "Gradient clipping"; torch.amp docs, "Working with unscaled gradients"):
    ``optimizer.synchronize()`` waits for the gradient allreduce; ``scaler.unscale_`` (fp16);
    ``clip_grad_norm_`` (foreach: multi-tensor kernels); ``step()`` inside
    ``optimizer.skip_synchronize()``; ``scaler.update()``.
    Every rank holds the same averaged gradients, so every rank takes the same skip decision;
    in a 1-bit optimiser's compressed phase gradients stay local (each rank clips its own), and
    the norm returned and tested is :meth:`OnebitDistributedOptimizer.agree_grad_norm`'s, the same
    on every rank.

    Args:
        params: the parameters to clip (list of tensors).
        max_norm: clip threshold for the global L2 norm (0 = no clipping).
        scaler: a ``torch.amp.GradScaler`` (fp16 on CUDA) or None.
        check_finite: without a scaler, skip the step when the gradient norm is inf/NaN.

    Returns:
        (applied, grad_norm, seconds spent waiting in ``synchronize()`` for the allreduce).
    """
    t0 = time.perf_counter()
    optimizer.synchronize()
    wait = time.perf_counter() - t0
    if scaler is not None:
        scaler.unscale_(optimizer)
    # foreach: the norms of all gradients in one multi-tensor kernel (and one scaling kernel),
    # not one kernel per parameter (torch.nn.utils docs, clip_grad_norm_ / get_total_norm).
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm(
            [p.grad.detach() for p in params if p.grad is not None], foreach=True)
    if isinstance(optimizer, OnebitDistributedOptimizer):
        norm = torch.tensor(optimizer.agree_grad_norm(float(norm)))
    norm_f = float(norm)  # the step's one host sync: every rank must take the same skip decision
    with optimizer.skip_synchronize():
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)  # skips internally on inf/NaN gradients
            scaler.update()
            applied = scaler.get_scale() >= before
        elif check_finite and not torch.isfinite(norm):
            applied = False
        else:
            optimizer.step()
            applied = True
    return applied, norm_f, wait


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64), e.g. NLL bits and char counts."""
    t = torch.tensor(values, dtype=torch.float64)
    return _hvd().allreduce(t, op=_hvd().Sum, name=name).tolist()


def allgather(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Concatenation over ranks along dim 0 (rank order) of each rank's ``tensor``."""
    return _hvd().allgather(tensor.contiguous(), name=name)


def allgather_object(obj, name: str) -> list:
    """Every rank's ``obj`` (picklable), in rank order (``hvd.allgather_object``)."""
    return _hvd().allgather_object(obj, name=name)


def gloo_timeout_s() -> float | None:
    """Seconds a collective of the Gloo controller waits for a lost peer before failing
    (``HOROVOD_GLOO_TIMEOUT_SECONDS``, default 30); None under the MPI controller, which has no
    such timeout (a lost link stalls until TCP gives up)."""
    if _hvd().mpi_enabled():
        return None
    return float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS") or HOROVOD_DEFAULT_GLOO_TIMEOUT_S)


def is_collective_failure(exc: BaseException) -> bool:
    """True for Horovod's ``HorovodInternalError``: a collective failed (a peer lost, a timeout;
    Horovod has shut down), as opposed to an error of this rank's own work."""
    from horovod.common.exceptions import HorovodInternalError

    return isinstance(exc, HorovodInternalError)


def barrier() -> None:
    """Wait for every rank (a tiny allreduce: works with every controller)."""
    allreduce_sum([0.0], name="barrier")


def shutdown() -> None:
    """``hvd.shutdown()``."""
    _hvd().shutdown()


# ---- raw collectives for the benchmarks (hvd_lm.perf.bench_allreduce) -------------------------

def controller() -> str:
    """The controller Horovod runs with after :func:`init`: ``"mpi"`` or ``"gloo"``."""
    return "mpi" if _hvd().mpi_enabled() else "gloo"


def allreduce_inplace(tensor: torch.Tensor, name: str, op: str = "sum",
                      compression: str = "none") -> None:
    """``hvd.allreduce_`` of ``tensor`` in place (op ``sum`` or ``average``); with
    ``compression="fp16"`` the tensor is cast to float16 around the allreduce, as
    ``hvd.Compression.fp16`` does inside ``DistributedOptimizer``."""
    hvd = _hvd()
    hop = {"sum": hvd.Sum, "average": hvd.Average}[op]
    if compression == "fp16":
        c = tensor.to(torch.float16)
        hvd.allreduce_(c, op=hop, name=name)
        tensor.copy_(c)
    else:
        hvd.allreduce_(tensor, op=hop, name=name)


def allreduce_group(tensors: list[torch.Tensor], prefix: str, op: str = "average",
                    compression: str = "none") -> None:
    """Allreduce a list of tensors in place the way ``DistributedOptimizer`` does: an
    ``allreduce_async_`` on each (Horovod's background thread fuses what is ready together), then
    ``synchronize`` on each; ``compression="fp16"`` casts each to float16 around it."""
    hvd = _hvd()
    hop = {"sum": hvd.Sum, "average": hvd.Average}[op]
    wire = [t.to(torch.float16) for t in tensors] if compression == "fp16" else tensors
    handles = [hvd.allreduce_async_(t, op=hop, name=f"{prefix}.{i}")
               for i, t in enumerate(wire)]
    for h in handles:
        hvd.synchronize(h)
    if wire is not tensors:
        for t, w in zip(tensors, wire):
            t.copy_(w)


def allreduce_max(value: float, name: str) -> float:
    """Maximum of ``value`` over all ranks."""
    hvd = _hvd()
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max,
                               name=name)[0])


class RootError(RuntimeError):
    """Raised on every rank but 0 when rank 0's part of :func:`root_call` failed (the message is
    rank 0's)."""


def root_call(fn):
    """Run ``fn()`` on rank 0 and make every rank agree on the outcome: its result on rank 0 and
    None elsewhere, or the same error everywhere (rank 0 re-raises its own exception, the others
    :class:`RootError` with its message) — so a failure of rank 0's setup (a locked run folder, a
    full disk) stops every rank with one clear line instead of leaving them in a collective."""
    hvd = _hvd()
    result, error = None, None
    if hvd.rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
    message = broadcast_object(None if error is None else str(error), name="root_call")
    if error is not None:
        raise error
    if message is not None:
        raise RootError(message)
    return result


# ---- 1-bit Adam / 1-bit LAMB: compressed allreduce with error feedback ---------------------------

def compressed_allreduce(x: torch.Tensor, errors: ErrorFeedback, name: str) -> torch.Tensor:
    """Average of ``x`` over all ranks through 1-bit compression with error feedback (Tang et al.
    2021, Algorithm 1's compressed allreduce): worker error added and every rank's part compressed
    (:meth:`~hvd_lm.comm.onebit.ErrorFeedback.worker_compress`), ``hvd.alltoall`` of the parts
    (uint8 [n, part_bytes]: signs packed 8 per byte, then the fp32 scales), average of this rank's
    part plus the server error, recompressed
    (:meth:`~hvd_lm.comm.onebit.ErrorFeedback.server_reduce`), ``hvd.allgather`` of the n
    compressed parts, decompressed (:meth:`~hvd_lm.comm.onebit.ErrorFeedback.assemble`).

    Args:
        x: this rank's tensor, float [N] (N = ``errors.layout.numel``).
        errors: this rank's error buffers (updated in place); its layout fixes n and the chunk.
        name: prefix of the collectives' names (unique per tensor).

    Returns:
        float32 [N], identical on every rank.

    Raises:
        ValueError: x does not match the layout, or the layout's world size is not Horovod's.
    """
    n = errors.layout.world_size
    send = errors.worker_compress(x)
    if n == 1:
        return errors.assemble(errors.server_reduce(send).unsqueeze(0))
    hvd = _hvd()
    if n != hvd.size():
        raise ValueError(f"compressed allreduce laid out for {n} ranks, Horovod has {hvd.size()}")
    received = hvd.alltoall(send, name=f"{name}.alltoall")  # row i: rank i's part for this rank
    part = errors.server_reduce(received)
    return errors.assemble(hvd.allgather(part.unsqueeze(0), name=f"{name}.allgather"))


#: backward_passes_per_step that keeps hvd.DistributedOptimizer's gradient hooks from ever starting
#: an allreduce (each backward pass counts it down by one).
_NEVER = 2 ** 62


class OnebitDistributedOptimizer(torch.optim.Optimizer):
    """A 1-bit optimiser (:class:`hvd_lm.train.onebit.OnebitAdam` / ``OnebitLamb``) on Horovod,
    with the interface the training loop uses for ``hvd.DistributedOptimizer``: ``synchronize()``,
    ``skip_synchronize()``, ``step()``, ``zero_grad()``, ``state_dict()`` / ``load_state_dict()``,
    ``param_groups`` (it passes ``isinstance(.., torch.optim.Optimizer)`` for LR schedulers).

    * Warmup (the optimiser's first ``warmup_steps`` steps): ``hvd.DistributedOptimizer`` with
      ``compression`` averages the gradients (its hooks and ``synchronize()``), then the
      uncompressed Adam / LAMB step.
    * Compressed phase: gradients stay local (the hooks are silenced by setting Horovod's
      ``backward_passes_per_step`` beyond reach; ``synchronize()`` returns at once); the
      optimiser's step hands its flat momentum to :func:`compressed_allreduce` with this rank's
      :class:`~hvd_lm.comm.onebit.ErrorFeedback` (created at the first compressed step). With one
      rank there is nothing to communicate and the momentum is used as is (as DeepSpeed does).

    :meth:`state_dict` adds every rank's error buffers (an ``allgather``: call it on every rank,
    as the training loop does before rank 0 writes a checkpoint); :meth:`load_state_dict` takes
    this rank's rows back when the world size and chunk match, else it starts from zero errors
    (with a warning: the resume is then not exact).

    Args:
        optimizer: a 1-bit optimiser (``optimizer.onebit``), unwrapped.
        model: its model (parameter names for Horovod).
        compression: the warmup's gradient compression, ``"fp16"`` or ``"none"``.
        backward_passes_per_step: local accumulation steps per step.
        save_errors: include the error buffers in :meth:`state_dict` ((n + 1) x 4 bytes per
            parameter on rank 0; False: a resume restarts error feedback from zero).
    """

    def __init__(self, optimizer, model: torch.nn.Module, compression: str = "fp16",
                 backward_passes_per_step: int = 1, save_errors: bool = True):
        # torch.optim.Optimizer.__init__ is not called: param_groups, state and defaults are the
        # Horovod-wrapped optimiser's own (load_state_dict replaces its param group dicts).
        hvd = _hvd()
        comps = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
        self._opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=comps[compression],
            backward_passes_per_step=backward_passes_per_step, op=hvd.Average)
        self._size, self._rank = hvd.size(), hvd.rank()
        self._warmup_wire = _gradient_wire_bytes(model, compression, self._size)
        self.save_errors = save_errors
        self.errors: ErrorFeedback | None = None
        self.wire_bytes = 0
        self.phase = "compressed" if self.compressing else "warmup"
        self._opt.reduce_momentum = self._reduce if self._size > 1 else None
        self._silence_hooks_if_compressing()

    # -- what torch.optim.Optimizer users read --------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The param groups (the wrapped optimiser's; LR schedulers write ``lr`` here)."""
        return self._opt.param_groups

    @property
    def state(self):
        """Per-parameter optimiser state."""
        return self._opt.state

    @property
    def defaults(self) -> dict:
        """The optimiser's default hyperparameters."""
        return self._opt.defaults

    @property
    def horovod_optimizer(self):
        """The ``hvd.DistributedOptimizer`` instance underneath."""
        return self._opt

    @property
    def compressing(self) -> bool:
        """True in the compressed phase (the warmup's steps are done)."""
        return self._opt.compressing

    # -- the step -------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Warmup: wait for the gradient allreduce. Compressed phase: nothing (local gradients)."""
        self.phase = "compressed" if self.compressing else "warmup"
        if self.compressing:
            self.wire_bytes = 0
            return
        self._opt.synchronize()
        self.wire_bytes = self._warmup_wire

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside it does not synchronize (Horovod's context manager)."""
        with self._opt.skip_synchronize():
            yield

    def step(self, closure=None):
        """One optimiser step (warmup: after the gradient allreduce; compressed: the compressed
        allreduce of the momentum happens inside)."""
        if self.compressing:
            with self._opt.skip_synchronize():
                loss = self._opt.step(closure)
        else:
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

    def agree_grad_norm(self, local_norm: float) -> float:
        """The gradient norm every rank reports and tests for inf/NaN: warmup, ``local_norm`` (the
        gradients are already averaged); compressed phase, sqrt(mean over ranks of each rank's
        squared local norm) by one tiny allreduce, so a non-finite gradient on any rank makes
        every rank skip the step."""
        if not self.compressing or self._size == 1:
            return local_norm
        self.wire_bytes += ring_allreduce_wire_bytes(8, self._size)
        return math.sqrt(allreduce_sum([local_norm ** 2], name="onebit.gradnorm")[0] / self._size)

    def _reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.errors is None:
            layout = Layout(flat.numel(), self._size, int(self.param_groups[0]["chunk"]))
            self.errors = ErrorFeedback(layout, self._rank, flat.device)
        out = compressed_allreduce(flat, self.errors, name="onebit.momentum")
        self.wire_bytes += self.errors.layout.wire_bytes()
        return out

    def _silence_hooks_if_compressing(self) -> None:
        if self.compressing and self._opt.backward_passes_per_step != _NEVER:
            self._opt.set_backward_passes_per_step(_NEVER)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The optimiser's ``state_dict()`` plus, in the compressed phase, ``"onebit_errors"``:
        ``world_size``, ``numel``, ``chunk``, ``worker`` float32 [n, n P] and ``server`` float32
        [n, P], every rank's error buffers in rank order (an ``allgather``: call on every rank)."""
        sd = self._opt.state_dict()
        if self.errors is not None and self.save_errors:
            lay = self.errors.layout
            sd["onebit_errors"] = {
                "world_size": lay.world_size, "numel": lay.numel, "chunk": lay.chunk,
                "worker": allgather(self.errors.worker_error.unsqueeze(0), "onebit.ckpt.worker"),
                "server": allgather(self.errors.server_error.unsqueeze(0), "onebit.ckpt.server")}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s output: the optimiser state (and with it the phase) and this
        rank's error buffers."""
        sd = dict(state_dict)
        saved = sd.pop("onebit_errors", None)
        self._opt.load_state_dict(sd)
        self.errors = None
        self._silence_hooks_if_compressing()
        if saved is None:
            if self.compressing and self._size > 1 and self._rank == 0:
                print("warning: checkpoint has no 1-bit error buffers: error feedback restarts "
                      "from zero (resume is not exact)", file=sys.stderr)
            return
        layout = Layout(int(saved["numel"]), self._size, int(saved["chunk"]))
        if saved["world_size"] != self._size or saved["worker"].shape[1] != layout.padded:
            if self._rank == 0:
                print(f"warning: 1-bit error buffers were saved by {saved['world_size']} ranks, "
                      f"this job has {self._size}: error feedback restarts from zero (resume is "
                      "not exact)", file=sys.stderr)
            return
        self.errors = ErrorFeedback(layout, self._rank, saved["worker"].device)
        self.errors.worker_error = saved["worker"][self._rank].clone().float()
        self.errors.server_error = saved["server"][self._rank].clone().float()


# ---- elastic training (Horovod docs, "Elastic Horovod") -----------------------------------------

def rank_context() -> RankContext:
    """This process's place in the job as Horovod has it now (after an elastic reset too)."""
    hvd = _hvd()
    return RankContext(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "horovod")


def elastic_state(model: torch.nn.Module, optimizer, **fields):
    """``hvd.elastic.TorchState`` of ``model`` and ``optimizer`` (their state dicts copied to host
    memory at each ``commit()``, restored after a failure, broadcast from rank 0 at each sync)
    plus plain ``fields`` (kept by reference at commit: assign new values, never mutate)."""
    return _hvd().elastic.TorchState(model=model, optimizer=optimizer, **fields)


def elastic_run(fn):
    """``hvd.elastic.run(fn)``: call ``fn(state)``; on ``HorovodInternalError`` (a worker lost)
    restore the last commit, on ``HostsUpdatedInterrupt`` (workers added or removed) keep it;
    then re-form the world (shutdown + init), run the state's reset callbacks, sync from rank 0
    and call ``fn`` again."""
    return _hvd().elastic.run(fn)
