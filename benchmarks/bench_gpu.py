"""``python -m benchmarks gpu``: one GPU's ceilings and the LM's training step, side by side in one
run.

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
   preflight's estimate (:func:`estimated_memory`), the kernels one step launches (counted by
   ``torch.profiler``: the device's kernels on CUDA, :func:`benchmarks.profile_step.cpu_launches`
   on the CPU; also per time step, the step's count / T) and the host's time in one step
   (:func:`host_seconds`: what launching costs, which the device time hides when it is
   shorter);
4. the same for ``--cell lstm`` (``torch.nn.LSTM``, i.e. cuDNN) as the yardstick, and the
   mLSTM / cuDNN-LSTM ratio of achieved TFLOP/s at each shape;
5. the mLSTM once per ``--rnn-impl`` (fused, the one autograd Function per window of
   :mod:`hvd_lm.model.mlstm_fused`, and reference, the per-step loop) and, for fused, per
   ``--rnn-kernels`` and (on CUDA) per ``--cuda-graphs``, each over the reference at the same
   shape;
6. with ``--profile-steps N``, one ``torch.profiler`` window of the fastest mLSTM variant: its
   top kernels and the idle gaps between them (:mod:`benchmarks.profile_step`).

cuDNN's LSTM in fp32 is a fraction of a TF32 matmul peak, measured beside the others: PyTorch
lets cuDNN use TF32 by default but not its matmuls (:func:`benchmarks.ceilings.peak_key`).

Every measurement is attempted on its own: one that fails (out of memory, a kernel the
backend lacks, any exception) is recorded with its error and the run goes on; with ``--json``
the file is rewritten (atomically) after every measurement, so a run cut short keeps every
figure taken before. Timing: CUDA events around ``--steps`` steps after ``--warmup`` (medians
of ``--repeats``). ``--device cpu`` runs the same code on the CPU (small shapes: tests; the
figures then describe the CPU). Figures measured on GPUs: docs/gpu.md (from
``docs/results/gpu_h200*/``).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from benchmarks import profile_step
from benchmarks.ceilings import Timer, copy_gbps, gemm_ceiling, matmul_tflops, peak_key, step_gemms
from benchmarks.harness import lm_step, print_table, random_batches, rnn_impls, save_json
from hvd_lm import options as configlib
from hvd_lm.model import device as devices
from hvd_lm.model.config import KERNELS
from hvd_lm.model.lm import LanguageModel, ModelConfig, recurrence_label
from hvd_lm.model.mlstm_kernels import resolve
from hvd_lm.options import Command, option
from hvd_lm.train import memory
from hvd_lm.train.settings import TrainConfig
from hvd_lm.train.step import train_step

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class BenchGpuConfig:
    """``python -m benchmarks gpu``."""

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
    profile_steps: int = option(0, "then profile the fastest mLSTM variant over N steps: top "
                                "kernels and the gaps between them (0 = no profile)", ge=0)
    json: str = option("", "write the results here (rewritten after every measurement)")


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

    def model(self, H: int, E: int) -> ModelConfig:
        """The variant's LM of width H and byte embedding E."""
        return ModelConfig(cell=self.cell, hidden_size=H, embed_dim=E, rnn_impl=self.rnn_impl,
                           rnn_kernels=self.rnn_kernels, cuda_graphs=self.cuda_graphs)


