"""The threads rule (hvd_lm/comm/threads.py) that train, eval, transfer and the tools share:
ranks are counted per machine (its boot id, not its host name: namespace hosts share one
machine's cores), and eval and transfer warn as train does when threads exceed the cores."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hvd_lm.comm import engine, threads
from tests._mp import launch_env, run


def test_ranks_are_counted_per_machine_not_per_host_name(monkeypatch):
    """Two namespace hosts of one machine: Horovod counts one local rank on each host name, the
    boot ids say two ranks share the cores; a 2-core machine then gives each rank 1 thread."""
    ctx = SimpleNamespace(size=3, local_size=1, local_rank=0)
    monkeypatch.setattr(threads, "machine_id", lambda: "boot-a")
    monkeypatch.setattr(engine, "allgather_object",
                        lambda obj, name: ["boot-a", "boot-b", "boot-a"])
    assert threads.ranks_on_this_machine(ctx) == 2
    assert threads.ranks_on_this_machine(ctx, collective=False) == 1  # an elastic worker
    assert threads.ranks_on_this_machine(None) == 1
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "idle_cores", lambda: 2.0)  # a quiet machine
    assert threads.threads_per_rank(0, 2) == 1 and threads.threads_per_rank(0, 1) == 2
    assert threads.machine_id() != ""


@pytest.mark.parametrize("cores,ranks,idle,want", [
    (2, 1, 2.0, 2), (2, 1, 1.6, 2), (2, 1, 1.4, 1), (2, 1, 0.0, 1),  # one other job: 1 thread
    (16, 4, 16.0, 4), (16, 4, 9.0, 2), (16, 4, 2.0, 1), (2, 2, 0.0, 1)])
def test_the_default_fits_the_cores_left_idle(monkeypatch, capsys, cores, ranks, idle, want):
    """--threads 0 gives each rank its share of the idle cores (rounded), never more than its
    share of the usable ones nor less than 1; an explicit --threads is kept whatever the
    load."""
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(threads, "idle_cores", lambda: idle)
    assert threads.threads_per_rank(0, ranks, "eval", warn=True) == want
    assert capsys.readouterr().err == ""  # recorded by the commands, not said: it varies
    assert threads.threads_per_rank(3, 1, "eval") == 3


def test_a_busy_machine_gets_fewer_threads(run_dir):
    """Two processes spinning on this 2-core machine: eval's default takes 1 thread and its
    JSON says so (before, 2 threads against 2 spinners: transfer ran 30x slower than on 1),
    measured by the kernel's own CPU times (psutil), not a model of them; --threads 2 is
    kept."""
    if threads.usable_cores() != 2:
        pytest.skip("the case of a 2-core machine")
    spin = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", "while True: pass"])
            for c in (0, 1)]
    measured = {k: v for k, v in launch_env().items() if k != "HVD_LM_IDLE_CORES"}  # the tests'
    try:
        ev = run(["taskset", "-c", "0,1", sys.executable, "-m", "hvd_lm", "eval", run_dir / "run",
                  run_dir / "shards"], env=measured, timeout=300)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert json.loads(ev.stdout.strip().splitlines()[-1])["threads"] == 1, ev.stdout
    quiet = run(["taskset", "-c", "0,1", sys.executable, "-m", "hvd_lm", "eval", run_dir / "run",
                 run_dir / "shards", "--threads", "2"], env=measured, timeout=300)
    assert json.loads(quiet.stdout.strip().splitlines()[-1])["threads"] == 2  # as asked


@pytest.fixture
def run_dir(trained_run, tmp_path):
    """The session's trained run (tests/conftest.py) and its shards, in a folder of this
    test's."""
    (tmp_path / "run").symlink_to(trained_run.run)
    (tmp_path / "shards").symlink_to(trained_run.shards)
    return tmp_path


def test_eval_and_transfer_warn_as_train_does(run_dir):
    """Confined to one core, --threads 2 in eval and transfer says so in one line naming the
    command (they used torch's default threads silently: 5x slower featurization); transfer
    says when its fit starts and ends."""
    for split in ("train", "val"):  # (no text in both: transfer would drop val's copies)
        rows = ["label,text"] + [f"{i % 2},{'great' if i % 2 else 'awful'} {split} {i}"
                                 for i in range(8)]
        (run_dir / f"{split}.csv").write_text("\n".join(rows) + "\n")
    warning = (f"WARNING: 1 rank(s) x 2 threads on {socket.gethostname()} exceed its 1 usable "
               "cores: steps can run 20-50x slower; use --threads 1 (0 picks that)")
    ev = run(["taskset", "-c", "0", sys.executable, "-m", "hvd_lm", "eval", run_dir / "run",
              run_dir / "shards", "--threads", "2"], env=launch_env(), timeout=300)
    assert f"hvd-lm eval: {warning}" in ev.stderr.splitlines(), ev.stderr
    tr = run(["taskset", "-c", "0", sys.executable, "-m", "hvd_lm", "transfer", run_dir / "run",
              "--train", run_dir / "train.csv", "--val", run_dir / "val.csv", "--out",
              run_dir / "tr", "--threads", "2", "--no-baseline", "--no-cache"],
             env=launch_env(), timeout=300)
    assert f"hvd-lm transfer: {warning}" in tr.stderr.splitlines(), tr.stderr
    # the minutes of the fit are said (a bar covers the featurization on a terminal)
    assert "hvd-lm transfer: fitting L1 logistic regression: 11 C values x 5-fold " \
        "cross-validation on 8 x 32 train features (auto solver)" in tr.stderr
    assert "hvd-lm transfer: fit in " in tr.stderr
    quiet = run(["taskset", "-c", "0", sys.executable, "-m", "hvd_lm", "eval", run_dir / "run",
                 run_dir / "shards"], env=launch_env(), timeout=300)
    assert "usable cores" not in quiet.stderr  # the default: 1 thread on 1 core


def test_the_tests_fix_the_idle_cores(monkeypatch):
    """HVD_LM_IDLE_CORES (set by tests/conftest.py for the whole suite) stands for the measured
    idle cores; a value that is not a count is one error naming it."""
    monkeypatch.setenv("HVD_LM_IDLE_CORES", "3")
    assert threads.idle_cores() == 3.0
    monkeypatch.setenv("HVD_LM_IDLE_CORES", "x")
    with pytest.raises(ValueError, match="HVD_LM_IDLE_CORES='x'"):
        threads.idle_cores()
