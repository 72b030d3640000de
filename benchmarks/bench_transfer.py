"""``python -m benchmarks transfer``: seconds of the transfer classifier fit per solver and problem
size, side by side in one run.

For each problem (synthetic ``--sizes NxD``, and real LM features when ``--checkpoint`` and a
dataset are given) each solver of ``--solvers`` (scikit-learn's liblinear and saga) runs the
whole protocol of ``hvd-lm transfer`` (:func:`hvd_lm.transfer.fit.fit_logreg`: the C grid,
default 11 values 2^-8..2^2, by k-fold cross-validation on train, the folds' fits in
``--threads`` worker processes, then the refit). Each fit runs in its own process
(``python -m benchmarks.bench_transfer --worker``) under ``--time-limit`` seconds, so a solver
that does not finish is reported as such instead of stalling the benchmark; solvers take turns
over ``--repeats`` rounds and the median is reported.

Printed per problem and solver: the fit's wall seconds (data already in memory), its ratio to
the fastest solver of that problem, the C the cross-validation chose, its mean fold accuracy,
validation accuracy and non-zero weights. ``--json FILE`` keeps everything.

Synthetic features (:func:`synthetic_problem`) imitate LM features: a few hundred shared
factors plus noise (strongly correlated columns), per-column scales over two orders of magnitude,
labels from a sparse logistic model on 64 units with logistic noise (Bayes accuracy ~90%).
Real features come from the transfer feature cache (or are computed into it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.harness import run_child, save_json
from hvd_lm.options import Command, option, to_argv
from hvd_lm.transfer import datasets
from hvd_lm.transfer import fit as classify
from hvd_lm.transfer.features import DEFAULT_CACHE_DIR, FEATURE_KINDS, open_lm
from hvd_lm.transfer.run import TransferConfig, featurize_splits
from hvd_lm.util.digest import file_sha256


def parse_size(text: str) -> tuple[int, int]:
    """``"6920x4096"`` -> (6920, 4096).

    Raises:
        ValueError: not NxD with N >= 10 and D >= 1.
    """
    try:
        n, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a size is NxD (texts x features), e.g. 6920x4096, got {text!r}") \
            from None
    if n < 10 or d < 1:
        raise ValueError(f"a size needs N >= 10 and D >= 1, got {text!r}")
    return n, d


def synthetic_problem(n: int, d: int, n_val: int = 872, seed: int = 0, factors: int = 256,
                      informative: int = 64) -> tuple[np.ndarray, ...]:
    """(Xtr float32 [n, d], ytr int64 [n], Xva [n_val, d], yva [n_val]) imitating LM features
    (see the module docstring): X = F A + 0.5 E scaled per column by exp(N(0, 1)), y ~
    Bernoulli(sigmoid(3 z / std(z))) with z = X w and w non-zero on ``informative`` columns."""
    rng = np.random.default_rng(seed)
    r = min(factors, d)
    A = (rng.normal(size=(r, d)) / np.sqrt(r)).astype(np.float32)
    scales = np.exp(rng.normal(size=d)).astype(np.float32)
    w = np.zeros(d, dtype=np.float32)
    k = min(informative, d)
    w[rng.choice(d, k, replace=False)] = rng.normal(size=k)
    out = []
    for m in (n, n_val):
        X = rng.normal(size=(m, r)).astype(np.float32) @ A
        X += 0.5 * rng.normal(size=(m, d)).astype(np.float32)
        z = X @ w
        y = (rng.random(m) < 1 / (1 + np.exp(-3 * z / z.std()))).astype(np.int64)
        out += [X * scales, y]
    return tuple(out)


# ---- settings -----------------------------------------------------------------------------------

@dataclass
class FitConfig:
    """The fit every solver runs."""

    c_grid: tuple[float, ...] = option(classify.DEFAULT_C_GRID, "comma-separated C values (default "
                                       "the transfer grid, 2^-8..2^2: 11 values)", gt=0)
    penalty: str = option("l1", "penalty", choices=("l1", "l2"))
    tol: float = option(0.0, "tolerance (0 = scikit-learn's, 1e-4)", ge=0)
    max_iter: int = option(0, "iterations per fit (0 = scikit-learn's, 1000)", ge=0)
    folds: int = option(classify.DEFAULT_FOLDS, "cross-validation folds", ge=2)
    standardize: bool = option(True, "z-score with train statistics, as transfer "
                               "(--no-standardize: raw features)", switch=False,
                               flag="--no-standardize")
    seed: int = option(0, "seed (synthetic data, liblinear/saga, folds)", ge=0)


@dataclass
class WorkerConfig(FitConfig):
    """One fit (``python -m benchmarks.bench_transfer --worker PROBLEM.npz --solver S``)."""

    worker: str = option("", "problem file (Xtr, ytr, Xva, yva)", required=True)
    solver: str = option("liblinear", "solver", choices=classify.SOLVERS[1:])
    threads: int = option(0, "worker processes of the cross-validation's fits (0 = one per "
                          "usable core)", ge=0)


@dataclass
class BenchTransferConfig(FitConfig):
    """``python -m benchmarks transfer``."""

    sizes: list[str] = option(default_factory=lambda: ["6920x4096"], help="synthetic training "
                              "sets NxD (texts x features), comma-separated; none: ''")
    val: int = option(872, "synthetic validation texts (SST-2's val has 872)", ge=10)
    solvers: list[str] = option(default_factory=lambda: ["liblinear", "saga"],
                                help="solvers to time", choices=classify.SOLVERS[1:])
    threads: list[int] = option(default_factory=lambda: [0], help="worker-process counts of the "
                                "cross-validation's fits to time each solver with (0 = one per "
                                "usable core), e.g. 1,2", ge=0)
    device: str = option("auto", "device the real features are computed on")
    repeats: int = option(1, "rounds (solvers take turns); the median is reported", ge=1)
    time_limit: float = option(900.0, "seconds a fit may take before it is stopped", gt=0)
    checkpoint: str = option("", "also real features: this checkpoint's on --dataset")
    dataset: str | None = option(None, "dataset of the real features", choices=("sst2", "imdb"))
    data_dir: str | None = option(None, "its folder (or IMDB tarball)")
    features: str = option("cell", "feature kind of the real features", choices=FEATURE_KINDS)
    max_examples: int = option(0, "at most N examples per split of the real data (0 = all)",
                               ge=0)
    cache_dir: str = option(DEFAULT_CACHE_DIR, "transfer feature cache")
    json: str = option("", "write the results here")

    def check(self) -> None:
        """Sizes parse; a checkpoint needs a dataset."""
        for s in self.sizes:
            parse_size(s)
        if self.checkpoint and not (self.dataset and self.data_dir):
            raise ValueError("--checkpoint needs --dataset and --data-dir")


# ---- one fit (worker process) ------------------------------------------------------------------

def worker(cfg: WorkerConfig) -> int:
    """Run transfer's fit (:func:`hvd_lm.transfer.fit.fit_logreg`) on the problem file and
    print one ``BENCH {json}`` line: seconds, the chosen C, its fold and validation accuracy,
    non-zero weights, convergence, and every C's mean fold accuracy."""
    with np.load(cfg.worker) as z:
        Xtr, ytr, Xva, yva = (z[k] for k in ("Xtr", "ytr", "Xva", "yva"))
    jobs = cfg.threads or classify.usable_cores()
    r = classify.fit_logreg(Xtr, ytr, Xva, yva, penalty=cfg.penalty, grid=cfg.c_grid,
                            seed=cfg.seed, max_iter=cfg.max_iter, standardize=cfg.standardize,
                            solver=cfg.solver, tol=cfg.tol, folds=cfg.folds, jobs=jobs)
    print("BENCH " + json.dumps({
        "solver": r["solver"], "seconds": r["fit_seconds"], "threads": jobs, "C": r["C"],
        "cv": r["accuracy"]["cv"], "val": r["accuracy"]["val"], "nonzero": r["nonzero"],
        "converged": r["converged"], "grid": r["grid"]}), flush=True)
    return 0


