"""The device a rank computes on and the precision it computes in.

Device (:func:`resolve_device`): one GPU per local rank (Horovod docs, "Horovod with PyTorch":
``torch.cuda.set_device(hvd.local_rank())``), or the CPU.

Mixed precision: autocast contexts and the dynamic loss scaler (torch.amp docs, "Automatic Mixed
Precision"; Micikevicius et al. 2018, as the reference used through apex).

* fp32: no autocast.
* fp16 (CUDA only): ``torch.autocast(dtype=float16)`` for matmuls, fp32 master weights (the model's
  parameters stay fp32), loss and softmax in fp32 (the caller upcasts logits), and
  ``torch.amp.GradScaler`` for dynamic loss scaling: overflowed steps are skipped and the scale
  halved; after 2000 clean steps it doubles.
* bf16 (CUDA or CPU): ``torch.autocast(dtype=bfloat16)``; bf16 has fp32's exponent range, so no
  loss scaling.
"""
from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "fp16", "bf16")


def check(device: torch.device, precision: str) -> None:
    """Raise ValueError for an unknown precision or fp16 on a non-CUDA device."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("precision fp16 needs a CUDA device (on CPU use fp32 or bf16)")


def autocast(device: torch.device, precision: str):
    """The autocast context for ``precision`` on ``device`` (a null context for fp32)."""
    check(device, precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """The loss scaler of ``precision``: dynamic (``GradScaler(enabled=True)``) for fp16, a
    disabled one otherwise, whose ``scale``/``unscale_``/``step``/``update`` pass through
    (torch.amp docs: "enabled=False ... calls become no-ops"), so the training step has one path
    for every precision."""
    check(device, precision)
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


class DeviceError(ValueError):
    """The device asked for cannot serve this rank (no CUDA, or more local ranks than GPUs)."""


def resolve_device(name: str, local_rank: int, local_size: int = 1,
                   gpus: int | None = None) -> torch.device:
    """The device of this rank: one GPU per local rank (Horovod docs, "Horovod with PyTorch":
    ``torch.cuda.set_device(hvd.local_rank())``).

    ``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` means ``cuda:<local_rank>``;
    ``cuda:N`` is honoured when this rank is alone on its node. Two ranks must never share a GPU
    (NCCL refuses: "Duplicate GPU detected"), so a node running more local ranks than it has GPUs
    is an error here, at start-up.

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (``run.device``).
        local_rank / local_size: this rank and the rank count on this node.
        gpus: GPUs torch sees (default ``torch.cuda.device_count()``; tests pass it).

    Raises:
        DeviceError: CUDA asked for but not available, ``cuda:N`` beyond the GPUs or with
            several local ranks, or more local ranks than GPUs (saying how many of each and
            what to do).
    """
    available = torch.cuda.is_available() if gpus is None else gpus > 0
    n = (torch.cuda.device_count() if available else 0) if gpus is None else gpus
    if name == "auto":
        name = "cuda" if available else "cpu"
    if not name.startswith("cuda"):
        return torch.device(name)
    if not available:
        raise DeviceError(f"run.device={name!r} but torch sees no CUDA device (a CPU build of "
                          "torch, or no GPU visible: check CUDA_VISIBLE_DEVICES); use --device "
                          "cpu")
    if ":" in name:
        index = int(name.split(":", 1)[1])
        if local_size > 1:
            raise DeviceError(
                f"run.device={name!r} puts all {local_size} ranks of this node on one GPU (NCCL "
                "refuses: duplicate GPU); use --device cuda (one GPU per local rank, "
                "cuda:<local_rank>), or launch one rank per node")
        if index >= n:
            raise DeviceError(f"run.device={name!r} but torch sees {n} GPU(s) (cuda:0.."
                              f"cuda:{n - 1})")
    else:
        if local_size > n:
            raise DeviceError(
                f"{local_size} ranks run on this node but torch sees {n} GPU(s): one rank per "
                f"GPU (launch at most {n} rank(s) per node, e.g. horovodrun -np {n}), or train "
                "on the CPU with --device cpu")
        index = local_rank
    dev = torch.device(f"cuda:{index}")
    if gpus is None:
        torch.cuda.set_device(dev)
    return dev
