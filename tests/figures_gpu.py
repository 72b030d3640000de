"""The GPU cards' figures (docs/results/gpu_*: what each lent card's calls returned), registered
in :mod:`tests.figures` as the others are."""
from __future__ import annotations

import re
import statistics

from tests._mp import REPO
from tests.figures import IMPL, RESULTS, figures, jsonl, load, pct  # noqa: F401

# --- docs/gpu.md, docs/mlstm_fused.md: the first H200 (docs/results/gpu_h200) -----------------

#: docs/gpu.md's first table: its (impl, B, precision) rows
H200_1_ROWS = [("fused/triton", 256, "bf16"), ("fused/triton+graphs", 256, "bf16"),
               ("reference", 256, "bf16"), ("cudnn", 256, "bf16"),
               ("fused/triton+graphs", 128, "bf16"), ("fused/triton", 128, "bf16"),
               ("reference", 128, "bf16"), ("cudnn", 128, "bf16"),
               ("fused/triton+graphs", 128, "fp32"), ("cudnn", 128, "fp32")]


@figures("docs/results/gpu_h200/bench_gpu_b{256,128}.json")
def h200_1() -> dict[str, str]:
    """docs/gpu.md's first table (its rows by impl, B, precision), the comparisons under it,
    docs/mlstm_fused.md section 7's profile and GEMM ceiling."""
    runs = {b: load(f"gpu_h200/bench_gpu_b{b}.json") for b in (256, 128)}
    rows = {(r["impl"], r["batch_size"], r["precision"]): r
            for d in runs.values() for r in d["train"]}
    peaks = {m["precision"]: m["tflops"] for m in runs[128]["matmul"]}
    out = {"h200_1.peak_bf16": f"{peaks['bf16']:.1f}", "h200_1.peak_fp32": f"{peaks['fp32']:.1f}"}
    for impl, b, prec in H200_1_ROWS:
        r, p = rows[(impl, b, prec)], f"h200_1.{IMPL[impl]}.b{b}.{prec}"
        out |= {f"{p}.chars_per_s": f"{r['chars_per_s']:,.0f}", f"{p}.tflops": f"{r['tflops']:.1f}",
                f"{p}.peak_gib": f"{r['peak_memory_gib']:.1f}"}
        if (impl, prec) != ("cudnn", "fp32"):             # the page says TF32: its peak is TF32's
            out[f"{p}.of_peak"] = pct(r["fraction_of_peak"])
    f256 = rows[("fused/triton", 256, "bf16")]
    p = runs[256]["profile"]
    g = p["gaps"]
    (ceiling,) = runs[256]["ceiling"]
    out |= {
        "h200_1.triton.b256.vs_reference": f"{f256['vs_reference']:.2f}x",
        "h200_1.triton.b256.vs_cudnn": f"{f256['vs_cudnn_lstm_per_flop']:.3f}",
        "h200_1.graphs.b128.vs_cudnn":
            f"{rows[('fused/triton+graphs', 128, 'bf16')]['vs_cudnn_lstm_per_flop']:.3f}",
        "h200_1.bf16_over_fp32.b128": f"{runs[128]['bf16_over_fp32']['128']:.2f}x",
        "h200_1.profile.window_ms": f"{g['window_us'] / 1e3:.1f}",
        "h200_1.profile.busy": pct(1 - g["idle_fraction"]),
        "h200_1.profile.gaps": f"{g['gaps']:,}",
        "h200_1.profile.kernels": f"{p['events']:,}",
        "h200_1.profile.gaps_over_5us": f"{g['gaps_over_us']['5.0']}",
        "h200_1.profile.steps": f"{p['steps']}",
        "h200_1.profile.kernels_per_time_step": f"{p['events'] / p['steps'] / 256:.1f}",
        "h200_1.triton.b256.of_gemm_ceiling": pct(f256["fraction_of_gemm_ceiling"]),
        "h200_1.b256.gemm_ceiling_chars_per_s": f"{ceiling['chars_per_s']:,.0f}",
    }
    for i, k in enumerate(p["top"][:5], 1):
        out |= {f"h200_1.profile.top{i}.share": pct(k["share"]),
                f"h200_1.profile.top{i}.total_ms": f"{k['total_us'] / 1e3:.2f}",
                f"h200_1.profile.top{i}.calls": f"{k['calls']}",
                f"h200_1.profile.top{i}.mean_us": f"{k['mean_us']:.1f}"}
    return out


