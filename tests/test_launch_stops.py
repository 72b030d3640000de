"""How a launch template ends when its launcher's exit status says less than the run's own records
(launch/lib.sh with hvd_lm/jobs/failure_summary.py): a clean stop on a signal exits 0 whatever
the launcher's status, a start mpirun refused as root ends with the fix, and a rank the launcher
reports lost is named with its host."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests._mp import REPO, launch_env, run

LAUNCH = REPO / "launch"
TINY = ("--hidden-size 16 --embed-dim 8 --seq-len 16 --batch-size 2 --log-every 1 "
        "--threads 1 --device cpu")


def stand_in(path, body: str):
    """An executable shell script standing in for the launcher."""
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("status", [255, 0])
def test_a_clean_stop_exits_0_whatever_the_launchers_status(shards, tmp_path, status):
    """The real mpirun trains; the stand-in then exits 255 or 0, as horovodrun across hosts did
    (either, from one run to the next) after its ranks checkpointed on SIGTERM: the template
    says a clean stop and exits 0."""
    mpirun = stand_in(tmp_path / "mpirun", 'mpirun "$@" &\npid=$!\n'
                      "trap 'kill -USR1 $pid' USR1\ntrap 'kill -TERM $pid' TERM\n"
                      f'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done\nexit {status}\n')
    out = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(LAUNCH / "mpirun.sh")], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=launch_env(NP="2", OUT_DIR=str(out), MPIRUN=str(mpirun),
                                           HVD_LM_STEP_SLEEP="0.2",
                                           TRAIN_ARGS=f"--shards {shards} {TINY} "
                                                      "--max-steps 100000"))
    try:
        end = time.time() + 120
        while time.time() < end and not ((out / "metrics.jsonl").exists() and sum(
                '"train"' in x for x in (out / "metrics.jsonl").read_text().splitlines()) >= 3):
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop"] == "signal"
    assert proc.returncode == 0, err[-3000:]
    assert "==== hvd-lm: stopped on a signal: every rank checkpointed at step " in err
    assert "the job failed" not in err and "killed outright" not in err


@pytest.mark.slow
def test_mpirun_refusing_root_ends_with_the_fix(shards, tmp_path):
    """As root with OpenMPI's permission taken away (the templates give it to root): the
    closing block's cause is the refusal and its fix, not 'a rank killed outright'."""
    env = launch_env(NP="2", OUT_DIR=str(tmp_path / "run"), OMPI_ALLOW_RUN_AS_ROOT="",
                     OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="", PREFLIGHT="0",
                     TRAIN_ARGS=f"--shards {shards} {TINY} --max-steps 2")
    p = run(["bash", LAUNCH / "mpirun.sh"], env=env, cwd=tmp_path, check=False, timeout=120)
    if "as root" not in p.stderr + p.stdout:
        pytest.skip("not root: OpenMPI has nothing to refuse here")
    assert p.returncode != 0
    last = p.stderr.rstrip().splitlines()[-1]
    assert last.startswith("cause: mpirun refused to start: OpenMPI does not run as root "
                           "unless told to; set OMPI_ALLOW_RUN_AS_ROOT=1"), p.stderr[-2000:]
    ok = run(["bash", LAUNCH / "mpirun.sh"], env={**env, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                                    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
             cwd=tmp_path, timeout=180)
    assert ok.returncode == 0


def test_a_rank_the_launcher_lost_is_named_with_its_host(shards, tmp_path):
    """srun's own line about a killed task (printed here by a stand-in launcher): the closing
    block names the rank and host instead of 'no rank recorded a failure'."""
    srun_like = stand_in(tmp_path / "mpirun", 'echo "srun: error: n2: task 1: Killed" >&2\n'
                         "exit 137\n")
    env = launch_env(NP="2", OUT_DIR=str(tmp_path / "run"), MPIRUN=str(srun_like),
                     TRAIN_ARGS=f"--shards {shards} {TINY} --max-steps 2")
    p = run(["bash", LAUNCH / "mpirun.sh"], env=env, cwd=tmp_path, check=False, timeout=120)
    assert p.returncode == 137
    assert p.stderr.rstrip().splitlines()[-1] == "cause: srun: rank 1 on host n2: Killed", \
        p.stderr[-2000:]


def sbatch_end(tmp_path, stop: str, start: int, step: int, late_signal: bool = False):
    """launch/slurm.sbatch run as SLURM would run it, with stand-ins for srun (it writes the
    training's summary.json: how it stopped, the step it started from and the one it ended at;
    optionally SLURM's warning signal to the batch script after the training ended) and for
    scontrol (it records its calls)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    (tmp_path / "shards").mkdir(exist_ok=True)
    (tmp_path / "shards/manifest.json").write_text("{}")
    summary = json.dumps({"stop": stop, "start_step": start, "step": step})
    stand_in(bin_ / "srun", f"echo '{summary}' > {out}/summary.json\n")
    stand_in(bin_ / "scontrol", f'echo "$*" >> {tmp_path}/scontrol.log\n')
    # the script's first python after the run (it reads summary.json) signals the script first:
    # the warning arriving once the training has ended, at a known point
    python = stand_in(bin_ / "python_late", f"kill -USR1 $PPID\nexec {sys.executable} \"$@\"\n")
    env = launch_env(SLURM_JOB_ID="77", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1",
                     OUT_DIR=str(out), SHARDS=str(tmp_path / "shards"), WORKDIR=str(REPO),
                     PATH=f"{bin_}:{launch_env()['PATH']}",
                     PYTHON=str(python) if late_signal else sys.executable)
    proc = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch")], env=env, capture_output=True,
                          text=True, timeout=120)
    log = tmp_path / "scontrol.log"
    return proc, (log.read_text() if log.exists() else "")


def test_a_slurm_job_is_requeued_only_when_its_allocation_trained(tmp_path):
    """The training stopped at its --time-limit with budget left: requeued when this allocation
    trained a step; when it trained none (its walltime all start), not requeued, one ERROR line
    and a failed job instead of a requeue loop; a run that ended is never requeued."""
    proc, calls = sbatch_end(tmp_path, "time-limit", 40, 57)
    assert proc.returncode == 0 and calls == "requeue 77\n", proc.stderr
    assert "requeueing job 77" in proc.stdout
    (tmp_path / "scontrol.log").unlink()
    proc, calls = sbatch_end(tmp_path, "time-limit", 57, 57)
    assert proc.returncode == 1 and "requeue" not in calls, proc.stderr
    assert "launch: ERROR: not requeued: this allocation trained no step" in proc.stderr
    proc, calls = sbatch_end(tmp_path, "done", 57, 90)
    assert proc.returncode == 0 and "requeue" not in calls, proc.stderr


def test_a_signal_after_the_training_ended_leaves_a_finished_job_finished(tmp_path):
    """SLURM's warning (which may come up to 60 s early) reaching the batch script after the
    training ended: one line, the job exits 0 (it was killed by the signal, exit status 138:
    a finished run reported FAILED), and it is not requeued."""
    proc, calls = sbatch_end(tmp_path, "done", 0, 90, late_signal=True)
    assert proc.returncode == 0 and "requeue" not in calls, proc.stderr
    assert "launch: got SIGUSR1 after the training had ended: nothing left to stop" in \
        proc.stderr, proc.stderr


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_requeue_is_reported_as_a_requeue_and_a_cancel_as_a_cancel(tmp_path, restarts):
    """SIGTERM to the batch script while the training runs: `scontrol requeue` (SLURM counted
    the restart first: Restarts 1 above SLURM_RESTART_COUNT 0) is said as a requeue and the
    script exits 0 without requeueing again; a plain scancel (Restarts 0) keeps its warning
    that SLURM's kill may come first and ends the job (was: the requeue reported as "got
    SIGTERM (scancel, or the node going down) ... the job ends")."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards/manifest.json").write_text("{}")
    (tmp_path / "summary").write_text(json.dumps({"stop": "signal", "start_step": 0, "step": 9}))
    # the training: checkpoints (its summary) on the SIGUSR1 the script forwards
    # started: once the script catches SIGTERM (its trap set: SigCgt bit 15 of /proc/PID/status)
    stand_in(bin_ / "srun", f"trap 'cp {tmp_path}/summary {out}/summary.json; exit 0' USR1\n"
             "until (( (16#$(awk '/^SigCgt/ {print $2}' /proc/$PPID/status) >> 14) & 1 )); do "
             f"sleep 0.02; done\ntouch {tmp_path}/started\nwhile :; do sleep 0.05; done\n")
    stand_in(bin_ / "scontrol", f'echo "$*" >> {tmp_path}/scontrol.log\n'
             f'[ "$1 $2" = "show job" ] && echo "JobId=77 JobState=COMPLETING Restarts={restarts}"'
             "\nexit 0\n")
    env = launch_env(SLURM_JOB_ID="77", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1",
                     SLURM_RESTART_COUNT="0", OUT_DIR=str(out), SHARDS=str(tmp_path / "shards"),
                     WORKDIR=str(REPO), PATH=f"{bin_}:{launch_env()['PATH']}",
                     PYTHON=sys.executable)
    job = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch")], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not (tmp_path / "started").exists() and job.poll() is None:
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    calls = (tmp_path / "scontrol.log").read_text()
    assert "requeue" not in calls.replace("show job", ""), calls  # never requeued twice
    if restarts:
        assert job.returncode == 0, stderr
        assert "launch: got SIGTERM: SLURM is requeueing job 77 (scontrol requeue)" in stderr
        assert "checkpoint written; SLURM requeued job 77 (scontrol requeue): it starts again " \
            "after its BeginTime and continues with --resume auto" in stdout, stdout
    else:
        assert "got SIGTERM (scancel, or the node going down)" in stderr, stderr
        assert "checkpoint written after SIGTERM; the job ends" in stdout, stdout


def _rank_pid(launch: subprocess.Popen, rank: int) -> int | None:
    """The pid of the training process of ``rank`` under ``launch`` (its environment says the
    rank: every launcher sets one of these), or None."""
    import psutil
    for p in psutil.Process(launch.pid).children(recursive=True):
        try:
            env, cmd = p.environ(), " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "hvd_lm" in cmd and "train" in cmd and str(rank) in (
                env.get("OMPI_COMM_WORLD_RANK"), env.get("HOROVOD_RANK"), env.get("RANK")):
            return p.pid
    return None


