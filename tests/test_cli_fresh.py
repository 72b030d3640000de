"""Every command as users start it: a fresh interpreter, never the warm one of tests/_warm.py.

* ``--help`` of every command under ``python -X importtime`` (CPython's own list of what an
  interpreter imported), and of every benchmark (``python -m benchmarks NAME``): exit 0, and
  the import promises of hvd_lm/cli.py and the commands' docs hold (``hvd-lm --help`` loads
  nothing heavy; ``prepare`` and ``verify`` no torch; ``classify``, ``generate`` and
  ``visualize`` no scikit-learn, scipy or pyplot...).
* One tiny real invocation of every command that works on this machine without a network, a
  cluster or a GPU, chained as a user would (prepare, verify, train, eval, export, transfer,
  classify, generate, visualize, launch, kernels, doctor), each a fresh ``python -m hvd_lm``;
  the rest (download, demo, check-build, import-openai, the benchmarks) run
  fresh where their own tests start them (tests/test_demo.py, tests/test_foundation.py,
  tests/test_export.py, tests/test_bench_*.py).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import BENCHMARKS
from hvd_lm.cli import COMMANDS
from tests._mp import REPO, launch_env
from tests.shardutil import review_texts

#: Modules a command's start must not import (what its docs promise): checked on ``--help``.
HEAVY = {"torch", "sklearn", "scipy", "matplotlib.pyplot", "horovod"}
NOT_IMPORTED = {
    "": HEAVY | {"numpy", "h5py"},                       # hvd-lm --help loads nothing
    "prepare": HEAVY, "verify": HEAVY, "doctor": HEAVY | {"numpy"}, "launch": HEAVY,
    "download": HEAVY | {"numpy"}, "kernels": HEAVY - {"scipy"},
    "classify": HEAVY - {"torch"}, "generate": HEAVY - {"torch"}, "visualize": HEAVY - {"torch"},
    "train": {"sklearn", "scipy", "matplotlib.pyplot"}, "eval": {"sklearn", "matplotlib.pyplot"},
    "export": {"sklearn", "matplotlib.pyplot"}, "import-openai": {"sklearn", "matplotlib.pyplot"},
}


def fresh(*argv: str, cwd=REPO, timeout: float = 300, importtime: bool = False,
          module: str = "hvd_lm") -> subprocess.CompletedProcess:
    """``python [-X importtime] -m MODULE ARGV``, always a new interpreter."""
    x = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *x, "-m", module, *map(str, argv)], cwd=cwd,
                          env=launch_env(), capture_output=True, text=True, timeout=timeout)


def imported(stderr: str) -> set[str]:
    """The modules ``-X importtime`` says were imported."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("words", [[], *([c] for c in COMMANDS)],
                         ids=lambda w: " ".join(w) or "hvd-lm")
def test_help_of_every_command_runs_fresh_and_imports_what_it_promises(words):
    proc = fresh(*words, "--help", importtime=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: hvd-lm" + "".join(f" {w}" for w in words))
    loaded = imported(proc.stderr)
    assert "hvd_lm.cli" in loaded
    wrong = sorted(NOT_IMPORTED.get(" ".join(words), set()) & loaded)
    assert not wrong, f"hvd-lm {' '.join(words)} --help imported {wrong}"


@pytest.mark.parametrize("name", [None, *BENCHMARKS])
def test_help_of_every_benchmark_runs_fresh_from_any_folder(name, tmp_path):
    """``python -m benchmarks [NAME] --help`` from a folder outside the checkout (the checkout
    on PYTHONPATH, as docs/performance.md says): exit 0, its own usage line."""
    words = [name] if name else []
    proc = fresh(*words, "--help", module="benchmarks", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m benchmarks" + "".join(f" {w}" for w in words))


@pytest.mark.slow
def test_every_command_runs_fresh_once(tmp_path):
    """A user's first session, each command a new interpreter: what each wrote is what the
    next reads."""
    (tmp_path / "reviews.txt").write_text("\n".join(review_texts(120)) + "\n")

    def ok(*argv, **kw):
        proc = fresh(*argv, cwd=tmp_path, **kw)
        assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-3000:])
        return proc

    p = fresh("prepare", "reviews.txt", "--out", "shards", "--split", "8,1,0", "--workers", "1",
              "--no-progress", cwd=tmp_path, importtime=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not imported(p.stderr) & HEAVY, "prepare imported the training stack"
    ok("verify", "shards")
    tiny = ["--hidden-size", "16", "--embed-dim", "8", "--seq-len", "16", "--batch-size", "2",
            "--threads", "1", "--device", "cpu", "--log-every", "1"]
    ok("train", "--shards", "shards", "--out-dir", "run", *tiny, "--max-steps", "3")
    bpc = json.loads(ok("eval", "run", "shards").stdout.strip().splitlines()[-1])["bpc"]
    assert 0 < bpc < 9
    ok("export", "run", "exported")
    rows = ["label,text"] + [f"{i % 2},{'great album' if i % 2 else 'awful noise'} {i}"
                             for i in range(24)]
    (tmp_path / "labelled.csv").write_text("\n".join(rows) + "\n")
    ok("transfer", "exported", "--train", "labelled.csv", "--out", "clf", "--no-cache",
       "--no-progress", "--no-baseline", "--threads", "1")
    c = fresh("classify", "run", "clf", "--input", "labelled.csv", "--output", "pred.csv",
              cwd=tmp_path, importtime=True)
    assert c.returncode == 0 and not imported(c.stderr) & {"sklearn", "scipy"}, c.stderr[-2000:]
    assert len((tmp_path / "pred.csv").read_text().splitlines()) == 25
    ok("generate", "run", "--length", "20", "--samples", "1", "--seed", "1")
    (tmp_path / "texts.txt").write_text("Great value.\nBroke in a day.\n")
    ok("visualize", "run", "--classifier", "clf", "--input", "texts.txt", "--out", "v.html")
    assert fresh("scaling-report", "run", module="benchmarks", cwd=tmp_path).returncode == 0
    ok("launch", "--scheduler", "slurm", "--gpus", "16", "--gpus-per-node", "8",
       "--walltime", "4:00:00", "--out", "job.sbatch", "--", "--shards", "shards")
    assert fresh("scaling-model", "--gpus", "8", module="benchmarks", cwd=tmp_path).returncode == 0
    ok("kernels", "--help")  # building kernels needs Triton's compiler: tests/test_mlstm_fused.py
    d = json.loads(ok("doctor", "--hosts", "localhost:1", "--shards", "shards", "--format",
                      "json", timeout=120).stdout)
    from hvd_lm.formats.manifest import load_manifest
    assert d["errors"] == [] and d["facts"]["localhost"]["shards"]["shards"] == len(
        load_manifest(tmp_path / "shards").shards)
