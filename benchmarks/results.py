"""The ``python -m benchmarks allreduce`` results: records, their JSON file and the alpha-beta fit.

A record is one (configuration, case, size) measurement: ``label``, ``case`` (``single`` or
``grouped``), ``size_bytes``, ``time_s`` (mean seconds per allreduce, max over ranks), ``ranks``.
The fit is Hockney's alpha-beta model read as the ring allreduce (Thakur, Rabenseifner & Gropp
2005, "Optimization of collective communication operations in MPICH"):
``t = 2(n-1) alpha + 2(n-1)/n S / beta``. Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``):
``algbw = S / t``, ``busbw = algbw x 2(n-1)/n``, in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Sequence

import numpy as np

from hvd_lm.util.files import read_json
from hvd_lm.util.units import GB, MIB

#: Largest ``bench allreduce --json`` file read (a 128-rank sweep's records are a few MB).
BENCH_JSON_MAX_BYTES = 256 * MIB


def busbw_factor(n: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2(n-1)/n (n ranks)."""
    if n < 1:
        raise ValueError(f"rank count must be >= 1, got {n}")
    return 2 * (n - 1) / n


def load_bench_json(path: str | os.PathLike) -> dict:
    """Read a ``bench allreduce --json`` file and check it.

    Raises:
        ValueError: not such a file (missing keys, no records, non-positive times), not a
            regular file or over :data:`BENCH_JSON_MAX_BYTES` (FileRefused), naming it.
        FileNotFoundError: no such file.
    """
    data = read_json(path, BENCH_JSON_MAX_BYTES, "a bench allreduce --json file is a few MB")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a bench-allreduce JSON (not an object)")
    for key in ("ranks", "records"):
        if key not in data:
            raise ValueError(f"{path}: not a bench-allreduce JSON (no {key!r})")
    if not data["records"]:
        raise ValueError(f"{path}: no records")
    for r in data["records"]:
        missing = {"label", "case", "size_bytes", "time_s", "ranks"} - r.keys()
        if missing:
            raise ValueError(f"{path}: record without {sorted(missing)}: {r}")
        if not (r["time_s"] > 0 and r["size_bytes"] > 0):
            raise ValueError(f"{path}: non-positive time or size in {r}")
    return data


def fit_records(records: list[dict]) -> dict[str, dict]:
    """Alpha-beta fit per configuration label over its single-tensor records (see
    :func:`fit_alpha_beta`); labels with < 2 sizes, or whose times do not
    grow with size (noise), get none."""
    fits = {}
    for label in dict.fromkeys(r["label"] for r in records if r["case"] == "single"):
        rs = [r for r in records if r["case"] == "single" and r["label"] == label]
        if len({r["size_bytes"] for r in rs}) >= 2:
            try:
                fits[label] = fit_alpha_beta([r["size_bytes"] for r in rs],
                                             [r["time_s"] for r in rs], rs[0]["ranks"])
            except ValueError as e:  # e.g. noise: times not growing with size
                print(f"  no alpha-beta fit for {label}: {e}", file=sys.stderr)
    return fits


def derive(records: list[dict]) -> None:
    """Add ``algbw_GBps`` and ``busbw_GBps`` (nccl-tests' definitions) to every record."""
    for r in records:
        r["algbw_GBps"] = r["size_bytes"] / r["time_s"] / GB
        r["busbw_GBps"] = r["algbw_GBps"] * busbw_factor(r["ranks"])


def ratios_to_mpi(records: list[dict], reference: str = "mpi4py") -> list[dict]:
    """Per single-tensor size and non-reference label: time / the reference's time at that size."""
    ref = {r["size_bytes"]: r["time_s"] for r in records
           if r["case"] == "single" and r["label"] == reference}
    return [{"label": r["label"], "size_bytes": r["size_bytes"],
             "time_ratio": r["time_s"] / ref[r["size_bytes"]]} for r in records
            if r["case"] == "single" and r["label"] != reference and r["size_bytes"] in ref]


def median_over_repeats(records: list[dict]) -> list[dict]:
    """One record per (label, case, size, group, mode): the median ``time_s`` over repeated
    launches, all of them kept in ``time_s_repeats``."""
    out: dict[tuple, dict] = {}
    for r in records:
        key = (r["label"], r["case"], r["size_bytes"], r.get("group"), r.get("mode"))
        out.setdefault(key, dict(r, time_s_repeats=[]))["time_s_repeats"].append(r["time_s"])
    for r in out.values():
        r["time_s"] = statistics.median(r["time_s_repeats"])
    return list(out.values())


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], n: int,
                   intercept_s: float | None = None) -> dict:
    """Least-squares fit of t = a + b S to allreduce times, weighted by 1/t (relative errors, so
    small sizes fix a and large ones b), read as the ring model a = 2(n-1) alpha,
    b = 2(n-1)/n / beta (Hockney; Thakur et al. 2005). With ``intercept_s`` the intercept is
    that measured time (e.g. of a 32-byte allreduce: alpha where it is defined) and only b is
    fitted, to the times less it.

    Returns:
        ``intercept_s`` (a), ``slope_s_per_byte`` (b), ``alpha_s``, ``beta_GBps``,
        ``max_rel_error`` of the fit.

    Raises:
        ValueError: fewer than 2 distinct sizes (1 with ``intercept_s``), a non-positive time or
            ``intercept_s``, or n < 2.
    """
    s, t = np.asarray(sizes, float), np.asarray(times, float)
    if n < 2:
        raise ValueError(f"an allreduce fit needs >= 2 ranks, got {n}")
    need = 2 if intercept_s is None else 1
    if len(set(s.tolist())) < need or len(s) != len(t):
        raise ValueError(f"need times at >= {need} distinct size(s)")
    if (t <= 0).any():
        raise ValueError("times must be > 0 s")
    if intercept_s is not None:
        if not intercept_s > 0:
            raise ValueError(f"intercept must be > 0 s, got {intercept_s}")
        a = float(intercept_s)  # min sum(((a + b S - t) / t)^2) over b alone
        b = float(np.sum(s * (t - a) / t ** 2) / np.sum((s / t) ** 2))
    else:
        A = np.stack([np.ones_like(s), s], 1) / t[:, None]
        (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if a < 0:  # latency below resolution: fit through the origin
        a, b = 0.0, float(np.sum(s / t) / np.sum((s / t) ** 2))
    if b <= 0:
        raise ValueError("fitted bandwidth term is not positive (times do not grow with size)")
    pred = a + b * s
    return {"intercept_s": float(a), "slope_s_per_byte": float(b),
            "alpha_s": float(a) / (2 * (n - 1)), "beta_GBps": 2 * (n - 1) / n / float(b) / GB,
            "max_rel_error": float(np.max(np.abs(pred - t) / t)), "ranks": n}