@figures("docs/results/gpu_h4096 (metrics.jsonl, eval.json, transfer.json)")
def h4096() -> dict[str, str]:
    """The 4096-d model the first H200 trained: docs/gpu.md's "Model at scale" row and
    docs/mlstm_fused.md's account of the run."""
    recs = jsonl("gpu_h4096/metrics.jsonl")
    start = next(r for r in recs if r["kind"] == "start")
    end = next(r for r in recs if r["kind"] == "end")
    ev, t = load("gpu_h4096/eval.json"), load("gpu_h4096/transfer.json")
    val = [r["val_bpc"] for r in recs if r["kind"] == "eval"]
    train = [r for r in recs if r["kind"] == "train"]
    return {
        "h4096.chars_trained": f"{end['chars_trained']:,}",
        "h4096.minutes": f"{(end['time'] - start['time']) / 60:.1f}",
        "h4096.eval_bpc": f"{ev['bpc']:.3f}",
        "h4096.sst2_val": pct(t["classifier"]["accuracy"]["val"]),
        "h4096.unit_val": pct(t["neuron"]["accuracy"]["val"]),
        "h4096.params": f"{start['params']:,}",
        "h4096.bpc_below_demo": f"{load('demo.json')['val_bpc'] - ev['bpc']:.2f}",
        "h4096.first_val_bpc": f"{val[0]:.3f}",
        "h4096.best_val_bpc": f"{min(val):.3f}",
        "h4096.median_chars_per_s": f"{statistics.median(r['chars_per_s'] for r in train):,.0f}",
        "h4096.median_mfu": f"{statistics.median(r['mfu'] for r in train):.2f}",
        "h4096.epochs": f"{train[-1]['epoch']:.1f}",
    }


@figures("docs/results/issue43_cpu.json")
def issue43() -> dict[str, str]:
    """docs/mlstm_fused.md section 8: the kernels per time step (the counts the launch test
    asserts), the host time per time step and per launch."""
    d = load("issue43_cpu.json")
    k, fixed = d["kernels_per_time_step"], d["kernels_per_window_fixed_cpu"]["fp32"]
    h, w = d["host_us_per_time_step"], d["triton_wrapper_us_per_launch"]
    return {
        "issue43.kernels.fp32.before": f"{k['fp32']['before']}",
        "issue43.kernels.fp32.after": f"{k['fp32']['after']}",
        "issue43.kernels.bf16_cpu.before": f"{k['bf16_cpu']['before']}",
        "issue43.kernels.bf16_cpu.after": f"{k['bf16_cpu']['after']}",
        "issue43.window_fixed.fp32.before": f"{fixed['before']}",
        "issue43.window_fixed.fp32.after": f"{fixed['after']}",
        "issue43.host_us.fp32.before": f"{h['fp32']['before_median']:.1f}",
        "issue43.host_us.fp32.after": f"{h['fp32']['after_median']:.1f}",
        "issue43.host_us.bf16.before": f"{h['bf16']['before_median']:.1f}",
        "issue43.host_us.bf16.after": f"{h['bf16']['after_median']:.1f}",
        "issue43.launch_us.before": f"{w['before_median']:.2f}",
        "issue43.launch_us.after": f"{w['after_median']:.2f}",
    }


