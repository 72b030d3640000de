"""The torch engine (``--backend torch``) across hosts, on the cluster in a box (tests/cluster.py:
n1-n3 with their own sshd, address and a decoy docker0), as tests/test_multinode.py runs Horovod:
each job trains the tiny model 6 steps on 2 ranks x batch 2 on two hosts and must equal one
process with batch 4 (1e-5): launch/torchrun.sh started on n1 and on n2 (c10d rendezvous at n1,
the preflight on n1), and the SLURM script ``hvd-lm launch --engine torch`` renders (srun on one
slurmd per node, MASTER_ADDR n1, the doctor's rendezvous-port check). Then n2's cable is pulled
under torchrun: the rank on n1 names n2 in one line after ``--gloo-timeout-s``."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from hvd_lm.cli import main
from tests._mp import launch_env
from tests.test_multinode import (  # noqa: F401 - reference: the fixtures it takes
    LAUNCH,
    STEPS,
    TINY,
    assert_equals_reference,
    records,
    reference,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
PY = sys.executable


def torchrun_on_two_hosts(cluster, shards, out, tmp_path, extra=(), **env):
    """launch/torchrun.sh on n1, then on n2 (torchrun's c10d rendezvous: n2 waits for n1's)."""
    knobs = dict(NNODES="2", NPROC_PER_NODE="1", HOSTS="n1:1,n2:1", PYTHON=PY, OUT_DIR=str(out),
                 RDZV_ID=out.name, TRAIN_ARGS=" ".join(map(str, ["--shards", shards, *TINY,
                                                                 "--batch-size", "2", *extra])),
                 **env)
    p1 = cluster.popen("n1", ["bash", LAUNCH / "torchrun.sh"], cwd=tmp_path,
                       env=launch_env(**knobs), stderr=subprocess.STDOUT)
    p2 = cluster.popen("n2", ["bash", LAUNCH / "torchrun.sh"], cwd=tmp_path,
                       env=launch_env(**knobs, NETWORK_INTERFACE="eth0"),
                       stderr=subprocess.STDOUT)
    return p1, p2


def test_torchrun_on_two_hosts_equals_one_process(cluster, shards, reference, tmp_path):
    out = tmp_path / "run"
    p1, p2 = torchrun_on_two_hosts(cluster, shards, out, tmp_path, STEPS)
    try:
        o1, _ = p1.communicate(timeout=240)
        o2, _ = p2.communicate(timeout=60)
    finally:
        for p in (p1, p2):
            if p.poll() is None:
                cluster.kill_jobs()
                p.kill()
    assert p1.returncode == 0 and p2.returncode == 0, o1[-3000:] + o2[-3000:]
    assert "use          eth0:" in o1 and "rendezvous n1:29500" in o1, o1[-3000:]
    start, = records(out, "start")
    assert start["engine"] == "torch" and "torchrun" in start["launcher"]
    assert_equals_reference(out, reference, o1, hosts=tuple(start["hosts"]))
    assert sorted(start["hosts"]) == ["n1", "n2"]


def test_slurm_engine_torch_on_two_nodes_equals_one_process(cluster, shards, reference,
                                                            tmp_path):
    """srun starts one rank per node; the script exports MASTER_ADDR=n1 and MASTER_PORT, and the
    preflight checks n2 reaches that port on n1 before any rank starts."""
    slurm = cluster.slurm()
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--scheduler", "slurm", "--engine", "torch", "--gpus", "2",
                 "--gpus-per-node", "1", "--device", "cpu", "--walltime", "10", "--job-name",
                 "hvdlm-t2n", "--run-dir", str(tmp_path / "run"), "--out", str(script), "--",
                 "--shards", str(shards), *TINY, *STEPS, "--batch-size", "2"]) == 0
    job = slurm.sbatch(script, tmp_path, launch_env())
    info = slurm.wait_job(job, timeout=180)
    log = (tmp_path / f"hvdlm-t2n-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    port = 29500 + int(job) % 1000
    assert f"rendezvous   n1:{port} (--backend torch): opened on n1" in log, log
    start, = records(tmp_path / "run", "start")
    assert start["engine"] == "torch" and f"rendezvous n1:{port} from MASTER_ADDR" in \
        start["launcher"], start
    assert_equals_reference(tmp_path / "run", reference, log)


def test_a_lost_link_under_torchrun_is_one_line_naming_the_host(cluster, shards, tmp_path):
    """n2's cable pulled mid-run: the rank on n1 fails after --gloo-timeout-s (10 s), probes
    n2 (no answer within 3 s) and stops with one line naming n2; torchrun on n1 ends the job
    with the closing block."""
    out = tmp_path / "run"
    p1, p2 = torchrun_on_two_hosts(cluster, shards, out, tmp_path,
                                   ["--max-steps", "100000", "--gloo-timeout-s", "10",
                                    "--checkpoint-every", "20"], HVD_LM_STEP_SLEEP="0.05")
    try:
        deadline = time.monotonic() + 150
        while not ((out / "metrics.jsonl").is_file() and len(records(out, "train")) >= 30):
            assert p1.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        t_cut = time.monotonic()
        cluster.link("n2", up=False)
        o1, _ = p1.communicate(timeout=90)
        took = time.monotonic() - t_cut
    finally:
        if p1.poll() is None or p2.poll() is None:
            cluster.kill_jobs()
            for p in (p1, p2):
                p.kill()
                p.wait()
        cluster.link("n2", up=True)
    lines = re.findall(r"hvd-lm train: ERROR: .*", o1)
    assert p1.returncode != 0 and took < 10 + 15 and len(lines) == 1, o1[-4000:]
    assert re.match(r"hvd-lm train: ERROR: lost rank \d on host n2 \(10\.77\.0\.2 does not "
                    r"answer within 3 s: its network link is down or the host is gone\): a "
                    r"collective failed at step \d+ \(torch\.distributed gave up after its "
                    r"timeout, --gloo-timeout-s=10 s\)", lines[0]), lines[0]
    assert o1.rstrip().splitlines()[-5].startswith("==== hvd-lm: the job failed")
    assert cluster.wait_idle(30) == {}
