"""``hvd-lm demo``: the main job end to end on real reviews, driven by one YAML file.

The file is one :class:`DemoConfig` tree whose sections are the other commands' own settings
(``prepare`` = :class:`data_prep.settings.PrepareConfig`, ``train`` =
:class:`hvd_lm.train.settings.TrainConfig`, ``transfer`` =
:class:`hvd_lm.transfer.run.TransferConfig`); the whole file is validated before the first step
runs. Steps (each the project's own command, run as a subprocess with its output shown and its
settings passed as a YAML file in the run folder):

1. corpus: the real Amazon review files in ``corpus.shared_dir`` when present, else the public
   copies listed in ``corpus.sources`` downloaded (sha256-verified) into ``corpus.download_dir``;
2. ``python -m data_prep prepare --config runs/<name>/prepare.yaml`` -> ``runs/<name>/shards``;
3. ``horovodrun -np N python -m hvd_lm train --config runs/<name>/train.yaml`` (or mpirun);
4. ``python -m hvd_lm eval ... --output runs/<name>/eval_lm.json`` on the validation split, and
   ``xz -9`` / ``gzip -9`` bits per character on the same bytes (``hvd-lm eval --baselines``,
   :func:`hvd_lm.train.evaluate.compressor_bpc`);
5. ``python -m hvd_lm transfer --config runs/<name>/transfer.yaml`` (SST-2, TF-IDF baseline);
6. ``runs/<name>/report.md`` with tables and PNG plots (:mod:`hvd_lm.jobs.report`), and a summary.

Every result is read from the files a step writes, never from its printed output. Like the CLI
table, this job sits above both packages, so it imports ``data_prep`` (for the section's type).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import hvd_lm
from data_prep.resume import finished_with_other_inputs
from data_prep.settings import PrepareConfig
from hvd_lm import options
from hvd_lm.jobs.download import download_all
from hvd_lm.jobs.job_scripts import horovodrun_argv, local_mpi_env, mpirun_argv
from hvd_lm.jobs.report import training_summary, write_report
from hvd_lm.options import Command, option
from hvd_lm.train.log import read_metrics
from hvd_lm.train.settings import TrainConfig
from hvd_lm.transfer.run import TransferConfig
from hvd_lm.util.atomic import write_text

REPO = hvd_lm.REPO_ROOT
CORPUS_SUFFIXES = (".gz", ".json", ".csv", ".tsv", ".review", ".txt")


@dataclass
class CorpusConfig:
    """Where the review text comes from (paths relative to the working directory)."""

    shared_dir: str = option("../shared/data/amazon", "real review files, used when this "
                             "folder exists")
    sources: str = option("configs/sources.yaml", "otherwise these public files are downloaded...")
    download_dir: str = option("data/amazon", "...here, each verified against its sha256")


@dataclass
class DemoLaunchConfig:
    """How the training (and evaluation) ranks start on this machine."""

    launcher: str = option("horovodrun", "horovodrun, mpirun, or none (one process)",
                           choices=("horovodrun", "mpirun", "none"))
    np: int = option(2, "ranks", ge=1)
    controller: str = option("mpi", "horovodrun --mpi or --gloo", choices=("mpi", "gloo"))


@dataclass
class EvaluateConfig:
    """The baselines the LM's validation BPC is compared with."""

    compressors: list[str] = option(default_factory=lambda: ["xz", "gzip"], help="BPC of `xz -9` "
                                    "and `gzip -9` on the same bytes", choices=("xz", "gzip"))
    batch_size: int = option(8, "eval rows per rank", ge=1)