@figures("hvd_lm/train/memory.py (estimated_memory, H=4096, T=256, fused/triton)")
def issue43_memory() -> dict[str, str]:
    """docs/mlstm_fused.md section 8: the refitted memory estimates."""
    import torch

    from benchmarks.bench_gpu import Variant, estimated_memory

    def gib(b: int, prec: str, graphs: bool) -> str:
        v = Variant("mlstm", "fused", "triton", graphs)
        return f"{estimated_memory(v, 4096, 64, b, 256, prec, torch.device('cuda')) / 2 ** 30:.1f}"

    return {"memory_estimate.triton.b256.bf16": gib(256, "bf16", False),
            "memory_estimate.graphs.b256.bf16": gib(256, "bf16", True),
            "memory_estimate.triton.b128.bf16": gib(128, "bf16", False),
            "memory_estimate.triton.b128.fp32": gib(128, "fp32", False)}


# --- docs/gpu.md and README: the second H200 (docs/results/gpu_h200_2026-11-27) ---------------

H200_2 = "gpu_h200_2026-11-27"


@figures(f"docs/results/{H200_2}/bench_gpu.json (and gpu_h200/bench_gpu_b256.json)")
def h200_2_bench() -> dict[str, str]:
    """Each row of the second card's bench table, the peak it is a fraction of, and the
    comparison with the first card."""
    d = load(f"{H200_2}/bench_gpu.json")
    (peak,) = d["matmul"]
    rows = {(r["impl"], r["batch_size"]): r for r in d["train"]}
    out = {"h200_2.peak_bf16": f"{peak['tflops']:.1f}"}
    for (impl, b), r in rows.items():
        p = f"h200_2.{IMPL[impl]}.b{b}"
        out |= {f"{p}.chars_per_s": f"{r['chars_per_s']:,.0f}", f"{p}.tflops": f"{r['tflops']:.1f}",
                f"{p}.of_peak": pct(r["fraction_of_peak"]),
                f"{p}.host_ms": f"{r['host_s_per_step'] * 1e3:.1f}"}
        if impl != "cudnn":
            out |= {f"{p}.of_gemms": pct(r["fraction_of_gemm_ceiling"]),
                    f"{p}.vs_cudnn": f"{r['vs_cudnn_lstm_per_flop']:.3f}"}
    first = load("gpu_h200/bench_gpu_b256.json")["train"]
    old = {r["impl"]: r for r in first if r["batch_size"] == 256 and r["precision"] == "bf16"}
    new, was = rows[("fused/triton", 256)], old["fused/triton"]
    return out | {
        "h200_2.triton.b256.over_first": f"{new['chars_per_s'] / was['chars_per_s']:.3f}x",
        "h200_2.triton.b256.kernels_per_time_step": f"{new['kernels_per_time_step']:.1f}",
    }


def session_records(name: str) -> tuple[dict, dict, list[dict], list[float]]:
    """A GPU call's training: its start and end records, train records and validation BPCs,
    after what every such run must satisfy: the run ended as planned (stop "done", before its
    deadline, LR at 0) and validation BPC fell at every evaluation."""
    recs = jsonl(name)
    start = next(r for r in recs if r["kind"] == "start")
    end = next(r for r in recs if r["kind"] == "end")
    train = [r for r in recs if r["kind"] == "train"]
    val = [r["val_bpc"] for r in recs if r["kind"] == "eval"]
    assert train[-1]["lr"] == 0.0 and 0 <= end["deadline_left_s"] and end["stop"] == "done"
    assert all(a > b for a, b in zip(val, val[1:])), f"{name}: val BPC fell at every eval"
    return start, end, train, val


def transfer_figures(prefix: str, mean: dict, cell: dict) -> dict[str, str]:
    """SST-2 on the mean of h_t and on the final cell state, the top unit, TF-IDF."""
    return {
        f"{prefix}.sst2_mean": pct(mean["classifier"]["accuracy"]["val"]),
        f"{prefix}.sst2_mean_C": f"{mean['classifier']['C']:g}",
        f"{prefix}.sst2_mean_nonzero": f"{mean['classifier']['nonzero']:,}",
        f"{prefix}.sst2_cell": pct(cell["classifier"]["accuracy"]["val"]),
        f"{prefix}.sst2_cell_C": f"{cell['classifier']['C']:g}",
        f"{prefix}.sst2_unit": pct(mean["neuron"]["accuracy"]["val"]),
        f"{prefix}.tfidf": pct(mean["baseline"]["accuracy"]["val"]),
    }


