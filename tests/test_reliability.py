"""Failure behaviour (README "Failure behaviour"): no job destroys another's work, a diverged run
stops, signals reach every rank under every launcher, a full disk is one line, bad settings and
files are one ERROR line before any work, and data_prep's workers never outlive it."""
from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import psutil
import pytest
import torch

from hvd_lm.formats import checkpoint as ck
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.train import preflight
from hvd_lm.train.loop import TRAIN
from hvd_lm.util import atomic
from hvd_lm.util.lock import FolderBusyError, FolderLock
from tests._mp import REPO, horovodrun_cmd, launch_env, mpirun_cmd, run
from tests.shardutil import default_shards

TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--batch-size", "2",
        "--log-every", "1", "--lr", "3e-3", "--threads", "1", "--eval-chars", "2000", "--device",
        "cpu"]
HVD_LM = [sys.executable, "-m", "hvd_lm"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return default_shards(tmp_path_factory.mktemp("shards"))


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if kind is None or r["kind"] == kind]


def hvd_lm(*args, timeout=180, **env) -> subprocess.CompletedProcess:
    return run([*HVD_LM, *map(str, args)], timeout=timeout, env=launch_env(**env), check=False)


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The run failed with exactly one ERROR line (no traceback) holding every needle."""
    err = proc.stderr
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "ERROR:" in x]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ---- 1. one job per run folder -------------------------------------------------------------------

def test_folder_lock_names_the_holder_and_is_freed_by_death(tmp_path):
    with FolderLock(tmp_path / "run", "run folder"):
        with pytest.raises(FolderBusyError, match=rf"pid {os.getpid()} on host"):
            FolderLock(tmp_path / "run", "run folder")
    assert not (tmp_path / "run" / ".lock").exists()  # a clean release leaves nothing
    # A holder killed with SIGKILL: the kernel frees the flock; the next job takes over with a
    # warning naming the dead holder.
    code = ("import sys, time; from hvd_lm.util.lock import FolderLock; "
            f"l = FolderLock({str(tmp_path / 'run2')!r}); print('held', flush=True); "
            "time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=launch_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
            FolderLock(tmp_path / "run2")
        holder.kill()
        holder.wait(10)
    finally:
        holder.kill()
    proc = subprocess.run([sys.executable, "-c", "from hvd_lm.util.lock import FolderLock; "
                           f"FolderLock({str(tmp_path / 'run2')!r}).release()"],
                          capture_output=True, text=True, env=launch_env(), timeout=60)
    assert proc.returncode == 0 and f"lock of pid {holder.pid}" in proc.stderr
    assert "which is gone" in proc.stderr


@pytest.mark.slow
def test_second_job_into_a_busy_run_folder_is_refused(shards, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([*HVD_LM, "train", "--shards", str(shards), "--out-dir", str(out),
                              *TINY, "--max-steps", "100000"], env=launch_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").exists() and records(out, "train")):
            assert time.time() < deadline and first.poll() is None
            time.sleep(0.3)
        before = (out / "config.yaml").read_text()
        second = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                        "--hidden-size", "64", "--seed", "2", "--max-steps", "5")
        assert second.returncode == 1
        one_error_line(second, str(out), "in use by another job", f"pid {first.pid}")
        assert (out / "config.yaml").read_text() == before  # nothing of B's was written
        assert {r["world_size"] for r in records(out, "start")} == {1}
        assert len(records(out, "start")) == 1
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(60)
    assert records(out, "end")[0]["stop"] == "signal"


# ---- 2. divergence ------------------------------------------------------------------------------

def test_diverged_run_stops_and_keeps_the_last_good_checkpoint(shards, tmp_path):
    """--lr 1e30: the weights overflow after a step or two and every later step is skipped; the
    run stops after --max-skipped-steps with one line, exit 1, and every checkpoint it left is
    finite (the last good one stays latest)."""
    out = tmp_path / "div"
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "200",
                  "--lr", "1e30", "--max-skipped-steps", "5", "--checkpoint-every", "1")
    assert proc.returncode == 1
    one_error_line(proc, "training diverged", "5 steps in a row")
    end = records(out, "end")[-1]
    assert end["stop"] == "diverged" and end["skipped_steps"] == 5 and end["step"] < 200
    saved = ck.list_checkpoints(out)
    for path in saved:
        assert all(torch.isfinite(v).all() for v in ck.load(path)["model"].values())
    if saved:
        assert ck.resolve(out) == saved[-1] and str(saved[-1]) in proc.stderr


def test_save_refuses_non_finite_weights(tmp_path):
    with pytest.raises(ck.NonFiniteError, match="w"):
        ck.save({"model": {"w": torch.tensor([1.0, float("nan")])}}, tmp_path, 1)
    assert ck.list_checkpoints(tmp_path) == []


# ---- 3. signals reach every rank under every launcher --------------------------------------------

def _launch_cmd(kind: str, argv: list) -> list:
    if kind == "mpirun":
        return mpirun_cmd(2, argv)
    return horovodrun_cmd(2, argv, kind.split("-")[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind,sig", [("horovodrun-mpi", signal.SIGTERM),
                                      ("horovodrun-gloo", signal.SIGINT),
                                      ("mpirun", signal.SIGTERM)])
def test_signal_to_the_launcher_checkpoints_every_rank(shards, tmp_path, kind, sig):
    """The signal goes to the launcher process itself (as `kill PID` or Ctrl-C would); every rank
    checkpoints at the same step and exits 0, and no process is left behind."""
    out = tmp_path / "sig"
    argv = ["-m", "hvd_lm", "train", "--shards", str(shards), "--out-dir", str(out), *TINY,
            "--max-steps", "100000"]
    proc = subprocess.Popen([str(c) for c in _launch_cmd(kind, argv)], env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 150
        while not ((out / "metrics.jsonl").exists() and len(records(out, "train")) >= 2):
            assert time.time() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.3)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "hvd_lm" in " ".join(p.cmdline()) and p.name().startswith("python")]
        assert len(ranks) == 2, [p.cmdline() for p in ranks]
        os.kill(proc.pid, sig)
        psutil.wait_procs(ranks, timeout=120)
        assert not [p for p in ranks if p.is_running() and p.status() != "zombie"], \
            "ranks still running after the launcher was signalled"
        proc.wait(60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    end = records(out, "end")
    log = proc.stdout.read()
    assert len(end) == 1 and end[0]["stop"] == "signal", log
    # the ranks exit 0; horovodrun --gloo returns 0, OpenMPI's mpirun returns 1 after a SIGTERM
    # it forwarded; under horovodrun --mpi the signalled process is the /bin/sh horovodrun
    # became, which the signal kills (its status says nothing about the ranks)
    if kind != "horovodrun-mpi":
        assert proc.returncode == (0 if kind == "horovodrun-gloo" else 1), (proc.returncode,
                                                                             log[-3000:])
    saved = ck.load(ck.resolve(out))
    assert saved["step"] == end[0]["step"] and saved["rnn_state"][0].shape == (4, 32)


# ---- 5. disk full --------------------------------------------------------------------------------

def test_disk_full_checkpoint_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    first = ck.save({"model": {"w": torch.ones(3)}, "step": 1}, tmp_path, 1)
    real = Path.write_bytes

    def full(self, data):
        if self.name.startswith(".step_"):
            real(self, bytes(data)[:10])  # some bytes get out, then the device is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(atomic.DiskFullError) as e:
        ck.save({"model": {"w": torch.ones(1000)}, "step": 2}, tmp_path, 2)
    msg = str(e.value)
    assert "step_00000002.pt: no space left" in msg and "needed" in msg and "free" in msg
    monkeypatch.undo()
    assert ck.resolve(tmp_path) == first and ck.load(first)["step"] == 1
    assert not list(ck.checkpoint_dir(tmp_path).glob(".*tmp*"))  # no partial file left


def test_start_refuses_when_a_checkpoint_cannot_fit(shards, tmp_path, monkeypatch):
    from hvd_lm.train import rundir
    from hvd_lm.train.settings import TrainConfig

    cfg = TrainConfig()
    cfg.run.out_dir = str(tmp_path / "run")
    model = torch.nn.Linear(1000, 1000)
    monkeypatch.setattr(rundir, "free_bytes", lambda d: 1000)
    # 1,001,000 fp32 weights + Adam's 2 moments = 12.01 MB, + 28 KiB (RNG states, config, zip)
    with pytest.raises(atomic.DiskFullError,
                       match=r"run: a checkpoint needs about 12\.0 MB but only 1\.0 kB is free"):
        rundir.open_run_folder(cfg, model, rows=4)
    assert not (tmp_path / "run" / "config.yaml").exists()
    assert not (tmp_path / "run" / ".lock").exists()


# ---- 6. settings: one ERROR line, exit 2, before any work ---------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--log-every", "0"], "run.log_every must be >= 1"),
    (["--lr", "-0.001"], "optim.lr must be > 0"),
    (["--lr", "0"], "optim.lr must be > 0"),
    (["--lr", "nan"], "optim.lr must be a finite number"),
    (["--lr", "inf"], "optim.lr must be a finite number"),
    (["--threads", "-1"], "run.threads must be >= 0"),
    (["--device", "bogus"], "run.device: must be auto, cpu, cuda or cuda:N"),
    (["--seed", "-1"], "data.seed must be >= 0"),
    (["--eval-chars", "-1"], "run.eval_chars must be >= 0"),
    (["--max-steps", "0"], "optim.max_steps must be >= 1"),
    (["--hidden-size", "20000"], "command line: model.hidden_size must be <= 16384"),
    (["--config", "/no/such.yaml"], "/no/such.yaml: cannot read the config file"),
])
def test_bad_train_settings_are_one_line(shards, tmp_path, flags, needle):
    proc = hvd_lm("train", "--shards", shards, "--out-dir", tmp_path / "r", *flags, timeout=60)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc, needle)
    assert not (tmp_path / "r").exists()


def test_yaml_bool_for_an_int_is_rejected(shards, tmp_path):
    (tmp_path / "c.yaml").write_text("data: {batch_size: true}\n")
    proc = hvd_lm("train", "--config", tmp_path / "c.yaml", "--shards", shards, "--out-dir",
                  tmp_path / "r", timeout=60)
    assert proc.returncode == 2
    one_error_line(proc, "c.yaml: data.batch_size: expected int, got True")


@pytest.mark.parametrize("flag,value", [("--val-split", "nope"), ("--train-split", "nope")])
def test_unknown_split_is_refused_before_anything_is_written(shards, tmp_path, flag, value):
    proc = hvd_lm("train", "--shards", shards, "--out-dir", tmp_path / "r", *TINY, flag, value,
                  "--max-steps", "2", timeout=120)
    assert proc.returncode == 1
    one_error_line(proc, f"'{value}' is not a split of", "it has: train, val")
    assert not (tmp_path / "r").exists()


def test_shards_without_manifest_and_corrupt_shard_write_nothing(shards, tmp_path):
    proc = hvd_lm("train", "--shards", tmp_path, "--out-dir", tmp_path / "r", *TINY, timeout=60)
    assert proc.returncode == 1
    one_error_line(proc, "manifest.json")
    assert not (tmp_path / "r").exists()
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in Path(shards).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    victim = sorted(bad.glob("train-*.h5"))[0]
    with h5py.File(victim, "r+") as f:  # flip one byte of the token stream
        f["tokens"][5] ^= 0x20
    proc = hvd_lm("train", "--shards", bad, "--out-dir", tmp_path / "r", *TINY, timeout=60)
    assert proc.returncode == 1
    one_error_line(proc, victim.name)
    assert not (tmp_path / "r").exists()


# ---- 8/9. checkpoints: clear load errors, fallback, no config rewrite, exact chars ---------------

def test_eval_on_files_that_are_not_checkpoints(shards, tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    proc = hvd_lm("eval", tmp_path / "x.json", shards, timeout=60)
    one_error_line(proc, "x.json: not an hvd_lm checkpoint (JSON")
    shard = sorted(Path(shards).glob("val-*.h5"))[0]
    proc = hvd_lm("eval", shard, shards, timeout=60)
    one_error_line(proc, "not an hvd_lm checkpoint (an HDF5 file")
    good = ck.save({"model": {"w": torch.ones(300)}, "step": 1, "config": {}}, tmp_path / "r", 1)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:200])
    proc = hvd_lm("eval", cut, shards, timeout=60)
    one_error_line(proc, "cut.pt: truncated or damaged checkpoint")
    assert "weights_only" not in proc.stderr


@pytest.mark.slow
def test_resume_auto_skips_a_damaged_newest_checkpoint(shards, tmp_path):
    out = tmp_path / "r"
    ok = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "4",
                "--checkpoint-every", "2")
    assert ok.returncode == 0, ok.stderr
    newest = ck.resolve(out)
    assert newest.name == "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "6",
                  "--checkpoint-every", "2", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "step_00000004.pt: truncated or damaged checkpoint" in proc.stderr
    start = records(out, "start")[-1]
    assert start["resumed_from"].endswith("step_00000002.pt") and start["step"] == 2


def test_start_record_holds_the_preflight_memory_estimate(shards, tmp_path):
    """The start record's step_memory_bytes is the preflight's estimate per rank for that run
    (preflight.check_memory with the run's settings, one rank on the CPU)."""
    argv = ["--shards", str(shards), "--out-dir", str(tmp_path / "r"), *map(str, TINY),
            "--max-steps", "1"]
    assert hvd_lm("train", *argv).returncode == 0
    parser = argparse.ArgumentParser()
    TRAIN.add_arguments(parser)
    cfg = TRAIN.settings(parser.parse_args(argv))
    est = preflight.check_memory(cfg, load_manifest(shards), torch.device("cpu"), 1, 1)
    assert records(tmp_path / "r", "start")[0]["step_memory_bytes"] == est.total > 0


def test_failed_resume_with_another_shape_changes_nothing(shards, tmp_path):
    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "2").returncode == 0
    before = (out / "config.yaml").read_text()
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "4",
                  "--resume", "auto", "--hidden-size", "64")
    assert proc.returncode == 1
    one_error_line(proc, "written for a model of another shape", "rnn.w_x.weight is [128, 8] there")
    assert (out / "config.yaml").read_text() == before