def variants(cfg: BenchGpuConfig, device: torch.device) -> list[Variant]:
    """The variants to run: the LSTM once; the mLSTM per ``--rnn-impl`` and, fused, per
    ``--rnn-kernels`` (resolved for ``device``, duplicates dropped) and on CUDA per
    ``--cuda-graphs`` (graphs need CUDA: off elsewhere)."""
    kernels = [resolve(k, device) for k in cfg.rnn_kernels]
    graphs = cfg.cuda_graphs if device.type == "cuda" else [False]
    return [v for cell in cfg.cells for v in (
        [Variant(cell, *r) for r in rnn_impls(cfg.rnn_impls, kernels, graphs)]
        if cell == "mlstm" else [Variant(cell)])]


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

    Returns:
        ``step_s`` (median of ``repeats``; ``step_s_repeats`` each), ``chars_per_s``,
        ``flops_per_char``, ``tflops``, ``peak_memory_gib`` (None off CUDA),
        ``host_s_per_step`` (:func:`host_seconds`), ``kernels_per_step`` and
        ``kernels_per_time_step`` (None where the profiler cannot start).

    Raises:
        whatever the step raises (torch.cuda.OutOfMemoryError when the shape does not fit);
        :func:`bench_gpu` records it as that variant's error.
    """
    try:
        return _train_step_rate(v, H, E, B, T, precision, device, timer, steps, warmup,
                                repeats)
    finally:  # the measurement's frame is gone here (on success): its objects can be freed
        free_device_memory(device)


def build_step(v: Variant, H: int, E: int, B: int, T: int, precision: str,
               device: torch.device) -> tuple[LanguageModel, Callable[[], None]]:
    """The variant's model and one training step on random bytes (the loop's own step,
    :func:`hvd_lm.train.step.train_step`, without Horovod: forward, backward, clip, Adam)."""
    j = lm_step(v.model(H, E), device, precision, B)
    batch = random_batches(1, B, T, 1)[0]

    def step():
        j.state = train_step(j.model, j.opt, j.scaler, [batch], j.state, j.spec).state

    return j.model, step


def host_seconds(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall seconds the host spends in one ``step()`` call started on an idle device (a
    synchronize before it, none inside the timing): the cost of queuing the step's work, its
    launches' Python and driver time. Less than the step's time when the device is the
    bottleneck (the host runs ahead); the whole of it when the host is (eager launches of
    small kernels), or on the CPU, where the work is the host's."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def _train_step_rate(v: Variant, H: int, E: int, B: int, T: int, precision: str,
                     device: torch.device, timer: Callable, steps: int, warmup: int,
                     repeats: int) -> dict:
    model, step = build_step(v, H, E, B, T, precision, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    times = [timer(step, steps) / steps for _ in range(repeats)]
    s = statistics.median(times)
    chars = B * T / s
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    host = host_seconds(step, device, repeats)
    try:  # a profiler that cannot start (no CUPTI) costs the count, not the row
        kernels = profile_step.count_launches(step, device)
    except Exception:  # noqa: BLE001 - recorded as unknown
        kernels = None
    return {"step_s": s, "step_s_repeats": times, "chars_per_s": chars,
            "flops_per_char": model.flops_per_char(),
            "tflops": chars * model.flops_per_char() / 1e12, "peak_memory_gib": peak,
            "host_s_per_step": host, "kernels_per_step": kernels,
            "kernels_per_time_step": None if kernels is None else kernels / T}


def profile_fastest(res: "Results", cfg: BenchGpuConfig, device: torch.device) -> None:
    """``--profile-steps``: one profiler window (:mod:`benchmarks.profile_step`) of the
    fastest mLSTM row measured, printed and saved as the JSON's ``profile``."""
    rows = [r for r in res.data.get("train", []) if r["cell"] == "mlstm" and "chars_per_s" in r]
    if not rows:
        return
    r = max(rows, key=lambda r: r["chars_per_s"])
    v = next(v for v in variants(cfg, device) if v.cell == "mlstm" and v.label == r["impl"])
    label = f"{r['impl']} B={r['batch_size']} {r['precision']}"

    def run():
        _, step = build_step(v, cfg.hidden_size, cfg.embed_dim, r["batch_size"], cfg.seq_len,
                             r["precision"], device)
        for _ in range(max(cfg.warmup, 1)):
            step()
        return profile_step.profile_window(step, device, cfg.profile_steps)

    p = attempt(run, device)
    res.add("profile", {"variant": label, **p})
    if "error" in p:
        print(f"profile of {label}: {p['error']}", flush=True)
    else:
        profile_step.print_profile(p, label)


def estimated_memory(v: Variant, H: int, E: int, B: int, T: int, precision: str,
                     device: torch.device) -> int:
    """Bytes the preflight of ``hvd-lm train`` (:func:`hvd_lm.train.memory.step_memory`, one
    rank, Adam) estimates for this variant's step: recorded beside the measured peak so that a
    GPU run checks the estimate, the CUDA-graph pool included."""
    cfg = TrainConfig(model=v.model(H, E))
    cfg.data.batch_size, cfg.data.seq_len, cfg.run.precision = B, T, precision
    return memory.step_memory(cfg, device.type).total


# ---- the run -------------------------------------------------------------------------------------

