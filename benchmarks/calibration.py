"""Calibrating the scaling model from ``python -m benchmarks allreduce --json``: Horovod's overhead
over raw MPI per message size and the machine's alpha-beta link, read into a :class:`Calibration`
that :mod:`benchmarks.scaling_model` and :mod:`benchmarks.scaling_study` use.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from benchmarks.results import fit_alpha_beta
from hvd_lm.util.units import MIB


@dataclass
class Calibration:
    """Horovod's overhead over raw MPI measured on this machine (``bench allreduce``).

    Attributes:
        per_cycle_overhead_s: Horovod's extra time per allreduce over raw MPI for small messages
            (median over sizes <= 64 KiB), at the smallest cycle time measured, s. A synchronous
            loop pays max(cycle, overhead) per allreduce, so this includes up to that cycle.
        bandwidth_factor: the factor the model applies to the bandwidth term: max(1, measured).
        measured_bandwidth_ratio: median Horovod / MPI time over sizes >= 16 MiB (or, without
            such sizes, the ratio of the fitted alpha-beta slopes). Horovod calls the same
            ``MPI_Allreduce`` for a single tensor, so this is 1 up to noise.
        latency_label / horovod_label / mpi_label: the configurations compared.
        fits: alpha-beta fits (:func:`fit_alpha_beta`) of the compared configurations.
        per_cycle_overhead_range_s / bandwidth_ratio_range: the interquartile range (25th, 75th
            percentile) of the same quantity over every size and repeated launch: how much one
            noisy measurement could move the calibration.
        source: the bench JSON it came from.
    """

    per_cycle_overhead_s: float = 0.0
    bandwidth_factor: float = 1.0
    measured_bandwidth_ratio: float = 1.0
    latency_label: str = ""
    horovod_label: str = ""
    mpi_label: str = ""
    fits: dict = field(default_factory=dict)
    per_cycle_overhead_range_s: tuple = (0.0, 0.0)
    bandwidth_ratio_range: tuple = (1.0, 1.0)
    source: str = ""

    def bounds(self) -> tuple["Calibration", "Calibration"]:
        """The calibration at the low and the high end of both ranges (a cheap, a dear
        Horovod): the predictions' sensitivity to the measurement's noise."""
        lo_o, hi_o = self.per_cycle_overhead_range_s
        lo_r, hi_r = self.bandwidth_ratio_range
        return (replace(self, per_cycle_overhead_s=lo_o, measured_bandwidth_ratio=lo_r,
                        bandwidth_factor=max(1.0, lo_r)),
                replace(self, per_cycle_overhead_s=hi_o, measured_bandwidth_ratio=hi_r,
                        bandwidth_factor=max(1.0, hi_r)))


def calibrate_from_bench(data: dict, horovod_label: str = "hvd-mpi", mpi_label: str = "mpi4py",
                         latency_label: str | None = None, small_max: int = 64 * 1024,
                         large_min: int = 16 * MIB) -> Calibration:
    """Horovod's per-operation overhead and bandwidth factor from a ``bench allreduce`` result
    (the dict of its ``--json``), single-tensor records of the same run.

    ``latency_label`` defaults to the uncompressed, default-fusion ``horovod_label``
    configuration with the smallest ``cycle_time_ms`` (e.g. ``"hvd-mpi cycle=0.2ms"``): a
    synchronous allreduce waits for the background thread's next cycle, which would otherwise
    hide the overhead under the cycle time.

    Raises:
        ValueError: a configuration missing, or no common sizes in the needed ranges.
    """
    recs = [r for r in data["records"] if r["case"] == "single"]
    labels = {r["label"] for r in recs}
    if latency_label is None:
        cands = [r for r in recs if r["label"].split(" ")[0] == horovod_label
                 and "fusion" not in r["label"] and r.get("compression", "none") == "none"]
        if cands:
            latency_label = min(cands, key=lambda r: r.get("cycle_time_ms", 1.0))["label"]
    by = {lb: {r["size_bytes"]: r["time_s"] for r in recs if r["label"] == lb}
          for lb in (horovod_label, mpi_label, latency_label)}
    # every launch's time (median_over_repeats keeps them), for the spread
    reps = {lb: {r["size_bytes"]: r.get("time_s_repeats") or [r["time_s"]] for r in recs
                 if r["label"] == lb} for lb in (horovod_label, mpi_label, latency_label)}
    for lb in (horovod_label, mpi_label, latency_label):
        if not by.get(lb):
            raise ValueError(f"no single-tensor records for {lb!r}; present: {sorted(labels)}")
    small = [s for s in by[latency_label] if s <= small_max and s in by[mpi_label]]
    if not small:
        raise ValueError(f"no common sizes <= {small_max} bytes for {latency_label!r} and "
                         f"{mpi_label!r}")
    overhead = max(0.0, statistics.median([by[latency_label][s] - by[mpi_label][s] for s in small]))
    overhead_samples = [max(0.0, a - b) for s in small
                        for a, b in zip(reps[latency_label][s], reps[mpi_label][s])]
    common = sorted(set(by[horovod_label]) & set(by[mpi_label]))
    large = [s for s in common if s >= large_min]
    n = data["ranks"]
    fits = {}
    for key, lb in (("horovod", horovod_label), ("mpi", mpi_label)):
        with contextlib.suppress(ValueError):
            fits[key] = fit_alpha_beta(common, [by[lb][s] for s in common], n)
    if large:
        ratio = statistics.median([by[horovod_label][s] / by[mpi_label][s] for s in large])
        ratio_samples = [a / b for s in large
                         for a, b in zip(reps[horovod_label][s], reps[mpi_label][s])]
    elif len(fits) == 2:
        ratio = fits["horovod"]["slope_s_per_byte"] / fits["mpi"]["slope_s_per_byte"]
        ratio_samples = [ratio]
    else:
        raise ValueError(f"no sizes >= {large_min} bytes and no alpha-beta fits to compare")
    return Calibration(overhead, max(1.0, ratio), ratio, latency_label, horovod_label, mpi_label,
                       fits, _iqr(overhead_samples), _iqr(ratio_samples),
                       str(data.get("source", "")))


def _iqr(xs: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th) percentile of ``xs`` (both the value for one sample)."""
    lo, hi = np.percentile(xs, [25, 75])  # linear interpolation: statistics' "inclusive"
    return (float(lo), float(hi))
