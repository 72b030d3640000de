"""Failure behaviour (README "Failure behaviour"): no job destroys another's work, a diverged run
stops, signals reach every rank under every launcher, a full disk is one line, bad settings are
one ERROR line before any work (checkpoints: test_reliability_checkpoints.py; data_prep:
test_reliability_prepare.py; shapes, memory, CLI errors: test_reliability_preflight.py)."""
from __future__ import annotations

import errno
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
from hvd_lm.util import atomic
from hvd_lm.util.lock import FolderBusyError, FolderLock
from tests._mp import horovodrun_cmd, launch_env, mpirun_cmd
from tests.conftest import records
from tests.reliability_common import (  # noqa: F401 - the fixtures these tests take
    HVD_LM,
    TINY,
    hvd_lm,
    one_error_line,
)

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
    if kind == "horovodrun-gloo-bash":  # /bin/sh is bash (RHEL...), in a mount namespace of its own
        return ["unshare", "-m", "sh", "-c", 'mount --bind /bin/bash /bin/sh && exec "$@"', "sh",
                *horovodrun_cmd(2, argv, "gloo")]
    return horovodrun_cmd(2, argv, kind.split("-")[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind,sig", [("horovodrun-mpi", signal.SIGTERM),
                                      ("horovodrun-gloo", signal.SIGINT),
                                      ("horovodrun-gloo-bash", signal.SIGINT),
                                      ("mpirun", signal.SIGTERM)])
def test_signal_to_the_launcher_checkpoints_every_rank(shards, tmp_path, kind, sig):
    """The signal goes to the launcher process itself (as `kill PID` or Ctrl-C would); every rank
    checkpoints at the same step and exits 0, and no process is left behind. Where /bin/sh is
    bash, each rank under horovodrun --gloo is a fork of the process that stands in for the shell
    (hvd_lm.comm.world.stand_in_for_horovodrun_shell): four processes."""
    if kind.endswith("bash") and (os.geteuid() != 0 or not Path("/usr/bin/unshare").exists()):
        pytest.skip("bash as /bin/sh needs root and unshare (util-linux) for a mount namespace")
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
        assert len(ranks) == (4 if kind.endswith("bash") else 2), [p.cmdline() for p in ranks]
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
    # the ranks exit 0; OpenMPI's mpirun returns 1 after a SIGTERM it forwarded; under
    # horovodrun --mpi the signalled process is the /bin/sh horovodrun became, which the signal
    # kills (its status says nothing about the ranks); horovodrun --gloo returns 0, or 1 naming
    # exit code 143 or 137: its teardown (safe_shell_exec.terminate_executor_shell_and_children,
    # 0.28.1) SIGTERMs each rank, SIGKILLs one not gone 5 s later (GRACEFUL_TERMINATION_TIME_S:
    # a rank still exiting after the checkpoint under load, 137), then SIGSTOPs and SIGTERMs the
    # /bin/sh around it, and a shell not yet exited dies of it (143); seen in make test under
    # load. The checkpoint below holds both ranks' rows: every rank took part in it
    if kind == "mpirun":
        assert proc.returncode == 1, (proc.returncode, log[-3000:])
    elif kind.startswith("horovodrun-gloo") and proc.returncode != 0:
        assert proc.returncode == 1 and ("Exit code: 143" in log or "Exit code: 137" in log), (
            proc.returncode, log[-3000:])
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
