"""The memory one training step of ``hvd-lm train`` needs on one rank, estimated from the
configuration before anything is built, and the memory the device has free.

Notation: B rows (``--batch-size``), T bytes per window (``--seq-len``), N = B T positions,
H hidden size, E embedding width, V = 256 byte values, P parameters; S = 4 bytes (fp32: the
state, the loss, master weights, gradients and optimizer state), C the compute dtype's bytes
(4 for fp32, 2 under bf16/fp16 autocast). Activations saved for the backward of one window:

* embedding output, as the input projections keep it: the mLSTM's two read the same
  contiguous [T, B, E] tensor and keep it once in fp32 (N E S), under autocast each its own
  cast (2 N E C); the LSTM 2 N E C;
* the recurrence, ``--rnn-impl fused``: :func:`hvd_lm.model.mlstm_fused.saved_bytes`
  (T, B, H, reset on: a window that starts a stream) = N H (6 S + 4 C) in fp32, N H (S + 8 C)
  under autocast (the gate pre-activations saved instead of the fp32 activations), + B H
  (S + C) + N S, and under autocast the recurrent weights W_mh and W_h cast once, 5 H^2 C;
  ``reference``: per step and row 7 H C + 2 H S (the matmuls' inputs h and m, W_mh h, the four
  gate activations in C; c and tanh(c) in S), xm N H C, and under autocast the two recurrent
  weights cast again at every step, T 5 H^2 C (autocast caches only leaf tensors' casts, and
  ``W.t()`` is not a leaf); ``--cell lstm`` (torch's CPU LSTM, measured): 16 N H S;
* hs N H C, kept by the decoder;
* the loss: the fp32 log-softmax N V S (``F.cross_entropy``) and the int64 inputs and
  targets 2 N 8.

Besides them: the fp32 parameters 4 P, their gradients
4 P, a gradient-sized allreduce buffer (Horovod's fusion buffer, capped at the fusion
threshold, 128 MiB by default; plus the fp16 copies, 2 P, under ``--compression fp16``; none
on one rank), the optimizer state (:data:`OPTIMIZER_STATES` tensors of 4 P), the backward's
workspace (the window's input gradients [T, B, 4H] and [T, B, H] and the gradient of hs
[T, B, H] in the compute dtype, alive together, and the logits and their gradient in fp32:
6 N H C + 2 N V S; under autocast the fused window writes the gate gradients over its saved
pre-activations, so the [T, B, 4H] one is not allocated: 2 N H C + 2 N V S) and, on the host,
the shard read buffers (1 MiB per row and split).

On a GPU the fused window's backward needs 1 N H C more than that workspace (added on CUDA
only), and with ``--cuda-graphs`` the fused window is replayed from a CUDA graph whose private
memory pool (``torch.cuda.make_graphed_callables``) stays allocated for the whole run and is
never shared with the eager allocator: :func:`graph_pool_bytes` adds the pool's static buffers
(inputs, outputs, their gradients and the backward's gate gradients: 14 N H C, 7 N H C under
autocast, plus the recurrent weights cast and their gradients, 10 H^2 C); the window's saved
activations live in the pool, so they count once. These GPU terms were fitted to an H200's
peaks and refitted without a card (:func:`gpu_savings`); the measurements and the fit:
docs/training.md, "One step's memory".

With ``--async-checkpoint`` (the default) rank 0 also holds a host copy of the checkpoint being
written while the next steps run: weights and optimizer state, 4 P (1 + states), and every
rank's recurrent state; counted on the CPU, where it shares the memory the step uses.

Checked against measurements in ``tests/test_reliability_preflight.py``: the activations against the
bytes torch's saved-tensor hooks see (both recurrences, fp32 and bf16, within 2%), and the
whole estimate against the peak resident memory of real ``hvd-lm train`` processes (within
15%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import psutil
import torch

from hvd_lm.comm.engine import HOROVOD_DEFAULT_FUSION_BYTES
from hvd_lm.model.lm import parameter_shapes
from hvd_lm.model.mlstm_fused import saved_bytes
from hvd_lm.train.data import READ_AHEAD
from hvd_lm.train.settings import TrainConfig
from hvd_lm.util.atomic import human
from hvd_lm.util.units import MIB

#: Tensors of the parameters' size each optimizer keeps per rank: Adam and LAMB their two
#: moments, SGD its momentum buffer, the 1-bit optimizers two moments, the local momentum
#: copy they compress and the worker error (the server error is 1/world of it: counted as 1).
OPTIMIZER_STATES = {"adam": 2, "sgd": 1, "lamb": 2, "onebit-adam": 5, "onebit-lamb": 5}


@dataclass
class StepMemory:
    """Bytes one rank needs for one training step, by kind (see the module docstring).

    Attributes:
        activations: saved for the backward of one window.
        workspace: the backward's largest short-lived tensors.
        parameters: fp32 weights.
        gradients: gradients and the allreduce buffer.
        optimizer: optimizer state.
        data: host-side shard read buffers.
        graph_pool: the CUDA-graph pool of the fused window (``--cuda-graphs`` on a GPU;
            :func:`graph_pool_bytes`), 0 otherwise.
        checkpoint_copy: on the CPU with ``--async-checkpoint``, the host copy of a checkpoint
            being written while the next steps run (:mod:`hvd_lm.train.checkpointer`): the
            weights, the optimizer state and every rank's recurrent state, fp32 (on a GPU it is
            host memory, not the device's), 0 otherwise.
    """

    activations: int
    workspace: int
    parameters: int
    gradients: int
    optimizer: int
    data: int
    graph_pool: int = 0
    checkpoint_copy: int = 0

    @property
    def total(self) -> int:
        """All of it, bytes."""
        return sum(getattr(self, f.name) for f in fields(self))

    def describe(self) -> str:
        """``activations 1.2 GB, workspace ...``: each kind in decimal units."""
        return ", ".join(f"{f.name} {human(getattr(self, f.name))}" for f in fields(self))


def compute_bytes(precision: str) -> int:
    """Bytes per element of the compute dtype: 4 for fp32, 2 under bf16/fp16 autocast."""
    return 4 if precision == "fp32" else 2


def activation_bytes(T: int, B: int, H: int, E: int, V: int, C: int, impl: str = "fused",
                     cell: str = "mlstm") -> int:
    """Bytes of activations one training window keeps for its backward (module docstring).

    Args:
        T, B: window length and rows; H, E, V: hidden, embedding and vocabulary sizes.
        C: compute dtype bytes (:func:`compute_bytes`).
        impl: ``fused`` or ``reference`` (``model.rnn_impl``); cell: ``mlstm`` or ``lstm``.
    """
    S, N = 4, T * B
    casts = 5 * H * H * C if C != S else 0  # W_mh [H, H] and W_h [4H, H] in the compute dtype
    embedded = 2 * N * E * C if cell == "lstm" or C != S else N * E * S
    if cell == "lstm":
        rnn = 16 * N * H * S
    elif impl == "fused":
        cdtype = torch.float32 if C == 4 else torch.bfloat16
        rnn = saved_bytes(T, B, H, torch.float32, cdtype, mask=False, reset=True) + casts
    else:
        rnn = N * H * (7 * C + 2 * S) + N * H * C + T * casts
    return embedded + rnn + N * H * C + N * V * S + 2 * N * 8


def workspace_bytes(T: int, B: int, H: int, V: int, C: int, fused_gpu: bool,
                    fused: bool = True) -> int:
    """The backward's largest short-lived tensors (module docstring): the window's input
    gradients and the gradient of hs, 6 N H C (2 N H C when the fused window writes the gate
    gradients over its saved pre-activations: ``fused`` under autocast, C < 4), the logits and
    their gradient in fp32, 2 N V S, and the fused window's 1 N H C more on a GPU."""
    N = T * B
    units = 2 if fused and C < 4 else 6
    return N * ((units + (1 if fused_gpu else 0)) * H * C + 2 * V * 4)


