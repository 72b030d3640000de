"""``hvd-lm bench gpu``: one GPU's ceilings and the LM's training step, side by side in one run.

In one invocation (so every figure shares the card's clocks and temperature):

1. the card's ceilings: matmul TFLOP/s in bf16, fp16 and fp32 at 8192^3 and at the recurrent
   shapes of each batch (``[B,H] x [H,4H]`` and ``[B,H] x [H,H]``, the mLSTM's per-step GEMMs),
   and the device-to-device copy bandwidth (GB/s, bytes read + written, 1 GiB);
2. the training step (:func:`hvd_lm.train.evaluate.window_nll`, backward, gradient clipping,
   Adam; the loop's step without Horovod) of the mLSTM at ``--hidden-size`` (4096), ``--seq-len``
   (256), each ``--batch-sizes`` (128, 256) and ``--precisions`` (fp32, fp16 with dynamic loss
   scaling, bf16): chars/s, model TFLOP/s (:meth:`LanguageModel.flops_per_char`), the fraction of
   the measured matmul peak of that precision (8192^3), peak memory;
3. the same for ``--cell lstm`` (``torch.nn.LSTM``, i.e. cuDNN) as the yardstick, and the
   mLSTM / cuDNN-LSTM ratio of achieved TFLOP/s at each shape;
4. the mLSTM once per ``--rnn-impl`` (fused, the one autograd Function per window of
   :mod:`hvd_lm.core.mlstm_fused`, and reference, the per-step loop) and, for fused on CUDA, per
   ``--cuda-graphs`` (off, on), with each variant's speed over the reference at the same shape.

Timing: CUDA events around ``--steps`` steps after ``--warmup`` (medians of ``--repeats``).
``--json FILE`` saves everything. ``--device cpu`` runs the same code on the CPU (small shapes:
tests; the figures then describe the CPU).

Reference figures from one H100 (torch 2.11, before the fused recurrence): bf16 matmul 792 /
337 / 198 TFLOP/s at 8192^3 / [128,4096]x[4096,16384] / [128,4096]x[4096,4096]; mLSTM bf16
109k chars/s (B=128), 200k (B=256), fp32 65k (B=128); cuDNN LSTM bf16 689k, fp32 352k (B=128).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch

from hvd_lm.core import config as configlib
from hvd_lm.core.atomic import write_text
from hvd_lm.core.config import Command, option
from hvd_lm.core.model import LanguageModel, ModelConfig
from hvd_lm.train import runtime
from hvd_lm.train.data import Batch
from hvd_lm.train.evaluate import window_nll

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class BenchGpuConfig:
    """``hvd-lm bench gpu``."""

    device: str = option("cuda", "cuda (the GPU of this process) or cpu (small shapes, tests)",
                         choices=("cuda", "cpu"))
    hidden_size: int = option(4096, "LM width H (the reference's 4096)", ge=1)
    embed_dim: int = option(64, "byte embedding width", ge=1)
    seq_len: int = option(256, "TBPTT window T, chars", ge=1)
    batch_sizes: list[int] = option(default_factory=lambda: [128, 256],
                                    help="per-GPU batches B", ge=1)
    precisions: list[str] = option(default_factory=lambda: ["fp32", "fp16", "bf16"],
                                   help="training precisions", choices=tuple(DTYPES))
    cells: list[str] = option(default_factory=lambda: ["mlstm", "lstm"],
                              help="cells (lstm = torch.nn.LSTM on cuDNN, the yardstick)",
                              choices=("mlstm", "lstm"))
    rnn_impls: list[str] = option(default_factory=lambda: ["fused", "reference"],
                                  help="mLSTM recurrences, side by side", flag="--rnn-impl",
                                  choices=("fused", "reference"))
    rnn_kernels: str = option("auto", "fused path's cell kernels", choices=("auto", "torch",
                                                                           "compile", "triton"))
    cuda_graphs: list[bool] = option(default_factory=lambda: [False, True],
                                     help="fused path on CUDA: without and with CUDA graphs")
    steps: int = option(5, "timed training steps per configuration", ge=1)
    warmup: int = option(2, "untimed steps first", ge=0)
    repeats: int = option(3, "timed repeats (median)", ge=1)
    matmul_size: int = option(8192, "square matmul size for the peak", ge=1)
    copy_mib: int = option(1024, "device-to-device copy size, MiB", ge=1)
    json: str = option("", "write the results here")


class _Timer:
    """Seconds of ``fn()`` calls: CUDA events on a GPU (device time), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, n: int) -> float:
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


