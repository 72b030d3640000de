"""``python -m benchmarks scaling-report``: s/iter, speedup and efficiency against GPU count from a
sweep's runs.

Reads each run's ``metrics.jsonl`` (written by rank 0 of ``hvd-lm train``): the world size and
global batch from its ``start`` record(s) and the median ``step_time`` (s/iter) of its ``train``
records, skipping the first ``--skip`` records after every start (Horovod's first steps include
tensor negotiation, buffer allocation and cache warm-up). A resumed run has several starts; all must
have the same world size.

Speedup is the ratio of training throughput in sequences per second against the baseline run:

    speedup(N) = (B_N / t_N) / (B_1 / t_1)      (B = global batch, t = s/iter)

which, for weak scaling (per-GPU batch fixed, B_N = N x B_1, as in the reference's table and as
``hvd-lm launch --sweep`` renders it), is ``N x t_1 / t_N``; efficiency = speedup / N. The
reference's table (Puri et al. 2018, "Distributed data parallel scaling") is in :data:`REFERENCE`;
``--reference ib`` (or ``no-ib``, ``8192-ib``) prints and plots it beside the measured numbers.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import matplotlib

from benchmarks.harness import medians, print_table, save_json
from hvd_lm.options import Command, option
from hvd_lm.train.log import iter_metrics
from hvd_lm.util.files import shown

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

#: The talk's scaling table, GPUs -> (s/iter, speedup as printed). Columns: 4096-d mLSTM without
#: and with InfiniBand, 8192-d mLSTM with InfiniBand (weak scaling, DGX-1 nodes of 8 V100s).
REFERENCE: dict[str, dict[int, tuple[float, float]]] = {
    "no-ib": {1: (0.81, 1.0), 8: (0.85, 7.6), 16: (1.09, 14.3), 32: (1.11, 23.4),
              64: (1.13, 55.7), 128: (1.12, 92.6)},
    "ib": {1: (0.81, 1.0), 8: (0.85, 7.6), 16: (0.91, 13.6), 32: (0.91, 27.2),
           64: (0.93, 55.7), 128: (0.91, 109.0)},
    "8192-ib": {1: (2.01, 1.0), 8: (2.02, 7.9), 16: (2.08, 15.5), 32: (2.05, 31.4),
                64: (2.10, 61.3), 128: (2.13, 120.8)},
}
REFERENCE_LABEL = {"no-ib": "Puri et al. 2018, 4096-d, w/o InfiniBand",
                   "ib": "Puri et al. 2018, 4096-d, w/ InfiniBand",
                   "8192-ib": "Puri et al. 2018, 8192-d, w/ InfiniBand"}


@dataclass
class RunTiming:
    """One run's timing.

    Attributes:
        run: the run directory (or metrics file) read.
        gpus: world size (ranks = GPUs).
        global_batch: sequences per optimizer step over all ranks.
        step_time: median seconds per optimizer step (s/iter) over the records used.
        records: train records used (after skipping warm-up).
        chars_per_s: median training throughput over all ranks, bytes/s (None if not logged).
        compute_time_max: median of the records' ``compute_time_max``: seconds per step outside
            the allreduce wait of each step's slowest rank (None if not logged).
    """

    run: str
    gpus: int
    global_batch: int
    step_time: float
    records: int
    chars_per_s: float | None
    compute_time_max: float | None = None


@dataclass
class ScalingRow:
    """One row of the report: a run against the baseline (speedup 1x)."""

    gpus: int
    step_time: float
    speedup: float
    efficiency: float
    chars_per_s: float | None
    run: str
    reference_step_time: float | None = None
    reference_speedup: float | None = None


def read_run(path: str | Path, skip: int = 1) -> RunTiming:
    """Timing of one run from its metrics.jsonl.

    Args:
        path: run directory (its ``metrics.jsonl`` is read) or metrics.jsonl file.
        skip: train records to drop after each ``start`` record (warm-up).

    Raises:
        FileNotFoundError: no metrics file (neither ``path/metrics.jsonl`` nor ``path``).
        hvd_lm.util.files.FileRefused: the metrics file is not a regular file (a FIFO, a
            device), or is larger than :data:`hvd_lm.train.log.METRICS_MAX_BYTES` (read
            streamed: memory of one record, whatever its size).
        ValueError: malformed records, no start record, starts with different world sizes, or no
            train record left after skipping.
    """
    f = Path(path) / "metrics.jsonl" if Path(path).is_dir() else Path(path)
    if not f.exists():  # (a FIFO or a device is named by the reader: hvd_lm.train.log)
        raise FileNotFoundError(f"{shown(path)}: no metrics.jsonl (is it an hvd-lm train run "
                                "directory?)")
    starts, used, since_start = [], [], 0
    for rec in iter_metrics(f):
        kind = rec.get("kind")
        if kind == "start":
            starts.append(rec)
            since_start = 0
        elif kind == "train" and rec.get("step_time") is not None:
            since_start += 1
            if since_start > skip:
                used.append({k: rec.get(k) for k in ("step_time", "chars_per_s",
                                                     "compute_time_max")})
    if not starts:
        raise ValueError(f"{f}: no 'start' record, so no world size")
    sizes = {int(s["world_size"]) for s in starts}
    if len(sizes) != 1:
        raise ValueError(f"{f}: the run was (re)started with different world sizes {sorted(sizes)}")
    if not used:
        raise ValueError(f"{f}: no 'train' record with step_time left after skipping the first "
                         f"{skip} after each start (train longer, log more often, or lower --skip)")
    gpus = sizes.pop()
    gb = int(starts[0].get("global_batch") or gpus)
    m = medians(used, ("step_time", "chars_per_s", "compute_time_max"))
    return RunTiming(str(path), gpus, gb, m["step_time"], len(used), m["chars_per_s"],
                     m["compute_time_max"])


def scaling_rows(runs: list[RunTiming], baseline: str = "one",
                 reference: str | None = None) -> tuple[list[ScalingRow], str]:
    """Speedup and efficiency of each run against the baseline; returns (rows by GPUs, note).

    Args:
        baseline: ``"one"`` requires a 1-GPU run; ``"smallest"`` uses the run with the fewest GPUs
            (N0) and reports speedup relative to it (1x at N0; efficiency = speedup / (N / N0)).
        reference: a key of :data:`REFERENCE` to put the talk's numbers beside each row.

    Raises:
        ValueError: no runs, two runs with the same world size, or no 1-GPU run with
            ``baseline="one"``.
    """
    if not runs:
        raise ValueError("no runs given")
    by_gpus: dict[int, RunTiming] = {}
    for r in runs:
        if r.gpus in by_gpus:
            raise ValueError(f"two runs with world size {r.gpus}: {by_gpus[r.gpus].run} and "
                             f"{r.run}")
        by_gpus[r.gpus] = r
    if baseline not in ("one", "smallest"):
        raise ValueError(f"baseline must be 'one' or 'smallest', got {baseline!r}")
    if reference is not None and reference not in REFERENCE:
        raise ValueError(f"reference must be one of {list(REFERENCE)}, got {reference!r}")
    smallest = min(by_gpus)
    if baseline == "one" and 1 not in by_gpus:
        raise ValueError(f"no 1-GPU baseline run among world sizes {sorted(by_gpus)}: add a 1-GPU "
                         f"run, or use --baseline smallest (speedup relative to {smallest} GPUs)")
    base = by_gpus[1 if baseline == "one" else smallest]
    note = (f"baseline: {base.gpus} GPU{'s' * (base.gpus > 1)} ({base.run})"
            + ("" if base.gpus == 1 else
               f"; no 1-GPU run, so speedup is relative to {base.gpus} GPUs, not to one"))
    base_rate = base.global_batch / base.step_time
    rows = []
    for g, r in sorted(by_gpus.items()):
        speedup = (r.global_batch / r.step_time) / base_rate
        ref = REFERENCE[reference].get(g) if reference else None
        rows.append(ScalingRow(g, r.step_time, speedup, speedup / (g / base.gpus), r.chars_per_s,
                               r.run, ref[0] if ref else None, ref[1] if ref else None))
    return rows, note


def print_rows(rows: list[ScalingRow], reference: str | None = None) -> None:
    """The report in the talk's form: GPUs, s/iter, speedup (+ efficiency, throughput; the
    talk's s/iter and speedup with ``reference``), and the run."""
    talk = [("talk s/iter", ">11.2f", lambda r: r.reference_step_time),
            ("talk speed", ">10", lambda r: None if r.reference_speedup is None
             else f"{r.reference_speedup:.1f}x")] if reference else []
    print_table(rows, [
        ("GPUs", ">5", lambda r: r.gpus), ("s/iter", ">8.3f", lambda r: r.step_time),
        ("speedup", ">8", lambda r: f"{r.speedup:.1f}x"),
        ("efficiency", ">10.1%", lambda r: r.efficiency),
        ("chars/s", ">11.4g", lambda r: r.chars_per_s), *talk, (" run", "", lambda r: " " + r.run)])