def gpu_savings(T: int, B: int, H: int, C: int, graphed: bool = False) -> int:
    """Bytes issue 43 took off the fused window's step on a GPU, per rank: the activations
    (the pre-activations 4 H C saved instead of the activations and tanh(c) 5 H S per position,
    under autocast), the gate-gradient buffer (4 N H C, autocast), the copy of the gradient of
    hs (1 N H C), and with CUDA graphs the pool's merged buffers (7 N H C, autocast): what
    ``tests/test_reliability_preflight.py`` takes off the GPU peaks measured before them, to
    check the refitted estimate (docs/training.md, "One step's memory")."""
    N, narrow = T * B, C < 4
    saved = N * H * (5 * 4 - 4 * C) if narrow else 0
    pool = 7 * N * H * C if graphed and narrow else 0
    return saved + N * H * C * ((4 if narrow else 0) + 1) + pool


def graph_pool_bytes(T: int, B: int, H: int, C: int) -> int:
    """Bytes the private memory pool of a CUDA-graphed fused window adds for the whole run
    (module docstring), N = T B positions: its static buffers, 14 N H C in the compute dtype
    (the inputs xg [T, B, 4H] and xm [T, B, H], the output hs and its gradient, the inputs'
    gradients, the backward's gate gradients), 7 N H C under autocast (C < 4: the gate
    gradients and xg's gradient are xg's own buffer),
    and the recurrent weights W_mh [H, H], W_h [4H, H]
    cast and their gradients, 10 H^2 C. The saved activations move into the pool and are
    counted in ``activations``.

    Args:
        T, B: window length and rows; H: hidden size; C: compute dtype bytes.
    """
    return (7 if C < 4 else 14) * T * B * H * C + 10 * H * H * C


