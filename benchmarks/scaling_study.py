"""``python -m benchmarks scaling-model``: the alpha-beta model of :mod:`benchmarks.scaling_model`
checked against the reference talk and used to answer its questions.

* :func:`validate`: the model against the talk's published s/iter and speedup (Puri et al. 2018,
  "Distributed data parallel scaling", :data:`PUBLISHED`), with one constant, ``t_sync``,
  fitted on the 4096-d 8-GPU row (:func:`calibrate_sync_overhead`); :func:`plot_validation`.
* :func:`effective_inter_bandwidth`: the inter-node bandwidth the published IB rows imply.
* :func:`recommend`: settings (batch, fusion, cycle time, hierarchical allreduce, compression) at
  128 GPUs; :func:`onebit_study`: 1-bit Adam/LAMB against fp16 compression.
* The command: :data:`SCALING_MODEL` (:class:`ScalingModelConfig`, :func:`run`), calibrated by
  default from the shipped ``docs/results/allreduce_calibration.json``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import matplotlib

from benchmarks.calibration import Calibration, calibrate_from_bench
from benchmarks.harness import print_table, save_json
from benchmarks.results import load_bench_json
from benchmarks.scaling_model import (
    DGX1V_LINKS,
    PCIE3_X16_GBPS,
    V100_COPY_GBPS,
    Link,
    ScalingConfig,
    predict,
    step_time,
)
from benchmarks.scaling_report import REFERENCE
from hvd_lm import REPO_ROOT
from hvd_lm.comm.onebit_compression import DEFAULT_CHUNK
from hvd_lm.model.lm import mlstm_parameters
from hvd_lm.options import Command, option
from hvd_lm.util.units import MIB

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

# ---- validation against the reference talk ------------------------------------------------------

#: Puri et al. 2018 (the reference talk), "Distributed data parallel scaling": s/iter and their
#: speedup column, per GPU count; the numbers live once, in
#: :data:`benchmarks.scaling_report.REFERENCE`.
PUBLISHED = {
    "4096-d w/o IB": {"hidden_size": 4096, "inter": "10gbe", "rows": REFERENCE["no-ib"]},
    "4096-d w/ IB": {"hidden_size": 4096, "inter": "ib", "rows": REFERENCE["ib"]},
    "8192-d w/ IB": {"hidden_size": 8192, "inter": "ib", "rows": REFERENCE["8192-ib"]},
}


def reference_config(hidden_size: int, inter: str | Link, compute_time_s: float,
                     calibration: Calibration | None = None, sync_overhead_s: float = 0.0,
                     **overrides) -> ScalingConfig:
    """The reference's setup as modelled: mixed-precision training (fp16 gradients, 2 bytes per
    value on the wire), batch 256 per GPU (32k over 128 GPUs), 8 V100 per DGX-1V, NCCL flat ring,
    with Horovod's overhead (``calibration``) and defaults (128 MiB fusion, 1 ms cycle) on top.
    ``inter``: a :data:`DGX1V_LINKS` key or a :class:`Link`."""
    cal = calibration or Calibration()
    return ScalingConfig(**dict(
        compute_time_s=compute_time_s, params=mlstm_parameters(hidden_size), grad_bytes=2,
        compression="fp16", batch_per_gpu=256, ref_batch=256, gpus_per_node=8,
        intra=DGX1V_LINKS["nvlink"], inter=inter if isinstance(inter, Link) else DGX1V_LINKS[inter],
        algorithm="ring", per_cycle_overhead_s=cal.per_cycle_overhead_s,
        fusion_copy_GBps=V100_COPY_GBPS, bandwidth_factor=cal.bandwidth_factor,
        sync_overhead_s=sync_overhead_s) | overrides)


def calibrate_sync_overhead(calibration: Calibration | None = None,
                            column: str = "4096-d w/ IB", n: int = 8) -> float:
    """The one global fitted constant: the per-step multi-GPU overhead that makes the model meet
    the published s/iter of ``column`` at n GPUs (default: one DGX-1V, 4096-d), s (>= 0)."""
    col = PUBLISHED[column]
    cfg = reference_config(col["hidden_size"], col["inter"], col["rows"][1][0], calibration)
    return max(0.0, col["rows"][n][0] - step_time(cfg, n)["s_per_iter"])


def _sync(calibration: Calibration | None, sync_overhead_s: float | None) -> float:
    """``sync_overhead_s``, or when None :func:`calibrate_sync_overhead`'s."""
    return calibrate_sync_overhead(calibration) if sync_overhead_s is None else sync_overhead_s