def steering(name: str) -> dict[str, float]:
    """The pinned samples' mean classifier P(positive), by the value the unit was held at."""
    return {v: statistics.mean(r["p_positive"] for r in jsonl(f"{name}/samples_unit{v}.jsonl"))
            for v in ("1.0", "-1.0")}


@figures(f"docs/results/{H200_2} (metrics.jsonl, eval.json, transfer*/transfer.json, samples)")
def h200_2_model() -> dict[str, str]:
    """The model paragraph, the targets table, README's summary and the steering: eval on the
    final checkpoint equals the last logged val BPC (to four places)."""
    from hvd_lm.transfer.generate import WEAK_UNIT_ACCURACY

    start, end, train, val = session_records(f"{H200_2}/metrics.jsonl")
    ev = load(f"{H200_2}/eval.json")
    assert f"{ev['bpc']:.4f}" == f"{val[-1]:.4f}" and ev["step"] == end["step"]
    mean = load(f"{H200_2}/transfer/transfer.json")
    cell = load(f"{H200_2}/transfer_cell/transfer.json")
    acc, unit = mean["classifier"]["accuracy"]["val"], mean["neuron"]["accuracy"]["val"]
    tfidf = mean["baseline"]["accuracy"]["val"]
    assert unit < WEAK_UNIT_ACCURACY          # what generate's WEAK_UNIT_ACCURACY warning is for
    p = steering(H200_2)
    return transfer_figures("h200_2", mean, cell) | {
        "h200_2.time_limit": f"{start['time_limit_s']}",
        "h200_2.time_limit_s": f"{start['time_limit_s']}s",
        "h200_2.steps": f"{end['step']:,}",
        "h200_2.minutes": f"{(end['time'] - start['time']) / 60:.1f}",
        "h200_2.median_chars_per_s": f"{statistics.median(r['chars_per_s'] for r in train):,.0f}",
        "h200_2.median_mfu": f"{statistics.median(r['mfu'] for r in train):.2f}",
        "h200_2.deadline_left_s": f"{end['deadline_left_s']:.1f}",
        **{f"h200_2.val_bpc_{i}": f"{v:.3f}" for i, v in enumerate(val, 1)},
        "h200_2.final_windows_bpc": f"{statistics.mean(r['bpc'] for r in train[-10:]):.3f}",
        "h200_2.epochs": f"{train[-1]['epoch']:.1f}",
        "h200_2.eval_bpc": f"{ev['bpc']:.3f}",
        "h200_2.eval_bpc_4": f"{ev['bpc']:.4f}",
        "h200_2.last_val_bpc_4": f"{val[-1]:.4f}",
        "h200_2.chars_trained_M": f"{end['chars_trained'] / 1e6:.1f}M",
        "h200_2.sst2_mean_below_tfidf": f"{(tfidf - acc) * 100:.1f}",
        "h200_2.sst2_unit_below_70": f"{(0.7 - unit) * 100:.1f}",
        "h200_2.steer_plus_p_positive": f"{p['1.0']:.3f}",
        "h200_2.steer_minus_p_positive": f"{p['-1.0']:.3f}",
    }


@figures("hvd_lm/transfer/generate.py (WEAK_UNIT_ACCURACY)")
def weak_unit() -> dict[str, str]:
    from hvd_lm.transfer.generate import WEAK_UNIT_ACCURACY
    return {"weak_unit_accuracy": pct(WEAK_UNIT_ACCURACY, 0)}


