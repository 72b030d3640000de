"""Real SLURM jobs: a one-node cluster on localhost (tests/slurm_cluster.py) runs the script that
``hvd-lm launch --scheduler slurm`` renders, as a 2-rank job started with srun (PMIx); then
SIGTERM to the srun step (every rank checkpoints) and a plain ``scancel`` (the script promises no
checkpoint SLURM will not wait for), and the preemption flow: SIGUSR1 to the batch script ->
checkpoint on all ranks -> the script's ``scontrol requeue`` -> ``--resume auto``. An admin's
``scontrol requeue`` (mpirun inside a two-node allocation) runs in tests/test_journey.py."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hvd_lm.cli import main
from tests import conftest
from tests._mp import launch_env
from tests.conftest import records
from tests.slurm_cluster import TERMINAL_STATES, Unavailable, running_cluster

pytestmark = pytest.mark.slow

TINY = [*conftest.TINY, "--lr", "1e-2"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster (skips when SLURM cannot be installed or we are not root)."""
    try:
        with running_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    except Unavailable as e:
        pytest.skip(f"no local SLURM cluster: {e}")


def render(tmp: Path, shards: Path, *opts: str, steps: int, log_every: int) -> Path:
    """Render a 2-rank CPU job through the `hvd-lm launch` command line."""
    out = tmp / "job.sbatch"
    assert main([
        "launch", "--scheduler", "slurm", "--gpus", "2", "--gpus-per-node", "2", "--device", "cpu",
        "--walltime", "10", "--job-name", "hvdlm-test", "--run-dir", str(tmp / "run"),
        "--out", str(out), *opts, "--", "--shards", str(shards), *TINY,
        "--max-steps", str(steps), "--log-every", str(log_every)]) == 0
    return out




def job_log(tmp: Path, job_id: str) -> str:
    return (tmp / f"hvdlm-test-{job_id}.out").read_text()


def test_rendered_sbatch_runs_two_ranks_with_srun(slurm, shards, tmp_path):
    script = render(tmp_path, shards, steps=6, log_every=1)
    job_id = slurm.sbatch(script, tmp_path, launch_env())
    info = slurm.wait_job(job_id, timeout=120)
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["Restarts"] == "0" and "requeue" not in log, log  # a walltime job that finished
    assert "2 ranks via srun" in log and "srun --mpi=pmix" in log
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").is_file(), f"{info}\n{log[-6000:]}"
    assert [s["world_size"] for s in records(run, "start")] == [2]
    end, = records(run, "end")
    assert end["stop"] == "done" and end["world_size"] == 2
    losses = [r["loss"] for r in records(run, "train")]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_preemption_checkpoints_requeues_and_the_job_completes(slurm, shards, tmp_path):
    """`scancel --signal=USR1 --batch JOB` (SLURM's warning before the walltime, or a
    preemption): every rank checkpoints, the script requeues the job, and the requeued job
    continues from that checkpoint with --resume auto and completes."""
    script = render(tmp_path, shards, steps=100, log_every=2)  # >= 5 s: the signal comes first
    job_id = slurm.sbatch(script, tmp_path, launch_env(HVD_LM_STEP_SLEEP="0.05"))
    run = tmp_path / "run"
    slurm.wait_job(job_id, 90, lambda i: i.get("JobState") in TERMINAL_STATES
                   or ((run / "metrics.jsonl").is_file() and len(records(run, "train")) >= 2))
    slurm.client(["scancel", "--signal=USR1", "--batch", job_id])
    slurm.release_requeued(job_id, timeout=120)
    info = slurm.wait_job(job_id, timeout=180)
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    assert "got SIGUSR1" in log and "requeueing job" in log, log[-4000:]
    assert "--resume auto" in log.split("(restart 1)")[1]
    starts, ends = records(run, "start"), records(run, "end")
    assert [e["stop"] for e in ends] == ["signal", "done"] and ends[1]["step"] == 100, ends
    assert 0 < ends[0]["step"] == starts[1]["step"] < 100
    assert starts[1]["resumed_from"].endswith(f"step_{ends[0]['step']:08d}.pt")


