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
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

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

    t0 = time.monotonic()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:]
    assert "ready (stamp" in (out / "setup.log").read_text()
    assert time.monotonic() - t0 < 60


def test_gpu_session_runs_every_part_on_the_cpu(tmp_path):
    """``scripts/gpu_session.sh`` (the one 10-minute call on a lent GPU) rehearsed at tiny shapes
    (SMALL=1, DEVICE=cpu, the suite's venv as setup) with an "image" python that lacks Horovod,
    orjson and pytorch-optimizer, as the node's does: every part's flags reach its command, the
    model trains and transfers without Horovod (one process), with the fastest fused bf16
    variant of the bench's JSON (recomputed here), and the tarball holds every result but never
    a checkpoint, whose sha256 it lists instead."""
    import tarfile

    from tests.shardutil import default_shards
    data = tmp_path / "data"
    default_shards(data / "shards")
    (data / "sst2").mkdir()
    for split, n in (("train", 40), ("val", 20)):
        rows = ["label,sentence"] + [f"{i % 2},{'great fun' if i % 2 else 'dull and bad'} {i}"
                                     for i in range(n)]
        (data / "sst2" / f"{split}.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    image = make_image(tmp_path / "image")
    env = {**os.environ, "SMALL": "1", "DEVICE": "cpu", "WIDTH": "16", "TRAIN_BATCH": "4",
           "SKIP": "setup cudaA", "CUDA_B_S": "10", "PYTHON": str(image), "TOTAL_S": "300",
           "POST_S": "60"}
    p = subprocess.run(["bash", str(REPO / "scripts/gpu_session.sh"), str(tmp_path / "no.whl"),
                        str(data), str(out)], env=env, capture_output=True, text=True,
                       timeout=400)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    for part in ("bench b256", "bench b128", "train", "eval", "transfer", "generate",
                 "generate_unit1.0", "generate_unit-1.0", "visualize", "transfer_cell"):
        assert f"] {part}: exit 0" in log, (part, log)
    rows = [r for f in ("b256", "b128") for r in
            json.loads((out / f"bench_{f}.json").read_text())["train"]
            if r["impl"].startswith("fused") and r["precision"] == "bf16" and "chars_per_s" in r]
    best = max([r for r in rows if r["batch_size"] == 4] or rows, key=lambda r: r["chars_per_s"])
    assert f"bf16 {best['impl']} at {best['chars_per_s']}" in log
    assert json.loads((out / "bench_b256.json").read_text())["profile"]["steps"] == 2
    with tarfile.open(out / "gpu_session.tar.gz") as tar:
        names = {n.lstrip("./") for n in tar.getnames()}
    for f in ("bench_b256.json", "bench_b128.json", "run/metrics.jsonl", "eval.json",
              "transfer/transfer.json", "transfer_cell/transfer.json", "samples.jsonl",
              "samples_unit1.0.jsonl", "heatmap.png",
              "checkpoint.sha256", "train.yaml"):
        assert f in names, f
    assert not [n for n in names if n.endswith(".pt")]
    start = json.loads((out / "run/metrics.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and "no Horovod" in start["launcher"], start
    kinds = [json.loads((out / f / "transfer.json").read_text())["features"]["kind"]
             for f in ("transfer", "transfer_cell")]
    assert kinds == ["mean", "cell"]
    (digest, path), = [line.split() for line in (out / "checkpoint.sha256").read_text().splitlines()]
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest


def test_gpu_data_fits_the_carry(shared_data, tmp_path):
    """``scripts/gpu_data.sh`` (the card's data, made here) prepares the Amazon text and the IMDB
    tarball into gzip-compressed shards (the plain ones, 46.6 MB, would not travel beside the
    34 MiB wheelhouse under the device tool's 64 MiB), copies SST-2 train/val, and states what
    would travel; over MAX_CARRY_MIB it fails, saying so."""
    import h5py

    dest = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable, "SHARED": str(shared_data)}
    p = subprocess.run(["bash", str(REPO / "scripts/gpu_data.sh"), str(dest),
                        str(tmp_path / "no.whl")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r"^carry: [\d.]+ MiB of 64 \(tree ", p.stdout, re.M), p.stdout
    manifest = json.loads((dest / "shards/manifest.json").read_text())
    tar, = [i for i in manifest["inputs"] if i["format"] == "tar"]
    assert tar["name"].endswith("aclImdb_train.tar.gz")
    assert manifest["counters"]["records"] > 40_000  # 15,859 Amazon + 25,000 IMDB reviews
    for info in load_manifest(dest / "shards").shards:
        with h5py.File(info.path) as f:
            assert f["tokens"].compression == "gzip"
    assert sorted(q.name for q in (dest / "sst2").iterdir()) == ["train.csv", "val.csv"]
    over = subprocess.run(["bash", str(REPO / "scripts/gpu_data.sh"), str(dest)],
                          env={**env, "MAX_CARRY_MIB": "1", "IMDB": "0"}, capture_output=True,
                          text=True, timeout=300)
    assert over.returncode == 1 and "over MAX_CARRY_MIB=1" in over.stderr, over.stderr


def test_gpu_session_second_call_measures_what_the_first_left(tmp_path):
    """The card's second call (docs/mlstm_fused.md section 7: bench only, other precisions and
    kernels): SKIP leaves out setup, the tests, the B=128 bench and the model; B256_PRECISIONS
    and KERNELS reach `bench gpu`, whose JSON then holds those rows at B=256 (fp32 here: the
    card's fp16 needs CUDA)."""
    out = tmp_path / "out"
    env = {**os.environ, "SMALL": "1", "DEVICE": "cpu", "WIDTH": "16", "PYTHON": sys.executable,
           "SKIP": "setup cudaA b128 cudaB model", "B256_PRECISIONS": "bf16,fp32",
           "KERNELS": "torch", "TOTAL_S": "200"}
    p = subprocess.run(["bash", str(REPO / "scripts/gpu_session.sh"), str(tmp_path / "no.whl"),
                        str(tmp_path / "no-data"), str(out)], env=env, capture_output=True,
                       text=True, timeout=300)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "] bench b256: exit 0" in log and "no model (SKIP)" in log
    assert "bench b128" not in log and "cuda tests" not in log and "] train" not in log
    rows = json.loads((out / "bench_b256.json").read_text())["train"]
    assert {r["precision"] for r in rows if r.get("chars_per_s")} == {"bf16", "fp32"}
    assert {r["impl"] for r in rows if r["impl"].startswith("fused")} <= {
        "fused/torch", "fused/torch+graphs"}