def _run_fit(problem: Path, solver: str, threads: int, cfg: BenchTransferConfig) -> dict:
    """One fit of ``solver`` on the problem file, in a worker process (:func:`worker`): its
    record (``seconds`` wall, ``C``, ``cv``/``val`` accuracy in [0, 1], ``nonzero``, ...), with
    ``stopped`` when it took over ``--time-limit`` seconds or was killed 60 s after that.

    Raises:
        RuntimeError: the worker failed (:func:`benchmarks.harness.run_child`, its output).
    """
    wc = WorkerConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(FitConfig)},
                      worker=str(problem), solver=solver, threads=threads)
    cmd = [sys.executable, "-m", "benchmarks.bench_transfer", *to_argv(wc)]
    t0 = time.perf_counter()
    try:
        rec = run_child(cmd, cfg.time_limit + 60, {**os.environ, "PYTHONWARNINGS": "ignore"})[-1]
    except subprocess.TimeoutExpired:
        return {"solver": solver, "stopped": True, "seconds": time.perf_counter() - t0}
    if rec["seconds"] > cfg.time_limit:
        rec["stopped"] = True
    return rec


# ---- the benchmark ----------------------------------------------------------------------------

def _problems(cfg: BenchTransferConfig):
    """(name, Xtr, ytr, Xva, yva) of each problem, features as the fit sees them."""
    for size in cfg.sizes:
        n, d = parse_size(size)
        yield (f"synthetic {n:,} x {d:,}", *synthetic_problem(n, d, cfg.val, cfg.seed))
    if cfg.checkpoint:
        tc = TransferConfig(checkpoint=cfg.checkpoint, out="-", dataset=cfg.dataset,
                            data_dir=cfg.data_dir, max_examples=cfg.max_examples,
                            seed=cfg.seed, features=cfg.features, cache_dir=cfg.cache_dir,
                            device=cfg.device, progress=False)
        splits = datasets.load_splits(tc.dataset, tc.data_dir, max_examples=tc.max_examples,
                                      seed=tc.seed)
        lm = open_lm(tc.checkpoint, tc.device, tc.precision, tc.threads)
        sf = featurize_splits(lm, splits, tc, file_sha256(lm.path))
        tr, va = sf.features["train"], sf.features["val"]
        yield (f"{cfg.dataset} {cfg.features}, H={tr.shape[1]} ({lm.path.name}): "
               f"{tr.shape[0]:,} x {tr.shape[1]:,}", tr, splits["train"].labels, va,
               splits["val"].labels)


