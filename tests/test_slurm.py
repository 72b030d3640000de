"""Real SLURM jobs: a one-node cluster on localhost (tests/slurm_cluster.py) runs the script that
``hvd-lm launch --scheduler slurm`` renders, as a 2-rank job started with srun (PMIx) and with
OpenMPI's mpirun inside the allocation, including the preemption flow: SIGUSR1 to the batch script
-> checkpoint on all ranks -> ``scontrol requeue`` -> the job continues with ``--resume auto``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hvd_lm.cli import main
from tests._mp import launch_env
from tests.shardutil import default_shards
from tests.slurm_cluster import TERMINAL_STATES, Unavailable, running_cluster

pytestmark = pytest.mark.slow

TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--batch-size", "2",
        "--threads", "1", "--lr", "1e-2", "--eval-chars", "2000", "--device", "cpu"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster (skips when SLURM cannot be installed or we are not root)."""
    try:
        with running_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    except Unavailable as e:
        pytest.skip(f"no local SLURM cluster: {e}")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return default_shards(tmp_path_factory.mktemp("shards"))


def render(tmp: Path, shards: Path, *opts: str, steps: int, log_every: int) -> Path:
    """Render a 2-rank CPU job through the `hvd-lm launch` command line."""
    out = tmp / "job.sbatch"
    assert main([
        "launch", "--scheduler", "slurm", "--gpus", "2", "--gpus-per-node", "2", "--device", "cpu",
        "--walltime", "10", "--job-name", "hvdlm-test", "--run-dir", str(tmp / "run"),
        "--out", str(out), *opts, "--", "--shards", str(shards), *TINY,
        "--max-steps", str(steps), "--log-every", str(log_every)]) == 0
    return out


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def job_log(tmp: Path, job_id: str) -> str:
    return (tmp / f"hvdlm-test-{job_id}.out").read_text()


def test_rendered_sbatch_runs_two_ranks_with_srun(slurm, shards, tmp_path):
    script = render(tmp_path, shards, steps=6, log_every=1)
    job_id = slurm.sbatch(script, tmp_path, launch_env())
    info = slurm.wait_job(job_id, timeout=120)
    log = job_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "2 ranks via srun" in log and "srun --mpi=pmix" in log
    run = tmp_path / "run"
    assert [s["world_size"] for s in records(run, "start")] == [2]
    end, = records(run, "end")
    assert end["stop"] == "done" and end["world_size"] == 2
    losses = [r["loss"] for r in records(run, "train")]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def requeued(info: dict) -> bool:
    return info.get("JobState") == "PENDING" and int(info.get("Restarts", "0")) >= 1


def test_preempted_job_checkpoints_requeues_and_resumes_with_mpirun(slurm, shards, tmp_path):
    # Preempt once training is under way: what `#SBATCH --signal=B:USR1@120` does before the limit.
    # On a fast machine the first attempt may finish before the signal reaches it (nothing to
    # preempt, the job just completes): then try again with 10x the steps.
    for steps in (200, 2000):
        tmp = tmp_path / f"steps{steps}"
        tmp.mkdir()
        script = render(tmp, shards, "--launcher", "mpirun", steps=steps, log_every=2)
        job_id = slurm.sbatch(script, tmp, launch_env())
        run = tmp / "run"
        slurm.wait_job(job_id, 90, lambda i: i.get("JobState") in TERMINAL_STATES
                       or ((run / "metrics.jsonl").is_file() and bool(records(run, "train"))))
        slurm.client(["scancel", "--signal=USR1", "--batch", job_id], check=False)
        info = slurm.wait_job(job_id, 90, lambda i: requeued(i) or i["JobState"] in TERMINAL_STATES)
        if requeued(info):
            break
        assert info["JobState"] == "COMPLETED", job_log(tmp, job_id)
    else:
        pytest.fail("training finished before SIGUSR1 reached it, even with 2000 steps")
    slurm.release_requeued(job_id)
    info = slurm.wait_job(job_id, timeout=120)
    log = job_log(tmp, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert int(info["Restarts"]) == 1, info
    # One log for both attempts (--open-mode=append); the second resumed from the checkpoint.
    assert "got SIGUSR1" in log and "requeueing job" in log and "(restart 1)" in log, log
    assert "--resume auto" in log.split("(restart 1)")[1]
    starts, ends = records(run, "start"), records(run, "end")
    assert [e["stop"] for e in ends] == ["signal", "done"], log
    assert [s["world_size"] for s in starts] == [2, 2]
    assert starts[0]["resumed_from"] is None
    assert starts[1]["resumed_from"].endswith(f"step_{ends[0]['step']:08d}.pt")
    assert 0 < ends[0]["step"] == starts[1]["step"] < steps and ends[1]["step"] == steps
    losses = [r["loss"] for r in records(run, "train")]
    assert losses[-1] < losses[0], losses


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
    end, = records(run, "end")
    assert end["stop"] == "signal" and end["world_size"] == 2, log
    ck = torch.load(sorted((run / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    assert ck["step"] == end["step"] and ck["rnn_state"][0].shape[0] == 4