@pytest.mark.slow
def test_chars_trained_is_exact_across_a_world_size_change(shards, tmp_path):
    """2 ranks x 3 steps, then resumed on 1 rank for 3 more: every character counted once."""
    out = tmp_path / "r"
    argv = ["-m", "hvd_lm", "train", "--shards", str(shards), "--out-dir", str(out), *TINY,
            "--max-steps", "3"]
    run(horovodrun_cmd(2, argv, "gloo"), timeout=240)
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "6",
                  "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    ends = records(out, "end")
    # batch 2 rows x 16 bytes per window (every window full at this size): 2 ranks x 3 steps +
    # 1 rank x 3 steps
    assert ends[0]["chars_trained"] == 2 * 3 * 2 * 16
    assert ends[1]["chars_trained"] == 2 * 3 * 2 * 16 + 3 * 2 * 16


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


# ---- 10. issue 27: a finite divergence stops the run --------------------------------------------

def test_finite_divergence_stops_on_default_settings(shards, tmp_path):
    """`--lr 1e6 --max-steps 300`, nothing else changed: the loss explodes to millions of nats,
    every value finite; the run stops after 3 logged steps (of 10) above 2 ln 256 nats with one
    line and exit 1, never reaches step 300 and writes no checkpoint."""
    out = tmp_path / "r"
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--log-every", "10",
                  "--lr", "1e6", "--max-steps", "300")
    assert proc.returncode == 1, proc.stderr
    one_error_line(proc, "training diverged", "above --divergence-loss 11.09", "3 logged step",
                   "steps 10-30")
    train = records(out, "train")
    assert [r["step"] for r in train] == [10, 20, 30]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 2 * math.log(256) for r in train)
    end = records(out, "end")[-1]
    assert end["stop"] == "diverged" and end["step"] == 30
    assert ck.list_checkpoints(out) == [] and json.loads((out / "summary.json").read_text())[
        "stop"] == "diverged"


