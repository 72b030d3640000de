"""Training to a deadline (``--time-limit``) and to a budget across allocations (``--time-budget``,
hvd_lm/train/deadline.py): the schedule's re-planned line, the planner's arithmetic against a
hand computation, and real runs on the planner's virtual clock (what the plan guarantees, never
what this machine's speed allows) that end before their deadline with the LR at 0 and a final
checkpoint, resumed with a limit of their own, and three allocations of a budget equal to one
run; ``hvd-lm launch --walltime`` deriving the limit. On 2 ranks: tests/parallel/test_training.py.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_lm.formats.checkpoint import load, resolve
from hvd_lm.train.deadline import SKIP_ATTEMPTS, Cadence, DeadlinePlanner
from hvd_lm.train.schedule import LRPlan, lr_factor
from hvd_lm.util.units import parse_duration, scheduler_time
from tests import conftest
from tests._mp import REPO, horovodrun_cmd, launch_env, run
from tests.conftest import records

TINY = [*conftest.TINY, "--hidden-size", "16", "--log-every", "1", "--warmup-steps", "5"]




# ---- the pieces --------------------------------------------------------------------------------

def test_durations_in_the_forms_people_and_slurm_write():
    # sbatch's --time forms as the sbatch manual defines them: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
    forms = {"40s": 40, "6m": 360, "1.5h": 5400, "2d": 172800, "90": 90 * 60, "10:00": 10 * 60,
             "1:30": 90, "3:50:00": 3 * 3600 + 50 * 60, "1-02": 26 * 3600,
             "1-02:30": 26 * 3600 + 30 * 60, "1-02:00:05": 26 * 3600 + 5}
    assert {t: parse_duration(t) for t in forms} == forms
    assert parse_duration("90", bare="seconds") == 90  # qsub's bare number
    assert {t: scheduler_time(t, "slurm") for t in ("10:00", "90", "1-02", "4h")} == \
        {"10:00": "10:00", "90": "90", "1-02": "1-02", "4h": "4:00:00"}
    assert {t: scheduler_time(t, "pbs") for t in ("10:00", "90", "1-02", "4h")} == \
        {"10:00": "10:00", "90": "90", "1-02": "26:00:00", "4h": "4:00:00"}
    for bad, says in (("0", "must be positive"), ("6 parsecs", "not a duration"),
                      ("400-00:00:00", "more than 365"), ("9" * 20, "more than 365 days")):
        with pytest.raises(ValueError, match=says):
            parse_duration(bad, "--time-limit")
    for bad in ("1:2:3:4", "1-2-3", ":30", "1-:30"):
        with pytest.raises(ValueError, match="not a duration.*sbatch's --time"):
            parse_duration(bad, "--time-limit")


def test_a_replanned_schedule_bends_without_a_jump_and_ends_at_zero():
    plan = LRPlan(1.0, warmup_steps=10, total_steps=100)
    s = plan.factor
    assert [s(i) for i in range(100)] == [lr_factor(i, 10, 100) for i in range(100)]
    plan.replan(4, 50)  # in the warmup: only the end moves
    assert [s(i) for i in range(50)] == [lr_factor(i, 10, 50) for i in range(50)]
    before = s(30)
    plan.replan(30, 80)  # later: from the factor it had, a straight line to 0 at 80
    assert s(30) == before and s(80) == 0.0 and s(90) == 0.0
    assert s(55) == pytest.approx(before * 25 / 50)
    before = s(60)
    plan.replan(60, 60)  # nothing fits anymore: 0 from here
    assert s(60) == 0.0 and before > 0
    # the plan travels in its state (a checkpoint holds it)
    plan = LRPlan(1.0, 0, 100)
    plan.replan(20, 40)
    fresh = LRPlan(1.0, 0, 100)
    fresh.load_state_dict(plan.state_dict())
    assert vars(fresh) == vars(plan) and fresh.factor(30) == pytest.approx(0.8 * 10 / 20)


def test_the_planner_fits_steps_evaluations_and_checkpoints_before_the_deadline():
    now = [1000.0]
    p = DeadlinePlanner(100.0, started=1000.0, clock=lambda: now[0],
                        cadence=Cadence(eval_every=50, checkpoint_every=100, has_val=True),
                        eval_estimate=lambda: 3.0, checkpoint_estimate_s=4.0, margin_s=2.0)
    for _ in range(SKIP_ATTEMPTS):
        p.step_done(30.0)  # compilation: left out
    assert p.plan(0, 10**9) is None  # not measured yet
    for t in (0.1, 0.3, 0.2):
        p.step_done(t)
    now[0] = 1010.0  # 90 s left; reserve 3 (eval) + 4 (checkpoint) + 2 (margin)
    per_step = (0.1 + 0.3 + 0.2) / 3 + 3.0 / 50 + 4.0 / 100
    assert p.plan(7, 10**9) == 7 + math.floor((90 - 9) / per_step)
    assert 269 <= p.plan(7, 10**9) - 7 <= 270
    assert p.plan(7, 7 + 271) is None  # within 1% of the steps left: kept
    assert p.plan(7, 10**9, cap=100) == 100  # --max-steps caps it
    p.checkpoint_done(write_s=6.0, blocked_s=0.5)  # measured: the plan follows
    p.eval_done(1.0)
    per_step = (0.1 + 0.3 + 0.2) / 3 + 1.0 / 50 + 0.5 / 100
    assert p.plan(7, 10**9) == 7 + math.floor((90 - 9) / per_step)
    now[0] = 1095.0  # less left than the reserve: the run ends where it is
    assert p.plan(300, 400) == 300
    d = p.describe()
    assert d["left_s"] == 5.0 and d["reserve_s"] == 9.0 and d["step_time"] == pytest.approx(0.2)


def test_a_budget_plans_the_lr_to_its_end_and_each_allocation_stops_before_its_limit():
    """--time-budget 100 s with 20 s trained before, in an allocation of --time-limit 30 s: the
    plan's end is 80 s after the loop's start, the allocation's stop 30 s after the process's;
    a hand computation of both."""
    now = [1000.0]
    p = DeadlinePlanner(30.0, budget_s=100.0, trained_s=20.0, started=995.0,
                        clock=lambda: now[0], checkpoint_estimate_s=1.0, margin_s=2.0)
    p.start()  # the loop starts 5 s after the process: trained time counts from here
    assert p.stop_step(0) is None  # nothing timed yet
    p.step_done(4.0)  # the first attempt (compilation): the slowest stands for a step until...
    now[0] = 1004.0
    assert p.stop_step(1) == 1 + math.floor((21 - 1 - 2) / 4.0)
    for _ in range(SKIP_ATTEMPTS - 1 + 3):
        p.step_done(0.5)  # ... the step time is measured
    now[0] = 1010.0
    assert p.stops_first and p.trained_s() == pytest.approx(30.0)
    assert p.plan(10, 10**9) == 10 + math.floor((70 - (1 + 2)) / 0.5)  # LR 0 at the budget's end
    assert p.stop_step(10) == 10 + math.floor((15 - (1 + 2)) / 0.5)  # the allocation's end
    assert p.describe()["budget_s"] == 100.0 and p.describe()["stop_left_s"] == 15.0
    # the budget's end before the limit: the plan governs, and the run ends there (no stop)
    q = DeadlinePlanner(300.0, budget_s=100.0, trained_s=90.0, started=995.0,
                        clock=lambda: now[0], margin_s=2.0)
    q.start()
    for _ in range(SKIP_ATTEMPTS + 3):
        q.step_done(0.5)
    assert not q.stops_first and q.stop_step(0) is None
    assert q.plan(0, 10**9) == math.floor((10 - 2) / 0.5)
    with pytest.raises(ValueError, match="time limit or a time budget"):
        DeadlinePlanner(None)


# ---- real runs ---------------------------------------------------------------------------------

def train(shards, out, *extra, np_: int = 1, **env) -> subprocess.Popen:
    argv = ["-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out, *TINY, *extra]
    cmd = horovodrun_cmd(np_, argv, "gloo") if np_ > 1 else [sys.executable, *argv]
    return subprocess.Popen([str(c) for c in cmd], env=launch_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def check_ended_at_deadline(run_dir, limit_s: float, step_s: float) -> dict:
    """On the virtual clock: the run's LR reached 0 at its last step, whose checkpoint is its
    newest, with the margin kept before the deadline (2 s + 1% of the limit: no more than one
    more step's worth, and none overrun); the plan was logged."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop"] == "done" and summary["time_limit_s"] == limit_s
    margin = 2 + 0.01 * limit_s
    assert margin <= summary["deadline_left_s"] < margin + step_s, summary
    last = records(run_dir, "train")[-1]
    assert last["step"] == summary["step"] and last["lr"] == 0.0
    assert load(resolve(run_dir))["step"] == summary["step"]
    plans = records(run_dir, "plan")
    assert plans and plans[-1]["total_steps"] == summary["step"]
    return summary


@pytest.mark.slow
def test_one_process_trains_to_its_deadline_and_a_resume_has_its_own(shards, tmp_path):
    """1 rank on the planner's virtual clock (every step attempt 0.25 s of it, whatever this
    machine's speed; each really sleeps 0.05 s so that a signal lands mid-run): stopped by
    SIGTERM, resumed with its own limit, the LR continues from where it was (no jump back to the
    peak) and reaches 0 at the second deadline, with the final checkpoint; started again, a run
    whose LR reached 0 has nothing to train."""
    out = tmp_path / "run"
    clock = {"HVD_LM_VIRTUAL_STEP_S": "0.25", "HVD_LM_STEP_SLEEP": "0.05"}
    first = train(shards, out, "--time-limit", "60s", **clock)
    try:
        t_end = time.time() + 120
        while time.time() < t_end and first.poll() is None and not (
                (out / "metrics.jsonl").exists() and len(records(out, "plan")) >= 1
                and len(records(out, "train")) >= 30):
            time.sleep(0.3)
        first.send_signal(signal.SIGTERM)
    finally:
        finished(first, 60)
    assert records(out, "end")[0]["stop"] == "signal"
    lr_at_stop = records(out, "train")[-1]["lr"]
    peak = records(out, "start")[0]["peak_lr"]
    assert 0 < lr_at_stop < peak  # decaying towards the first deadline

    finished(train(shards, out, "--time-limit", "15s", "--resume", "auto", **clock), 120)
    check_ended_at_deadline(out, 15, 0.25)
    starts = records(out, "start")
    first_lr = [r for r in records(out, "train") if r["time"] > starts[-1]["time"]][0]["lr"]
    assert first_lr <= lr_at_stop and first_lr == pytest.approx(lr_at_stop, rel=0.05)

    again = run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out,
                 *TINY, "--time-limit", "15s", "--resume", "auto"], timeout=120, check=False)
    assert again.returncode == 0 and "nothing to train" in again.stderr, again.stderr