def test_plain_scancel_promises_no_checkpoint_it_cannot_deliver(slurm, shards, tmp_path):
    """A plain `scancel JOB` sends SIGTERM to every process of the job and SIGKILL KillWait
    seconds later (5 s on this cluster), whatever they are doing: the batch script says so,
    names the cancels that do checkpoint, and neither promises a checkpoint nor requeues the
    job (it used to print "checkpoint on all ranks, then stop")."""
    script = render(tmp_path, shards, steps=100000, log_every=2)
    job_id = slurm.sbatch(script, tmp_path, launch_env())
    run = tmp_path / "run"
    slurm.wait_job(job_id, 90, lambda i: i.get("JobState") in TERMINAL_STATES
                   or ((run / "metrics.jsonl").is_file() and len(records(run, "train")) >= 2))
    slurm.client(["scancel", job_id])
    info = slurm.wait_job(job_id, timeout=60)
    time.sleep(6)  # past KillWait: a requeue would have happened by now
    info = slurm.job(job_id)
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, log)
    assert ("launch: got SIGTERM (scancel, or the node going down): asking the ranks to "
            "checkpoint, but SLURM kills the job 5 s after this signal, so a checkpoint is "
            "written only if it fits; to stop with a checkpoint use `scancel --signal=USR1 "
            f"--batch {job_id}` (checkpoint, then requeue) or `scancel --signal=TERM {job_id}` "
            "(checkpoint, then end)") in log, log
    assert "then stop" not in log and "requeueing" not in log, log


def test_sigterm_to_the_srun_step_checkpoints_every_rank(slurm, shards, tmp_path):
    """`scancel --signal=TERM JOB` (SIGTERM to the srun step, as a cancel or a node drain
    sends it): srun passes it to both ranks, which checkpoint at the same step and exit 0."""
    script = render(tmp_path, shards, steps=100000, log_every=2)
    job_id = slurm.sbatch(script, tmp_path, launch_env())
    run = tmp_path / "run"
    slurm.wait_job(job_id, 90, lambda i: i.get("JobState") in TERMINAL_STATES
                   or ((run / "metrics.jsonl").is_file() and len(records(run, "train")) >= 2))
    slurm.client(["scancel", "--signal=TERM", job_id], check=False)
    info = slurm.wait_job(job_id, timeout=120)
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["Restarts"] == "0" and "requeue" not in log, log  # a walltime job that finished
    end, = records(run, "end")
    assert end["stop"] == "signal" and end["world_size"] == 2, log
    ck = torch.load(sorted((run / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    assert ck["step"] == end["step"] and ck["rnn_state"][0].shape[0] == 4


def test_a_time_budget_longer_than_the_allocation_requeues_the_job_until_it_is_spent(
        slurm, shards, tmp_path):
    """`hvd-lm launch --time-budget` on a job whose training `--time-limit` is shorter: the first
    allocation stops at its limit with a checkpoint and the script requeues the job; the requeued
    job continues the same plan with --resume auto and ends it, the LR at 0, COMPLETED. On the
    planner's virtual clock (HVD_LM_VIRTUAL_STEP_S: every step attempt 0.25 s), so the plan does
    not depend on this machine's speed."""
    out = tmp_path / "job.sbatch"
    run = tmp_path / "run"
    assert main([
        "launch", "--scheduler", "slurm", "--gpus", "2", "--gpus-per-node", "2", "--device", "cpu",
        "--walltime", "10", "--job-name", "hvdlm-test", "--run-dir", str(run), "--out", str(out),
        "--time-budget", "20s", "--", "--shards", str(shards), *TINY, "--time-limit", "12s",
        "--control-every", "1", "--warmup-steps", "10", "--log-every", "1"]) == 0
    assert "--time-budget 20s" in out.read_text()
    job_id = slurm.sbatch(out, tmp_path, launch_env(HVD_LM_VIRTUAL_STEP_S="0.25"))
    slurm.release_requeued(job_id, timeout=120)
    info = slurm.wait_job(job_id, timeout=180)
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    assert "requeueing job" in log and "--resume auto" in log.split("(restart 1)")[1], log
    ends, starts = records(run, "end"), records(run, "start")
    assert [e["stop"] for e in ends] == ["time-limit", "done"], ends
    assert starts[1]["resumed_from"].endswith(f"step_{ends[0]['step']:08d}.pt")
    assert 0 < starts[1]["trained_s"] <= 12 and ends[1]["trained_s"] <= 20
    lrs = [r["lr"] for r in records(run, "train")]
    assert lrs[-1] == 0.0 and all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:]))