@dataclass
class DemoConfig:
    """``configs/demo.yaml``: every step's settings."""

    name: str = option("demo", "outputs go to runs/<name>/")
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    launch: DemoLaunchConfig = field(default_factory=DemoLaunchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    transfer_enabled: bool = option(True, "run the transfer step")
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def check(self) -> None:
        """The name is a plain folder name."""
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name must be a plain folder name, got {self.name!r}")


def _run(cmd: list, env: dict | None = None) -> float:
    """Run ``cmd`` showing its output live; returns its wall seconds.

    Raises:
        RuntimeError: it failed (naming the command and its exit status).
    """
    print("$ " + " ".join(map(str, cmd)), flush=True)
    t = time.time()
    if rc := subprocess.run([str(c) for c in cmd], env=env).returncode:
        raise RuntimeError(f"step failed ({rc}): {' '.join(map(str, cmd))}")
    return time.time() - t


def corpus_files(cfg: CorpusConfig) -> list[Path]:
    """Input files: the shared real files if present, else the verified downloads."""
    shared = Path(cfg.shared_dir).resolve()
    # (rglob finds nothing where the folder is missing)
    if files := sorted(p for p in shared.rglob("*") if p.is_file() and p.suffix in CORPUS_SUFFIXES):
        print(f"corpus: {len(files)} real review files from {shared}")
        return files
    print(f"corpus: {shared} not found; downloading the public sources of {cfg.sources}")
    return download_all(Path(cfg.sources), Path(cfg.download_dir))


def launcher_argv(cfg: DemoLaunchConfig, argv: list[str]) -> list[str]:
    """``argv`` (after the interpreter) started by ``cfg``'s launcher on this machine."""
    if cfg.launcher == "horovodrun":
        return horovodrun_argv(cfg.np, argv, cfg.controller)
    return mpirun_argv(cfg.np, argv) if cfg.launcher == "mpirun" else [sys.executable, *argv]


def demo(cfg: DemoConfig) -> int:
    """Run every step of the demo described by ``cfg`` (validated as a whole when it was
    loaded: :data:`DEMO`); print where the report went; return 0.

    Raises:
        RuntimeError: a failed step.
    """
    t0 = time.time()
    # runs/<name> in the working directory, as every path of the config: relative to where the
    # demo is run, like every hvd-lm command's paths (`make demo` runs it from the repository)
    run_dir = (Path.cwd() / "runs" / cfg.name).absolute()
    shards, train_dir = run_dir / "shards", run_dir / "train"
    run_dir.mkdir(parents=True, exist_ok=True)
    env = local_mpi_env()
    timings = {}

    print("\n== 1/5 corpus ==", flush=True)
    files = corpus_files(cfg.corpus)

    print("\n== 2/5 prepare shards ==", flush=True)
    prep = cfg.prepare
    prep.inputs, prep.out, prep.resume = [str(f) for f in files], str(shards), True
    if finished_with_other_inputs(prep):  # e.g. the corpus was copied again: start afresh
        print(f"{shards} was prepared from other input files or settings: rebuilding "
              f"{run_dir} (shards and training run)", flush=True)
        for d in (shards, train_dir, run_dir / "transfer"):
            shutil.rmtree(d, ignore_errors=True)
    prep.summary_json = str(run_dir / "prepare_summary.json")
    options.save_yaml(prep, run_dir / "prepare.yaml")
    timings["prepare_s"] = _run([sys.executable, "-m", "data_prep", "prepare", "--config",
                                 run_dir / "prepare.yaml"], env)

    print("\n== 3/5 train ==", flush=True)
    cfg.train.data.shards = str(shards)
    cfg.train.run.out_dir = str(train_dir)
    if (train_dir / "checkpoints").is_dir():
        cfg.train.run.resume = "auto"  # a second `make demo` continues (or ends at once)
    options.save_yaml(cfg.train, run_dir / "train.yaml")
    timings["train_s"] = _run(launcher_argv(cfg.launch, ["-m", "hvd_lm", "train", "--config",
                                                         str(run_dir / "train.yaml")]), env)

    print("\n== 4/5 evaluate ==", flush=True)
    lm_json = run_dir / "eval_lm.json"
    lm_json.unlink(missing_ok=True)
    baselines = ["--baselines", ",".join(cfg.evaluate.compressors)]
    _run(launcher_argv(cfg.launch, [
        "-m", "hvd_lm", "eval", str(train_dir), str(shards), "--split", "val", "--batch-size",
        str(cfg.evaluate.batch_size), "--output", str(lm_json),
        # the ranks of training: on its device (2 CPU ranks on a 1-GPU node cannot share the GPU)
        "--device", cfg.train.run.device, *(baselines if cfg.evaluate.compressors else [])]), env)
    eval_result = json.loads(lm_json.read_text())
    comp = eval_result.pop("baselines", {})
    write_text(run_dir / "eval.json", json.dumps({**eval_result, "compressors": comp}, indent=1))

    transfer_dir = None
    if cfg.transfer_enabled:
        print("\n== 5/5 sentiment transfer ==", flush=True)
        transfer_dir = run_dir / "transfer"
        cfg.transfer.checkpoint, cfg.transfer.out = str(train_dir), str(transfer_dir)
        options.save_yaml(cfg.transfer, run_dir / "transfer.yaml")
        timings["transfer_s"] = _run([sys.executable, "-m", "hvd_lm", "transfer", "--config",
                                      run_dir / "transfer.yaml"], env)

    summary_json = Path(prep.summary_json)
    prep_summary = json.loads(summary_json.read_text()) if summary_json.exists() else None
    report = write_report(run_dir, train_dir, cfg.name, eval_result, comp, transfer_dir,
                          prep_summary)
    s = training_summary(read_metrics(train_dir / "metrics.jsonl"))
    lm = eval_result["bpc"]
    print("\n== summary ==")
    print(f"trained {s['steps']} steps on {s['world_size']} ranks, "
          f"{s['median_chars_per_s']:.0f} chars/s")
    print(f"validation BPC: LM {lm:.3f} | " + " | ".join(f"{c} -9 {v:.3f}" for c, v in comp.items())
          + ("  -> the LM beats them" if all(lm < v for v in comp.values())
             else "  -> the LM does not beat them all"))
    tr = json.loads((transfer_dir / "transfer.json").read_text()) if transfer_dir else None
    total = time.time() - t0
    headline = demo_summary(s, eval_result, comp, tr, total, timings)
    if tr:
        print("SST-2: " + transfer_line(headline["transfer"]))
    print(f"total {total:.0f} s ({', '.join(f'{k} {v:.0f}' for k, v in timings.items())})")
    write_text(run_dir / "summary.json", json.dumps(headline, indent=1) + "\n")
    print(f"report: {report} (headline figures: {run_dir / 'summary.json'})")
    return 0


def demo_summary(train: dict, eval_result: dict, compressors: dict[str, float],
                 transfer: dict | None, total_s: float, timings: dict[str, float]) -> dict:
    """The demo's headline figures in one JSON object (``runs/<name>/summary.json``; README's
    demo paragraph quotes the committed copy ``docs/results/demo.json``, checked by
    tests/test_figures.py).

    Args:
        train: :func:`hvd_lm.jobs.report.training_summary` of the run (``median_chars_per_s``
            in chars/s, ``wall_s`` in seconds).
        eval_result: ``hvd-lm eval``'s JSON (``bpc`` in bits per char over ``chars`` bytes).
        transfer: the ``transfer.json`` report, or None when transfer was off.
        total_s, timings: wall seconds of the whole demo and of its steps.
    """
    out = {"total_s": round(total_s, 1), "timings_s": {k: round(v, 1) for k, v in timings.items()},
           "world_size": train["world_size"], "steps": train["steps"],
           "median_chars_per_s": train["median_chars_per_s"], "val_bpc": eval_result["bpc"],
           "val_chars": eval_result["chars"], "compressor_bpc": compressors}
    if transfer:
        clf, neuron = transfer["classifier"], transfer["neuron"]
        out["transfer"] = {
            "dataset": transfer["dataset"]["name"], "features": transfer["features"]["kind"],
            "val_acc": clf["accuracy"]["val"], "cv_acc": clf["accuracy"]["cv"],
            "cv_folds": clf["cv"]["folds"], "C": clf["C"], "nonzero": clf["nonzero"],
            "neuron": neuron["index"], "neuron_val_acc": neuron["accuracy"]["val"],
            "baseline_val_acc": (transfer.get("baseline") or {}).get("accuracy", {}).get("val")}
    return out


def transfer_line(t: dict) -> str:
    """One line of headline accuracies from :func:`demo_summary`'s ``transfer`` figures."""
    line = (f"LM {t['features']} features val acc {t['val_acc']:.3f} (C={t['C']:g} by "
            f"{t['cv_folds']}-fold CV on train: {t['cv_acc']:.3f}; {t['nonzero']} non-zero), "
            f"neuron {t['neuron']} alone {t['neuron_val_acc']:.3f}")
    if t["baseline_val_acc"] is not None:
        line += f"; TF-IDF baseline val acc {t['baseline_val_acc']:.3f}"
    return line


DEMO = Command(DemoConfig, demo, flags=False, default_config=str(REPO / "configs" / "demo.yaml"),
               description="End to end on real reviews: prepare, train on 2 ranks, evaluate vs "
               "xz/gzip, SST-2 transfer, report (every step's settings in one YAML file).")