def test_finite_divergence_keeps_the_checkpoint_written_before_it(shards, tmp_path):
    """3 good steps (checkpointed), then the run continued with --lr 1e6 and
    --keep-checkpoints 1: the checkpoint of step 4 (the weights after the first 1e6 step) is
    moved to checkpoints/diverged/, the good step-3 checkpoint survives the pruning and is
    latest again, bit for bit what the first job wrote."""
    out = tmp_path / "r"
    first = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "3",
                   "--checkpoint-every", "1", "--keep-checkpoints", "1")
    assert first.returncode == 0, first.stderr
    good = ck.resolve(out)
    assert good.name == "step_00000003.pt"
    good_bytes = good.read_bytes()
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "300",
                  "--lr", "1e6", "--checkpoint-every", "1", "--keep-checkpoints", "1",
                  "--resume", "auto")
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc, "training diverged", "steps 5-7", str(good),
                          "1 written since moved to")
    assert "is latest" in line
    assert ck.resolve(out) == good and good.read_bytes() == good_bytes
    assert ck.list_checkpoints(out) == [good]
    aside = ck.checkpoint_dir(out) / "diverged" / "step_00000004.pt"
    assert aside.exists()
    assert float(ck.load(aside)["model"]["embed.weight"].abs().max()) > 1e3  # really diverged
    assert [r["step"] for r in records(out, "checkpoint_held")] == [5, 6]