def validate(calibration: Calibration | None = None, sync_overhead_s: float | None = None
             ) -> dict:
    """Predicted vs published for every row of the reference's scaling table.

    Two predictions per row: ``pure`` (published link figures and local calibration only, no
    fitted constant) and ``model`` (plus the global ``t_sync`` of :func:`calibrate_sync_overhead`).

    Returns:
        ``{"sync_overhead_s", "rows": [...], "summary": {column: max/mean abs error}}``.
    """
    sync_overhead_s = _sync(calibration, sync_overhead_s)
    rows = []
    for col, spec in PUBLISHED.items():
        t1 = spec["rows"][1][0]
        pure = reference_config(spec["hidden_size"], spec["inter"], t1, calibration)
        full = replace(pure, sync_overhead_s=sync_overhead_s)
        for n, (pub_t, pub_speed) in spec["rows"].items():
            p, f = step_time(pure, n), step_time(full, n)
            rows.append({"column": col, "gpus": n, "published_s_per_iter": pub_t,
                         "published_speedup": pub_speed,
                         "published_n_t1_over_tn": n * t1 / pub_t,
                         "pure_s_per_iter": p["s_per_iter"],
                         "pure_error": p["s_per_iter"] / pub_t - 1,
                         "model_s_per_iter": f["s_per_iter"],
                         "model_error": f["s_per_iter"] / pub_t - 1,
                         "model_speedup": f["speedup"], "model_efficiency": f["efficiency"],
                         "model_exposed_comm_s": f["exposed_comm_s"],
                         "gradient_MB": full.gradient_bytes / 1e6})
    summary = {}
    for col in PUBLISHED:
        multi = [r for r in rows if r["column"] == col and r["gpus"] > 1]
        errs = [abs(r["model_error"]) for r in multi]
        summary[col] = {"model_max_abs_error": max(errs), "model_mean_abs_error":
                        sum(errs) / len(errs),
                        "pure_max_abs_error": max(abs(r["pure_error"]) for r in multi)}
    return {"sync_overhead_s": sync_overhead_s, "rows": rows, "summary": summary,
            "links": {k: asdict(v) for k, v in DGX1V_LINKS.items()},
            "calibration": asdict(calibration or Calibration())}


def effective_inter_bandwidth(column: str = "4096-d w/ IB", n: int = 128,
                              sync_overhead_s: float = 0.0,
                              calibration: Calibration | None = None) -> float:
    """The inter-node bandwidth per node, GB/s, at which the model meets the published s/iter of
    ``column`` at n GPUs (bisection): what the 2018 software stack achieved, if the rest holds.

    Raises:
        ValueError: no bandwidth in (1e-3, 1e4) GB/s meets it.
    """
    col = PUBLISHED[column]
    target = col["rows"][n][0]
    base = reference_config(col["hidden_size"], col["inter"], col["rows"][1][0], calibration,
                            sync_overhead_s)

    def t(bw: float) -> float:
        return step_time(replace(base, inter=replace(base.inter, bandwidth_GBps=bw)),
                         n)["s_per_iter"]

    lo, hi = 1e-3, 1e4
    if not t(hi) <= target <= t(lo):
        raise ValueError(f"no inter-node bandwidth reproduces {target} s/iter at {n} GPUs")
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if t(mid) > target else (lo, mid)
    return math.sqrt(lo * hi)


