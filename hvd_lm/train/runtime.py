"""The device and precision a rank computes with.

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


def make_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """A dynamic ``GradScaler`` for fp16 on CUDA, else None."""
    check(device, precision)
    return torch.amp.GradScaler("cuda") if precision == "fp16" else None


def resolve_device(name: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` for ``auto`` when CUDA is available (one GPU per local rank), else
    CPU; an explicit ``cpu``/``cuda``/``cuda:N`` is honoured (``cuda`` means ``cuda:local_rank``).

    Raises:
        ValueError: CUDA asked for but not available.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"run.device={name!r} but torch sees no CUDA device")
        dev = torch.device(name if ":" in name else f"cuda:{local_rank % torch.cuda.device_count()}")
        torch.cuda.set_device(dev)
        return dev
    return torch.device(name)