@pytest.mark.slow
@pytest.mark.parametrize("template,ranks", [("horovodrun_local.sh", "NP"),
                                            ("mpirun.sh", "NP"),
                                            ("torchrun.sh", "NPROC_PER_NODE")])
def test_a_rank_killed_under_each_launcher_is_the_one_the_block_names(shards, tmp_path, template,
                                                                      ranks):
    """Rank 2 of 3 SIGKILLed mid-run (an OOM kill): the closing block's cause names rank 2 and
    this host and no other rank (before: torchrun's 'lost ranks 1,2 ...' from a probe after
    torchrun had stopped them, horovodrun's 'no rank reported an error'); no rank claims a
    checkpoint it did not write; this one host acknowledges the launcher's SIGTERM at most once
    and prints at most one ERROR line."""
    import socket
    out = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(LAUNCH / template)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=launch_env(**{ranks: "3"}, OUT_DIR=str(out), PREFLIGHT="0",
                                           ENGINE="horovod" if template != "torchrun.sh"
                                           else "torch", HVD_LM_STEP_SLEEP="0.1",
                                           MPIRUN_ARGS="--oversubscribe",
                                           TRAIN_ARGS=f"--shards {shards} {TINY} "
                                                      "--max-steps 100000"))
    try:
        end, pid = time.time() + 180, None
        while time.time() < end and proc.poll() is None and not (pid and (
                out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count(
                '"train"') >= 3):
            pid = pid or _rank_pid(proc, 2)
            time.sleep(0.3)
        assert pid, "rank 2 was not found"
        import os
        os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode != 0, output[-3000:]
    cause = output.rstrip().splitlines()[-1]
    assert cause.startswith("cause: ") and "rank 2 " in cause, output[-3000:]
    assert f"host {socket.gethostname()}" in cause, cause
    assert not any(f"rank {r}" in cause or f",{r}" in cause for r in (0, 1)), cause
    assert "checkpoint is written" not in output and "every rank checkpointed" not in output
    assert sum("received:" in x for x in output.splitlines()) <= 1, output[-3000:]
    assert sum("hvd-lm train: ERROR:" in x for x in output.splitlines()) <= 1, output[-3000:]
