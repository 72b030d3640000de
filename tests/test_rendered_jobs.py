"""What `hvd-lm launch` writes for a large job, and the preflight the batch scripts run:
the header states the peak LR the run trains at for its global batch (and warns when
``--lr-rule none`` keeps it unscaled at 32x the reference batch), PBS asks cores for every rank's
threads, torchrun's rendezvous id is the job's own, and under SLURM and PBS the doctor's agents
start the way the ranks do (srun, mpirun), with no ssh between the nodes (the scripts run with
stand-ins for srun, scontrol and the training's mpirun; the doctor and its agents are real)."""
from __future__ import annotations

import math
import os
import socket
from pathlib import Path

from hvd_lm.cli import main
from tests._mp import launch_env, run

HOST = socket.gethostname()  # with "localhost": two names of this machine, two "nodes"


def render(tmp: Path, capsys, *opts: str, train: tuple[str, ...] = ()) -> tuple[str, str]:
    """A script rendered through the command line; (its text, what launch wrote on stderr)."""
    out = tmp / "job"
    capsys.readouterr()
    assert main(["launch", *opts, "--out", str(out), "--", "--shards", "data/s", *train]) == 0
    return out.read_text(), capsys.readouterr().err


def stand_ins(tmp: Path, **scripts: str) -> dict[str, str]:
    """Executables on PATH (name -> bash body; ``ssh`` always: it logs each call and fails),
    and the environment to run a script with."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    scripts["ssh"] = f'echo "$*" >> {tmp}/ssh.log; exit 255'
    for name, body in scripts.items():
        (bindir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bindir / name).chmod(0o755)
    env = launch_env(PATH=f"{bindir}:{os.environ['PATH']}")
    for var in ("SLURM_JOB_ID", "PBS_JOBID", "RDZV_ID", "NETWORK_INTERFACE", "MASTER_PORT"):
        env.pop(var, None)
    return env


def test_the_header_states_the_peak_lr_at_the_global_batch(tmp_path, capsys):
    gpus = ("--scheduler", "slurm", "--gpus", "128", "--gpus-per-node", "8")
    text, err = render(tmp_path, capsys, *gpus)
    warning = ("WARNING: LR rule none at global batch 4096, 32x its reference 128: the peak LR "
               "stays 0.0005, as at 128; scale it with --lr-rule sqrt (or linear, with --lr-cap)")
    assert text.splitlines()[2:4] == [
        "# 128 GPUs = 16 node(s) x 8; global batch 4096 (32 per GPU); peak LR at that batch "
        "0.0005 (LR rule none: 0.0005 at global batch 128)", f"# {warning}"]
    assert err.splitlines()[0] == f"hvd-lm launch: {warning}"
    # 128 ranks x batch 16 x 2 backward passes = 4096 under the sqrt rule: 5e-4 x sqrt(32)
    text, err = render(tmp_path, capsys, *gpus, train=(
        "--batch-size", "16", "--backward-passes-per-step", "2", "--lr-rule", "sqrt"))
    lr = 5e-4 * math.sqrt(4096 / 128)
    assert text.splitlines()[2] == (
        f"# 128 GPUs = 16 node(s) x 8; global batch 4096 (32 per GPU); peak LR at that batch "
        f"{lr:.4g} (LR rule sqrt: 0.0005 at global batch 128)") and "WARNING" not in text + err
    text, err = render(tmp_path, capsys, "--scheduler", "slurm", "--gpus", "64")  # 16x: no warning
    assert "global batch 2048 (32 per GPU)" in text and "WARNING" not in text + err


def test_pbs_asks_cores_for_every_ranks_threads(tmp_path, capsys):
    for opts, select in (((), "16:ncpus=32:ngpus=8:mpiprocs=8"),  # 8 ranks x 4 cores
                         (("--cpus-per-task", "6"), "16:ncpus=48:ngpus=8:mpiprocs=8"),
                         (("--device", "cpu"), "16:ncpus=8:mpiprocs=8")):  # a core per rank
        text, _ = render(tmp_path, capsys, "--scheduler", "pbs", "--gpus", "128", *opts)
        assert f"\n#PBS -l select={select}\n" in text, opts


def test_torchrun_meets_under_the_jobs_own_rendezvous_id(tmp_path, capsys):
    """The same id on every node of one job (the scheduler's job id, else one made from the
    hosts, the folder and the run folder), another for another job; before, every job was
    "hvd-lm" and two jobs at one endpoint would join one rendezvous."""
    (tmp_path / "data" / "s").mkdir(parents=True)
    (tmp_path / "data" / "s" / "manifest.json").write_text("{}")
    python = tmp_path / "python"  # `-c` (is this the first host?): no; else print the launch
    python.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 1\necho "LAUNCHED $*"\n')
    python.chmod(0o755)
    render(tmp_path, capsys, "--scheduler", "torchrun", "--gpus", "4", "--gpus-per-node", "2",
           "--hosts", "g1,g2", "--python", str(python))
    env = stand_ins(tmp_path)

    def rdzv_id(**extra: str) -> str:
        proc = run(["bash", tmp_path / "job"], env={**env, **extra}, cwd=tmp_path, timeout=60)
        words = next(x for x in proc.stdout.splitlines() if x.startswith("LAUNCHED")).split()
        return words[words.index("--rdzv-id") + 1]

    assert rdzv_id(SLURM_JOB_ID="777") == "777" and rdzv_id(PBS_JOBID="12.pbs") == "12.pbs"
    assert rdzv_id(RDZV_ID="mine") == "mine"
    node1, node2, other = rdzv_id(), rdzv_id(), rdzv_id(OUT_DIR="runs/other")
    assert node1 == node2 != other and node1.startswith("hvd-lm-"), (node1, other)


def test_slurm_preflight_starts_its_agents_with_srun_not_ssh(shards, tmp_path, capsys):
    render(tmp_path, capsys, "--scheduler", "slurm", "--gpus", "2", "--gpus-per-node", "1",
           "--device", "cpu", train=("--shards", str(shards)))
    env = stand_ins(
        tmp_path, scontrol=f"printf '%s\\n' localhost {HOST}",
        srun='[[ "$*" == *--nodelist=* ]] || { echo "LAUNCHED $*"; exit 0; }\n'
             'while [[ $1 == --* ]]; do [[ $1 == --nodelist=* ]] && nodes=${1#--nodelist=}; '
             'shift; done\nfor n in ${nodes//,/ }; do SLURMD_NODENAME=$n "$@" & done\nwait')
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="t", SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="2",
               SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NODELIST="n", SLURM_SUBMIT_DIR=str(tmp_path))
    proc = run(["bash", tmp_path / "job"], env=env, cwd=tmp_path, timeout=120)
    assert f"hvd-lm doctor: 2 host(s) (localhost:1, {HOST}:1)" in proc.stderr, proc.stderr
    assert "ssh          not checked: srun started the agents, one per host" in proc.stderr
    assert "LAUNCHED --mpi=pmix" in proc.stdout and not (tmp_path / "ssh.log").exists()


def test_pbs_preflight_starts_its_agents_with_mpirun_not_ssh(shards, tmp_path, capsys):
    render(tmp_path, capsys, "--scheduler", "pbs", "--gpus", "4", "--gpus-per-node", "2",
           "--device", "cpu", train=("--shards", str(shards)))
    nodefile = tmp_path / "nodefile"  # a line per rank, two nodes
    nodefile.write_text(f"localhost\nlocalhost\n{HOST}\n{HOST}\n")
    env = stand_ins(tmp_path, training_mpirun='echo "LAUNCHED $*"')
    env.update(PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(tmp_path), PBS_JOBID="42.pbs",
               MPIRUN=str(tmp_path / "bin" / "training_mpirun"))
    proc = run(["bash", tmp_path / "job"], env=env, cwd=tmp_path, timeout=120)
    assert f"hvd-lm doctor: 2 host(s) (localhost:2, {HOST}:2)" in proc.stderr, proc.stderr
    assert "ssh          not checked: mpirun started the agents, one per host" in proc.stderr
    assert "LAUNCHED -np 4 -hostfile" in proc.stdout and not (tmp_path / "ssh.log").exists()