def step_memory(cfg: TrainConfig, device_type: str, world_size: int = 1,
                split_bytes: tuple[int, ...] = ()) -> StepMemory:
    """The estimate for ``cfg`` on one rank.

    Args:
        device_type: ``cpu`` or ``cuda`` (the read buffers count on the CPU only).
        world_size: ranks in the job (one rank allocates no allreduce buffer).
        split_bytes: bytes of the splits read (train, val), to cap the read buffers.
    """
    m, d = cfg.model, cfg.data
    P = sum(math.prod(shape) for _, shape in parameter_shapes(m))
    C = compute_bytes(cfg.run.precision)
    fusion = int(cfg.dist.fusion_threshold_mb * MIB) if cfg.dist.fusion_threshold_mb is not None \
        else HOROVOD_DEFAULT_FUSION_BYTES
    allreduce = (min(4 * P, fusion) + (2 * P if cfg.dist.compression == "fp16" else 0)
                 if world_size > 1 else 0)
    states = (0 if cfg.optim.optimizer == "sgd" and cfg.optim.momentum == 0
              else OPTIMIZER_STATES.get(cfg.optim.optimizer, 2))
    fused_gpu = device_type == "cuda" and m.cell == "mlstm" and m.rnn_impl == "fused"
    return StepMemory(
        activations=activation_bytes(d.seq_len, d.batch_size, m.hidden_size, m.embed_dim,
                                     m.vocab_size, C, m.rnn_impl, m.cell),
        workspace=workspace_bytes(d.seq_len, d.batch_size, m.hidden_size, m.vocab_size, C,
                                  fused_gpu, m.cell == "mlstm" and m.rnn_impl == "fused"),
        parameters=4 * P,
        gradients=4 * P + allreduce,
        optimizer=4 * P * states,
        # each row's shard reader buffers (hvd_lm.train.data.ConcatStream), on the host
        data=d.batch_size * sum(min(READ_AHEAD, n) for n in split_bytes)
        if device_type == "cpu" else 0,
        graph_pool=graph_pool_bytes(d.seq_len, d.batch_size, m.hidden_size, C)
        if fused_gpu and m.cuda_graphs else 0,
        checkpoint_copy=(4 * P * (1 + states) + 2 * 4 * world_size * d.batch_size * m.hidden_size
                         if device_type == "cpu" and cfg.run.async_checkpoint else 0))


def free_memory(device: torch.device) -> tuple[int, str]:
    """(bytes free for new allocations, where the number comes from) on ``device``:
    ``torch.cuda.mem_get_info`` on a GPU, ``psutil.virtual_memory().available`` on the CPU
    (memory usable without swapping, as the kernel's MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), f"free on {device}"
    return int(psutil.virtual_memory().available), "available on this node"
