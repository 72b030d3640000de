"""data_prep's MPI world (hvd_lm/comm/mpi.py) does not hang when its ranks cannot reach each other:
the first barrier is polled against a deadline and the job ends with one line naming the likely
cause (OpenMPI on an interface another host cannot reach) and the fix. Simulated on one host by a
rank that joins after the deadline. Its deadline, ``HVD_LM_MPI_CONNECT_TIMEOUT``, is seconds above
0 or the job stops at once naming it (issue 56)."""
from __future__ import annotations

import time

import pytest

from tests._mp import launch_env, mpirun_cmd, run

SCRIPT = """
import os, sys, time
from mpi4py import MPI  # noqa: F401 - initialised as data_prep's world would be
if int(os.environ["OMPI_COMM_WORLD_RANK"]) == 1:
    time.sleep(30)  # a rank nobody can reach
from hvd_lm.comm.mpi import MpiWorld
MpiWorld(connect_timeout_s=2)
print("reached each other")
"""


def test_ranks_that_cannot_reach_each_other_end_with_the_fix_not_a_hang(tmp_path):
    script = tmp_path / "world.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    p = run(mpirun_cmd(2, [script]), timeout=60, env=launch_env(), check=False)
    assert time.monotonic() - t0 < 25  # not the 30 s the other rank sleeps: aborted
    assert p.returncode != 0 and "reached each other" not in p.stdout
    line = next(x for x in p.stderr.splitlines() if "ERROR: rank 0 on " in x)
    assert "the 2 ranks did not reach each other within 2 s (MPI's first barrier)" in line
    assert "-mca btl_tcp_if_include IF -mca oob_tcp_if_include IF), with -x PATH" in line


def test_ranks_that_reach_each_other_pass_the_barrier(tmp_path):
    script = tmp_path / "world.py"
    script.write_text(SCRIPT.replace("time.sleep(30)", "time.sleep(0.5)"))
    p = run(mpirun_cmd(2, [script]), timeout=60, env=launch_env())
    assert p.stdout.count("reached each other") == 2, p.stdout + p.stderr


@pytest.mark.parametrize("value", ["-1", "abc", "nan"])
def test_a_bad_connect_timeout_stops_every_rank_naming_it(tmp_path, value):
    """Before: ``HVD_LM_MPI_CONNECT_TIMEOUT=-1`` (or 0) ended with "did not reach each other
    within -1 s", ``abc`` with "could not convert string to float", and ``nan`` was accepted
    (a barrier that never timed out). Now every rank of ``mpirun -np 2 python -m data_prep
    prepare`` stops before MPI starts with one line naming the variable and its value (the
    same on each rank); nothing is written."""
    reviews, out = tmp_path / "reviews.txt", tmp_path / "out"
    reviews.write_text("".join(f"review {i}: a record long enough to keep\n" for i in range(60)))
    p = run(mpirun_cmd(2, ["-m", "data_prep", "prepare", reviews, "--out", out,
                           "--no-progress"]), timeout=60,
            env=launch_env(HVD_LM_MPI_CONNECT_TIMEOUT=value), check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    said = f"data_prep prepare: ERROR: HVD_LM_MPI_CONNECT_TIMEOUT='{value}' is not a " \
        "duration: give seconds, a finite number above 0 and at most 604800 (unset: 120)"
    # each rank says it (mpirun forwards the ranks' streams as they come: two lines may join)
    assert 1 <= p.stderr.count(said) == p.stderr.count("ERROR:") <= 2, p.stderr
    assert not out.exists()
