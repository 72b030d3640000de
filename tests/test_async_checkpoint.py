"""Asynchronous checkpoints (hvd_lm.train.checkpointer.CheckpointWriter): the copy is taken at the
step, the write goes on while training does, a failed write is the synchronous error at the next
wait, the next checkpoint / a signal / the end wait for the write in flight, and a process killed
during a write resumes from the previous complete checkpoint."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hvd_lm.formats import checkpoint as ck
from hvd_lm.formats.checkpoint import to_host
from hvd_lm.train.checkpointer import CheckpointWriter
from hvd_lm.util import atomic
from tests import conftest
from tests._mp import launch_env, run
from tests.conftest import records

TINY = [*conftest.TINY, "--log-every", "1", "--control-every", "1"]
HVD_LM = [sys.executable, "-m", "hvd_lm"]




def wait_for(pred, timeout: float = 120, proc: subprocess.Popen | None = None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.communicate()}")
        time.sleep(0.1)
    raise AssertionError("timed out")


def train_with_a_slow_write(shards, out: Path, max_steps: int, sleep_s: float,
                            step: int) -> subprocess.Popen:
    """`hvd-lm train` in the background, checkpointing every 2 steps, the writer of step
    ``step``'s checkpoint sleeping ``sleep_s`` first (the HVD_LM_CHECKPOINT_SLEEP fault hook)."""
    argv = [*HVD_LM, "train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps",
            max_steps, "--checkpoint-every", "2"]
    return subprocess.Popen(list(map(str, argv)), env=launch_env(
        HVD_LM_CHECKPOINT_SLEEP=str(sleep_s), HVD_LM_CHECKPOINT_SLEEP_STEP=str(step)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_the_copy_is_taken_at_submit_and_written_in_the_background(tmp_path, monkeypatch):
    """submit returns before the (slowed) write; changing the tensors afterwards does not change
    the file; ``latest`` moves only when the file is complete; on_written reports it."""
    monkeypatch.setenv("HVD_LM_CHECKPOINT_SLEEP", "0.5")
    first = ck.save({"model": {"w": torch.zeros(4)}, "step": 1}, tmp_path, 1)
    done = []
    w = CheckpointWriter(True, done.append)
    state = {"model": {"w": torch.ones(4)}, "optimizer": {"state": {0: {"m": torch.ones(2)}}},
             "step": 2}
    w.submit(state, tmp_path, 2)
    assert w.in_flight  # returned while the write (0.5 s at least) runs: latest not moved yet
    state["model"]["w"].mul_(7)                      # training goes on, in place
    state["optimizer"]["state"][0]["m"].add_(1)
    assert ck.resolve(tmp_path) == first and not done
    written = w.wait()
    assert written.step == 2 and written.write_s >= 0.5 and written.blocked_s < written.write_s
    assert done == [written] and ck.resolve(tmp_path) == written.path
    saved = ck.load(written.path)
    assert saved["model"]["w"].tolist() == [1.0] * 4
    assert saved["optimizer"]["state"][0]["m"].tolist() == [1.0, 1.0]
    assert w.wait() is None and not w.in_flight


def test_to_host_keeps_state_dict_types():
    m = torch.nn.Linear(3, 2)
    sd = m.state_dict()
    host = to_host({"model": sd, "pair": (torch.ones(1), [2, "x"])})
    assert type(host["model"]) is type(sd) and host["model"]._metadata == sd._metadata
    assert host["model"]["weight"].data_ptr() != sd["weight"].data_ptr()
    assert torch.equal(host["model"]["weight"], sd["weight"])
    assert host["pair"][1] == [2, "x"] and isinstance(host["pair"], tuple)


def test_a_failed_background_write_is_the_synchronous_error_at_the_next_wait(tmp_path,
                                                                              monkeypatch):
    """Disk full in the writer thread: the same DiskFullError (same one-line message) as a
    synchronous write's, raised by the next wait; the previous checkpoint stays latest and no
    partial file is left."""
    first = ck.save({"model": {"w": torch.ones(3)}, "step": 1}, tmp_path, 1)
    real = Path.write_bytes

    def full(self, data):
        if self.name.startswith(".step_"):
            real(self, bytes(data)[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    monkeypatch.setattr(atomic, "free_bytes", lambda d: 1234)  # the message names it
    errors = []
    for asynchronous in (False, True):
        w = CheckpointWriter(asynchronous)
        with pytest.raises(atomic.DiskFullError) as e:
            w.submit({"model": {"w": torch.ones(1000)}, "step": 2}, tmp_path, 2)
            w.wait()
        errors.append(str(e.value))
        assert not w.in_flight
    assert errors[0] == errors[1] and "step_00000002.pt: no space left" in errors[0]
    monkeypatch.undo()
    assert ck.resolve(tmp_path) == first
    assert not list(ck.checkpoint_dir(tmp_path).glob(".*tmp*"))


@pytest.mark.slow
def test_async_and_sync_checkpoints_hold_the_same_state(shards, tmp_path):
    """The background copy is the state at the checkpoint's step: the files of a run with and
    one with --async-checkpoint false are equal tensor for tensor (model, optimizer, recurrent
    state), and the async run's records say how long the loop was blocked."""
    common = ["--shards", shards, *TINY, "--max-steps", "4", "--checkpoint-every", "2"]
    for flag, name in (("true", "a"), ("false", "s")):
        run([*HVD_LM, "train", *common, "--out-dir", tmp_path / name, "--async-checkpoint",
             flag], timeout=300)
    for step in (2, 4):
        a = ck.load(ck.checkpoint_dir(tmp_path / "a") / f"step_{step:08d}.pt")
        s = ck.load(ck.checkpoint_dir(tmp_path / "s") / f"step_{step:08d}.pt")
        for k, v in s["model"].items():
            assert torch.equal(a["model"][k], v), k
        for i, st in s["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(a["optimizer"]["state"][i][k], v), (i, k)
        assert all(torch.equal(x, y) for x, y in zip(a["rnn_state"], s["rnn_state"]))
    recs = records(tmp_path / "a", "checkpoint")
    assert [r["step"] for r in recs] == [2, 4]
    assert all(r["blocked_s"] <= r["write_s"] for r in recs)
    assert records(tmp_path / "a", "start")[0]["async_checkpoint"] is True


@pytest.mark.slow
def test_kill_9_during_a_background_write_resumes_from_the_previous_checkpoint(shards,
                                                                               tmp_path):
    """The writer of step 4's checkpoint is slowed (a fault hook): training goes on past step
    4 while it is in flight, ``latest`` is still step 2; kill -9 then; ``--resume auto``
    continues from step 2."""
    out = tmp_path / "r"
    proc = train_with_a_slow_write(shards, out, 40, 120, step=4)
    try:
        wait_for(lambda: any(r["step"] >= 5 for r in records(out, "train")), proc=proc)
        assert ck.resolve(out).name == "step_00000002.pt"
        assert not (ck.checkpoint_dir(out) / "step_00000004.pt").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert [r["step"] for r in records(out, "checkpoint")] == [2]
    res = run([*HVD_LM, "train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "6",
               "--checkpoint-every", "2", "--resume", "auto"], timeout=300)
    start = records(out, "start")[-1]
    assert start["step"] == 2 and start["resumed_from"].endswith("step_00000002.pt"), res.stderr
    assert ck.load(ck.resolve(out))["step"] == 6


@pytest.mark.slow
@pytest.mark.serial  # a write's timing against the steps' or a signal's
def test_a_signal_and_the_end_wait_for_the_write_in_flight(shards, tmp_path):
    """Step 2's write is slowed by 3 s; SIGTERM arrives while it is in flight: the signal's
    checkpoint waits for it, the run ends after both are complete (the end record last),
    exits 0 and ``latest`` is the signal's step."""
    out = tmp_path / "r"
    proc = train_with_a_slow_write(shards, out, 400, 3, step=2)
    try:
        wait_for(lambda: any(r["step"] >= 3 for r in records(out, "train")), proc=proc)
        assert not records(out, "checkpoint")     # step 2's write is still in flight
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    recs = records(out)
    kinds = [r["kind"] for r in recs]
    ckpts = [r for r in recs if r["kind"] == "checkpoint"]
    assert ckpts[0]["step"] == 2 and len(ckpts) >= 2
    assert kinds[-1] == "end" and recs[-1]["stop"] == "signal"
    last = ckpts[-1]["step"]
    assert ck.resolve(out).name == f"step_{last:08d}.pt"
    assert ck.load(ck.resolve(out))["step"] == last
    assert ckpts[0]["write_s"] >= 3


@pytest.mark.serial  # a write's timing against the steps' or a signal's
def test_bench_checkpoint_measures_both_modes(tmp_path):
    """``python -m benchmarks checkpoint`` at a tiny size, 0.3 s of write latency added: the
    synchronous checkpoint blocks the loop for the whole write, the background one for its
    copy only."""
    from benchmarks import main as bench_main

    out = tmp_path / "b.json"
    assert bench_main(["checkpoint", "--hidden-size", "32", "--steps", "6",
                     "--checkpoint-after", "2", "--repeats", "1", "--added-write-latency", "0.3",
                     "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["sync"]["blocked_s"] >= 0.3 and d["sync"]["stall_s"] >= 0.3
    assert d["async"]["blocked_s"] < 0.3 and d["async"]["write_s"] >= 0.3
    assert d["stall_ratio_async_over_sync"] == d["async"]["stall_s"] / d["sync"]["stall_s"]
    assert [r["mode"] for r in d["rounds"]] == ["sync", "async"]
    assert "HVD_LM_CHECKPOINT_SLEEP" not in os.environ