def plot(rows: list[ScalingRow], path: str | Path, reference: str | None = None,
         title: str = "hvd_lm weak scaling") -> Path:
    """Write a PNG with three panels against GPUs (log2 axis): s/iter, speedup (with the ideal
    line, and the talk's column when ``reference`` is set) and efficiency. Uses matplotlib's Agg
    backend (no display needed)."""
    gpus = [r.gpus for r in rows]
    base = gpus[0]
    fig, (ax_t, ax_s, ax_e) = plt.subplots(1, 3, figsize=(13, 4))
    ax_t.set_ylabel("s/iter")
    ax_s.plot(gpus, [g / base for g in gpus], "k--", lw=1, label="ideal (linear)")
    ax_s.set_ylabel(f"speedup vs {base} GPU{'s' * (base > 1)}")
    ax_s.set_yscale("log", base=2)  # log-log: ideal scaling is the diagonal
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax_s.get_yaxis().set_major_formatter(plain)
    ax_e.set_ylabel("efficiency (%)")
    ax_e.set_ylim(0, 110)
    ref = sorted(REFERENCE[reference].items()) if reference else []
    ticks = sorted(set(gpus) | {g for g, _ in ref})
    for ax, measured, talk in (
            (ax_t, [r.step_time for r in rows], [t for _, (t, _) in ref]),
            (ax_s, [r.speedup for r in rows], [s for _, (_, s) in ref]),
            (ax_e, [100 * r.efficiency for r in rows], [100 * s / g for g, (_, s) in ref])):
        ax.plot(gpus, measured, "o-", label="measured")
        if reference:
            ax.plot([g for g, _ in ref], talk, "s:", label=REFERENCE_LABEL[reference])
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.get_xaxis().set_major_formatter(plain)
        ax.set_xlabel("GPUs (ranks)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_ylim(bottom=0)  # (after the lines: it ends autoscaling)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


@dataclass
class ScalingReportConfig:
    """Settings of ``python -m benchmarks scaling-report``."""

    runs: list[str] = option(default_factory=list, help="run directories (or metrics.jsonl "
                             "files), one per GPU count", positional=True, required=True,
                             metavar="RUN_DIR")
    skip: int = option(1, "warm-up train records to drop after each start record", ge=0)
    baseline: str = option("one", "speedup baseline: the 1-GPU run (error when missing) or the "
                           "smallest run", choices=("one", "smallest"))
    reference: Optional[str] = option(None, "show the talk's column beside the measurements "
                                      "(Puri et al. 2018)", choices=tuple(REFERENCE))
    plot: str = option("scaling.png", "PNG to write")
    write_plot: bool = option(True, "write the PNG (--no-plot: do not)", switch=False,
                              flag="--no-plot")
    json: Optional[str] = option(None, "also write the rows as JSON to this file ('-' = stdout "
                                 "only)")
    title: str = option("hvd_lm weak scaling", "plot title")


def report(args: ScalingReportConfig) -> int:
    """Print the table; write the PNG and JSON when asked.

    Raises:
        ValueError / FileNotFoundError: a run cannot be read (:func:`read_run`,
            :func:`scaling_rows`): exit 2 (the command's usage errors).
    """
    runs = [read_run(r, args.skip) for r in args.runs]
    rows, note = scaling_rows(runs, args.baseline, args.reference)
    payload = {"baseline_gpus": rows[0].gpus, "note": note,
               "reference": args.reference, "rows": [asdict(r) for r in rows]}
    if args.json == "-":
        print(json.dumps(payload, indent=2))
    else:
        print(note)
        print_rows(rows, args.reference)
        if args.json:
            save_json(args.json, payload)
            print(f"wrote {args.json}")
    if args.write_plot:
        out = plot(rows, args.plot, args.reference, args.title)
        print(f"wrote {out}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


SCALING_REPORT = Command(
    ScalingReportConfig, report, usage_errors=(ValueError, FileNotFoundError),
    description="s/iter, speedup (N x t1 / tN under weak scaling) and efficiency against GPU "
    "count, from the runs' metrics.jsonl files, as a table, PNG and JSON.")