# ---- hvd-lm launch ------------------------------------------------------------------------------

LAUNCH = ["launch", "--scheduler", "slurm", "--gpus", "16", "--gpus-per-node", "8"]


def test_launch_gives_the_training_the_walltime_less_a_margin(capsys):
    """The rendered scripts through the CLI's own entry point, in this process (the command
    line, exit status and one-line error through a real ``python -m hvd_lm``, once)."""
    from hvd_lm.cli import main

    def script(*args) -> str:
        assert main([*LAUNCH, *args, "--", "--shards", "d"]) == 0
        return capsys.readouterr().out

    assert "--time-limit 13800s" in script("--walltime", "4:00:00", "--time-margin", "10m")
    assert "--time-limit 3300s" in script("--walltime", "1h")  # default margin 5m
    assert "--time-limit" not in [x for x in script("--walltime", "1h", "--time-margin", "0")
                                  .splitlines() if x.startswith("TRAIN_ARGS=")][0]
    bad = subprocess.run([sys.executable, "-m", "hvd_lm", *LAUNCH, "--walltime", "4m", "--",
                          "--shards", "d"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert bad.returncode == 2
    assert "--time-margin 5m (300 s) is not below --walltime 4m" in bad.stderr
    # "10:00" is ten minutes to sbatch and qsub (not ten hours): written as given, and a 15m
    # margin leaves nothing to train
    ten = script("--walltime", "10:00")
    assert "#SBATCH --time=10:00" in ten and "--time-limit 300s" in ten
    assert main([*LAUNCH, "--walltime", "10:00", "--time-margin", "15m", "--", "--shards",
                 "d"]) == 2
    err = capsys.readouterr().err
    assert err.count("ERROR") == 1 and ("--time-margin 15m (900 s) is not below --walltime "
                                        "10:00 (600 s, as sbatch reads it)") in err, err
    pbs = script("--scheduler", "pbs", "--walltime", "3600")  # qsub: a bare number is seconds
    assert "#PBS -l walltime=3600" in pbs and "--time-limit 3300s" in pbs


def test_a_slurm_margin_ends_the_training_before_the_warning_signal(capsys):
    """Under SLURM the training's deadline falls before the script's warning signal: the margin
    covers the signal's lead (the template's own --signal), SLURM's up to 60 s early delivery
    and a start; one that cannot is refused naming both numbers (walltime 6 min, margin 1m: the
    signal came at ~240 s, inside the 300 s limit, and the job requeued itself every time)."""
    from hvd_lm.cli import main
    from hvd_lm.jobs.job_plans import MIN_START_S, SLURM_SIGNAL_EARLY_S, SLURM_SIGNAL_LEAD_S

    least = SLURM_SIGNAL_LEAD_S + SLURM_SIGNAL_EARLY_S + MIN_START_S
    assert main([*LAUNCH, "--walltime", "0:06:00", "--time-margin", "1m", "--", "--shards",
                 "d"]) == 2
    err = capsys.readouterr().err
    assert err.count("ERROR") == 1 and "--time-margin 1m (60 s) would let the training run " \
        "into SLURM's warning signal" in err and f"give --time-margin {least}s or more" in err
    assert main([*LAUNCH, "--walltime", "0:06:00", "--time-margin", f"{least}s", "--",
                 "--shards", "d"]) == 0
    text = capsys.readouterr().out
    assert f"--time-limit {360 - least}s" in text
    assert f"#SBATCH --signal=B:USR1@{SLURM_SIGNAL_LEAD_S} " in text  # the template's own lead
    assert main([*LAUNCH, "--scheduler", "pbs", "--walltime", "0:06:00", "--time-margin", "1m",
                 "--", "--shards", "d"]) == 0  # no warning signal under PBS
    assert "--time-limit 300s" in capsys.readouterr().out


def test_three_allocations_of_a_time_budget_equal_one_run_of_it(shards, tmp_path):
    """--time-budget 30s trained once, and in three allocations of --time-limit 12s each resumed
    with --resume auto: the LR at every step is the same, the first two stop before their limit
    with a checkpoint (stop: time-limit) and the third ends the plan with the LR at 0; started
    again, the spent budget is one line. On the planner's virtual clock (every step attempt 0.25
    s, HVD_LM_VIRTUAL_STEP_S), so that no verdict depends on this machine's speed."""
    flags = ["--time-budget", "30s", "--control-every", "1", "--warmup-steps", "10"]
    env = launch_env(HVD_LM_VIRTUAL_STEP_S="0.25")

    def train_run(out, *extra):
        return run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir",
                    out, *TINY, *flags, *extra], timeout=180, env=env)

    one = tmp_path / "one"
    train_run(one)
    whole = {r["step"]: r["lr"] for r in records(one, "train")}
    end = json.loads((one / "summary.json").read_text())
    # (30 s - the 2.3 s margin) / 0.25 s per step
    assert end["stop"] == "done" and end["step"] == math.floor((30 - 2.3) / 0.25)
    assert whole[end["step"]] == 0.0 and end["trained_s"] <= 30

    parts = tmp_path / "parts"
    stops = []
    for i in range(3):
        proc = train_run(parts, "--time-limit", "12s", *(["--resume", "auto"] if i else []))
        summary = json.loads((parts / "summary.json").read_text())
        # where each allocation started: the step the one before stopped at (the SLURM script
        # requeues only an allocation that trained a step)
        assert summary["start_step"] == (stops[-1][1] if stops else 0) < summary["step"]
        stops.append((summary["stop"], summary["step"]))
        if summary["stop"] == "time-limit":
            assert "stopped at step" in proc.stderr and "--resume auto" in proc.stderr
            assert load(resolve(parts))["step"] == summary["step"]  # checkpointed there
            assert 0 <= summary["deadline_left_s"] < 0.25 + 2.12  # within a step and margin
    assert [s for s, _ in stops] == ["time-limit", "time-limit", "done"], stops
    assert stops[-1][1] == end["step"]
    parted = {r["step"]: r["lr"] for r in records(parts, "train")}
    assert sorted(parted) == sorted(whole)
    assert [parted[k] for k in sorted(parted)] == pytest.approx(
        [whole[k] for k in sorted(whole)], rel=1e-9, abs=1e-12)
    assert load(resolve(parts))["trained_s"] == pytest.approx(load(resolve(one))["trained_s"])

    again = run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir", parts,
                 *TINY, *flags, "--resume", "auto"], timeout=120, env=env, check=False)
    assert again.returncode == 0, again.stderr
    lines = [x for x in again.stderr.splitlines() if "budget is spent" in x]
    assert len(lines) == 1 and "--time-budget 30s" in lines[0], again.stderr


