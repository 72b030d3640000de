"""Hostile and careless input, issue 44: what a command reads (:mod:`hvd_lm.util.files`, the one
owner). A file read is a regular file (a FIFO, a device or a socket is named and refused before it
is opened: a FIFO blocks ``open``, ``/dev/zero`` never ends), within a budget of its kind
(manifest.json, classifier.safetensors); record readers are bounded per document whatever the line
structure (an unclosed CSV quote, a Blitzer ``.review`` block of many short lines); flags that size
memory are bounded (``generate --length/--samples``, ``eval --seq-len``, ``visualize --max-chars``
for HTML), each error naming the flag and the bound. Where memory is the point the command runs
under an address-space cap (``RLIMIT_AS``: what it had at start plus a small headroom), so a read
that grows with the input ends as a MemoryError, not as a swapping machine."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
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
    measured_main,
    one_error_line,
    prepare_cli,
    reviews,
    run_a,
    snapshot,
)
from tests.test_transfer import synthetic_reviews, write_checkpoint

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
    proc = capped("verify", bad, headroom_mb=1024)  # an error, not a MISMATCH of a shard
    one_error_line(proc, needle)  # (issue 56: was "MISMATCH ..." on stdout, no ERROR line)
    assert proc.returncode == 1 and "MISMATCH" not in proc.stdout, proc


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


# ---- case 7: a classifier whose header declares 256 MiB it does not hold, or that is 3 GB ------

def fake_classifier(folder: Path, coef_values: int = 32) -> Path:
    """classifier.safetensors (metadata as transfer writes it) whose header declares
    ``coef_values`` float64 values of ``coef``; the file holds 32 (and the other arrays)."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": 2, "weights_sha256": "0" * 64,
            "features": {"kind": "mean", "max_chars": 100, "normalize": False, "precision": "fp32"}}
    header, at = {"__metadata__": {"classifier": json.dumps(meta)}}, 0
    for name, n in (("coef", coef_values), ("intercept", 1), ("mean", 32), ("scale", 32)):
        header[name] = {"dtype": "F64", "shape": [n], "data_offsets": [at, at + 8 * n]}
        at += 8 * n
    text = json.dumps(header).encode()
    (folder / "classifier.safetensors").write_bytes(len(text).to_bytes(8, "little") + text
                                                    + bytes(8 * 97))
    return folder


def test_a_classifier_is_checked_before_it_is_read_whole(tmp_path):
    """Before: a classifier.npz whose array inflated to gigabytes from megabytes was inflated
    before any shape check, and a 3 GB classifier.json was read whole. Now one
    classifier.safetensors: one whose header declares 256 MiB the file does not hold, and a
    3 GB one, end under a cap of 160 MB beyond the start as one line naming the file."""
    ckpt = write_checkpoint(tmp_path / "run")
    (tmp_path / "t.txt").write_text("a great album\n")
    clf = fake_classifier(tmp_path / "clf", 1 << 25)
    base = ["classify", ckpt, clf, "--input", tmp_path / "t.txt", "--output", tmp_path / "p.csv",
            "--no-progress"]
    proc = capped(*base)
    one_error_line(proc, f"{clf / 'classifier.safetensors'}: not a classifier file")
    with open(clf / "classifier.safetensors", "r+b") as f:  # a sparse file: 3 GB, no disk used
        f.truncate(3 << 30)
    proc = capped(*base)
    one_error_line(proc, f"{clf / 'classifier.safetensors'}: more than 16,777,216 bytes")
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


# ---- issue 56: readers that opened a file on their own -------------------------------------------

def dev_zero(path: Path) -> Path:
    """``path`` replaced by a link to /dev/zero (endless zeros, st_size 0)."""
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")
    return path


@pytest.mark.parametrize("name", ["manifest.json", ".prepare/state.json"])
def test_prepare_resume_names_a_fifo_among_its_own_files(reviews, tmp_path, name):
    """Before: ``prepare --resume`` blocked for ever in read_text() of a FIFO named
    ``manifest.json`` or ``.prepare/state.json`` in its output folder."""
    out = tmp_path / "out"
    assert prepare_cli(reviews, "--out", out).returncode == 0
    (out / "manifest.json").unlink()  # an interrupted run: its state.json is read
    (out / name).parent.mkdir(exist_ok=True)
    os.mkfifo(out / name)
    before = snapshot(out)
    proc = prepare_cli(reviews, "--out", out, "--resume", timeout=60)
    one_error_line(proc, f"{out / name}: a FIFO (named pipe), not a regular file",
                   "prepare writes this file itself: remove it, or use another --out")
    assert snapshot(out) == before and (out / name).is_fifo()


