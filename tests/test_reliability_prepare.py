"""Failure behaviour of data_prep: its workers die with it, a live prepare owns its folder, a
document over the memory budget and a full disk are one line, and a resume never replaces a
finished corpus of other inputs."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests._mp import launch_env, run
from tests.reliability_common import (  # noqa: F401 - the fixtures these tests take
    HVD_LM,
    TINY,
    hvd_lm,
    one_error_line,
)

# ---- 4/7. data_prep: workers die with the parent, a live prepare owns its folder, memory ---------

def _big_input(path: Path, docs: int = 4000) -> Path:
    import gzip

    with gzip.open(path, "wt") as f:
        for i in range(docs):
            f.write(json.dumps({"reviewText": f"review {i} " + "word " * 200}) + "\n")
    return path


@pytest.mark.slow
def test_prepare_workers_die_with_their_parent_and_the_folder_stays_locked_meanwhile(tmp_path):
    src = _big_input(tmp_path / "in.json.gz")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data_prep", "prepare", str(src), str(src), "--out", str(out),
           "--workers", "2", "--no-progress", "--max-memory-mb", "64", "--shard-size", "1M"]
    proc = subprocess.Popen(cmd, env=launch_env(HVD_LM_PREP_TASK_SLEEP="30"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        workers = []
        while time.time() < deadline and len(workers) < 2:
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if p.name().startswith("python")]
            time.sleep(0.05)
        assert len(workers) == 2, "no worker processes seen"
        busy = run(cmd + ["--resume"], check=False, timeout=60)
        assert busy.returncode == 1 and "in use by another job" in busy.stderr
        proc.kill()
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"workers outlived their parent: {alive}"
    finally:
        proc.kill()
    again = run(cmd + ["--resume"], timeout=180)
    assert "prepared" in again.stdout


def test_prepare_refuses_a_document_over_its_memory_budget(tmp_path):
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        f.write(json.dumps({"reviewText": "small one"}) + "\n")
        f.write(json.dumps({"reviewText": "x" * (40 << 20)}) + "\n")  # 40 MiB
        f.write(json.dumps({"reviewText": "small two"}) + "\n")
    base = [sys.executable, "-m", "data_prep", "prepare", str(src), "--max-memory-mb", "128",
            "--no-progress", "--split", "1,0,0"]
    proc = run([*base, "--out", str(tmp_path / "a")], check=False, timeout=120)
    assert proc.returncode == 1
    assert f"{src}:2: a record of 41,943," in proc.stderr and "--max-memory-mb" in proc.stderr
    proc = run([*base, "--out", str(tmp_path / "b"), "--skip-bad"], timeout=120)
    from hvd_lm.formats.manifest import load_manifest
    meta = load_manifest(tmp_path / "b").meta
    assert meta["counters"]["documents"] == 2 and meta["counters"]["bad_records"] == 1


@pytest.mark.slow
def test_prepare_memory_stays_within_budget_for_a_huge_document(tmp_path):
    """`/usr/bin/time -v`'s maximum RSS of a prepare with one 100 MB document and a 128 MiB
    budget: the document is streamed past and refused, the process stays under the budget."""
    time_bin = Path("/usr/bin/time")
    if not time_bin.exists():
        pytest.skip("/usr/bin/time (Debian package time) not installed")
    src = tmp_path / "huge.jsonl"
    with open(src, "w") as f:
        f.write(json.dumps({"reviewText": "small"}) + "\n")
        f.write(json.dumps({"reviewText": "y" * (100 << 20)}) + "\n")
    proc = run([str(time_bin), "-v", sys.executable, "-m", "data_prep", "prepare", str(src),
                "--out", str(tmp_path / "o"), "--max-memory-mb", "128", "--no-progress",
                "--skip-bad", "--split", "1,0,0"], timeout=300)
    rss_kb = int(next(x for x in proc.stderr.splitlines()
                      if "Maximum resident set size" in x).split(":")[1])
    assert rss_kb < 128 * 1024, f"max RSS {rss_kb / 1024:.0f} MiB over the 128 MiB budget"


def test_prepare_disk_full_is_one_line_and_resume_finishes_the_same_corpus(tmp_path, capsys,
                                                                           monkeypatch):
    """ENOSPC in the map phase's spill writes (injected at the write call; a real 8 MB tmpfs gave
    the same line): one ERROR line naming the output folder, what the job needs there and what is
    free; after space is freed, --resume gives the shards a clean run gives."""
    import data_prep.sort
    from hvd_lm.cli import main
    from hvd_lm.formats.manifest import load_manifest

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"reviewText": f"review {i} " * 20}) + "\n"
                           for i in range(300)))
    base = ["prepare", str(src), "--no-progress", "--workers", "1", "--split", "8,1,1"]

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(data_prep.sort._Spill, "flush", full)
        assert main([*base, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"ERROR: {tmp_path / 'o'}: no space left on the device (the job " \
        "needs about" in err[0] and "free); free space and rerun with --resume" in err[0], err
    assert main([*base, "--out", str(tmp_path / "o"), "--resume"]) == 0
    assert main([*base, "--out", str(tmp_path / "clean")]) == 0
    got, want = load_manifest(tmp_path / "o"), load_manifest(tmp_path / "clean")
    assert [s.sha256 for s in got.shards] == [s.sha256 for s in want.shards]


def test_prepare_resume_refuses_to_replace_a_finished_corpus_of_other_inputs(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"reviewText": f"a {i} text"}) + "\n" for i in range(30)))
    b.write_text("".join(json.dumps({"reviewText": f"b {i} text"}) + "\n" for i in range(30)))
    base = [sys.executable, "-m", "data_prep", "prepare", "--out", str(tmp_path / "o"),
            "--no-progress", "--split", "1,0,0"]
    run([*base, str(a)], timeout=60)
    manifest = (tmp_path / "o" / "manifest.json").read_text()
    proc = run([*base, str(b), "--resume"], check=False, timeout=60)
    assert proc.returncode == 1 and "finished corpus prepared with other" in proc.stderr
    assert (tmp_path / "o" / "manifest.json").read_text() == manifest


def test_prepare_input_errors_name_the_problem(tmp_path):
    (tmp_path / "folder").mkdir()
    proc = run([sys.executable, "-m", "data_prep", "prepare", str(tmp_path / "folder"),
                "--out", str(tmp_path / "o")], check=False, timeout=60)
    assert proc.returncode == 1 and "is a folder, not a file" in proc.stderr
    (tmp_path / "t.csv").write_text("id,stars\n1,5\n")
    proc = run([sys.executable, "-m", "data_prep", "prepare", str(tmp_path / "t.csv"),
                "--out", str(tmp_path / "o2")], check=False, timeout=60)
    assert proc.returncode == 1 and "no text column among" in proc.stderr
    assert "None" not in proc.stderr