def _label(solver: str, threads: int) -> str:
    return solver if threads == 0 else f"{solver}, {threads} thread{'s' * (threads > 1)}"


def run(cfg: BenchTransferConfig) -> dict:
    """Time every solver on every problem (see the module docstring); returns the results."""
    results = {"config": dataclasses.asdict(cfg), "host": os.uname().nodename,
               "cpus": classify.usable_cores(), "problems": []}
    with tempfile.TemporaryDirectory(prefix="bench_transfer_") as tmp:
        for name, Xtr, ytr, Xva, yva in _problems(cfg):
            path = Path(tmp) / "problem.npz"
            np.savez(path, Xtr=Xtr, ytr=ytr, Xva=Xva, yva=yva)
            combos = [(s, t) for s in cfg.solvers for t in cfg.threads]
            runs: dict[str, list[dict]] = {_label(s, t): [] for s, t in combos}
            for r in range(cfg.repeats):
                for s, t in combos:
                    rec = _run_fit(path, s, t, cfg)
                    runs[_label(s, t)].append(rec)
                    print(f"  {name}: {_label(s, t)} round {r + 1}: "
                          + (f"stopped after {cfg.time_limit:.0f} s" if rec.get("stopped")
                             else f"{rec['seconds']:.1f} s"), file=sys.stderr, flush=True)
            results["problems"].append(summarize(name, Xtr.shape, runs))
    return results


def summarize(name: str, shape, runs: dict[str, list[dict]]) -> dict:
    """Per solver: median seconds, ratio to the fastest finished solver, the chosen C, its mean
    fold and validation accuracy, non-zero weights."""
    done = {s: [r for r in rs if not r.get("stopped")] for s, rs in runs.items()}
    rows = {}
    for s, rs in runs.items():
        if not done[s]:
            rows[s] = {"stopped": True, "seconds": min(r["seconds"] for r in rs)}
            continue
        r = done[s][0]
        rows[s] = {"seconds": statistics.median(x["seconds"] for x in done[s]),
                   "all_seconds": [x["seconds"] for x in rs],
                   **{k: r[k] for k in ("threads", "C", "cv", "val", "nonzero", "converged",
                                        "grid")}}
    fastest = min((v["seconds"] for v in rows.values() if not v.get("stopped")), default=None)
    for v in rows.values():
        if not v.get("stopped") and fastest:
            v["x_fastest"] = v["seconds"] / fastest
    return {"problem": name, "shape": list(shape), "solvers": rows}


def format_table(results: dict) -> str:
    """Markdown table: one row per problem and solver."""
    lines = ["| problem | solver (worker processes) | fit s | x fastest | C | CV acc % | "
             "val acc % | non-zero |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    limit = results["config"]["time_limit"]
    for p in results["problems"]:
        for s, v in p["solvers"].items():
            if v.get("stopped"):
                lines.append(f"| {p['problem']} | {s} | > {limit:.0f} (stopped) | - | - | - | - "
                             "| - |")
                continue
            conv = "" if v["converged"] else " (not converged)"
            lines.append(f"| {p['problem']} | {s} ({v['threads']}) | "
                         f"{v['seconds']:.1f}{conv} | {v['x_fastest']:.2f} | {v['C']:g} | "
                         f"{100 * v['cv']:.2f} | {100 * v['val']:.2f} | {v['nonzero']:,} |")
    return "\n".join(lines) + "\n"


def bench_command(cfg: BenchTransferConfig) -> int:
    """``python -m benchmarks transfer``: run, print the table, write ``--json``."""
    results = run(cfg)
    print(format_table(results), end="")
    if cfg.json:
        save_json(cfg.json, results, indent=1)
        print(f"wrote {cfg.json}")
    return 0


BENCH_TRANSFER = Command(
    BenchTransferConfig, bench_command, usage_errors=(ValueError, datasets.DatasetError),
    description="Seconds of the transfer classifier fit (11 C values by k-fold "
    "cross-validation, then the refit) per solver (scikit-learn's liblinear and saga) and "
    "problem size, on synthetic and real LM features, side by side in one run.")
WORKER = Command(WorkerConfig, worker)


if __name__ == "__main__":
    sys.exit(WORKER.main(sys.argv[1:], "python -m benchmarks.bench_transfer"))