def test_divergence_guard_rules():
    """The rule on its own: NaN counts as above, a good log resets the count, a run ending
    above the bound is diverged, checkpoints are held while above, the state round-trips."""
    from hvd_lm.train.guard import DivergenceGuard

    g = DivergenceGuard(11.09, 3, 0, start_step=0)
    g.logged(10, 5.6)
    g.logged(20, 50.0)
    assert not g.may_checkpoint() and g.reason is None
    g.logged(30, float("nan"))
    g.logged(40, 5.0)  # recovered: count reset
    assert g.may_checkpoint() and g.confirmed_below() == 40
    for s in (50, 60, 70):
        g.logged(s, float("inf"))
    assert g.reason == "loss"
    h = DivergenceGuard(11.09, 3, 0)
    h.load_state_dict(g.state_dict())
    assert h.above == g.above and h.last_good_step == 40
    end = DivergenceGuard(11.09, 3, 0)
    end.logged(5, 12.0)
    end.at_end()
    assert end.reason == "loss"
    off = DivergenceGuard(11.09, 0, 0)  # loss rule off: a high loss holds nothing back
    off.logged(10, 50.0)
    assert off.may_checkpoint() and off.confirmed_below() == 10 and not off.above
    skips = DivergenceGuard(11.09, 0, 2)
    skips.attempt(False)
    skips.attempt(True)
    skips.attempt(False)
    assert skips.reason is None
    skips.attempt(False)
    assert skips.reason == "skipped"


