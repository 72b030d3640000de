"""``hvd-lm demo``: the main job end to end on real reviews, driven by one YAML file.

Steps (each one the project's own command, run as a subprocess with its output shown):

1. corpus: the real Amazon review files in ``corpus.shared_dir`` when present, else the public
   copies listed in ``corpus.sources`` downloaded (sha256-verified) into ``corpus.download_dir``;
2. ``python -m data_prep prepare`` -> ``runs/<name>/shards`` (train/val split);
3. ``horovodrun -np N python -m hvd_lm train --config runs/<name>/train.yaml`` (or mpirun);
4. ``python -m hvd_lm eval`` on the validation split, and ``xz -9`` / ``gzip -9`` bits per
   character on the same bytes (:func:`hvd_lm.evaluate.compressor_bpc`);
5. ``python -m hvd_lm transfer`` (SST-2, with the TF-IDF baseline);
6. ``runs/<name>/report.md`` with tables and PNG plots (:mod:`hvd_lm.report`), and a summary.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]


def _flags(options: dict) -> list[str]:
    """``{"shard_size": 4, "resume": True}`` -> ``["--shard-size", "4", "--resume"]``."""
    out = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value not in (False, None):
            out += [flag, str(value)]
    return out


def _run(cmd: list, env: dict | None = None) -> str:
    """Run ``cmd`` showing its output live; return stdout. Raises RuntimeError on failure."""
    print("$ " + " ".join(map(str, cmd)), flush=True)
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=None, text=True,
                            env=env, cwd=REPO)
    out = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        out.append(line)
    if proc.wait() != 0:
        raise RuntimeError(f"step failed ({proc.returncode}): {' '.join(map(str, cmd))}")
    return "".join(out)


def corpus_files(cfg: dict) -> list[Path]:
    """Input files: the shared real files if present, else the verified downloads."""
    shared = (REPO / cfg["shared_dir"]).resolve()
    if shared.is_dir():
        files = sorted(p for p in shared.rglob("*") if p.is_file() and p.suffix in
                       (".gz", ".json", ".csv", ".tsv", ".review", ".txt"))
        if files:
            print(f"corpus: {len(files)} real review files from {shared}")
            return files
    from hvd_lm.download import download_all

    print(f"corpus: {shared} not found; downloading the public sources of {cfg['sources']}")
    return download_all(REPO / cfg["sources"], REPO / cfg["download_dir"])


def _launcher(cfg: dict) -> list[str]:
    n, kind = int(cfg.get("np", 1)), cfg.get("launcher", "horovodrun")
    if kind == "horovodrun":
        return [str(Path(sys.executable).parent / "horovodrun"), "-np", str(n), "-H",
                f"localhost:{n}", f"--{cfg.get('controller', 'mpi')}", sys.executable]
    if kind == "mpirun":
        return ["mpirun", "-np", str(n), "-bind-to", "none", "-map-by", "slot", sys.executable]
    if kind == "none":
        return [sys.executable]
    raise ValueError(f"launch.launcher must be horovodrun, mpirun or none, got {kind!r}")


def val_bytes(shards: Path) -> bytes:
    """The validation split's token stream, as bytes (what the LM is evaluated on)."""
    from hvd_lm.shards import load_manifest, read_tokens

    parts = [read_tokens(s.path, 0, s.tokens) for s in load_manifest(shards).split("val")]
    return np.concatenate(parts).tobytes()


