"""``hvd-lm bench gpu``: one GPU's ceilings and the LM's training step, side by side in one run.

In one invocation (so every figure shares the card's clocks and temperature):

1. the card's ceilings: square matmul TFLOP/s in bf16, fp16 and fp32 (``--matmul-size``, 8192)
   and the device-to-device copy bandwidth (GB/s, bytes read + written, ``--copy-mib``);
2. **every GEMM of the mLSTM's training step** at its own shape, orientation and count
   (:func:`step_gemms`: input projections, the two recurrent GEMMs per step forward and
   backward, the decoder, the weight gradients over all T*B rows), each timed alone, per batch
   and precision; from them the step's **GEMM ceiling**: the chars/s the step would reach if
   it did nothing but its GEMMs at those measured rates (:func:`gemm_ceiling`);
3. the training step (:func:`hvd_lm.train.step.train_step`: forward, backward, gradient
   clipping, Adam; the loop's own step, without Horovod) of the mLSTM at ``--hidden-size`` (4096),
   ``--seq-len`` (256), each ``--batch-sizes`` (128, 256) and ``--precisions`` (fp32, fp16 with
   dynamic loss scaling, bf16): chars/s, model TFLOP/s (:meth:`LanguageModel.flops_per_char`),
   the fraction of the square-matmul peak and of the GEMM ceiling, peak memory beside the
   preflight's estimate (:func:`estimated_memory`);
4. the same for ``--cell lstm`` (``torch.nn.LSTM``, i.e. cuDNN) as the yardstick, and the
   mLSTM / cuDNN-LSTM ratio of achieved TFLOP/s at each shape;
5. the mLSTM once per ``--rnn-impl`` (fused, the one autograd Function per window of
   :mod:`hvd_lm.model.mlstm_fused`, and reference, the per-step loop) and, for fused, per
   ``--rnn-kernels`` and (on CUDA) per ``--cuda-graphs``, each over the reference at the same
   shape.

Every measurement is attempted on its own: one that fails (out of memory, a kernel the
backend lacks, any exception) is recorded with its error and the run goes on; with ``--json``
the file is rewritten (atomically) after every measurement, so a run cut short keeps every
figure taken before. Timing: CUDA events around ``--steps`` steps after ``--warmup`` (medians
of ``--repeats``). ``--device cpu`` runs the same code on the CPU (small shapes: tests; the
figures then describe the CPU).

Reference figures from one H100 (torch 2.11, before the fused recurrence): bf16 matmul 792 /
337 / 198 TFLOP/s at 8192^3 / [128,4096]x[4096,16384] / [128,4096]x[4096,4096]; mLSTM bf16
109k chars/s (B=128), 200k (B=256), fp32 65k (B=128); cuDNN LSTM bf16 689k, fp32 352k (B=128).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from hvd_lm import options as configlib
from hvd_lm.formats.tokenizer import VOCAB_SIZE
from hvd_lm.model import device as devices
from hvd_lm.model.lm import LanguageModel, ModelConfig, recurrence_label
from hvd_lm.model.mlstm_kernels import KERNELS, resolve
from hvd_lm.options import Command, option
from hvd_lm.train import memory
from hvd_lm.train.data import Batch
from hvd_lm.train.settings import TrainConfig
from hvd_lm.train.step import train_step
from hvd_lm.util.atomic import write_text

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
    rnn_kernels: list[str] = option(default_factory=lambda: ["auto"],
                                    help="fused path's cell kernels, side by side",
                                    choices=KERNELS)
    cuda_graphs: list[bool] = option(default_factory=lambda: [False, True],
                                     help="fused path on CUDA: without and with CUDA graphs")
    steps: int = option(5, "timed training steps per configuration", ge=1)
    warmup: int = option(2, "untimed steps first", ge=0)
    repeats: int = option(3, "timed repeats (median)", ge=1)
    matmul_size: int = option(8192, "square matmul size for the peak", ge=1)
    copy_mib: int = option(1024, "device-to-device copy size, MiB", ge=1)
    json: str = option("", "write the results here (rewritten after every measurement)")


class _Timer:
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
                  b_t: bool = False) -> float:
    """Median TFLOP/s of ``[m,k] @ [k,n]`` (2mkn FLOPs) in ``dtype`` on random data; ``a_t`` /
    ``b_t``: that operand is the transposed view of a row-major [k, m] / [n, k] tensor."""
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


# ---- the training step -------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One model variant of the benchmark: the cell and, for the mLSTM, its recurrence."""

    cell: str
    rnn_impl: str = "fused"
    rnn_kernels: str = "auto"
    cuda_graphs: bool = False

    @property
    def label(self) -> str:
        """``cudnn`` (the LSTM), ``reference``, or ``fused/<kernels>[+graphs]``."""
        if self.cell != "mlstm":
            return "cudnn"
        return recurrence_label(self.rnn_impl, self.rnn_kernels, self.cuda_graphs)