class Results:
    """The benchmark's record, rewritten to ``path`` (atomically) after every measurement, so a
    run that stops early keeps what it measured."""

    def __init__(self, path: str, head: dict):
        self.path, self.data = path, {**head, "matmul": [], "gemms": [], "ceiling": [],
                                      "copy_GBps": None, "copy_error": None, "train": [],
                                      "profile": None}

    def add(self, section: str, record: dict | float) -> None:
        """Append ``record`` to ``section`` (or set it, for a scalar) and save."""
        listed = isinstance(self.data[section], list)
        self.data[section] = [*self.data[section], record] if listed else record
        self.save()

    def save(self) -> None:
        """Write the JSON (when a path was given)."""
        save_json(self.path, self.data)


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
    timer = timer or Timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    res = Results(cfg.json, {"device": name, "torch": torch.__version__,
                             "config": configlib.to_dict(cfg)})
    H, E, T = cfg.hidden_size, cfg.embed_dim, cfg.seq_len

    # 1. the card's ceilings
    peak: dict[str, float] = {}
    peaks = list(cfg.precisions)
    if device.type == "cuda" and "fp32" in cfg.precisions and "lstm" in cfg.cells:
        peaks.append("tf32")  # the yardstick cuDNN's fp32 LSTM may reach (ceilings.peak_key)
    n = cfg.matmul_size
    for prec in peaks:
        r = attempt(lambda: {"tflops": matmul_tflops(n, n, n, DTYPES.get(prec, torch.float32),
                                                     device, timer, cfg.repeats,
                                                     tf32=prec == "tf32")}, device)
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
    print()
    print_table([], TRAIN_COLUMNS)
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
                key = peak_key(v.cell, prec, peak)
                if "tflops" in r and key in peak:
                    row["fraction_of_peak"] = r["tflops"] / peak[key]
                    row["peak_precision"] = key
                if "tflops" in r and v.cell == "mlstm" and (B, prec) in ceilings:
                    row["fraction_of_gemm_ceiling"] = \
                        r["chars_per_s"] / ceilings[(B, prec)]["chars_per_s"]
                res.add("train", row)
                print_table([row], TRAIN_COLUMNS[:4] + [("", "", "error")] if "error" in row
                            else TRAIN_COLUMNS, header=False)
    _ratios(res, cfg)
    if cfg.profile_steps:
        profile_fastest(res, cfg, device)
    res.save()
    return 0


#: The training rows' table (:func:`benchmarks.harness.print_table`); a row whose measurement
#: failed prints the first four columns and its error.
TRAIN_COLUMNS = [
    ("cell", ">6", "cell"), ("impl", ">20", "impl"), ("B", ">5", "batch_size"),
    ("prec", ">5", "precision"), ("chars/s", ">11,.0f", "chars_per_s"),
    ("TFLOP/s", ">8.1f", "tflops"), ("of peak", ">8.1%", lambda r: r.get("fraction_of_peak")),
    ("of GEMMs", ">8.1%", lambda r: r.get("fraction_of_gemm_ceiling")),
    ("GiB peak/est", ">12", lambda r: ("-" if r["peak_memory_gib"] is None else
                                       f"{r['peak_memory_gib']:.1f}")
     + f"/{r['estimated_memory_gib']:.1f}"),
    ("kernels", ">8", "kernels_per_step"), ("per t", ">6.1f", "kernels_per_time_step"),
    ("host ms", ">8.1f", lambda r: 1e3 * r["host_s_per_step"])]


def _ratios(res: Results, cfg: BenchGpuConfig) -> None:
    """Each mLSTM variant against cuDNN's LSTM (per FLOP) and the reference recurrence (chars/s)
    at the same batch and precision, and bf16 over fp32 of the first fused variant."""
    rows = [r for r in res.data["train"] if "tflops" in r]
    by = {(r["impl"], r["batch_size"], r["precision"]): r for r in rows}
    mlstm = [r for r in rows if r["cell"] == "mlstm"]
    for r in mlstm:
        lstm = by.get(("cudnn", r["batch_size"], r["precision"]))
        ref = by.get(("reference", r["batch_size"], r["precision"]))
        r["vs_cudnn_lstm_per_flop"] = r["tflops"] / lstm["tflops"] if lstm else None
        r["vs_reference"] = r["chars_per_s"] / ref["chars_per_s"] if ref else None
    print()
    print_table(mlstm, [
        ("impl", ">20", "impl"), ("B", ">5", "batch_size"), ("prec", ">5", "precision"),
        ("vs cuDNN/FLOP", ">13.3f", "vs_cudnn_lstm_per_flop"),
        ("vs reference", ">12", lambda r: r["vs_reference"] and f"{r['vs_reference']:.2f}x")])
    fused = next((r["impl"] for r in rows if r["impl"].startswith("fused")), None)
    for B in cfg.batch_sizes:
        f32, b16 = by.get((fused, B, "fp32")), by.get((fused, B, "bf16"))
        if f32 and b16:
            ratio = b16["chars_per_s"] / f32["chars_per_s"]
            res.data.setdefault("bf16_over_fp32", {})[str(B)] = ratio
            print(f"mLSTM ({fused}) B={B}: bf16 / fp32 = {ratio:.2f}x")


BENCH_GPU = Command(BenchGpuConfig, bench_gpu, description=__doc__.split("\n\n")[1])
