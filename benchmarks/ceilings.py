"""The card's ceilings and the mLSTM step's GEMMs, for ``python -m benchmarks gpu``.

A square matmul's TFLOP/s per precision and the device-to-device copy's GB/s are what the card
can do at best; every GEMM of the fused mLSTM's training window, timed alone at its own shape
(:func:`step_gemms`), gives the step's **GEMM ceiling** (:func:`gemm_ceiling`): the chars/s it
would reach doing nothing but its GEMMs. docs/mlstm_fused.md counts them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from hvd_lm.formats.tokenizer import VOCAB_SIZE


class Timer:
    """Seconds of ``n`` calls of ``fn()``: CUDA events on a GPU (device time), perf_counter on
    the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object], n: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t0


# ---- the step's GEMMs and their ceiling ----------------------------------------------------------

@dataclass(frozen=True)
class Gemm:
    """One GEMM of the training step: ``[m, k] @ [k, n]`` run ``count`` times per window.

    Attributes:
        name: what it computes (the fused recurrence's own names, docs/mlstm_fused.md).
        phase: ``forward``, ``backward data`` or ``weight gradient``.
        a_t / b_t: the operand is a transposed view as the step passes it (``x W^T`` reads W
            [n, k] transposed; ``dG^T M`` reads dG [k, m] transposed), timed the same way.
    """

    name: str
    phase: str
    m: int
    k: int
    n: int
    count: int
    a_t: bool = False
    b_t: bool = False

    @property
    def flops(self) -> int:
        """FLOPs per window: 2 m k n x count."""
        return 2 * self.m * self.k * self.n * self.count


def step_gemms(H: int, E: int, T: int, B: int, V: int = VOCAB_SIZE) -> list[Gemm]:
    """Every GEMM of one training window of the fused mLSTM (B rows x T chars, width H, byte
    embedding E, V = 256 outputs), as :mod:`hvd_lm.model.mlstm_fused` and the model run them.

    Their FLOPs add up to ``T * B * LanguageModel.flops_per_char()``: forward
    2 (5EH + 5H^2 + HV) per char, the backward's data and weight gradients the same each.
    """
    R = T * B  # rows of the whole-window GEMMs
    return [
        Gemm("input projection x W_x^T", "forward", R, E, 4 * H, 1, b_t=True),
        Gemm("input projection x W_mx^T", "forward", R, E, H, 1, b_t=True),
        Gemm("a_t = h_{t-1} W_mh^T", "forward", B, H, H, T, b_t=True),
        Gemm("g_t = x_t W_x^T + m_t W_h^T", "forward", B, H, 4 * H, T, b_t=True),
        Gemm("decoder hs W_d^T", "forward", R, H, V, 1, b_t=True),
        Gemm("decoder dlogits W_d", "backward data", R, V, H, 1),
        Gemm("dm_t = dg_t W_h", "backward data", B, 4 * H, H, T),
        Gemm("dh_{t-1} = da_t W_mh", "backward data", B, H, H, T),
        Gemm("embedding grad dxg W_x", "backward data", R, 4 * H, E, 1),
        Gemm("embedding grad dxm W_mx", "backward data", R, H, E, 1),
        Gemm("dW_d = dlogits^T hs", "weight gradient", V, R, H, 1, a_t=True),
        Gemm("dW_h = dG^T M", "weight gradient", 4 * H, R, H, 1, a_t=True),
        Gemm("dW_mh = dA^T Hprev", "weight gradient", H, R, H, 1, a_t=True),
        Gemm("dW_x = dG^T x", "weight gradient", 4 * H, R, E, 1, a_t=True),
        Gemm("dW_mx = dXm^T x", "weight gradient", H, R, E, 1, a_t=True),
    ]


def gemm_ceiling(gemms: list[Gemm], tflops: list[float], chars: int) -> dict:
    """The step's GEMM ceiling: the seconds per window its GEMMs take at their measured rates
    (``tflops[i]`` for ``gemms[i]``), and the chars/s and model TFLOP/s the step would reach if
    it spent no time on anything else (pointwise kernels, launches, the optimizer).

    Returns:
        {"seconds": s, "chars_per_s": chars / s, "tflops": sum of FLOPs / s / 1e12}.
    """
    seconds = sum(g.flops / (r * 1e12) for g, r in zip(gemms, tflops))
    flops = sum(g.flops for g in gemms)
    return {"seconds": seconds, "chars_per_s": chars / seconds, "tflops": flops / seconds / 1e12}


def matmul_tflops(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                  timer: Callable, repeats: int = 3, iters: int = 10, a_t: bool = False,
                  b_t: bool = False, tf32: bool = False) -> float:
    """Median TFLOP/s of ``[m,k] @ [k,n]`` (2mkn FLOPs) in ``dtype`` on random data; ``a_t`` /
    ``b_t``: that operand is the transposed view of a row-major [k, m] / [n, k] tensor;
    ``tf32``: fp32 matmuls may use TF32 tensor cores for this measurement
    (``torch.backends.cuda.matmul.allow_tf32``, off by default in PyTorch)."""
    if tf32:
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return matmul_tflops(m, k, n, dtype, device, timer, repeats, iters, a_t, b_t)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    a = torch.randn(k, m, device=device, dtype=dtype).t() if a_t else \
        torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t() if b_t else \
        torch.randn(k, n, device=device, dtype=dtype)
    torch.mm(a, b)
    times = [timer(lambda: torch.mm(a, b), iters) / iters for _ in range(repeats)]
    return 2 * m * k * n / statistics.median(times) / 1e12


def copy_gbps(mib: int, device: torch.device, timer: Callable, repeats: int = 3) -> float:
    """Median device-to-device copy bandwidth, GB/s, counting the bytes read and written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timer(lambda: dst.copy_(src), 5) / 5 for _ in range(repeats)]
    return 2 * (mib << 20) / statistics.median(times) / 1e9


def peak_key(cell: str, precision: str, peaks: dict[str, float]) -> str:
    """Which measured matmul peak a training row is a fraction of: its precision's, except
    cuDNN's LSTM in fp32, which PyTorch lets use TF32 tensor cores by default
    (``torch.backends.cudnn.allow_tf32``, unlike its matmuls): the ``tf32`` peak when measured
    (against the fp32 peak such a row can exceed 1; docs/gpu.md has an H200's figures)."""
    if cell == "lstm" and precision == "fp32" and "tf32" in peaks \
            and torch.backends.cudnn.allow_tf32:
        return "tf32"
    return precision