def recommend(calibration: Calibration | None = None, sync_overhead_s: float | None = None,
              n: int = 128, published_speedup: float = 109.0) -> dict:
    """Settings at n GPUs (4096-d, DGX-1V with InfiniBand), each alone and combined, in two
    scenarios for the inter-node link: ``wire`` (4 x EDR at line rate) and ``as-published`` (the
    effective per-node bandwidth that reproduces the published 128-GPU s/iter,
    :func:`effective_inter_bandwidth`). Speedup is n t(1)/t(n) at the setting's own batch;
    ``throughput_vs_1gpu_ref`` is throughput relative to 1 GPU at batch 256."""
    sync_overhead_s = _sync(calibration, sync_overhead_s)
    bw_eff = effective_inter_bandwidth(sync_overhead_s=sync_overhead_s, calibration=calibration)
    fusion_default = 128 * MIB
    settings = {
        "reference (fp16 grads, ring, 128 MB fusion, 1 ms cycle, batch 256)": {},
        "fp32 gradients (no compression)": {"grad_bytes": 4, "compression": "none"},
        "no fusion (threshold 0)": {"fusion_threshold_bytes": 0},
        "fusion 64 MB": {"fusion_threshold_bytes": 64 * MIB},
        "cycle time 5 ms": {"cycle_time_s": 5e-3},
        "hierarchical allreduce (NCCL across nodes)": {"algorithm": "hierarchical"},
        "hierarchical allreduce (Horovod MPI variant, host staging)": {
            "algorithm": "hierarchical", "staging_GBps": PCIE3_X16_GBPS},
        "batch 512 per GPU (or 2 backward passes per step)": {"batch_per_gpu": 512},
        "batch 1024 per GPU (or 4 backward passes per step)": {"batch_per_gpu": 1024},
        "batch 512 + hierarchical (NCCL)": {"batch_per_gpu": 512, "algorithm": "hierarchical"},
        "(not a setting) without the multi-GPU overhead t_sync": {"sync_overhead_s": 0.0},
    }
    out = {"n": n, "published_speedup": published_speedup, "sync_overhead_s": sync_overhead_s,
           "effective_inter_GBps": bw_eff, "fusion_default_bytes": fusion_default, "rows": []}
    for scen, inter in (("wire", DGX1V_LINKS["ib"]),
                        ("as-published", replace(DGX1V_LINKS["ib"], bandwidth_GBps=bw_eff))):
        for name, kw in settings.items():
            cfg = reference_config(4096, inter, 0.81, calibration,
                                   **({"sync_overhead_s": sync_overhead_s} | kw))
            r = step_time(cfg, n)
            thr = n * (cfg.batch_per_gpu / 256) * 0.81 / r["s_per_iter"]
            out["rows"].append({"scenario": scen, "setting": name, "s_per_iter": r["s_per_iter"],
                                "speedup": r["speedup"], "efficiency": r["efficiency"],
                                "throughput_vs_1gpu_ref": thr,
                                "vs_published": r["speedup"] / published_speedup - 1,
                                "exposed_comm_s": r["exposed_comm_s"]})
    for row in out["rows"]:  # relative to the same scenario's reference row
        base = next(b for b in out["rows"] if b["scenario"] == row["scenario"])
        row["vs_reference_setting"] = row["speedup"] / base["speedup"] - 1
    return out