def test_a_step_longer_than_the_limit_stops_the_run_after_it_with_a_checkpoint(shards, tmp_path):
    """Before: with every step slower than --time-limit (a cold node's first step, a compile, a
    straggler), the first step ended past the limit and a second one started: the scheduler's
    kill came with no checkpoint. Now the step that ends past the limit is the last one, with a
    checkpoint and one line saying the limit is shorter than a step; the time budget counts
    exactly the step trained. On the virtual clock (every step attempt 330 s of it)."""
    env = launch_env(HVD_LM_VIRTUAL_STEP_S="330")
    for extra in ([], ["--time-budget", "20m"]):
        out = tmp_path / f"run{len(extra)}"
        proc = run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir",
                    out, *TINY, "--time-limit", "5m", *extra], timeout=180, env=env)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["stop"] == "time-limit" and summary["step"] == 1, summary
        assert load(resolve(out))["step"] == 1  # checkpointed there
        lines = [x for x in proc.stderr.splitlines() if "is shorter than one step" in x]
        assert len(lines) == 1 and "--time-limit 5m (300 s)" in lines[0], proc.stderr
        if extra:
            assert summary["trained_s"] == 330 and load(resolve(out))["trained_s"] == 330
            assert summary["budget_left_s"] == 20 * 60 - 330


def test_the_attempt_that_just_ended_counts_before_it_is_timed():
    """On the wall clock the loop times an attempt when the next one begins; the stop decided
    between them counts the attempt that just ended (``running_s``): a first step of 200 s
    under a 300 s limit leaves no room for a second (stop after step 1), one of 330 s ended past
    it (stop there too); a 2 s step leaves room."""
    now = {"t": 0.0}
    for took, expect in ((200.0, 1), (330.0, 1), (2.0, None)):
        now["t"] = took
        p = DeadlinePlanner(300, started=0.0, clock=lambda: now["t"])
        got = p.stop_step(1, running_s=took)
        assert (got == 1) if expect else got > 1, (took, got)