def matmul_tflops(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                  timer: _Timer, repeats: int = 3, iters: int = 10) -> float:
    """Median TFLOP/s of ``[m,k] @ [k,n]`` (2mkn FLOPs) in ``dtype`` on random data."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    torch.mm(a, b)
    times = [timer(lambda: torch.mm(a, b), iters) / iters for _ in range(repeats)]
    return 2 * m * k * n / statistics.median(times) / 1e12


def copy_gbps(mib: int, device: torch.device, timer: _Timer, repeats: int = 3) -> float:
    """Median device-to-device copy bandwidth, GB/s, counting the bytes read and written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timer(lambda: dst.copy_(src), 5) / 5 for _ in range(repeats)]
    return 2 * (mib << 20) / statistics.median(times) / 1e9


def train_step_rate(cell: str, H: int, E: int, B: int, T: int, precision: str,
                    device: torch.device, timer: _Timer, steps: int, warmup: int,
                    repeats: int, rnn_impl: str = "fused", rnn_kernels: str = "auto",
                    cuda_graphs: bool = False) -> dict:
    """chars/s of the training step (forward + backward + clip + Adam) and its peak memory.

    Args:
        rnn_impl, rnn_kernels, cuda_graphs: the mLSTM's :class:`ModelConfig` fields.

    Raises:
        torch.cuda.OutOfMemoryError: the shape does not fit (reported as such by the caller).
    """
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(cell=cell, hidden_size=H, embed_dim=E, rnn_impl=rnn_impl,
                                      rnn_kernels=rnn_kernels,
                                      cuda_graphs=cuda_graphs)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    scaler = runtime.make_scaler(device, precision)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (B, T + 1), generator=g)
    batch = Batch(data[:, :-1].contiguous(), data[:, 1:].contiguous(),
                  torch.zeros(B, T, dtype=torch.bool), B * T)
    state = [model.init_state(B, device)]

    def step():
        nats, state[0] = window_nll(model, batch, state[0], device, precision)
        loss = nats / batch.chars
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    times = [timer(step, steps) / steps for _ in range(repeats)]
    s = statistics.median(times)
    chars = B * T / s
    return {"cell": cell, "impl": _impl_name(cell, rnn_impl, cuda_graphs), "hidden_size": H,
            "batch_size": B, "seq_len": T, "precision": precision, "step_s": s, "step_s_repeats": times,
            "chars_per_s": chars, "flops_per_char": model.flops_per_char(),
            "tflops": chars * model.flops_per_char() / 1e12,
            "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30
                                if device.type == "cuda" else None)}


def _impl_name(cell: str, rnn_impl: str, cuda_graphs: bool) -> str:
    if cell != "mlstm":
        return "cudnn" if cell == "lstm" else "-"
    return rnn_impl + ("+graphs" if cuda_graphs else "")


def variants(cfg: BenchGpuConfig, device: torch.device) -> list[tuple[str, str, bool]]:
    """(cell, rnn_impl, cuda_graphs) to run: the LSTM once; the mLSTM per ``--rnn-impl`` and,
    fused on CUDA, per ``--cuda-graphs`` (graphs need CUDA: off elsewhere)."""
    out = []
    for cell in cfg.cells:
        if cell != "mlstm":
            out.append((cell, "fused", False))
            continue
        for impl in cfg.rnn_impls:
            graphs = cfg.cuda_graphs if impl == "fused" and device.type == "cuda" else [False]
            out += [(cell, impl, g) for g in dict.fromkeys(graphs)]
    return out


