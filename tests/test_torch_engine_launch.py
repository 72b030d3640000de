"""Launching the torch engine: ``hvd-lm launch --engine torch`` (SLURM: srun starts one rank per
GPU and the script exports MASTER_ADDR/MASTER_PORT; mpirun and PBS: MPI tells the ranks where
rank 0 is) and ``--scheduler torchrun``, rendered and run: mpirun.sh with ENGINE=torch, the
SLURM script under a stand-in srun (and under a real one-node SLURM where it can be made), and
``hvd-lm doctor --rendezvous-port`` (the first host opens the port, the others reach it; a port
another process holds is one line). launch/torchrun.sh runs in tests/test_torch_engine_train.py;
across two hosts in tests/test_multinode_torch.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.jobs import job_scripts as L
from tests import conftest
from tests._mp import REPO, launch_env, run
from tests.conftest import records

LAUNCH = REPO / "launch"
TINY = " ".join([*conftest.TINY, "--max-steps", "4", "--log-every", "1", "--lr", "1e-2"])




def render(tmp: Path, *opts: str) -> str:
    out = tmp / "job.sh"
    assert main(["launch", *opts, "--out", str(out), "--", "--shards", "data/s"]) == 0
    return out.read_text()


def test_launch_renders_the_torch_engine(tmp_path, capsys):
    slurm = render(tmp_path, "--scheduler", "slurm", "--engine", "torch", "--gpus", "16",
                   "--gpus-per-node", "8")
    assert 'ENGINE="${ENGINE:-torch}"' in slurm and "#SBATCH --nodes=2" in slurm
    assert 'LAUNCHER="${LAUNCHER:-srun}"' in slurm
    for sched in ("pbs", "mpirun"):
        assert 'ENGINE="${ENGINE:-torch}"' in render(tmp_path, "--scheduler", sched, "--engine",
                                                     "torch", "--gpus", "8")
    tr = L.knob_defaults(render(tmp_path, "--scheduler", "torchrun", "--gpus", "16",
                                "--gpus-per-node", "8", "--hosts", "g1,g2"))
    assert (tr["NNODES"], tr["NPROC_PER_NODE"], tr["HOSTS"]) == ("2", "8", "g1:8,g2:8")
    capsys.readouterr()
    for opts, says in ((["--scheduler", "horovodrun", "--engine", "torch"],
                        ("--engine torch runs under torchrun, mpirun, slurm or pbs, not "
                         "horovodrun")),
                       (["--scheduler", "slurm", "--engine", "torch", "--elastic"],
                        "not --elastic (Horovod elastic)"),
                       (["--scheduler", "torchrun", "--engine", "horovod"],
                        "--scheduler torchrun trains on the torch engine")):
        assert main(["launch", *opts, "--gpus", "2", "--", "--shards", "s"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    # bf16 on the wire is the torch engine's: accepted with it, refused without
    assert main(["launch", "--scheduler", "torchrun", "--gpus", "2", "--out",
                 str(tmp_path / "b.sh"), "--", "--shards", "s", "--compression", "bf16"]) == 0
    assert main(["launch", "--scheduler", "slurm", "--gpus", "2", "--", "--shards", "s",
                 "--compression", "bf16"]) == 2


@pytest.mark.slow
def test_mpirun_template_trains_on_the_torch_engine(shards, tmp_path):
    env = launch_env(NP="2", ENGINE="torch", OUT_DIR=str(tmp_path / "run"),
                     TRAIN_ARGS=f"--shards {shards} {TINY}")
    env.pop("MASTER_ADDR", None)
    run(["bash", LAUNCH / "mpirun.sh"], timeout=240, env=env, cwd=tmp_path)
    start, = records(tmp_path / "run", "start")
    assert start["engine"] == "torch" and start["world_size"] == 2
    assert "rendezvous" in start["launcher"]
    assert "from rank 0 via MPI (openmpi)" in start["launcher"]
    assert records(tmp_path / "run", "end")[0]["stop"] == "done"


def fake_slurm(tmp: Path) -> dict[str, str]:
    """``srun`` and ``scontrol`` stand-ins on PATH: srun starts its command twice with the
    variables SLURM gives a 2-task step on one node (block distribution); ``scontrol show
    hostnames`` names that node."""
    bindir = tmp / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for i in 0 1; do SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NUM_TASKS=2 "
        "SLURM_STEP_TASKS_PER_NODE=2 SLURM_STEP_NODELIST=localhost \"$@\" & done\n"
        "rc=0; for j in $(jobs -p); do wait \"$j\" || rc=$?; done; exit $rc\n")
    (bindir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = launch_env(PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
                     SLURM_JOB_NAME="t", SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost",
                     SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=str(tmp))
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    return env


@pytest.mark.slow
def test_slurm_script_with_engine_torch_meets_at_the_first_node(shards, tmp_path):
    """The rendered SLURM script (--engine torch) under a stand-in srun: the ranks meet at
    MASTER_ADDR (the first node, from scontrol) and MASTER_PORT (29500 + job id mod 1000)."""
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--scheduler", "slurm", "--engine", "torch", "--gpus", "2",
                 "--gpus-per-node", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
                 "--out", str(script), "--", "--shards", str(shards), *TINY.split()]) == 0
    proc = run(["bash", script], timeout=240, env=fake_slurm(tmp_path), cwd=tmp_path)
    start, = records(tmp_path / "run", "start")
    assert start["engine"] == "torch" and start["world_size"] == 2, proc.stdout
    assert "slurm; rendezvous localhost:29742 from MASTER_ADDR" in start["launcher"]
    assert "--backend torch" in proc.stdout


@pytest.mark.slow
def test_slurm_job_on_the_torch_engine(shards, tmp_path):
    """A real one-node SLURM cluster (tests/slurm_cluster.py) runs the rendered 2-rank job with
    srun on the torch engine (skipped where SLURM cannot be made)."""
    from tests.slurm_cluster import Unavailable, running_cluster

    script = tmp_path / "job.sbatch"
    assert main(["launch", "--scheduler", "slurm", "--engine", "torch", "--gpus", "2",
                 "--gpus-per-node", "2", "--device", "cpu", "--walltime", "10", "--job-name",
                 "hvdlm-torch", "--run-dir", str(tmp_path / "run"), "--out", str(script), "--",
                 "--shards", str(shards), *TINY.split()]) == 0
    try:
        with running_cluster(tmp_path / "slurm") as slurm:
            job = slurm.sbatch(script, tmp_path, launch_env())
            info = slurm.wait_job(job, timeout=180)
    except Unavailable as e:
        pytest.skip(f"no local SLURM cluster: {e}")
    log = (tmp_path / f"hvdlm-torch-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    start, = records(tmp_path / "run", "start")
    assert start["engine"] == "torch" and start["world_size"] == 2, log


# ---- the doctor's rendezvous check --------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def doctor(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvd_lm", "doctor", *args, "--timeout", "30"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=90,
                          check=False)


def test_doctor_checks_the_rendezvous_port(tmp_path):
    """Two names of this machine as two hosts (ssh stood in by a script that succeeds): the
    first host's agent opens the port and the second reaches it there, and the exports name it;
    a port another process listens on is one line naming it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "ssh").chmod(0o755)
    env = launch_env(PATH=f"{bindir}:{os.environ['PATH']}")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    port = free_port()
    hosts = f"localhost:1,{socket.gethostname()}:1"
    proc = doctor(env, "--hosts", hosts, "--rendezvous-port", str(port), "--format", "shell")
    assert proc.returncode == 0, proc.stderr
    assert f"export MASTER_ADDR=localhost\nexport MASTER_PORT={port}\n" in proc.stdout
    assert f"rendezvous   localhost:{port} (--backend torch): opened on localhost" in proc.stderr
    with socket.create_server(("", port)):  # another job holds the port
        proc = doctor(env, "--hosts", "localhost:2", "--rendezvous-port", str(port))
    errors = [x for x in proc.stderr.splitlines() if "ERROR" in x]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout + proc.stderr
    assert errors[0].startswith(f"hvd-lm doctor: ERROR: rendezvous: port {port} cannot be "
                                "opened on ")