@figures(f"docs/results/{H200_2}/session.log and commands.md; scripts/gpu_session.sh")
def h200_2_post_training() -> dict[str, str]:
    """The steps after training took 125 s on the H200 (the call's timeline, session.log; the
    three it cut ran in 36.0 s in a later call, commands.md): scripts/gpu_session.sh keeps at
    least that (POST_S), and the page says both."""
    log = (RESULTS / H200_2 / "session.log").read_text()
    at = {m[2]: int(m[1]) for m in re.finditer(r"\+(\d+)s\] (\S+)$", log, re.M)}
    done = {m[2]: int(m[1]) for m in re.finditer(r"\+(\d+)s\] (\S+): exit 0$", log, re.M)}
    took = {k: done[k] - at[k] for k in ("eval", "transfer", "transfer_cell", "generate")}
    later = float(re.search(r"three cut steps \(wall ([\d.]+) s",
                            (RESULTS / H200_2 / "commands.md").read_text())[1])
    total = sum(took.values()) + later
    script = (REPO / "scripts/gpu_session.sh").read_text()
    defaults = {int(x) for x in re.findall(r"\$\{POST_S:-(\d+)\}", script)}
    assert len(defaults) == 1 and defaults.pop() >= total, (took, later)
    return {"h200_2.post_training_s": f"{round(total)}",
            **{f"h200_2.post_training.{k}_s": f"{v}" for k, v in took.items()},
            "h200_2.post_training.later_s": f"{round(later)}"}


# --- docs/gpu.md: the third H200 (docs/results/gpu_h200_2026-11-27b) ---------------------------

H200_3 = "gpu_h200_2026-11-27b"


@figures(f"docs/results/{H200_3}/bench_gpu.json")
def h200_3_bench() -> dict[str, str]:
    d = load(f"{H200_3}/bench_gpu.json")
    (peak,) = d["matmul"]
    out = {"h200_3.peak_bf16": f"{peak['tflops']:.1f}"}
    for r in d["train"]:
        p = f"h200_3.{IMPL[r['impl']]}.b{r['batch_size']}"
        out |= {f"{p}.chars_per_s": f"{r['chars_per_s']:,.0f}", f"{p}.tflops": f"{r['tflops']:.1f}",
                f"{p}.of_peak": pct(r["fraction_of_peak"])}
        if r["impl"] != "cudnn":
            out[f"{p}.vs_cudnn"] = f"{r['vs_cudnn_lstm_per_flop']:.3f}"
    return out


@figures(f"docs/results/{H200_3} (run/metrics.jsonl, eval.json, transfer*/transfer.json, "
         "samples)")
def h200_3_model() -> dict[str, str]:
    """The third card's training to its 318 s deadline, `hvd-lm eval` on its checkpoint, SST-2
    transfer and the pinned unit's samples."""
    start, end, train, val = session_records(f"{H200_3}/run/metrics.jsonl")
    ev = load(f"{H200_3}/eval.json")
    assert ev["step"] == end["step"] and f"{ev['bpc']:.4f}" == f"{val[-1]:.4f}"
    assert load(f"{H200_3}/run/summary.json")["chars_trained"] == end["chars_trained"]
    mean = load(f"{H200_3}/transfer/transfer.json")
    cell = load(f"{H200_3}/transfer_cell/transfer.json")
    seconds = end["time"] - start["time"]
    p = steering(H200_3)
    return transfer_figures("h200_3", mean, cell) | {
        "h200_3.time_limit": f"{start['time_limit_s']}",
        "h200_3.steps": f"{end['step']:,}",
        "h200_3.chars_trained": f"{end['chars_trained']:,}",
        "h200_3.minutes": f"{seconds / 60:.1f}",
        "h200_3.seconds": f"{seconds:.0f}",
        "h200_3.median_chars_per_s": f"{statistics.median(r['chars_per_s'] for r in train):,.0f}",
        "h200_3.median_mfu": f"{statistics.median(r['mfu'] for r in train):.2f}",
        "h200_3.deadline_left_s": f"{end['deadline_left_s']:.1f}",
        "h200_3.epochs": f"{train[-1]['epoch']:.1f}",
        **{f"h200_3.val_bpc_{i}": f"{v:.3f}" for i, v in enumerate(val, 1)},
        "h200_3.eval_bpc": f"{ev['bpc']:.3f}",
        "h200_3.unit": f"{mean['neuron']['index']}",
        "h200_3.steer_plus_p_positive": f"{p['1.0']:.3f}",
        "h200_3.steer_minus_p_positive": f"{p['-1.0']:.3f}",
    }