def variants(cfg: BenchGpuConfig, device: torch.device) -> list[Variant]:
    """The variants to run: the LSTM once; the mLSTM per ``--rnn-impl`` and, fused, per
    ``--rnn-kernels`` (resolved for ``device``, duplicates dropped) and on CUDA per
    ``--cuda-graphs`` (graphs need CUDA: off elsewhere)."""
    out: list[Variant] = []
    for cell in cfg.cells:
        if cell != "mlstm":
            out.append(Variant(cell))
            continue
        for impl in cfg.rnn_impls:
            if impl != "fused":
                out.append(Variant(cell, impl))
                continue
            graphs = cfg.cuda_graphs if device.type == "cuda" else [False]
            for kernels in dict.fromkeys(resolve(k, device) for k in cfg.rnn_kernels):
                out += [Variant(cell, impl, kernels, g) for g in dict.fromkeys(graphs)]
    return out


def free_device_memory(device: torch.device) -> None:
    """Free what a finished measurement leaves: a CUDA-graphed window
    (``torch.cuda.make_graphed_callables``) sits in reference cycles that keep its graphs and
    their private memory pool alive until the garbage collector runs, so six graphed variants
    in a row could hold six pools when the next variant starts; collect them, then hand the
    cached blocks back (``torch.cuda.empty_cache``)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def train_step_rate(v: Variant, H: int, E: int, B: int, T: int, precision: str,
                    device: torch.device, timer: Callable, steps: int, warmup: int,
                    repeats: int) -> dict:
    """chars/s of the training step (forward + backward + clip + Adam) and its peak memory;
    the model, its optimizer and its CUDA graphs are freed before it returns
    (:func:`free_device_memory`).

    Raises:
        whatever the step raises (torch.cuda.OutOfMemoryError when the shape does not fit);
        :func:`bench_gpu` records it as that variant's error.
    """
    try:
        return _train_step_rate(v, H, E, B, T, precision, device, timer, steps, warmup,
                                repeats)
    finally:  # the measurement's frame is gone here (on success): its objects can be freed
        free_device_memory(device)


def _train_step_rate(v: Variant, H: int, E: int, B: int, T: int, precision: str,
                     device: torch.device, timer: Callable, steps: int, warmup: int,
                     repeats: int) -> dict:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(cell=v.cell, hidden_size=H, embed_dim=E,
                                      rnn_impl=v.rnn_impl, rnn_kernels=v.rnn_kernels,
                                      cuda_graphs=v.cuda_graphs)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    scaler = devices.make_scaler(device, precision)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (B, T + 1), generator=g)
    batch = Batch(data[:, :-1].contiguous(), data[:, 1:].contiguous(),
                  torch.zeros(B, T, dtype=torch.bool), B * T)
    state = [model.init_state(B, device)]

    def step():  # the training loop's step (hvd_lm.train.step), without Horovod
        state[0] = train_step(model, opt, scaler, params, [batch], 1, state[0], device,
                              precision, grad_clip=1.0).state

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    times = [timer(step, steps) / steps for _ in range(repeats)]
    s = statistics.median(times)
    chars = B * T / s
    return {"step_s": s, "step_s_repeats": times, "chars_per_s": chars,
            "flops_per_char": model.flops_per_char(),
            "tflops": chars * model.flops_per_char() / 1e12,
            "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30
                                if device.type == "cuda" else None)}


def estimated_memory(v: Variant, H: int, E: int, B: int, T: int, precision: str,
                     device: torch.device) -> int:
    """Bytes the preflight of ``hvd-lm train`` (:func:`hvd_lm.train.memory.step_memory`, one
    rank, Adam) estimates for this variant's step: recorded beside the measured peak so that a
    GPU run checks the estimate, the CUDA-graph pool included."""
    cfg = TrainConfig()
    cfg.model = dataclasses.replace(cfg.model, cell=v.cell, hidden_size=H, embed_dim=E,
                                    rnn_impl=v.rnn_impl, rnn_kernels=v.rnn_kernels,
                                    cuda_graphs=v.cuda_graphs)
    cfg.data.batch_size, cfg.data.seq_len, cfg.run.precision = B, T, precision
    return memory.step_memory(cfg, device.type).total


# ---- the run -------------------------------------------------------------------------------------

class Results:
    """The benchmark's record, rewritten to ``path`` (atomically) after every measurement, so a
    run that stops early keeps what it measured."""

    def __init__(self, path: str, head: dict):
        self.path, self.data = path, {**head, "matmul": [], "gemms": [], "ceiling": [],
                                      "copy_GBps": None, "copy_error": None, "train": []}

    def add(self, section: str, record: dict | float) -> None:
        """Append ``record`` to ``section`` (or set it, for a scalar) and save."""
        if isinstance(self.data[section], list):
            self.data[section].append(record)
        else:
            self.data[section] = record
        self.save()

    def save(self) -> None:
        """Write the JSON (when a path was given)."""
        if self.path:
            write_text(self.path, json.dumps(self.data, indent=2) + "\n")


def attempt(fn: Callable[[], dict], device: torch.device) -> dict:
    """``fn()``, or ``{"error": "Type: first line"}`` when it raises any ``Exception`` (out of
    memory reads ``out of memory``); what the failed measurement held is freed
    (:func:`free_device_memory`). ``KeyboardInterrupt``
    and ``SystemExit`` pass through: the JSON written so far stays."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failed measurement is recorded, the run goes on
        first = (str(e).strip().splitlines() or [""])[0][:160]
        error = ("out of memory" if "out of memory" in str(e)
                 else f"{type(e).__name__}: {first}")
    # here the exception and its traceback (which held the failed measurement's frames) are gone
    free_device_memory(device)
    return {"error": error}


