"""Model FLOP utilisation (MFU): the model's achieved FLOP rate against the device's peak.

The achieved rate of one rank is its characters per second times the model's FLOPs per character
(:meth:`hvd_lm.model.lm.LanguageModel.flops_per_char`: forward + backward matmuls, 6 x the
multiply-adds, the convention of Kaplan et al. 2020 and of torchtitan / Megatron-LM's MFU),
``tflops = chars_per_s_per_rank x flops_per_char / 1e12``; MFU is that over the peak of one
device, ``mfu = tflops / peak_tflops`` (Chowdhery et al. 2022, PaLM, appendix B).

The peak (:func:`device_peak`), in this order:

1. ``--peak-tflops`` when given (a GPU this table lacks, or another convention);
2. on CUDA, the **published dense peak** of the card (:data:`GPU_PEAKS`, keyed by a substring of
   ``torch.cuda.get_device_name``; each row names its NVIDIA datasheet) in the column of the
   run's precision: ``bf16`` and ``fp16`` autocast run their matmuls in that type; ``fp32`` runs
   them on TF32 tensor cores only when torch allows it (``torch.backends.cuda.matmul.allow_tf32``,
   i.e. ``torch.set_float32_matmul_precision("high")``; off by default since torch 1.12, and
   hvd_lm never turns it on), so ``fp32`` is compared with the TF32 column then and with the
   plain FP32 column otherwise. Datasheets print the tensor-core figures "with sparsity"
   (2:4 structured sparsity, which dense training does not use): the table holds half of them,
   the dense rate;
3. otherwise (a CPU, a GPU the table lacks, or a column the card has no figure for: bf16 on a
   V100) a **measured** rate: on a GPU the best of 3 ``torch.mm`` of 4096^3 in the matmul dtype;
   on a CPU the best of 5 of 1024^3 with the run's threads, **measured once per machine** and
   kept in :func:`peak_cache_path` (keyed by host, CPU model, cores, torch, dtype and threads),
   so the MFU is relative to what this machine's BLAS reaches with those threads (what
   ``python -m benchmarks train`` calls the matmul peak) and comparable across restarts, whatever
   load the machine has at each start; a run that reaches more than the kept figure raises it
   (:func:`rate_against`), so MFU stays at or below 1. A cache that is not a regular JSON file
   of peaks within :data:`PEAK_CACHE_MAX_BYTES` (a FIFO, a device, a damaged or huge file) is
   never opened or read past that size: the peak is measured again with one warning naming the
   file, and the cache rewritten (atomically: a link is replaced, never written through).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hvd_lm.options.command import error_text
from hvd_lm.util.atomic import write_text
from hvd_lm.util.files import FileRefused, read_json, shown

#: Published dense peaks, TFLOP/s: (name substring, fp32, tf32, fp16, bf16, source). Matched in
#: order, case-insensitively, against ``torch.cuda.get_device_name()`` (e.g. "NVIDIA H100 80GB
#: HBM3", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"). None: the card has no such unit.
GPU_PEAKS: list[tuple[str, float, float | None, float, float | None, str]] = [
    ("H100 NVL", 60.0, 417.5, 835.5, 835.5,
     "NVIDIA H100 datasheet, H100 NVL (TF32 835, BF16/FP16 1,671 with sparsity; halved)"),
    ("H100 PCIe", 51.0, 378.0, 756.5, 756.5,
     "NVIDIA H100 datasheet, H100 PCIe (TF32 756, BF16/FP16 1,513 with sparsity; halved)"),
    ("H100", 67.0, 494.5, 989.5, 989.5,
     "NVIDIA H100 datasheet, H100 SXM (TF32 989, BF16/FP16 1,979 with sparsity; halved)"),
    ("H200 NVL", 60.0, 417.5, 835.5, 835.5,
     "NVIDIA H200 datasheet, H200 NVL (TF32 835, BF16/FP16 1,671 with sparsity; halved)"),
    ("H200", 67.0, 494.5, 989.5, 989.5,
     "NVIDIA H200 datasheet, H200 SXM (TF32 989, BF16/FP16 1,979 with sparsity; halved)"),
    ("A100", 19.5, 156.0, 312.0, 312.0,
     "NVIDIA A100 datasheet (FP32 19.5; TF32 156, BF16/FP16 312 dense)"),
    ("V100S", 16.4, None, 130.0, None,
     "NVIDIA V100S datasheet (single precision 16.4, tensor performance 130)"),
    ("V100-PCIE", 14.0, None, 112.0, None,
     "NVIDIA Tesla V100 datasheet, PCIe (single precision 14, tensor performance 112)"),
    ("V100", 15.7, None, 125.0, None,
     "NVIDIA Tesla V100 datasheet, SXM2 (single precision 15.7, tensor performance 125)"),
]
_COLUMNS = {"fp32": 1, "tf32": 2, "fp16": 3, "bf16": 4}


@dataclass(frozen=True)
class Peak:
    """One device's peak FLOP rate: ``tflops`` (TFLOP/s) and where it comes from (``source``:
    ``--peak-tflops``, a datasheet row and column, or the matmul measured)."""

    tflops: float
    source: str
    key: str | None = None  # a CPU peak kept per machine: its key in peak_cache_path()


#: Largest peak cache read (a few hundred bytes per machine x dtype x threads).
PEAK_CACHE_MAX_BYTES = 1 << 20


def peak_cache_path() -> Path:
    """Where measured CPU peaks are kept: ``$XDG_CACHE_HOME/hvd_lm/cpu_peaks.json`` (default
    ``~/.cache``); delete it to measure again."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hvd_lm" / "cpu_peaks.json"