def bench_gpu(cfg: BenchGpuConfig) -> int:
    """Print (and with ``--json`` save) the ceilings, the training rates and the ratios.

    Raises:
        hvd_lm.train.runtime.DeviceError: ``--device cuda`` without a GPU.
    """
    device = runtime.resolve_device(cfg.device, 0, 1)
    timer = _Timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}")
    out: dict = {"device": name, "torch": torch.__version__, "config": configlib.to_dict(cfg),
                 "matmul": [], "train": []}
    peak = {}
    for prec in cfg.precisions:
        n = cfg.matmul_size
        peak[prec] = matmul_tflops(n, n, n, DTYPES[prec], device, timer, cfg.repeats)
        out["matmul"].append({"precision": prec, "shape": [n, n, n], "tflops": peak[prec]})
        for B in cfg.batch_sizes:
            for width in (4, 1):  # [B,H] x [H,4H] (W_h) and [B,H] x [H,H] (W_mh)
                H = cfg.hidden_size
                t = matmul_tflops(B, H, width * H, DTYPES[prec], device, timer, cfg.repeats)
                out["matmul"].append({"precision": prec, "shape": [B, H, width * H],
                                      "tflops": t})
    out["copy_GBps"] = copy_gbps(cfg.copy_mib, device, timer, cfg.repeats)
    print(f"{'matmul':>8} {'shape':>22} {'TFLOP/s':>9}")
    for r in out["matmul"]:
        print(f"{r['precision']:>8} {'x'.join(map(str, r['shape'])):>22} {r['tflops']:>9.1f}")
    print(f"device-to-device copy: {out['copy_GBps']:.0f} GB/s (read + write)")

    for cell, impl, graphs in variants(cfg, device):
        for B in cfg.batch_sizes:
            for prec in cfg.precisions:
                try:
                    r = train_step_rate(cell, cfg.hidden_size, cfg.embed_dim, B, cfg.seq_len,
                                        prec, device, timer, cfg.steps, cfg.warmup, cfg.repeats,
                                        impl, cfg.rnn_kernels, graphs)
                except RuntimeError as e:  # out of memory, or a kernel the backend lacks
                    first = (str(e).splitlines() or [type(e).__name__])[0][:100]
                    r = {"cell": cell, "impl": _impl_name(cell, impl, graphs), "batch_size": B,
                         "precision": prec,
                         "error": "out of memory" if "out of memory" in str(e) else first}
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if "tflops" in r:
                    r["fraction_of_peak"] = r["tflops"] / peak[prec]
                out["train"].append(r)
    by = {(r["impl"], r["batch_size"], r["precision"]): r for r in out["train"]
          if "tflops" in r}
    print(f"\n{'cell':>6} {'impl':>15} {'B':>5} {'prec':>5} {'chars/s':>11} {'TFLOP/s':>8} "
          f"{'of peak':>8} {'mem GiB':>8} {'vs cuDNN/FLOP':>13} {'vs reference':>12}")
    for r in out["train"]:
        head = f"{r['cell']:>6} {r['impl']:>15} {r['batch_size']:>5} {r['precision']:>5}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        ref = by.get(("cudnn", r["batch_size"], r["precision"]))
        r["vs_cudnn_lstm_per_flop"] = r["tflops"] / ref["tflops"] if ref else None
        base = by.get(("reference", r["batch_size"], r["precision"]))
        r["vs_reference"] = (r["chars_per_s"] / base["chars_per_s"]
                             if base and r["cell"] == "mlstm" else None)
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        ratio = f"{r['vs_cudnn_lstm_per_flop']:.3f}" if ref and r["cell"] != "lstm" else "-"
        vs_ref = f"{r['vs_reference']:.2f}x" if r["vs_reference"] else "-"
        print(f"{head} {r['chars_per_s']:>11,.0f} {r['tflops']:>8.1f} "
              f"{r['fraction_of_peak']:>8.1%} {mem:>8} {ratio:>13} {vs_ref:>12}")
    best = cfg.rnn_impls[0]
    for B in cfg.batch_sizes:
        f32, b16 = by.get((best, B, "fp32")), by.get((best, B, "bf16"))
        if f32 and b16:
            out.setdefault("bf16_over_fp32", {})[B] = b16["chars_per_s"] / f32["chars_per_s"]
            print(f"mLSTM ({best}) B={B}: bf16 / fp32 = "
                  f"{b16['chars_per_s'] / f32['chars_per_s']:.2f}x")
    if cfg.json:
        write_text(cfg.json, json.dumps(out, indent=2) + "\n")
    return 0


BENCH_GPU = Command(BenchGpuConfig, bench_gpu, description=__doc__.split("\n\n")[1])