def test_pruning_keeps_the_newest_confirmed_checkpoint(tmp_path):
    for step in (1, 2, 3):
        ck.save({"model": {"w": torch.ones(2)}}, tmp_path, step, keep=1, protect_below=3)
    names = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert names == ["step_00000002.pt", "step_00000003.pt"]  # 2 kept: newest below 3
    ck.save({"model": {"w": torch.ones(2)}}, tmp_path, 4, keep=1)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000004.pt"]


def test_the_checkpoint_a_job_resumed_from_is_confirmed(tmp_path):
    """Resumed at step 4 with --keep-checkpoints 1: before any loss is logged, step 4's
    checkpoint (not this job's) is the confirmed one: pruning keeps it, and a divergence
    moves this job's checkpoints aside and points latest back at it."""
    from hvd_lm.train.guard import DivergenceGuard

    ck.save({"model": {"w": torch.ones(2)}}, tmp_path, 4, keep=1)
    guard = DivergenceGuard(max_loss=11.09, logs=1, max_skipped=0, start_step=4)
    for step in (5, 6):
        ck.save({"model": {"w": torch.ones(2)}}, tmp_path, step, keep=1,
                protect_below=guard.confirmed_below())
        guard.wrote(step)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000004.pt",
                                                               "step_00000006.pt"]
    guard.logged(6, 20.0)
    latest, moved = guard.settle(tmp_path)
    assert latest.name == "step_00000004.pt" and [p.name for p in moved] == ["step_00000006.pt"]
    assert ck.resolve(tmp_path) == latest


@pytest.mark.slow
def test_finite_divergence_stops_every_rank_at_the_same_step(shards, tmp_path):
    """2 ranks under horovodrun: both decide from the allreduced loss, stop at the same step and
    fail the job (no rank left waiting in a collective)."""
    out = tmp_path / "r"
    argv = ["-m", "hvd_lm", "train", "--shards", str(shards), "--out-dir", str(out), *TINY,
            "--lr", "1e6", "--max-steps", "300"]
    proc = run(horovodrun_cmd(2, argv, "gloo"), timeout=240, check=False)
    assert proc.returncode != 0
    out_text = proc.stdout + proc.stderr
    assert out_text.count("training diverged") == 2, out_text[-3000:]  # one line per rank
    end = records(out, "end")[-1]
    assert end["stop"] == "diverged" and end["step"] == 4 and end["world_size"] == 2


# ---- 11. issue 27: shapes and memory checked before anything is written --------------------------

@pytest.mark.parametrize("flags,needles", [
    (["--vocab-size", "10"], ["model.vocab_size is 10", "byte ids 0..255", "--vocab-size 256"]),
    (["--seq-len", "1000000", "--batch-size", "32"],
     ["data.seq_len 1,000,000 (--seq-len)", "74,300 targets / (1 rank(s) x 32 rows",
      "= 2,321 bytes per row", "--seq-len 2,321 or less"]),
    (["--batch-size", "5000"], ["5000 rows (--batch-size)) = 14 bytes per row"]),
    (["--eval-chars", "2"], ["run.eval_batch_size 16 (--eval-batch-size) x 1 rank(s) = 16 rows",
                             "--eval-chars 2", "lower --eval-batch-size"]),
])
def test_impossible_shapes_are_refused_before_anything_is_written(shards, tmp_path, flags,
                                                                   needles):
    """Today: --vocab-size 10 fails mid-training with "index out of range in self", and
    --seq-len 1000000 is OOM-killed; both leave the run folder behind."""
    proc = hvd_lm("train", "--shards", shards, "--out-dir", tmp_path / "r", *TINY,
                  "--max-steps", "3", *flags, timeout=120)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc, *needles)
    assert not (tmp_path / "r").exists()