def bench_gpu(cfg: BenchGpuConfig, timer: Callable | None = None) -> int:
    """Print (and with ``--json`` save as it goes) the ceilings, the step's GEMMs and ceiling,
    the training rates and the ratios.

    Args:
        timer: ``timer(fn, n) -> seconds`` (default: CUDA events on a GPU, perf_counter on the
            CPU; tests pass a fake).

    Raises:
        hvd_lm.model.device.DeviceError: ``--device cuda`` without a GPU.
    """
    device = devices.resolve_device(cfg.device, 0, 1)
    timer = timer or _Timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    res = Results(cfg.json, {"device": name, "torch": torch.__version__,
                             "config": configlib.to_dict(cfg)})
    H, E, T = cfg.hidden_size, cfg.embed_dim, cfg.seq_len

    # 1. the card's ceilings
    peak: dict[str, float] = {}
    for prec in cfg.precisions:
        n = cfg.matmul_size
        r = attempt(lambda: {"tflops": matmul_tflops(n, n, n, DTYPES[prec], device, timer,
                                                     cfg.repeats)}, device)
        res.add("matmul", {"precision": prec, "shape": [n, n, n], **r})
        if "tflops" in r:
            peak[prec] = r["tflops"]
        print(f"matmul {prec} {n}^3: " + (f"{r['tflops']:.1f} TFLOP/s" if "tflops" in r
                                            else r["error"]), flush=True)
    r = attempt(lambda: {"GBps": copy_gbps(cfg.copy_mib, device, timer, cfg.repeats)}, device)
    res.add("copy_GBps", r.get("GBps"))
    res.add("copy_error", r.get("error"))
    print("device-to-device copy: " + (f"{r['GBps']:.0f} GB/s (read + write)" if "GBps" in r
                                       else r["error"]), flush=True)

    # 2. every GEMM of the mLSTM step at its shape, and the step's GEMM ceiling
    ceilings: dict[tuple[int, str], dict] = {}
    if "mlstm" in cfg.cells:
        print(f"\n{'prec':>5} {'B':>5} {'GEMM':>30} {'m x k x n':>22} {'count':>6} "
              f"{'TFLOP/s':>8}")
        for B in cfg.batch_sizes:
            gemms = step_gemms(H, E, T, B)
            for prec in cfg.precisions:
                rates = []
                for gm in gemms:
                    r = attempt(lambda: {"tflops": matmul_tflops(
                        gm.m, gm.k, gm.n, DTYPES[prec], device, timer, cfg.repeats,
                        a_t=gm.a_t, b_t=gm.b_t)}, device)
                    res.add("gemms", {"precision": prec, "batch_size": B, **asdict(gm), **r})
                    rates.append(r.get("tflops"))
                    shape = f"{gm.m}x{gm.k}x{gm.n}"
                    print(f"{prec:>5} {B:>5} {gm.name[:30]:>30} {shape:>22} {gm.count:>6} "
                          + (f"{r['tflops']:>8.1f}" if "tflops" in r else r["error"]),
                          flush=True)
                if all(x for x in rates):
                    c = {"batch_size": B, "precision": prec, **gemm_ceiling(gemms, rates, B * T)}
                    ceilings[(B, prec)] = c
                    res.add("ceiling", c)
                    print(f"  GEMM ceiling {prec} B={B}: {c['chars_per_s']:,.0f} chars/s "
                          f"({c['tflops']:.1f} TFLOP/s)", flush=True)

    # 3-5. the training step, every variant
    print(f"\n{'cell':>6} {'impl':>20} {'B':>5} {'prec':>5} {'chars/s':>11} {'TFLOP/s':>8} "
          f"{'of peak':>8} {'of GEMMs':>8} {'GiB peak/est':>12}")
    for v in variants(cfg, device):
        for B in cfg.batch_sizes:
            for prec in cfg.precisions:
                r = attempt(lambda: train_step_rate(v, H, E, B, T, prec, device, timer,
                                                    cfg.steps, cfg.warmup, cfg.repeats),
                            device)
                row = {"cell": v.cell, "impl": v.label, "hidden_size": H, "batch_size": B,
                       "seq_len": T, "precision": prec, **r,
                       "estimated_memory_gib": estimated_memory(v, H, E, B, T, prec, device)
                       / 2 ** 30}
                if "tflops" in r and prec in peak:
                    row["fraction_of_peak"] = r["tflops"] / peak[prec]
                if "tflops" in r and v.cell == "mlstm" and (B, prec) in ceilings:
                    row["fraction_of_gemm_ceiling"] = \
                        r["chars_per_s"] / ceilings[(B, prec)]["chars_per_s"]
                res.add("train", row)
                print(_row_line(row), flush=True)
    _ratios(res, cfg)
    res.save()
    return 0