def test_prepare_resume_reads_nothing_of_a_manifest_that_is_a_device(reviews, tmp_path):
    """Before: /dev/zero (a link named manifest.json) took 2.7 GB and ended in a bare
    ``ERROR: MemoryError``."""
    out = tmp_path / "out"
    assert prepare_cli(reviews, "--out", out).returncode == 0
    before = snapshot(out)
    dev_zero(out / "manifest.json")
    proc, read_mb, grew_mb = measured_main(["prepare", reviews, "--out", out, "--resume",
                                            "--no-progress"])
    one_error_line(proc, f"{out / 'manifest.json'}: a character device, not a regular file")
    assert read_mb < 1 and grew_mb < 64, (read_mb, grew_mb)
    del before["manifest.json"]
    assert snapshot(out) == before and (out / "manifest.json").is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_bad_cpu_peak_cache_is_measured_again_with_one_warning(shards, tmp_path, kind):
    """Before: ``train`` blocked before step 0 on a FIFO ``~/.cache/hvd_lm/cpu_peaks.json``,
    and read /dev/zero there whole (1.9 GB). Now: one warning naming it, the peak measured
    again, the cache rewritten as a file (the link replaced, /dev/zero untouched)."""
    cache = tmp_path / "cache" / "hvd_lm" / "cpu_peaks.json"
    cache.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(cache)
    else:
        dev_zero(cache)
    proc, read_mb, grew_mb = measured_main(
        ["train", "--shards", shards, "--out-dir", tmp_path / "r", *TINY, "--max-steps", "2"],
        env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [x for x in proc.stderr.splitlines() if "cpu_peaks.json" in x]
    what = "a FIFO (named pipe)" if kind == "fifo" else "a character device"
    assert len(said) == 1 and said[0].startswith(f"warning: {cache}: {what}") and \
        "measuring the CPU peak again" in said[0], proc.stderr
    assert read_mb < 64 and grew_mb < 400, (read_mb, grew_mb)
    assert not cache.is_symlink() and list(json.loads(cache.read_text()).values())[0] > 0


_SUMMARY = ("import sys, resource; from hvd_lm.jobs.failure_summary import SUMMARY; "
            "vm = int([x for x in open('/proc/self/status') if x.startswith('VmSize')][0]"
            ".split()[1]) * 1024 + (256 << 20); resource.setrlimit(resource.RLIMIT_AS, (vm, vm)); "
            "sys.exit(SUMMARY.main(sys.argv[1:], 'python -m hvd_lm.jobs.failure_summary'))")


def closing_block(out: Path, *args) -> subprocess.CompletedProcess:
    """What the launch templates run after a failure, under an address-space cap of 256 MB
    beyond its start."""
    return subprocess.run([sys.executable, "-c", _SUMMARY, str(out), *map(str, args)],
                          env=launch_env(), capture_output=True, text=True, timeout=60)


def test_the_closing_block_reads_the_tail_of_metrics_jsonl(tmp_path):
    """Before: the closing block every template runs after a failure blocked on a FIFO
    ``metrics.jsonl`` and read a 5 GB sparse one whole (MemoryError). Now a FIFO is named in its
    ``where`` line, and the failure recorded after 5 GB of zeros is found in the last 16 MiB."""
    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / "metrics.jsonl")
    p = closing_block(out, "--rc", "1")
    assert p.returncode == 0, p.stderr
    assert f"(unreadable: {out / 'metrics.jsonl'}: a FIFO (named pipe), not a regular file" \
        in p.stdout and p.stdout.strip().splitlines()[-1].startswith("cause: "), p.stdout
    (out / "metrics.jsonl").unlink()
    t0 = time.time()
    rec = {"kind": "failure", "step": 7, "time": t0, "rank": 1, "host": "n2",
           "error": "lost rank 0 on host n1", "checkpoint": None}
    with open(out / "metrics.jsonl", "wb") as f:  # sparse: no disk used
        f.truncate(5 << 30)
        f.seek(5 << 30)
        f.write(b"\n" + json.dumps(rec).encode() + b"\n")
    p = closing_block(out, "--rc", "1", "--since", t0 - 1)
    assert p.returncode == 0, p.stderr
    assert "where: rank 1 on host n2, after step 7" in p.stdout, p.stdout
    assert p.stdout.strip().endswith("cause: lost rank 0 on host n1"), p.stdout