def _machine_key(dtype: torch.dtype, threads: int) -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f
                      if ln.startswith("model name")), model)
    return (f"{socket.gethostname()} | {model} | {os.cpu_count()} cores | torch "
            f"{torch.__version__} | {str(dtype)[6:]} | {threads} thread(s)")


def _kept_peaks(path: Path, warn: bool = False) -> dict[str, float]:
    """The kept peaks (GFLOP/s by key); {} when absent or not such a file: a FIFO or a device is
    never opened, a file over :data:`PEAK_CACHE_MAX_BYTES` never read
    (:func:`hvd_lm.util.files.read_json`), and with ``warn`` one warning on stderr names a bad
    cache (it is measured again and rewritten)."""
    try:
        data = read_json(path, PEAK_CACHE_MAX_BYTES, "the CPU peak cache is a small JSON file "
                         "(hvd_lm.model.mfu.PEAK_CACHE_MAX_BYTES)")
        if not isinstance(data, dict):
            raise FileRefused(f"{shown(path)}: a JSON {type(data).__name__}, not an object of "
                              "peaks")
    except FileNotFoundError:
        return {}
    except (OSError, FileRefused) as e:
        if warn:
            print(f"warning: {error_text(e)}; measuring the CPU peak again (the cache is "
                  "rewritten)", file=sys.stderr)
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e12}


def _keep_peak(key: str, gflops: float) -> None:
    path = peak_cache_path()
    kept = _kept_peaks(path)
    kept[key] = gflops
    with contextlib.suppress(OSError):  # a read-only home: measured again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(kept, indent=1, sort_keys=True) + "\n")


def cpu_peak(dtype: torch.dtype, threads: int) -> Peak:
    """This machine's CPU matmul peak for ``dtype`` and ``threads``: kept from an earlier
    measurement, else the best of 5 ``torch.mm`` of 1024^3 measured now and kept."""
    key = _machine_key(dtype, threads)
    gflops = _kept_peaks(peak_cache_path(), warn=True).get(key)
    if gflops is None:
        gflops = matmul_gflops(1024, repeats=5, threads=threads, dtype=dtype)
        _keep_peak(key, gflops)
    return Peak(gflops / 1e3, f"measured: {str(dtype)[6:]} torch.mm 1024^3 on the CPU, "
                f"{threads} thread(s), best of 5, once on this machine (kept in "
                f"{peak_cache_path()})", key)