def test_a_step_that_cannot_fit_in_memory_is_refused_with_the_estimate(shards, tmp_path):
    from hvd_lm.train import memory
    from hvd_lm.train.settings import TrainConfig
    from hvd_lm.util.atomic import human

    flags = ["--hidden-size", "16384", "--embed-dim", "64", "--batch-size", "1", "--seq-len",
             "70000"]
    cfg = TrainConfig()
    cfg.model.hidden_size, cfg.data.batch_size, cfg.data.seq_len = 16384, 1, 70000
    est = memory.step_memory(cfg, "cpu", 1, (74301, 2000))
    if est.total <= psutil.virtual_memory().available:
        pytest.skip(f"this machine has more than {human(est.total)} available")
    proc = hvd_lm("train", "--shards", shards, "--out-dir", tmp_path / "r", "--device", "cpu",
                  "--eval-chars", "2000", "--threads", "1", *flags, timeout=120)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc, f"one training step needs about {human(est.total)} per rank",
                   "activations", "optimizer", "available on this node", "lower --batch-size",
                   "--seq-len", "--check-memory false")
    assert not (tmp_path / "r").exists()


def test_the_memory_check_counts_the_cuda_graph_pool(shards, monkeypatch):
    """With --cuda-graphs on a GPU the graphed window's private pool counts (before: the
    estimate was the eager one, so a graphed run that needs about twice as much started and ran
    out of memory). H=4096, B=256, T=256 bf16: the graphed estimate is about 1.5x the eager one
    (measured on an H200: 21.1 / 14.1 GiB); a card with memory between the two takes the eager
    run and refuses the graphed one, naming the pool; on the CPU graphs never apply."""
    from hvd_lm.options import ConfigError
    from hvd_lm.train import memory, preflight
    from hvd_lm.train.settings import TrainConfig
    from hvd_lm.util.atomic import human

    cfg = TrainConfig()
    cfg.model.hidden_size, cfg.data.batch_size, cfg.data.seq_len = 4096, 256, 256
    cfg.run.precision = "bf16"
    cuda = torch.device("cuda")
    eager = memory.step_memory(cfg, "cuda").total
    cfg.model.cuda_graphs = True
    graphed = memory.step_memory(cfg, "cuda")
    assert 1.4 < graphed.total / eager < 1.6
    assert memory.step_memory(cfg, "cpu").graph_pool == 0
    free = (eager + graphed.total) // 2
    monkeypatch.setattr(memory, "free_memory", lambda device: (free, f"free on {device}"))
    with pytest.raises(ConfigError, match=f"needs about {human(graphed.total)} per rank") as e:
        preflight.check_memory(cfg, load_manifest(shards), cuda, 1, 1)
    assert f"graph_pool {human(graphed.graph_pool)}" in str(e.value)
    cfg.model.cuda_graphs = False
    assert preflight.check_memory(cfg, load_manifest(shards), cuda, 1, 1).total == eager


def test_gpu_memory_estimate_against_the_h200s_peaks():
    """The preflight's estimate of the fused step on CUDA (eager and graphed, fp32, fp16 and
    bf16, B=128 and 256 at H=4096, T=256) against the peak memory `hvd-lm bench gpu` measured on
    an H200 (docs/results/gpu_h200/): never below the peak (a run the check lets through must
    fit) and at most 5% above it. Before: the eager estimate was 6-9% below the peak and the
    graphed one 32-42% above. Those peaks predate issue 43, which took bytes off the step
    (hvd_lm.train.memory.gpu_savings: the activations, a workspace buffer, a copy, the graph
    pool's merged buffers): the estimate plus those bytes is checked against them (the next
    card's JSON holds the new peaks beside the new estimate)."""
    from hvd_lm.perf.bench_gpu import Variant, estimated_memory
    from hvd_lm.train.memory import compute_bytes, gpu_savings

    rows = [r for b in (256, 128) for r in json.loads(
        (REPO / f"docs/results/gpu_h200/bench_gpu_b{b}.json").read_text())["train"]
        if r["impl"].startswith("fused/triton") and "peak_memory_gib" in r]
    assert len(rows) == 8
    for r in rows:
        graphed = r["impl"].endswith("+graphs")
        v = Variant("mlstm", "fused", "triton", graphed)
        est = estimated_memory(v, r["hidden_size"], 64, r["batch_size"], r["seq_len"],
                               r["precision"], torch.device("cuda"))
        before = est + gpu_savings(r["seq_len"], r["batch_size"], r["hidden_size"],
                                   compute_bytes(r["precision"]), graphed)
        assert 1.0 <= before / 2 ** 30 / r["peak_memory_gib"] <= 1.05, (
            r["impl"], r["batch_size"], r["precision"], before / 2 ** 30)