def test_scaling_report_streams_metrics_jsonl_within_its_cap(tmp_path):
    """Before: ``python -m benchmarks scaling-report`` blocked on a FIFO metrics.jsonl and read
    a 5 GB sparse one whole. Now: the FIFO named, a file over 1 GiB refused from its size
    (nothing read), and a file read in 1 MiB pieces, a line over 1 MiB skipped with a warning,
    never held."""
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    os.mkfifo(metrics)
    argv = ["scaling-report", run, "--no-plot"]
    proc, _, _ = measured_main(argv, cli="benchmarks")
    one_error_line(proc, f"{metrics}: a FIFO (named pipe), not a regular file")
    metrics.unlink()
    with open(metrics, "wb") as f:
        f.truncate(5 << 30)
    proc, read_mb, grew_mb = measured_main(argv, cli="benchmarks")
    one_error_line(proc, f"{metrics}: more than 1,073,741,824 bytes", "METRICS_MAX_BYTES")
    assert read_mb < 1 and grew_mb < 32, (read_mb, grew_mb)
    recs = [{"kind": "start", "world_size": 1, "global_batch": 2}] + [
        {"kind": "train", "step": i, "step_time": 0.5} for i in range(4)]
    lines = [json.dumps(r) for r in recs]
    metrics.write_text("\n".join(lines[:2] + ["x" * (24 << 20)] + lines[2:]) + "\n")
    proc, read_mb, grew_mb = measured_main(argv, cli="benchmarks")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("warning:") == 1 and f"{metrics}:3: a line of more than " \
        "1,048,576 bytes" in proc.stderr, proc.stderr
    assert 23 < read_mb < 26 and grew_mb < 16, (read_mb, grew_mb)  # read, never held


def test_a_bad_feature_cache_entry_is_featurized_again_with_one_warning(tmp_path):
    """Before: a feature-cache ``.npy`` whose header declares [N, 2**31] float32 made
    ``np.load`` ask for 1.56 TiB (here N = 160: 1.25 TiB). Now its header is read first, the
    entry named in one warning and featurized again (the entry rewritten)."""
    write_checkpoint(tmp_path / "run")
    train = synthetic_reviews(tmp_path / "train.jsonl", 160, 0)
    argv = ["transfer", tmp_path / "run", "--train", train, "--text-field", "review",
            "--label-field", "sentiment", "--cache-dir", tmp_path / "cache", "--no-progress",
            "--no-baseline", "--batch-size", "16"]
    assert main([str(a) for a in [*argv, "--out", tmp_path / "a"]]) == 0
    entries = sorted((tmp_path / "cache").glob("*.npy"))
    rows = {e: np.load(e).shape[0] for e in entries}
    for e, n in rows.items():
        header = np.lib.format.header_data_from_array_1_0(np.zeros(0, np.float32))
        header["shape"] = (n, 2**31)
        with open(e, "wb") as f:
            np.lib.format.write_array_header_1_0(f, header)
            f.write(b"\0" * 64)
    proc, read_mb, grew_mb = measured_main([*argv, "--out", tmp_path / "b"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [x for x in proc.stderr.splitlines() if "feature cache" in x]
    assert len(said) == len(entries) >= 1, proc.stderr
    for e, n in rows.items():
        assert any(f"{e}: its header declares [{n}, 2147483648] float32" in x for x in said)
        assert np.load(e).shape == (n, 32)  # featurized again and rewritten
    assert grew_mb < 400, grew_mb


def test_the_streamed_readers_agree_with_reading_whole(tmp_path):
    """files.iter_lines (small chunks and line caps here, so every boundary is crossed),
    tail_lines and head_lines against the file read whole and split."""
    from hvd_lm.util import files

    def whole(pieces: list[bytes]) -> list[bytes]:  # a last empty piece is no line
        return pieces[:-1] if pieces and not pieces[-1] else pieces

    rng = np.random.default_rng(0)
    path = tmp_path / "f"
    for trial in range(60):
        data = bytes(rng.choice(list(b"ab\n"), size=int(rng.integers(0, 80)),
                                p=[0.45, 0.35, 0.2]))
        path.write_bytes(data)
        lines = whole(data.split(b"\n"))
        got = list(files.iter_lines(path, 1 << 20, "", line_limit=5, chunk=trial % 7 + 1))
        assert got == [(i, x if len(x) <= 5 else None) for i, x in enumerate(lines, 1)], data
        for limit in (1, 7, 30, 200):
            cut = len(data) > limit
            tail = data[-limit:].split(b"\n")[cut and data[-limit - 1:-limit] != b"\n":]
            head = data[:limit].split(b"\n")[:-1 if cut else None]
            assert files.tail_lines(path, limit) == whole(tail), (data, limit)
            assert files.head_lines(path, limit) == whole(head), (data, limit)
    path.write_bytes(b"x" * 11)
    with pytest.raises(files.FileRefused, match="more than 10 bytes; a test"):
        list(files.iter_lines(path, 10, "a test"))