def matmul_gflops(n: int = 2048, repeats: int = 5, threads: int = 1, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> float:
    """Best-of-``repeats`` ``torch.mm`` rate for n x n x n (2 n^3 FLOPs) in ``dtype`` on
    ``device`` (CPU with ``threads`` threads), GFLOP/s, after one untimed call."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    times = []
    for _ in range(repeats + 1):  # the first call untimed
        t = time.perf_counter()
        torch.mm(a, b)
        if a.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    torch.set_num_threads(old)
    if a.is_cuda:
        del a, b
        torch.cuda.empty_cache()  # the workers a benchmark driver launches get the GPU's memory
    return 2 * n ** 3 / min(times[1:]) / 1e9


def matmul_column(precision: str, tf32: bool) -> str:
    """The peak column a run's matmuls use: ``bf16``/``fp16`` autocast as such; ``fp32`` is
    ``tf32`` when torch lets fp32 matmuls use TF32 (``tf32``), else ``fp32``."""
    return precision if precision in ("bf16", "fp16") else "tf32" if tf32 else "fp32"


def published_peak(device_name: str, column: str) -> Peak | None:
    """The published dense peak of the card named ``device_name`` (as
    ``torch.cuda.get_device_name`` gives it) in ``column`` (fp32, tf32, fp16, bf16), or None when
    :data:`GPU_PEAKS` has no row for it or no figure in that column (``tf32`` falls back to the
    card's ``fp32`` on a card without TF32, V100: it runs fp32 matmuls as such)."""
    name = device_name.lower()
    for row in GPU_PEAKS:
        if row[0].lower() in name:
            value, used = row[_COLUMNS[column]], column
            if value is None and column == "tf32":
                value, used = row[_COLUMNS["fp32"]], "fp32"
            return None if value is None else Peak(value, f"{row[5]}: {used} dense, {device_name}")
    return None


def device_peak(device: torch.device, precision: str, override: float | None = None,
                threads: int = 1) -> Peak:
    """The peak one rank's MFU is computed against (module docstring: ``override``, the
    published figure of the CUDA card, or a matmul measured here: on a CPU once per machine).

    Args:
        device: the rank's device; precision: ``run.precision`` (fp32, fp16, bf16);
        override: ``--peak-tflops``; threads: the CPU threads the rank trains with.
    """
    if override:
        return Peak(float(override), "--peak-tflops")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = published_peak(name, matmul_column(
            precision, torch.backends.cuda.matmul.allow_tf32))
        if found is not None:
            return found
        rate = matmul_gflops(4096, repeats=3, device=str(device), dtype=dtype)
        return Peak(rate / 1e3, f"measured: {str(dtype)[6:]} torch.mm 4096^3 on {name} "
                    "(no published figure here; --peak-tflops sets one)")
    return cpu_peak(dtype, threads)


def rate_against(chars_per_s_per_rank: float, flops_per_char: float, peak: Peak
                 ) -> tuple[dict[str, float | None], Peak]:
    """``{"tflops": achieved TFLOP/s of one rank, "mfu": that / peak.tflops}`` (module
    docstring; ``mfu`` None for a zero peak), and the peak to use from now on: a kept CPU peak
    that the run exceeded (it was measured under load) is raised to the rate reached, and kept
    so, so that MFU never reads above 1."""
    tflops = chars_per_s_per_rank * flops_per_char / 1e12
    if peak.key is not None and tflops > peak.tflops:
        _keep_peak(peak.key, tflops * 1e3)
        peak = Peak(tflops, f"{peak.source.split(' (kept in')[0]}, raised to a rate a "
                    f"training step reached (kept in {peak_cache_path()})", peak.key)
    return {"tflops": tflops, "mfu": tflops / peak.tflops if peak.tflops else None}, peak