def test_the_async_checkpoints_host_copy_counts_once_per_node(shards, monkeypatch):
    """On the CPU the background checkpoint's host copy is rank 0's alone: the memory check adds
    it once per node, not once per local rank (before: 4 ranks were refused memory that fits
    them by 3 copies)."""
    from hvd_lm.options import ConfigError
    from hvd_lm.train import memory
    from hvd_lm.train.settings import TrainConfig

    cfg = TrainConfig()
    cfg.model.hidden_size, cfg.data.batch_size, cfg.data.seq_len = 1024, 4, 32
    manifest = load_manifest(shards)
    est = preflight.check_memory(cfg, manifest, torch.device("cpu"), 4, 4)
    assert est.checkpoint_copy > 0
    need = 4 * est.total - 3 * est.checkpoint_copy
    monkeypatch.setattr(memory, "free_memory", lambda d: (need, "available on this node"))
    assert preflight.check_memory(cfg, manifest, torch.device("cpu"), 4, 4).total == est.total
    monkeypatch.setattr(memory, "free_memory", lambda d: (need - 1, "available on this node"))
    with pytest.raises(ConfigError, match="4 rank\\(s\\) share"):
        preflight.check_memory(cfg, manifest, torch.device("cpu"), 4, 4)
    cfg.run.async_checkpoint = False
    assert memory.step_memory(cfg, "cpu", 4).checkpoint_copy == 0


@pytest.mark.parametrize("cell,impl,precision", [
    ("mlstm", "fused", "fp32"), ("mlstm", "fused", "bf16"), ("mlstm", "reference", "fp32"),
    ("mlstm", "reference", "bf16"), ("lstm", "fused", "fp32")])
def test_activation_estimate_matches_saved_tensor_hooks(cell, impl, precision):
    """The estimate of activations saved for backward vs the bytes torch's saved-tensor hooks
    see in one real training window (each storage once, parameters excluded): within 2%."""
    from hvd_lm.model.lm import LanguageModel, ModelConfig
    from hvd_lm.train.data import Batch
    from hvd_lm.train.memory import activation_bytes, compute_bytes
    from hvd_lm.train.step import window_nll

    T, B, H, E = 64, 16, 128, 64
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(cell=cell, hidden_size=H, embed_dim=E, rnn_impl=impl))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[:, 0] = True
    batch = Batch(torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T)), reset, B * T)
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        window_nll(model, batch, model.init_state(B), torch.device("cpu"), precision)
    est = activation_bytes(T, B, H, E, 256, compute_bytes(precision), impl, cell)
    assert est == pytest.approx(sum(seen.values()), rel=0.02)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/time").exists(), reason="/usr/bin/time not installed")
@pytest.mark.serial  # peak RSS beside other tests' processes read 1.154 once (bound 1.15)
@pytest.mark.parametrize("flags", [
    ["--hidden-size", "512", "--batch-size", "32", "--seq-len", "256"],
    ["--hidden-size", "256", "--batch-size", "32", "--seq-len", "256", "--rnn-impl",
     "reference"],
    ["--hidden-size", "1024", "--batch-size", "8", "--seq-len", "128"],
])
def test_step_memory_estimate_against_peak_rss(shards, tmp_path, flags):
    """The whole estimate against the peak resident memory (`/usr/bin/time -v`) of a real
    one-step `hvd-lm train`, minus that of a tiny one (the interpreter, torch, Horovod), over
    several runs: never more than 15% below it (measured 0.92-1.03 alone, up to 1.28 above: the
    allocator's slack is not modelled)."""
    import re

    from hvd_lm.train import memory
    from hvd_lm.train.settings import TrainConfig

    def peak(extra, run_no: int) -> int:
        proc = run(["/usr/bin/time", "-v", *HVD_LM, "train", "--shards", shards, "--out-dir",
                    tmp_path / f"{'_'.join(extra[1::2])}_{run_no}", "--max-steps", "1",
                    "--val-split", "", "--threads", "1", "--device", "cpu", "--tensorboard",
                    "false", *extra],
                   timeout=240)
        return 1024 * int(re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                                    proc.stderr).group(1))

    def estimate(extra) -> int:
        cfg = TrainConfig()
        values = dict(zip(extra[0::2], extra[1::2]))
        cfg.model.hidden_size = int(values["--hidden-size"])
        cfg.model.embed_dim = int(values.get("--embed-dim", 64))
        cfg.model.rnn_impl = values.get("--rnn-impl", "fused")
        cfg.data.batch_size, cfg.data.seq_len = int(values["--batch-size"]), int(
            values["--seq-len"])
        return memory.step_memory(cfg, "cpu", 1, (74301,)).total

    base = ["--hidden-size", "8", "--embed-dim", "8", "--batch-size", "1", "--seq-len", "8"]
    # several runs: the step's peak is the largest (what a run must have room for), the fixed
    # cost the smallest (a one-off lazy import or malloc arena is not the step's). The reference
    # loop's peak is bimodal inside a full suite: ratio 1.235, 1.238, 1.239 there (also with
    # three runs), 0.92-1.03 and once 1.284 alone. An estimate above the peak is the safe side
    # for the preflight (it refuses a run that might not fit): below is bounded tightly (0.85),
    # above by 1.35
    measured = max(peak(flags, i) for i in range(3)) - min(peak(base, i) for i in range(2))
    ratio = (estimate(flags) - estimate(base)) / measured
    assert 0.85 <= ratio <= 1.35, f"estimate / measured = {ratio:.3f}"


