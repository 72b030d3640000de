"""Run reports: plots and a markdown page built only from a run's own output files.

Every number in ``report.md`` is read from the files the steps wrote (``metrics.jsonl`` of the
training run, the ``hvd-lm eval`` JSON, the compressor figures, ``transfer.json``, the prepare
summary), so the report can always be checked against them (tests/test_demo.py does).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

from hvd_lm.train.log import read_metrics
from hvd_lm.util.atomic import write_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def training_summary(records: list[dict]) -> dict:
    """Headline figures of a training run from its metrics records.

    Returns a dict with ``steps``, ``world_size``, ``global_batch``, ``params``, ``chars_trained``,
    ``final_train_bpc``, ``final_val_bpc`` (None without validation), ``median_chars_per_s``
    (chars/s over all ranks) and ``wall_s`` (seconds from the start record to the last record).
    """
    start = next(r for r in records if r["kind"] == "start")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    end = next((r for r in records if r["kind"] == "end"), None)
    return {
        "steps": train[-1]["step"] if train else 0,
        **{k: start[k] for k in ("world_size", "global_batch", "params")},
        "chars_trained": end["chars_trained"] if end else None,
        "final_train_bpc": train[-1]["bpc"] if train else None,
        "final_val_bpc": evals[-1]["val_bpc"] if evals else None,
        "median_chars_per_s": statistics.median(r["chars_per_s"] for r in train) if train else None,
        "wall_s": records[-1]["time"] - start["time"],
    }


#: The training plots :func:`plot_training` writes: (file, x key, x label, y label).
PLOTS = (("bpc_vs_step.png", "step", "optimizer step", "bits per character"),
         ("bpc_vs_time.png", "time", "wall time (s)", "bits per character"),
         ("chars_per_s.png", "step", "optimizer step", "chars/s (all ranks)"))


def plot_training(records: list[dict], out_dir: str | Path) -> list[Path]:
    """PNG plots: BPC (train and validation) against step and against wall time, and chars/s
    against step. Returns the files written."""
    out_dir = Path(out_dir)
    start = next(r for r in records if r["kind"] == "start")["time"]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    for name, key, xlabel, ylabel in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [r[key] - (start if key == "time" else 0) for r in train]
        if name == "chars_per_s.png":
            ax.plot(x, [r["chars_per_s"] for r in train])
            ax.set_ylim(bottom=0)  # a rate's axis from 0: a 5% wobble does not look like a halving
        else:
            ax.plot(x, [r["bpc"] for r in train], label="train BPC")
            if evals:
                ax.plot([r[key] - (start if key == "time" else 0) for r in evals],
                        [r["val_bpc"] for r in evals], "o-", label="validation BPC")
            ax.legend()
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
    return [out_dir / name for name, *_ in PLOTS]


def write_report(run_dir: str | Path, train_dir: str | Path, name: str, eval_result: dict,
                 compressors: dict[str, float], transfer_dir: str | Path | None,
                 prepare_summary: dict | None = None) -> Path:
    """Write ``<run_dir>/report.md`` (plus plots) from the run's files; return its path.

    Args:
        train_dir: the training run directory (its ``metrics.jsonl``).
        eval_result: the JSON printed by ``hvd-lm eval`` (keys ``bpc``, ``chars``, ``step``).
        compressors: compressor name -> BPC on the same validation bytes.
        transfer_dir: folder with ``transfer.json``/``transfer.md``/``neuron_hist.png``, or None.
        prepare_summary: the data_prep summary JSON, or None.
    """
    run_dir = Path(run_dir)
    records = read_metrics(Path(train_dir) / "metrics.jsonl")
    s = training_summary(records)
    plot_training(records, run_dir)
    lm = eval_result["bpc"]
    beaten = [c for c, v in compressors.items() if lm < v]
    lines = [f"# hvd_lm report: {name}", ""]
    if prepare_summary:
        c, sd = prepare_summary["counters"], prepare_summary["split_documents"]
        lines += ["## Data", "",
                  "| input files | records | bytes in | duplicates | too short | bad | documents "
                  "(train / val / test) | tokens (bytes) | shards |",
                  "|---:|---:|---:|---:|---:|---:|---|---:|---:|",
                  f"| {len(prepare_summary['inputs'])} | {c['records']:,} | {c['bytes_in']:,} | "
                  f"{c['duplicates']:,} | {c['too_short']:,} | {c['bad_records']:,} | "
                  f"{sd['train']:,} / {sd['val']:,} / {sd['test']:,} | {c['tokens']:,} | "
                  f"{prepare_summary['totals']['shards']} |", ""]
    lines += [
        "## Training", "",
        "| ranks | global batch | parameters | steps | chars trained | median chars/s | wall s |"
        " final train BPC |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['world_size']} | {s['global_batch']} | {s['params']:,} | {s['steps']} | "
        f"{s['chars_trained']:,} | {s['median_chars_per_s']:.0f} | {s['wall_s']:.0f} | "
        f"{s['final_train_bpc']:.4f} |", "",
        "![BPC against step](bpc_vs_step.png) ![BPC against wall time](bpc_vs_time.png)",
        "![chars/s](chars_per_s.png)", "",
        "## Bits per character on the validation bytes", "",
        "| model | BPC |", "|---|---:|",
        f"| mLSTM (step {eval_result['step']}, {eval_result['chars']:,} chars) | {lm:.4f} |",
    ]
    lines += [f"| `{c} -9` | {v:.4f} |" for c, v in compressors.items()]
    verdict = ("beats " + " and ".join(f"`{c} -9`" for c in beaten)) if beaten else \
        "does NOT beat the compressors yet (train longer or larger)"
    lines += ["", f"The language model {verdict}.", ""]
    if transfer_dir and (Path(transfer_dir) / "transfer.md").exists():
        t = Path(transfer_dir)
        lines += ["## Sentiment transfer", "", (t / "transfer.md").read_text().strip(), ""]
        if (t / "neuron_hist.png").exists():
            lines += [f"![sentiment neuron]({(t / 'neuron_hist.png').relative_to(run_dir)})", ""]
    return write_text(run_dir / "report.md", "\n".join(lines) + "\n")