def _row_line(r: dict) -> str:
    head = f"{r['cell']:>6} {r['impl']:>20} {r['batch_size']:>5} {r['precision']:>5}"
    if "error" in r:
        return f"{head} {r['error']}"

    def pct(key):
        return f"{r[key]:>8.1%}" if key in r else f"{'-':>8}"

    mem = (f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-") + \
        f"/{r['estimated_memory_gib']:.1f}"
    return (f"{head} {r['chars_per_s']:>11,.0f} {r['tflops']:>8.1f} {pct('fraction_of_peak')} "
            f"{pct('fraction_of_gemm_ceiling')} {mem:>12}")


def _ratios(res: Results, cfg: BenchGpuConfig) -> None:
    """Each mLSTM variant against cuDNN's LSTM (per FLOP) and the reference recurrence (chars/s)
    at the same batch and precision, and bf16 over fp32 of the first fused variant."""
    rows = [r for r in res.data["train"] if "tflops" in r]
    by = {(r["impl"], r["batch_size"], r["precision"]): r for r in rows}
    print(f"\n{'impl':>20} {'B':>5} {'prec':>5} {'vs cuDNN/FLOP':>13} {'vs reference':>12}")
    for r in rows:
        if r["cell"] != "mlstm":
            continue
        lstm = by.get(("cudnn", r["batch_size"], r["precision"]))
        ref = by.get(("reference", r["batch_size"], r["precision"]))
        r["vs_cudnn_lstm_per_flop"] = r["tflops"] / lstm["tflops"] if lstm else None
        r["vs_reference"] = r["chars_per_s"] / ref["chars_per_s"] if ref else None
        a = f"{r['vs_cudnn_lstm_per_flop']:.3f}" if lstm else "-"
        b = f"{r['vs_reference']:.2f}x" if ref else "-"
        print(f"{r['impl']:>20} {r['batch_size']:>5} {r['precision']:>5} {a:>13} {b:>12}")
    fused = next((r["impl"] for r in rows if r["impl"].startswith("fused")), None)
    for B in cfg.batch_sizes:
        f32, b16 = by.get((fused, B, "fp32")), by.get((fused, B, "bf16"))
        if f32 and b16:
            ratio = b16["chars_per_s"] / f32["chars_per_s"]
            res.data.setdefault("bf16_over_fp32", {})[str(B)] = ratio
            print(f"mLSTM ({fused}) B={B}: bf16 / fp32 = {ratio:.2f}x")


BENCH_GPU = Command(BenchGpuConfig, bench_gpu, description=__doc__.split("\n\n")[1])
