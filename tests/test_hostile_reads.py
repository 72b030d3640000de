"""Hostile and careless input, issue 44: what a command reads (:mod:`hvd_lm.util.files`, the one
owner). A file read is a regular file (a FIFO, a device or a socket is named and refused before
it is opened: a FIFO blocks ``open``, ``/dev/zero`` never ends), within a budget of its kind
(manifest.json, classifier.json, every ``.npy`` member of a classifier.npz from its header, before
it is inflated); record readers are bounded per document whatever the line structure (an unclosed
CSV quote, a Blitzer ``.review`` block of many short lines); flags that size memory are bounded
(``generate --length/--samples``, ``eval --seq-len``, ``visualize --max-chars`` for HTML), each
error naming the flag and the bound. Where memory is the point the command runs under an
address-space cap (``RLIMIT_AS``: what it had at start plus a small headroom), so a read that
grows with the input ends as a MemoryError, not as a swapping machine."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hvd_lm.cli import main
from hvd_lm.formats import checkpoint as ck
from tests._mp import launch_env
from tests.conftest import records
from tests.hostile_common import (  # noqa: F401 - fixtures, shared with the first cases
    TINY,
    hvd_lm,
    one_error_line,
    prepare_cli,
    run_a,
)
from tests.test_transfer import write_checkpoint

_CAPPED = (
    "import sys, resource; from hvd_lm.cli import build_parser, main; "
    "head, argv = int(sys.argv[1]), sys.argv[2:]; build_parser(argv); "
    "vm = int([x for x in open('/proc/self/status') if x.startswith('VmSize')][0].split()[1]); "
    "lim = vm * 1024 + head; resource.setrlimit(resource.RLIMIT_AS, (lim, lim)); "
    "sys.exit(main(argv))")


def capped(*argv, headroom_mb: int = 160, timeout: float = 120) -> subprocess.CompletedProcess:
    """``hvd-lm ARGV`` in a child whose address space may grow ``headroom_mb`` beyond what it
    holds once the command's modules are imported (one malloc arena: glibc reserves 64 MB of
    address space per thread's arena)."""
    env = launch_env(MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", _CAPPED, str(headroom_mb << 20),
                           *map(str, argv)], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


# ---- case 6: manifest.json a link to /dev/zero; a FIFO as --config (a hang) ----------------------

def test_a_manifest_that_is_a_device_is_named_not_read(shards, tmp_path):
    """Before: train, eval and verify read the manifest whole ("MemoryError: MemoryError", no
    file named); config.json had a 1 MiB cap, the manifest none."""
    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    (bad / "manifest.json").unlink()
    (bad / "manifest.json").symlink_to("/dev/zero")
    ckpt = write_checkpoint(tmp_path / "run")
    needle = f"{bad / 'manifest.json'}: a character device, not a regular file"
    for argv in (["train", "--shards", bad, "--out-dir", tmp_path / "r", *TINY],
                 ["eval", ckpt, bad]):
        proc = capped(*argv, headroom_mb=1024)  # train's threads reserve their stacks first
        one_error_line(proc, needle)
    assert not (tmp_path / "r").exists()
    proc = capped("verify", bad, headroom_mb=1024)  # verify lists each problem it finds
    assert proc.returncode == 1 and f"MISMATCH {needle}" in proc.stdout, proc


def test_a_config_fifo_nobody_writes_is_refused_not_opened(shards, tmp_path):
    """Before: ``train --config FIFO`` waited in open() for a writer that never came."""
    fifo = tmp_path / "train.yaml"
    os.mkfifo(fifo)
    proc = hvd_lm("train", "--config", fifo, "--shards", shards, "--out-dir", tmp_path / "r",
                  timeout=60)
    one_error_line(proc, f"{fifo}: a FIFO (named pipe), not a regular file",
                   "a config is a YAML file")
    assert proc.returncode == 2
    # a pipe that is there (bash's <(cat f)) is still a config
    good = tmp_path / "good.yaml"
    good.write_text("model: {hidden_size: 1}\n")
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m hvd_lm train --config "
                           f"<(cat {good}) --shards {shards} --hidden-size 0"],
                          env=launch_env(), capture_output=True, text=True, timeout=60)
    one_error_line(proc, "model.hidden_size must be >= 1, got 0")


# ---- case 7: a classifier whose array inflates 1,000:1, or whose JSON is 3 GB --------------------

