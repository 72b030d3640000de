"""The GPU node, rehearsed on this CPU machine: ``scripts/gpu_check.sh --stage setup`` run the way
a lent H100 runs it, so that the first call there measures instead of debugging setup.

That node (``../shared/README.md``): its ``python3`` is itself a virtual environment
(``/opt/torch/.venv``) holding torch, numpy, h5py, mpi4py, scikit-learn, pytest, matplotlib...
but no Horovod, orjson, pytorch-optimizer or cffi; no package index and no apt. Here the "image"
is a virtual environment made from this interpreter's base Python, holding this project's own
packages less the ones that image lacks (linked, not copied: seconds); the wheelhouse is the one
``scripts/fetch_offline_wheels.sh`` assembles (for this Python's version), the only package
source; ``apt-get`` is a stand-in that records being called. Horovod comes from the wheel cache
``make setup`` filled (the rehearsal is about the venv, not the build: the build's flags are
tested in tests/test_build_horovod.py)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hvd_lm.formats.checkpoint import resolve
from hvd_lm.formats.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
#: Distributions the node's image does not hold (../shared/README.md, device KINDS.md).
IMAGE_LACKS = {"horovod", "hvd-lm", "hvd_lm", "cffi", "pycparser", "orjson", "pytorch-optimizer",
               "pytorch_optimizer", "mktestdocs"}


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """scripts/fetch_offline_wheels.sh's folder for this Python, cached per version of the
    script (~/.cache/hvd_lm/wheelhouse-<py>-<hash>); skips where the registry is unreachable."""
    script = REPO / "scripts/fetch_offline_wheels.sh"
    py = "%d.%d" % sys.version_info[:2]
    key = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hvd_lm"
    dest = cache / f"wheelhouse-{py}-{key}"
    if (dest / ".complete").exists():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    proc = subprocess.run(["bash", script, tmp], env=dict(os.environ, PY_VERSION=py),
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.skip("could not assemble the offline wheelhouse (no package index here?): "
                    + (proc.stderr.strip().splitlines() or ["?"])[-1])
    assert "MiB in" in proc.stdout.splitlines()[-1], proc.stdout  # the total is stated
    (tmp / ".complete").write_text("")
    tmp.rename(dest)
    return dest


def make_image(root: Path) -> Path:
    """A virtual environment at ``root`` holding this project's packages less
    :data:`IMAGE_LACKS` (symlinked from this venv's site-packages); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", root], check=True, timeout=120)
    src = Path(sysconfig.get_paths()["purelib"])
    dst = Path(subprocess.run([root / "bin/python", "-c", "import sysconfig; "
                               "print(sysconfig.get_paths()['purelib'])"], check=True,
                              capture_output=True, text=True).stdout.strip())
    lacking: set[str] = set()
    for dist in importlib.metadata.distributions(path=[str(src)]):
        if dist.metadata["Name"].lower().replace("_", "-") in IMAGE_LACKS:
            # its files' top-level entries, its .dist-info folder among them
            lacking |= {Path(str(f)).parts[0] for f in dist.files or []}
    for entry in src.iterdir():
        name = entry.name
        if name in lacking or name.startswith(("__editable__", "_hvd_lm", "hvd_lm")) \
                or (dst / name).exists():
            continue
        (dst / name).symlink_to(entry)
    return root / "bin/python"


def apt_stand_in(folder: Path) -> Path:
    """A folder whose ``apt-get`` records each call in ``calls`` and fails (no mirror)."""
    folder.mkdir()
    (folder / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >>{folder}/calls\nexit 100\n")
    (folder / "apt-get").chmod(0o755)
    return folder


@pytest.mark.slow
def test_gpu_check_setup_on_a_nested_venv_image_offline(tmp_path, wheelhouse):
    """Issue 32 (failed before: a venv made with --system-site-packages from a venv's python
    sees the base interpreter's packages only, so torch was missing in .venv and
    `pip install torch==2.13.0` failed with no index; apt-get was tried offline). The setup
    stage ends green: torch, numpy, h5py and mpi4py come from the image, the rest from the
    wheelhouse, Horovod from the cached build, `hvd-lm check-build` passes, apt-get is never
    called; a second run is seconds (the stamp)."""
    image = make_image(tmp_path / "image")
    apt = apt_stand_in(tmp_path / "apt")
    venv, out = tmp_path / "node-venv", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHON=str(image), VENV=str(venv), PIP_CONFIG_FILE=os.devnull,
               PATH=f"{apt}:{os.environ['PATH']}")
    cmd = ["bash", REPO / "scripts/gpu_check.sh", "--stage", "setup", wheelhouse, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = (out / "setup.log").read_text() if (out / "setup.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + log[-4000:]
    assert "is a virtual environment: its site-packages are visible" in log
    assert not (apt / "calls").exists(), (apt / "calls").read_text()
    probe = ("import torch, numpy, h5py, mpi4py, horovod.torch, hvd_lm, orjson, "
             "pytorch_optimizer; print(torch.__file__)")
    where = subprocess.run([venv / "bin/python", "-c", probe], capture_output=True, text=True,
                           timeout=120)
    assert where.returncode == 0, where.stderr
    assert str(tmp_path / "image") in where.stdout  # torch is the image's, not reinstalled
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"]["setup"]["exit_status"] == 0

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:]
    assert "ready (stamp" in (out / "setup.log").read_text()  # nothing set up again


@pytest.mark.slow
def test_gpu_session_runs_both_calls_on_the_cpu(tmp_path):
    """``scripts/gpu_session.sh``'s two calls rehearsed at tiny shapes (SMALL=1, DEVICE=cpu) with
    an "image" python that lacks Horovod, orjson and pytorch-optimizer, as the node's does, on the
    planner's virtual clock (HVD_LM_VIRTUAL_STEP_S: the plan does not depend on this machine's
    speed). Call 1: the bench's fastest fused bf16 variant (recomputed here) trains the first
    part of one --time-budget plan and stops at its --time-limit with a checkpoint, left in
    WORK; call 2 resumes it (no jump in the LR) to the plan's end (LR 0), then the steps after it
    run in order (the cell-state transfer last). OUT holds one tarball per call (the tool returns
    at most 8 files), every result and both timelines, never a checkpoint, whose sha256 it lists
    instead. Without FORCE_CHECKS, the bench runs only when its code's hash differs from
    docs/results/gpu_checked.txt's (computed here independently)."""
    import tarfile

    from tests.shardutil import default_shards
    data = tmp_path / "data"
    default_shards(data / "shards")
    (data / "sst2").mkdir()
    for split, n in (("train", 40), ("val", 20)):
        rows = ["label,sentence"] + [f"{i % 2},{'great fun' if i % 2 else 'dull and bad'} {i}"
                                     for i in range(n)]
        (data / "sst2" / f"{split}.csv").write_text("\n".join(rows) + "\n")
    out, work = tmp_path / "out", tmp_path / "work"
    image = make_image(tmp_path / "image")
    env = {**os.environ, "SMALL": "1", "DEVICE": "cpu", "WIDTH": "16", "TRAIN_BATCH": "4",
           "SKIP": "cuda", "PYTHON": str(image), "WORK": str(work),
           "HVD_LM_VIRTUAL_STEP_S": "0.25"}

    def call(part: str, **extra) -> str:
        shutil.rmtree(out, ignore_errors=True)  # as the device tool empties $OUT before a call
        p = subprocess.run(["bash", str(REPO / "scripts/gpu_session.sh"), str(data), str(out)],
                           env={**env, "PART": part, **extra}, capture_output=True, text=True,
                           timeout=400)
        log = p.stdout + p.stderr
        assert p.returncode == 0, log
        return log

    # whether the bench runs: the hash of its code against the last card's
    files = sorted(str(f.relative_to(REPO)) for f in (REPO / "hvd_lm/model").glob("*.py"))
    files = sorted(files + ["benchmarks/bench_gpu.py", "benchmarks/ceilings.py",
                            "benchmarks/harness.py", "hvd_lm/train/step.py"])
    listing = "".join(f"{hashlib.sha256((REPO / f).read_bytes()).hexdigest()}  {f}\n"
                      for f in files)
    digest = hashlib.sha256(listing.encode()).hexdigest()
    checked = (REPO / "docs/results/gpu_checked.txt").read_text()
    log = call("1", TOTAL_S="60", SKIP="cuda model")
    assert ("bench: its code is the one the last card ran" in log) == \
        (f"bench {digest} " in checked), log
    assert f"code: bench {digest} " in (work / "probe.txt").read_text()

    log = call("1", TOTAL_S="80", BUDGET_S="90", FORCE_CHECKS="1")
    assert "] bench: exit 0" in log and "] train: exit 0" in log and "cuda tests" not in log
    rows = [r for r in json.loads((work / "bench_gpu.json").read_text())["train"]
            if r["impl"].startswith("fused") and r["precision"] == "bf16" and "chars_per_s" in r]
    assert {r["batch_size"] for r in rows} == {4, 128}
    best = max([r for r in rows if r["batch_size"] == 4], key=lambda r: r["chars_per_s"])
    assert f"bf16 {best['impl']}: --time-limit" in log and "--time-budget 90s" in log
    first = json.loads((work / "run/summary.json").read_text())
    assert first["stop"] == "time-limit" and 0 < first["trained_s"] < 90, first
    assert sorted(q.name for q in out.iterdir()) == ["gpu_session1.tar.gz"]

    # budgets far above what the steps take here, so that no verdict hangs on this machine's
    # speed (each part is bounded by its budget: a slow one would be cut, and named)
    log = call("2", TOTAL_S="400", POST_S="300", RESUME_S="5")
    order = ("train", "eval", "transfer", "generate", "generate_unit1.0",
             "generate_unit-1.0", "visualize", "transfer_cell")  # the least valuable last
    for part in order:
        assert f"] {part}: exit 0" in log, (part, log)
    assert [log.index(f"] {part}: exit 0") for part in order] == \
        sorted(log.index(f"] {part}: exit 0") for part in order), log
    assert sorted(q.name for q in out.iterdir()) == ["gpu_session2.tar.gz"]
    with tarfile.open(out / "gpu_session2.tar.gz") as tar:
        names = {n.lstrip("./") for n in tar.getnames()}
    for f in ("bench_gpu.json", "run/metrics.jsonl", "run/summary.json", "eval.json",
              "transfer/transfer.json", "transfer_cell/transfer.json", "samples.jsonl",
              "samples_unit1.0.jsonl", "heatmap.png", "checkpoint.sha256", "train.yaml",
              "probe.txt", "session1.log", "session2.log", "train1.log", "train2.log"):
        assert f in names, f
    assert not [n for n in names if n.endswith(".pt") or n.startswith("data/")]
    recs = [json.loads(x) for x in (work / "run/metrics.jsonl").read_text().splitlines()]
    starts = [r for r in recs if r["kind"] == "start"]
    assert [s["resumed_from"] is None for s in starts] == [True, False]
    assert starts[0]["engine"] == "torch" and starts[1]["trained_s"] == first["trained_s"]
    end = json.loads((work / "run/summary.json").read_text())
    assert end["stop"] == "done" and end["trained_s"] <= end["time_budget_s"], end
    lrs = [r["lr"] for r in recs if r["kind"] == "train"]
    peak = lrs.index(max(lrs))  # after the warmup, down to 0 without a jump at the resume
    assert lrs[-1] == 0.0 and all(b <= a for a, b in zip(lrs[peak:], lrs[peak + 1:])), lrs
    kinds = [json.loads((work / f / "transfer.json").read_text())["features"]["kind"]
             for f in ("transfer", "transfer_cell")]
    assert kinds == ["mean", "cell"]
    listed = dict(reversed(line.split())
                  for line in (work / "checkpoint.sha256").read_text().splitlines())
    assert str(resolve(work / "run")) in listed
    for path, digest in listed.items():
        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest


def test_gpu_data_fits_the_carry(shared_data, tmp_path):
    """``scripts/gpu_data.sh`` (the card's data, made here) prepares every review source of
    ../shared/data but SST-2 (Amazon, amazon_more, IMDB train and unsup from their tarballs,
    Pang & Lee) into gzip-compressed shards, copies SST-2 train/val, states what would travel
    (under the device tool's 64 MiB, the tree included) and the call to make; over
    MAX_CARRY_MIB it fails, saying so (CHECK_ONLY: the size alone)."""
    import h5py

    dest = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable, "SHARED": str(shared_data)}
    p = subprocess.run(["bash", str(REPO / "scripts/gpu_data.sh"), str(dest)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    carry = re.search(r"^carry: ([\d.]+) MiB of 64 \(tree ", p.stdout, re.M)
    assert carry and float(carry.group(1)) < 64, p.stdout
    assert "run(command=\"bash scripts/gpu_session.sh " in p.stdout
    manifest = json.loads((dest / "shards/manifest.json").read_text())
    names = {Path(i["name"]).name for i in manifest["inputs"]}
    assert {"aclImdb_train.tar.gz", "aclImdb_unsup.tar.gz", "review_polarity.tar.gz",
            "AllProductReviews.csv.gz", "Musical_instruments_reviews_first5050.csv.gz",
            "amazon_product_reviews_first1000.csv.gz"} <= names
    # 15,859 Amazon + 49,477 amazon_more + 25,000 IMDB train + 47,589 unsup + 1,979 P&L
    assert manifest["counters"]["records"] > 135_000
    for info in load_manifest(dest / "shards").shards:
        with h5py.File(info.path) as f:
            assert f["tokens"].compression == "gzip"
    assert sorted(q.name for q in (dest / "sst2").iterdir()) == ["train.csv", "val.csv"]
    over = subprocess.run(["bash", str(REPO / "scripts/gpu_data.sh"), str(dest)],
                          env={**env, "MAX_CARRY_MIB": "1", "CHECK_ONLY": "1"},
                          capture_output=True, text=True, timeout=300)
    assert over.returncode == 1 and "over MAX_CARRY_MIB=1" in over.stderr, over.stderr