def run_demo(config_path: str | Path) -> Path:
    """Run every step of the demo described by ``config_path``; return the report's path.

    Raises:
        ValueError: a bad config (naming the file and key). RuntimeError: a failed step.
    """
    from hvd_lm.config import from_dict, save_yaml
    from hvd_lm.evaluate import compressor_bpc
    from hvd_lm.report import training_summary, read_metrics, write_report

    config_path = Path(config_path)
    cfg = yaml.safe_load(config_path.read_text())
    for key in ("name", "corpus", "prepare", "launch", "train"):
        if key not in cfg:
            raise ValueError(f"{config_path}: missing top-level key {key!r}")
    t0 = time.time()
    run_dir = REPO / "runs" / cfg["name"]
    shards, train_dir = run_dir / "shards", run_dir / "train"
    run_dir.mkdir(parents=True, exist_ok=True)
    from hvd_lm.launch import local_mpi_env

    env = local_mpi_env()
    timings = {}

    print("\n== 1/5 corpus ==", flush=True)
    files = corpus_files(cfg["corpus"])

    print("\n== 2/5 prepare shards ==", flush=True)
    t = time.time()
    summary_json = run_dir / "prepare_summary.json"
    _run([sys.executable, "-m", "data_prep", "prepare", *files, "--out", shards, "--resume",
          "--summary-json", summary_json, *_flags(cfg["prepare"])], env)
    timings["prepare_s"] = time.time() - t

    print("\n== 3/5 train ==", flush=True)
    t = time.time()
    train_cfg = from_dict(cfg["train"], f"{config_path}: train")
    train_cfg.data.shards = str(shards)
    train_cfg.run.out_dir = str(train_dir)
    if (train_dir / "checkpoints").is_dir():
        train_cfg.run.resume = "auto"  # a second `make demo` continues (or ends at once)
    save_yaml(train_cfg, run_dir / "train.yaml")
    _run([*_launcher(cfg["launch"]), "-m", "hvd_lm", "train", "--config", run_dir / "train.yaml"],
         env)
    timings["train_s"] = time.time() - t

    print("\n== 4/5 evaluate ==", flush=True)
    out = _run([*_launcher(cfg["launch"]), "-m", "hvd_lm", "eval", train_dir, shards,
                "--split", "val", "--batch-size", "8"], env)
    line = [ln for ln in out.splitlines() if '"bpc"' in ln][-1]  # horovodrun prefixes "[0]<stdout>:"
    eval_result, _ = json.JSONDecoder().raw_decode(line[line.index("{"):])  # ignore any suffix
    comp = compressor_bpc(val_bytes(shards), tuple(cfg.get("evaluate", {}).get(
        "compressors", ["xz", "gzip"])))
    (run_dir / "eval.json").write_text(json.dumps({**eval_result, "compressors": comp}, indent=1))

    transfer_dir = None
    if cfg.get("transfer"):
        print("\n== 5/5 sentiment transfer ==", flush=True)
        t = time.time()
        transfer_dir = run_dir / "transfer"
        _run([sys.executable, "-m", "hvd_lm", "transfer", train_dir, "--out", transfer_dir,
              *_flags(cfg["transfer"])], env)
        timings["transfer_s"] = time.time() - t

    prep = json.loads(summary_json.read_text()) if summary_json.exists() else None
    report = write_report(run_dir, train_dir, cfg["name"], eval_result, comp, transfer_dir, prep)
    s = training_summary(read_metrics(train_dir / "metrics.jsonl"))
    lm = eval_result["bpc"]
    print("\n== summary ==")
    print(f"trained {s['steps']} steps on {s['world_size']} ranks, "
          f"{s['median_chars_per_s']:.0f} chars/s")
    print("validation BPC: LM {:.3f} | ".format(lm)
          + " | ".join(f"{c} -9 {v:.3f}" for c, v in comp.items())
          + ("  -> the LM beats them" if all(lm < v for v in comp.values())
             else "  -> the LM does not beat them all"))
    if transfer_dir:
        tr = json.loads((transfer_dir / "transfer.json").read_text())
        print("SST-2: " + _transfer_line(tr))
    print(f"total {time.time() - t0:.0f} s ({', '.join(f'{k} {v:.0f}' for k, v in timings.items())})")
    print(f"report: {report}")
    return report


def _transfer_line(tr: dict) -> str:
    """One line of headline accuracies from a ``transfer.json`` report (hvd_lm.transfer)."""
    acc, neuron = tr["classifier"]["accuracy"], tr["neuron"]
    line = (f"LM {tr['features']['kind']} features val acc {acc['val']:.3f} "
            f"(C={tr['classifier']['C']:g}, {tr['classifier']['nonzero']} non-zero), "
            f"neuron {neuron['index']} alone {neuron['accuracy']['val']:.3f}")
    if tr.get("baseline"):
        line += f"; TF-IDF baseline val acc {tr['baseline']['accuracy']['val']:.3f}"
    return line


def _cmd_download(args: argparse.Namespace) -> int:
    from hvd_lm.download import ChecksumMismatch, download_all

    try:
        download_all(args.sources, args.out, mirror=args.mirror)
    except (ChecksumMismatch, OSError, ValueError) as e:
        print(f"hvd-lm download: ERROR: {e}", file=sys.stderr)
        return 1
    return 0


def add_subcommands(subparsers) -> None:
    """Register ``hvd-lm demo`` and ``hvd-lm download``."""
    d = subparsers.add_parser("download", help="fetch the demo's public review files, each "
                              "verified against its sha256")
    d.add_argument("--sources", default=str(REPO / "configs" / "sources.yaml"))
    d.add_argument("--out", default=str(REPO / "data" / "amazon"), help="destination folder")
    d.add_argument("--mirror", default=None, help="base URL to use instead of the list's")
    d.set_defaults(func=_cmd_download)
    p = subparsers.add_parser("demo", help="end to end on real reviews: prepare, train on 2 ranks, "
                              "evaluate vs xz/gzip, SST-2 transfer, report")
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="demo YAML")
    p.set_defaults(func=lambda a: (run_demo(a.config), 0)[1])