def fake_classifier(folder: Path, npz_writer) -> Path:
    """classifier.npz written by ``npz_writer(path)`` and a classifier.json recording its sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    npz_writer(folder / "classifier.npz")
    digest = hashlib.sha256((folder / "classifier.npz").read_bytes()).hexdigest()
    (folder / "classifier.json").write_text(json.dumps({
        "format": 1, "npz": "classifier.npz", "npz_sha256": digest, "checkpoint_sha256": "0" * 64,
        "features": {"kind": "mean", "max_chars": 100, "normalize": False, "precision": "fp32"},
        "inputs": 32}))
    return folder


def bomb(path: Path, mib: int = 256) -> None:
    """An npz whose ``coef`` is ``mib`` MiB of float64 zeros, deflated (~1,000:1)."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros(0))
    header["shape"] = (mib << 17,)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("coef.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, header)
            block = bytes(16 << 20)
            for _ in range(mib // 16):
                f.write(block)
        for name, a in (("intercept", np.zeros(1)), ("mean", np.zeros(32)),
                        ("scale", np.ones(32))):
            with zf.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, a)


def test_a_classifier_is_checked_before_it_is_inflated_or_read(tmp_path):
    """Before: a classifier.npz whose array inflates to gigabytes from megabytes was inflated
    before any shape check, and a 3 GB classifier.json was read whole; under a cap of 160 MB
    beyond the start both end as one line naming the file and the bound."""
    ckpt = write_checkpoint(tmp_path / "run")
    (tmp_path / "t.txt").write_text("a great album\n")
    clf = fake_classifier(tmp_path / "clf", bomb)
    assert (clf / "classifier.npz").stat().st_size < 2 << 20
    base = ["classify", ckpt, clf, "--input", tmp_path / "t.txt", "--output", tmp_path / "p.csv",
            "--no-progress"]
    proc = capped(*base)
    one_error_line(proc, f"{clf / 'classifier.npz'}: member coef.npy", "268,435,456 bytes",
                   "more than the 16,777,216 bytes")
    with open(clf / "classifier.json", "r+b") as f:  # a sparse file: 3 GB, no disk used
        f.truncate(3 << 30)
    proc = capped(*base)
    one_error_line(proc, f"{clf / 'classifier.json'}: more than 1,048,576 bytes")
    assert not (tmp_path / "p.csv").exists()


# ---- case 8: one document of many lines, under prepare's --max-memory-mb -------------------------

@pytest.mark.parametrize("name,head,line,needle", [
    ("open.csv", "id,text\n1,\"an unclosed quote\n", "x" * 99 + "\n",
     "open.csv:2: a record of more than 2,097,152 characters (a quote never closed?)"),
    ("big.review", "<review>\n<review_text>\n", "word " * 19 + "word\n",
     "big.review:1: a <review> block of more than 2,097,152 characters"),
], ids=["csv", "review"])
def test_a_record_of_many_lines_stops_at_the_per_document_cap(tmp_path, name, head, line,
                                                              needle):
    """Before: the per-document cap counted physical lines only, so a CSV quote that never
    closes (300 MB peaked at 1.81 GB with --max-memory-mb 128) or a .review block of 300 MB
    (601 MB) was held whole. Here 48 MB under --max-memory-mb 16 (2 MiB per document) and an
    address-space cap of 160 MB beyond the start: one line naming the file, the record's first
    line and the cap."""
    src = tmp_path / name
    with open(src, "w") as f:
        f.write(head)
        f.write(line * ((48 << 20) // len(line)))
        if name.endswith(".review"):
            f.write("</review_text>\n</review>\n")
    out = tmp_path / "out"
    proc = capped("prepare", src, "--out", out, "--max-memory-mb", "16", "--shard-size", "1M",
                  "--no-progress")
    one_error_line(proc, needle, "the memory budget allows per document")
    # --skip-bad drops it and goes on with the records after it
    with open(src, "a") as f:
        for i in range(3):
            f.write(f"{i},short review {i} after it\n" if name.endswith(".csv") else
                    f"<review>\n<review_text>\nshort review {i} after it\n</review_text>\n"
                    "</review>\n")
    proc = capped("prepare", src, "--out", out, "--max-memory-mb", "16", "--shard-size", "1M",
                  "--no-progress", "--skip-bad", "--split", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["totals"]["documents"] == 3


# ---- case 9: flags that size memory are bounded, the flag and the bound named --------------------

@pytest.mark.parametrize("argv,needle", [
    (["generate", "CK", "--length", str(10**15)],
     "length must be <= 1048576, got 1000000000000000 (--length)"),
    (["generate", "CK", "--samples", str(10**9)], "samples must be <= 4096, got 1000000000 "
                                                   "(--samples)"),
    (["generate", "CK", "--length", str(2**20), "--samples", "4096"],
     "--length 1,048,576 x --samples 4,096 = 4,294,967,296 bytes, more than the 16,777,216"),
    (["generate", "CK", "--neuron", "1", "--length", "300000", "--heatmap", "h.html"],
     "300,000 characters are too many for an HTML heatmap (at most 200,000): lower --length"),
    (["eval", "CK", "SH", "--seq-len", "10000000"],
     "seq_len must be <= 1048576, got 10000000 (--seq-len)"),
])
def test_flags_that_size_memory_are_bounded(shards, tmp_path, capsys, argv, needle):
    """Before: ``generate --length 10**15`` was accepted and grew ~70 MB per 30 s printing
    nothing; ``--samples 1e9`` asked for 8 GB; ``eval --seq-len 10000000`` allocated 1.6 GB and
    asked 5.1 GB more, none of them naming the flag."""
    ckpt = write_checkpoint(tmp_path / "run")
    argv = [str(ckpt) if a == "CK" else str(shards) if a == "SH" else
            str(tmp_path / a) if a.endswith(".html") else a for a in argv]
    rc = main(argv)
    one_error_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err), needle)
    assert rc == 2 and not (tmp_path / "h.html").exists()


def test_eval_reads_a_window_no_longer_than_the_split(shards, tmp_path, capsys):
    """``eval --seq-len 1000000`` on a split of a few kB per row: the window is the longest
    row (the state is carried across windows, so the BPC is the same as with short windows);
    before, each row was padded to 10**6 bytes (logits of [16, 10**6, 256])."""
    ckpt = write_checkpoint(tmp_path / "run")
    bpc = {}
    for seq_len in ("64", "1000000"):
        assert main(["eval", str(ckpt), str(shards), "--seq-len", seq_len]) == 0
        bpc[seq_len] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert bpc["64"]["chars"] == bpc["1000000"]["chars"]
    assert abs(bpc["64"]["bpc"] - bpc["1000000"]["bpc"]) < 1e-5, bpc


# ---- case 10: an HTML heatmap has a size bound, checked before the model runs --------------------

def test_an_html_heatmap_is_bounded_before_the_model_runs(tmp_path, capsys):
    """Before: ``visualize --max-chars 0`` over 3.2 MB of text took 222 s and 1.08 GB and wrote
    179 MB of HTML (PNG had a cap, HTML none). Here 20 texts of 12,000 characters: refused at
    once, naming the bound, --max-chars and --max-texts."""
    ckpt = write_checkpoint(tmp_path / "run")
    texts = tmp_path / "t.txt"
    texts.write_text(("a great album, " * 800 + "\n") * 20)
    out = tmp_path / "h.html"
    rc = main(["visualize", str(ckpt), "--neuron", "1", "--input", str(texts), "--out", str(out),
               "--max-chars", "0"])
    one_error_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err),
                   f"{out}: 240,000 characters are too many for an HTML heatmap (at most "
                   "200,000): lower --max-chars (0: all) or --max-texts (20)")
    assert rc == 2 and not out.exists()
    assert main(["visualize", str(ckpt), "--neuron", "1", "--input", str(texts), "--out",
                 str(out), "--max-chars", "50", "--max-texts", "2"]) == 0
    assert out.read_text().count("<span") == 100


# ---- a FIFO named like a checkpoint is skipped as a damaged one ----------------------------------

def test_resume_auto_skips_a_fifo_named_like_a_checkpoint(shards, run_a, tmp_path):
    """Before: a FIFO named ``checkpoints/step_00000099.pt`` stopped ``--resume auto`` ("no
    such checkpoint file") instead of being skipped like a damaged file."""
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    (out / "checkpoints" / "latest").unlink()
    os.mkfifo(out / "checkpoints" / "step_00000099.pt")
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "21",
                  "--resume", "auto", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step_00000099.pt: a FIFO (named pipe), not a regular file" in proc.stderr
    assert records(out, "start")[-1]["resumed_from"].endswith("step_00000020.pt")
    assert ck.resolve(out).name == "step_00000021.pt"