def onebit_study(calibration: Calibration | None = None, sync_overhead_s: float | None = None,
                 gpus: Sequence[int] = (1, 8, 16, 32, 64, 128), warmup_fraction: float = 0.15,
                 chunk: int = DEFAULT_CHUNK, n_recommend: int = 128) -> dict:
    """1-bit Adam / LAMB against the reference's fp16 gradient allreduce on the talk's columns
    (4096-d mLSTM, DGX-1V, batch 256 per GPU, t(1) = 0.81 s): ``10 GbE`` (the "w/o I.band" column,
    which the model reproduces: :func:`validate`), ``IB as published`` (InfiniBand at the effective
    per-node bandwidth behind their 0.91 s/iter at 128 GPUs) and ``IB wire`` (4 x EDR).

    Per column and GPU count: the fp16 model's speedup, the compressed phase's, and the
    end-to-end speedup with ``warmup_fraction`` of the steps in the warmup (fp16 gradient
    allreduce): ``t = f t_fp16 + (1 - f) t_onebit``. Then, at ``n_recommend`` GPUs, settings of
    compression x batch per GPU, and the recommended one: the fastest at the reference's batch
    (256 per GPU, 32k global: larger batches converged worse in the reference, see its LR table).

    Raises:
        ValueError: ``warmup_fraction`` outside [0, 1].
    """
    if not 0 <= warmup_fraction <= 1:
        raise ValueError(f"warmup fraction must be in [0, 1], got {warmup_fraction}")
    sync_overhead_s = _sync(calibration, sync_overhead_s)
    bw_eff = effective_inter_bandwidth(sync_overhead_s=sync_overhead_s, calibration=calibration)
    columns = {"10 GbE": DGX1V_LINKS["10gbe"],
               "IB as published": replace(DGX1V_LINKS["ib"], bandwidth_GBps=bw_eff),
               "IB wire": DGX1V_LINKS["ib"]}

    def cfg(inter: Link, **kw) -> ScalingConfig:
        return reference_config(4096, inter, 0.81, calibration, sync_overhead_s=sync_overhead_s,
                                onebit_chunk=chunk, **kw)

    def blended(fp16: dict, onebit: dict, n: int) -> float:
        t = warmup_fraction * fp16["s_per_iter"] + (1 - warmup_fraction) * onebit["s_per_iter"]
        return n * fp16["compute_s"] / t

    rows = []
    for col, inter in columns.items():
        for n in gpus:
            f16, one = step_time(cfg(inter), n), step_time(cfg(inter, compression="onebit"), n)
            rows.append({"column": col, "gpus": n, "fp16_s_per_iter": f16["s_per_iter"],
                         "fp16_speedup": f16["speedup"], "onebit_s_per_iter": one["s_per_iter"],
                         "onebit_comm_s": one["comm_s"], "fp16_comm_s": f16["exposed_comm_s"],
                         "onebit_speedup": one["speedup"],
                         "onebit_end_to_end_speedup": blended(f16, one, n)})
    settings = []
    for col, inter in columns.items():
        for comp in ("fp16", "onebit"):
            for batch in (256, 512, 1024):
                f16 = step_time(cfg(inter, batch_per_gpu=batch), n_recommend)
                r = step_time(cfg(inter, compression=comp, batch_per_gpu=batch), n_recommend)
                speed = r["speedup"] if comp == "fp16" else blended(f16, r, n_recommend)
                settings.append({"column": col, "compression": comp, "batch_per_gpu": batch,
                                 "global_batch": batch * n_recommend, "speedup": speed,
                                 "compressed_phase_speedup": r["speedup"]})
    recommended = {col: max((x for x in settings if x["column"] == col
                             and x["batch_per_gpu"] == 256), key=lambda x: x["speedup"])
                   for col in columns}
    return {"sync_overhead_s": sync_overhead_s, "effective_inter_GBps": bw_eff,
            "warmup_fraction": warmup_fraction, "chunk": chunk, "rows": rows,
            "settings": settings, "recommended": recommended, "n": n_recommend,
            "published": {"10 GbE": 92.6, "IB as published": 109.0, "IB wire": 109.0}}


