"""``python -m benchmarks fusion``: the training step's time against Horovod's tensor fusion
threshold and cycle time (Horovod docs, "Tensor Fusion", "Autotune"), each configuration a launch of
``python -m benchmarks train``'s worker (:mod:`benchmarks.bench_train`), and what Horovod's
autotuner chose from the same start (``HOROVOD_AUTOTUNE_LOG``).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench_train import StepConfig, launch
from benchmarks.harness import print_table, save_json
from hvd_lm import options
from hvd_lm.comm.engine import HOROVOD_DEFAULT_CYCLE_MS, HOROVOD_DEFAULT_FUSION_BYTES
from hvd_lm.options import Command, option
from hvd_lm.util.units import MIB


@dataclass
class BenchFusionConfig(StepConfig):
    """``python -m benchmarks fusion``."""

    hidden_size: int = option(256, "mLSTM width H", ge=1)
    steps: int = option(20, "timed steps per run", ge=1)
    warmup: int = option(3, "untimed steps first", ge=0)
    np: int = option(2, "ranks", ge=1)
    fusion_mb: list[float] = option(default_factory=lambda: [0.0, 1.0, 16.0, 64.0, 128.0],
                                    help="fusion thresholds, MiB", ge=0)
    cycle_ms: list[float] = option(default_factory=lambda: [0.2, 1.0, 5.0, 20.0],
                                   help="cycle times, ms", gt=0)
    repeats: int = option(1, "round-robin repeats", ge=1)
    autotune: bool = option(True, "then a HOROVOD_AUTOTUNE run (--no-autotune: skip it)",
                            switch=False, flag="--no-autotune")
    autotune_steps: int = option(150, "timed steps of the autotune run (the tuner needs (1 warmup "
                                 "+ 12 samples + 8) x 5 steps)", ge=1)
    timeout: float = option(600.0, "per-run limit, s", gt=0)
    json: str = option("", "write the results here")


def parse_autotune_log(path: str | Path) -> dict:
    """Horovod's ``HOROVOD_AUTOTUNE_LOG`` CSV (horovod/common/parameter_manager.cc): a header
    ``hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,
    tensor_fusion_threshold,score``, one row per sample (score in bytes/us), and, once tuning
    has finished, a last row with the best values.

    Returns:
        ``{"samples": [row dicts], "best": row dict or None, "finished": bool}``; the fusion
        threshold is in MB as Horovod logs it, the score in bytes per microsecond.

    Raises:
        ValueError: not a Horovod autotune log.
    """
    lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("hierarchical_allreduce"):
        raise ValueError(f"{path}: not a Horovod autotune log")
    head = lines[0].split(",")
    split = ([v.strip() for v in ln.split(",")] for ln in lines[1:])
    rows = [dict(zip(head, map(float, vals))) for vals in split if len(vals) == len(head)]
    # The best-parameters row repeats one earlier sample's values with the best score; Horovod
    # writes it only when tuning finished. It is recognisable as the last row whose score equals
    # the maximum of the preceding rows.
    finished = len(rows) >= 2 and rows[-1]["score"] == max(r["score"] for r in rows[:-1])
    best = rows[-1] if finished else (max(rows, key=lambda r: r["score"]) if rows else None)
    return {"samples": rows[:-1] if finished else rows, "best": best, "finished": finished}


def fusion_configs(cfg: BenchFusionConfig) -> list[tuple[str, float, float]]:
    """(label, fusion MiB, cycle ms): fusion thresholds at the default cycle time, then cycle
    times at the default threshold."""
    dfus, dcyc = HOROVOD_DEFAULT_FUSION_BYTES / MIB, HOROVOD_DEFAULT_CYCLE_MS
    pairs = [(f, dcyc) for f in cfg.fusion_mb] + [(dfus, c) for c in cfg.cycle_ms]
    return [(f"fusion={f:g}MB cycle={c:g}ms", f, c) for f, c in dict.fromkeys(pairs)]


def bench_fusion(cfg: BenchFusionConfig) -> int:
    """Print (and with ``--json`` save, after every run) the fusion/cycle-time sweep and the
    autotune result.

    Raises:
        RuntimeError: a launch failed (:func:`benchmarks.harness.run_child`);
            subprocess.TimeoutExpired; ValueError: the autotune log is not Horovod's.
    """
    runs: list[dict] = []
    autotune = None

    def timed(label: str, fmb: float, cms: float, rep: int) -> dict:
        # launch() unsets every other Horovod knob (HOROVOD_AUTOTUNE included)
        r = launch("horovod", cfg.np, cfg, cfg.timeout, {
            "HOROVOD_FUSION_THRESHOLD": str(int(fmb * MIB)), "HOROVOD_CYCLE_TIME": f"{cms:g}"})[0]
        runs.append({"label": label, "fusion_threshold_mb": fmb, "cycle_time_ms": cms,
                     "repeat": rep, **r})
        return r

    for rep in range(cfg.repeats):  # round robin: drift on a shared machine hits all alike
        for label, fmb, cms in fusion_configs(cfg):
            r = timed(label, fmb, cms, rep)
            _save_fusion(cfg, runs, None)  # partial results survive an interrupted sweep
            print(f"  {label} (repeat {rep}): {r['step_time_s']:.4f} s/step",
                  file=sys.stderr, flush=True)
    if cfg.autotune:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "autotune.csv"
            tune_env = {  # launch() unsets the fusion threshold and the cycle time
                "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
                "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "12"}
            tuned_step = dataclasses.replace(cfg, steps=cfg.autotune_steps)
            r = launch("horovod", cfg.np, tuned_step, cfg.timeout, tune_env)[0]
            autotune = parse_autotune_log(log) | {"run": r, "log": log.read_text()}
        if (best := autotune["best"]) is not None:
            fmb, cms = best["tensor_fusion_threshold"], best["cycle_time_ms"]
            timed(f"autotuned fusion={fmb:g}MB cycle={cms:g}ms", fmb, cms, 0)
    summary = summarize_fusion(runs)
    print(f"\npython -m benchmarks fusion: {cfg.np} ranks, mLSTM H={cfg.hidden_size}, "
          f"per-rank batch {cfg.batch_size} x {cfg.seq_len}, compression {cfg.compression}, "
          f"{cfg.steps} timed steps x {cfg.repeats} repeat(s)")
    print_table(summary, [
        ("configuration", "36", "label"), ("median s/step", ">13.4f", "step_time_s"),
        ("min", ">9.4f", "step_time_min_s"), ("vs default", ">10.3f", "relative_to_default"),
        ("ar wait", ">8.1%", "allreduce_wait_share")])
    if autotune:
        b = autotune["best"]
        print(f"autotune ({len(autotune['samples'])} samples, finished={autotune['finished']}): "
              + ("no samples logged" if b is None else
                 f"cycle {b['cycle_time_ms']:g} ms, fusion {b['tensor_fusion_threshold']:g} MB, "
                 f"hierarchical allreduce {int(b['hierarchical_allreduce'])}, cache "
                 f"{int(b['cache_enabled'])}, score {b['score']:.1f} bytes/us"))
    _save_fusion(cfg, runs, autotune)
    return 0


def _save_fusion(cfg: BenchFusionConfig, runs: list[dict], autotune: dict | None) -> None:
    save_json(cfg.json, {"runs": runs, "summary": summarize_fusion(runs), "autotune": autotune,
                         "args": options.to_dict(cfg)})


def summarize_fusion(runs: list[dict]) -> list[dict]:
    """Median (robust on a shared machine) and minimum step time per configuration label over
    repeats, relative to Horovod's defaults (fusion 128 MB, cycle 1 ms) when that configuration
    ran (else to the first)."""
    out = []
    for label in dict.fromkeys(r["label"] for r in runs):
        rs = [r for r in runs if r["label"] == label]
        out.append({"label": label, "fusion_threshold_mb": rs[0]["fusion_threshold_mb"],
                    "cycle_time_ms": rs[0]["cycle_time_ms"], "repeats": len(rs),
                    "step_time_s": statistics.median(r["step_time_s"] for r in rs),
                    "step_time_min_s": min(r["step_time_s"] for r in rs),
                    "allreduce_wait_share": sum(r["allreduce_wait_share"] or 0 for r in rs)
                    / len(rs)})
    dflt = [s for s in out if s["fusion_threshold_mb"] == HOROVOD_DEFAULT_FUSION_BYTES / MIB
            and s["cycle_time_ms"] == HOROVOD_DEFAULT_CYCLE_MS and "autotuned" not in s["label"]]
    ref = (dflt or out)[0]["step_time_s"] if out else 1.0
    for s in out:
        s["relative_to_default"] = s["step_time_s"] / ref
    return out


BENCH_FUSION = Command(BenchFusionConfig, bench_fusion,
                       description="Training step time vs HOROVOD_FUSION_THRESHOLD / "
                       "HOROVOD_CYCLE_TIME, then what HOROVOD_AUTOTUNE picks.")