# ---- 12. issue 27: every CLI error is one line ---------------------------------------------------

@pytest.mark.parametrize("argv,needles", [
    (["train", "--lr-rule", "bogus"], ["argument --lr-rule (optim.lr_rule): invalid choice: "
                                       "'bogus' (choose from 'none', 'linear', 'sqrt')"]),
    (["train", "--precision", "fp8"], ["--precision (run.precision)", "'fp32', 'fp16', 'bf16'"]),
    (["train", "--batch-szie", "3"], ["unrecognized arguments: --batch-szie 3",
                                      "did you mean --batch-size?"]),
    (["train", "--lr"], ["argument --lr (optim.lr): expected one argument"]),
    (["trian"], ["argument COMMAND: invalid choice: 'trian'", "hvd-lm --help lists the commands"]),
])
def test_argparse_errors_are_one_line(capsys, argv, needles):
    from hvd_lm.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    assert err.startswith(f"hvd-lm{' train' if argv[0] == 'train' else ''}: ERROR: ")
    for n in needles:
        assert n in err, err
    assert "--help lists the" in err


# ---- 13. issue 27: the small ones ----------------------------------------------------------------

def test_truncated_checkpoint_error_is_a_whole_sentence(shards, tmp_path):
    good = ck.save({"model": {"w": torch.ones(300)}, "step": 1, "config": {}}, tmp_path / "r", 1)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:200])
    proc = hvd_lm("eval", cut, shards, timeout=60)
    line = one_error_line(proc, "cut.pt: truncated or damaged checkpoint")
    assert line.endswith("(PytorchStreamReader failed reading zip archive: failed finding "
                         "central directory)"), line


def test_free_space_warning_states_the_real_checkpoint_size(shards, tmp_path, monkeypatch,
                                                            capsys):
    """The size the free-space check uses is within 3% of the checkpoint hvd-lm train wrote
    (it was 1.25 MB for this 231 kB file: a fixed 1 MiB for "the rest")."""
    import re

    from hvd_lm.model.lm import LanguageModel, ModelConfig
    from hvd_lm.train import rundir
    from hvd_lm.train.settings import TrainConfig

    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "2").returncode == 0
    real = ck.resolve(out).stat().st_size
    cfg = TrainConfig()
    cfg.run.out_dir = str(tmp_path / "r2")
    model = LanguageModel(ModelConfig(hidden_size=32, embed_dim=8))
    monkeypatch.setattr(rundir, "free_bytes", lambda d: 2 * real)
    rundir.open_run_folder(cfg, model, rows=2).release()
    err = capsys.readouterr().err
    m = re.search(r"checkpoints of about ([\d.]+) kB", err)
    assert m, err
    assert float(m.group(1)) * 1000 == pytest.approx(real, rel=0.03)


def test_eval_refuses_a_manifest_whose_vocabulary_is_not_bytes(shards, tmp_path):
    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "2").returncode == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in Path(shards).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = json.loads((bad / "manifest.json").read_text())
    data["vocab_size"] = 300
    (bad / "manifest.json").write_text(json.dumps(data))
    proc = hvd_lm("eval", out, bad, timeout=60)
    assert proc.returncode != 0
    one_error_line(proc, "manifest.json: field vocab_size is 300, expected 256")


def test_resume_with_nothing_to_train_says_so_and_writes_nothing(shards, tmp_path):
    """A run at step 6 resumed with --max-steps 3: one ERROR line, exit 2; with --max-steps 6
    (a finished run started again): a note, exit 0. Neither touches a file of the run."""
    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "6").returncode == 0
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    past = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "3",
                  "--resume", "auto")
    assert past.returncode == 2
    one_error_line(past, "step_00000006.pt is at step 6, past the end of this schedule",
                   "--max-steps 3", "nothing to train", "give --max-steps above 6")
    again = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "6",
                   "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "is at step 6, the last of this schedule" in again.stderr
    assert "nothing to train" in again.stderr and "ERROR" not in again.stderr
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert after == before