def plot_validation(result: dict, path: str | Path) -> None:
    """PNG (matplotlib, Agg) of published vs predicted s/iter and speedup per column."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(PUBLISHED, ("tab:red", "tab:blue", "tab:green")))
    for col in PUBLISHED:
        rs = [r for r in result["rows"] if r["column"] == col]
        x = [r["gpus"] for r in rs]
        c = colors[col]
        axes[0].plot(x, [r["published_s_per_iter"] for r in rs], "o", color=c,
                     label=f"{col} published")
        axes[0].plot(x, [r["model_s_per_iter"] for r in rs], "-", color=c,
                     label=f"{col} model")
        axes[0].plot(x, [r["pure_s_per_iter"] for r in rs], ":", color=c)
        axes[1].plot(x, [r["published_speedup"] / r["gpus"] for r in rs], "o", color=c)
        axes[1].plot(x, [r["published_n_t1_over_tn"] / r["gpus"] for r in rs], "x", color=c)
        axes[1].plot(x, [r["model_efficiency"] for r in rs], "-", color=c, label=col)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("s/iter")
    axes[0].set_title(f"step time (dots: published; lines: model; dotted: without t_sync "
                      f"= {result['sync_overhead_s'] * 1e3:.0f} ms)", fontsize=9)
    axes[1].set_ylabel("efficiency = speedup / n")
    axes[1].set_title("efficiency: model (lines), published speedup column (o), published "
                      "n t1/tn (x)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- CLI ----------------------------------------------------------------------------------------

#: The calibration the docs' figures used: ``python -m benchmarks allreduce --np 2 --repeats 3``
#: on the project's 2-core CI machine (the model's default ``--bench-json``).
SHIPPED_CALIBRATION = REPO_ROOT / "docs" / "results" / "allreduce_calibration.json"


def _load_calibration(args: "ScalingModelConfig") -> Calibration | None:
    if args.bench_json in ("", "none"):
        return None
    path = SHIPPED_CALIBRATION if args.bench_json == "shipped" else Path(args.bench_json)
    data = load_bench_json(path)
    data["source"] = str(path)
    return calibrate_from_bench(data)


def _print_validation(v: dict) -> None:
    print(f"t_sync (fitted once, 4096-d IB, 8 GPUs) = {v['sync_overhead_s'] * 1e3:.1f} ms")
    print_table(v["rows"], [
        ("column", "14", "column"), ("GPUs", ">4", "gpus"),
        ("pub s/it", ">8.2f", "published_s_per_iter"), ("pure", ">7.3f", "pure_s_per_iter"),
        ("err", ">+7.1%", "pure_error"), ("model", ">7.3f", "model_s_per_iter"),
        ("err", ">+7.1%", "model_error"), ("pub speed", ">9.1f", "published_speedup"),
        ("n t1/tn pub", ">11.1f", "published_n_t1_over_tn"),
        ("model speed", ">11.1f", "model_speedup")])
    for col, s in v["summary"].items():
        print(f"{col}: model max |error| {s['model_max_abs_error']:.1%}, mean "
              f"{s['model_mean_abs_error']:.1%} (without t_sync: max "
              f"{s['pure_max_abs_error']:.1%})")


def _print_onebit(r: dict) -> None:
    print(f"4096-d mLSTM, DGX-1V, batch 256/GPU; t_sync {r['sync_overhead_s'] * 1e3:.1f} ms; "
          f"1-bit: {r['chunk']} values per scale, {r['warmup_fraction']:.0%} of steps in the "
          f"fp16 warmup; IB as published = {r['effective_inter_GBps']:.2f} GB/s per node")
    print_table(r["rows"], [
        ("column", "16", "column"), ("GPUs", ">4", "gpus"),
        ("fp16 s/it", ">9.3f", "fp16_s_per_iter"), ("speedup", ">8.1f", "fp16_speedup"),
        ("1-bit s/it", ">10.3f", "onebit_s_per_iter"), ("speedup", ">8.1f", "onebit_speedup"),
        ("end-to-end", ">10.1f", "onebit_end_to_end_speedup"),
        ("comm fp16 ms", ">12.1f", lambda x: x["fp16_comm_s"] * 1e3),
        ("comm 1-bit ms", ">13.1f", lambda x: x["onebit_comm_s"] * 1e3)])
    print(f"\nat {r['n']} GPUs (1-bit speedups end to end, warmup included):")
    print_table(r["settings"], [
        ("column", "16", "column"), ("compression", ">11", "compression"),
        ("batch/GPU", ">9", "batch_per_gpu"), ("global", ">7", "global_batch"),
        ("speedup", ">8.1f", "speedup"),
        ("published", ">9", lambda x: r["published"][x["column"]])])
    for col, x in r["recommended"].items():
        print(f"recommended ({col}, the reference's 32k batch): {x['compression']} "
              f"-> {x['speedup']:.1f}x")


def run(args: "ScalingModelConfig") -> int:
    """Print (and with ``--json`` write) the predictions, the validation or the recommendations.

    Raises:
        ValueError: a bad calibration file (:func:`load_bench_json`,
            :func:`calibrate_from_bench`) or setting; OSError: the file cannot be read.
    """
    cal = _load_calibration(args)
    if cal is not None:
        lo_o, hi_o = cal.per_cycle_overhead_range_s
        lo_r, hi_r = cal.bandwidth_ratio_range
        print(f"calibration {cal.source} (vs {cal.mpi_label}): Horovod per-cycle overhead "
              f"{cal.per_cycle_overhead_s * 1e6:.0f} us (interquartile {lo_o * 1e6:.0f}.."
              f"{hi_o * 1e6:.0f}; {cal.latency_label}), bandwidth ratio "
              f"{cal.measured_bandwidth_ratio:.3f} ({lo_r:.3f}..{hi_r:.3f}; "
              f"{cal.horovod_label}; model uses {cal.bandwidth_factor:.3f})")
    else:
        print("calibration: none (Horovod's overhead over raw MPI taken as 0)")
    out: dict = {"calibration": asdict(cal) if cal else None}
    if args.mode == "predict":
        sync = calibrate_sync_overhead(cal)
        cfg = reference_config(args.hidden_size, args.inter, args.compute_time, cal, sync,
                               batch_per_gpu=args.batch_per_gpu, algorithm=args.algorithm)
        rows = predict(cfg, list(args.gpus))
        print(f"{cfg.gradient_bytes / 1e6:.1f} MB of gradients per step, overlappable "
              f"{rows[0]['overlappable_fraction']:.1%}, t_sync {sync * 1e3:.1f} ms")
        print_table(rows, [
            ("GPUs", ">5", "n"), ("s/iter", ">8.4f", "s_per_iter"), ("comm", ">8.4f", "comm_s"),
            ("exposed", ">8.4f", "exposed_comm_s"), ("buffers", ">7", "buffers"),
            ("speedup", ">8.1f", "speedup"), ("eff", ">6.1%", "efficiency")])
        out["predictions"] = rows
    elif args.mode == "validate":
        v = validate(cal)
        _print_validation(v)
        if cal is not None:  # how far the calibration's noise moves the comparison
            v["calibration_range"] = {name: validate(bound)["summary"]
                                      for name, bound in zip(("low", "high"), cal.bounds())}
            for col, s_ in v["summary"].items():
                lo = v["calibration_range"]["low"][col]["model_max_abs_error"]
                hi = v["calibration_range"]["high"][col]["model_max_abs_error"]
                print(f"{col}: max |error| {s_['model_max_abs_error']:.1%} with the "
                      f"calibration's interquartile range {min(lo, hi):.1%}..{max(lo, hi):.1%}")
        out["validation"] = v
        if args.plot:
            plot_validation(v, args.plot)
            print(f"plot: {args.plot}")
    elif args.mode == "onebit":
        r = onebit_study(cal, gpus=list(args.gpus))
        _print_onebit(r)
        out["onebit"] = r
    else:
        r = recommend(cal)
        print(f"{r['n']} GPUs, 4096-d, DGX-1V + IB; published speedup {r['published_speedup']}x"
              f"; effective inter-node bandwidth behind the published row "
              f"{r['effective_inter_GBps']:.2f} GB/s per node")
        print_table(r["rows"], [
            ("scenario", "13", "scenario"), ("setting", "62", "setting"),
            ("s/iter", ">7.3f", "s_per_iter"), ("speedup", ">8.1f", "speedup"),
            ("vs 109x", ">+8.1%", "vs_published"), ("vs ref", ">+7.1%", "vs_reference_setting"),
            ("thru vs 1GPU@256", ">16.1f", "throughput_vs_1gpu_ref")])
        out["recommendations"] = r
    save_json(args.json, out)
    return 0


@dataclass
class ScalingModelConfig:
    """Settings of ``python -m benchmarks scaling-model {predict,validate,recommend}``."""

    mode: str = option("predict", "predict s/iter on 1-128 GPUs, validate against the reference "
                       "table, recommend settings at 128 GPUs, or onebit: 1-bit Adam/LAMB vs "
                       "fp16 on the talk's 10 GbE and IB columns", positional=True,
                       choices=("predict", "validate", "recommend", "onebit"))
    hidden_size: int = option(4096, "mLSTM width H", ge=1)
    compute_time: float = option(0.81, "1-GPU compute s/iter at batch 256 (reference: 0.81 for "
                                 "4096-d on a V100)", gt=0)
    batch_per_gpu: int = option(256, "per-GPU batch", ge=1)
    gpus: list[int] = option(default_factory=lambda: [1, 8, 16, 32, 64, 128],
                             help="GPU counts, comma-separated", ge=1)
    inter: str = option("ib", "DGX-1V inter-node link preset", choices=("ib", "10gbe"))
    algorithm: str = option("ring", "allreduce algorithm", choices=("ring", "hierarchical"))
    bench_json: str = option("shipped", "`python -m benchmarks allreduce --json` output "
                             "calibrating Horovod's per-op overhead and bandwidth factor: a file, "
                             "'shipped' (docs/results/allreduce_calibration.json, what the docs "
                             "used) or 'none'")
    plot: str = option("", "validate: write a PNG here")
    json: str = option("", "write the results here")


SCALING_MODEL = Command(
    ScalingModelConfig, run,
    description="Alpha-beta model of data-parallel mLSTM training on 1-128 GPUs: predict s/iter, "
    "speedup and efficiency; validate against the reference talk's table; recommend settings "
    "at 128 GPUs.")
