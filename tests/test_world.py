"""hvd_lm.comm.world: the one reader of the launchers' rank/size variables.

Each family's variables are written out here by hand from the launchers' documentation (the
table in the module docstring), so a wrong name or a wrong lookup order in ``LAUNCHER_VARS``
fails these tests.
"""
import sys

import pytest

from hvd_lm.comm.world import (
    RankContext,
    from_environment,
    started_by_mpi,
    under_openmpi,
    world_size,
)

FAMILIES = {
    "horovodrun": {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1",
                   "HOROVOD_LOCAL_SIZE": "2"},
    "openmpi": {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    "pmi": {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
    "slurm": {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
              "SLURM_STEP_TASKS_PER_NODE": "2(x4)"},
    "torchrun": {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_read_whole(family):
    ctx = from_environment(FAMILIES[family])
    assert ctx == RankContext(3, 8, 1, 2, family)
    assert not ctx.is_root
    assert world_size(FAMILIES[family]) == 8
    assert started_by_mpi(FAMILIES[family]) == (family in ("openmpi", "pmi", "slurm"))


def test_no_launcher_is_rank_0_of_1():
    assert from_environment({}) == RankContext(0, 1, 0, 1, "none")
    assert from_environment({}).is_root
    assert world_size({}) == 1
    assert not started_by_mpi({})


def test_lookup_order_and_no_mixing():
    # horovodrun --mpi runs under mpirun: both families are set; Horovod's own comes first, and
    # nothing is taken from the other family even where the first lacks a variable.
    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", **FAMILIES["openmpi"]}
    assert from_environment(env) == RankContext(1, 2, 1, 2, "horovodrun")
    # srun inside an OpenMPI job step: OpenMPI's variables win over SLURM's.
    env = {**FAMILIES["slurm"], "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}
    assert from_environment(env) == RankContext(0, 4, 0, 4, "openmpi")


def test_family_counts_only_with_its_world_size():
    # A stray RANK without WORLD_SIZE (common in user shells) is not a launcher.
    assert from_environment({"RANK": "5"}) == RankContext()
    assert from_environment({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "0"}) == RankContext()


def test_one_rank_under_mpirun_is_not_an_mpi_job_but_is_under_openmpi():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert not started_by_mpi(env)
    assert under_openmpi(env)
    assert not under_openmpi(FAMILIES["pmi"])
    assert not under_openmpi({})


def test_inconsistent_rank_names_the_variables():
    with pytest.raises(ValueError, match=r"PMI_RANK='4' is outside 0..3 \(PMI_SIZE='4'\)"):
        from_environment({"PMI_RANK": "4", "PMI_SIZE": "4"})


def test_mpirun_and_horovodrun_argv_across_hosts():
    """With hosts: ``-H``, every forwarded variable passed with ``-x`` (names and prefixes of
    FORWARDED only, sorted), the interface for OpenMPI's BTL and out-of-band channel; horovodrun
    gets ``-H`` and ``--network-interface``. Without: this node only, as before."""
    from hvd_lm.comm.world import horovodrun_argv, mpirun_argv

    env = {"PATH": "/b", "HOROVOD_CYCLE_TIME": "1", "NCCL_DEBUG": "INFO", "HOME": "/root",
           "OMPI_MCA_x": "1", "PYTHONPATH": "/r"}
    cmd = mpirun_argv(2, ["-m", "x"], "n1:1,n2:1", "eth0", env)
    assert cmd[:5] == ["mpirun", "-np", "2", "-H", "n1:1,n2:1"]
    xs = [cmd[i + 1] for i, w in enumerate(cmd) if w == "-x"]
    assert xs == ["HOROVOD_CYCLE_TIME", "NCCL_DEBUG", "PATH", "PYTHONPATH"]
    i = cmd.index("btl_tcp_if_include")
    assert cmd[i - 1:i + 5] == ["-mca", "btl_tcp_if_include", "eth0", "-mca",
                                "oob_tcp_if_include", "eth0"]
    assert cmd[-3:] == [sys.executable, "-m", "x"]
    local = mpirun_argv(2, ["-m", "x"])
    assert "-H" not in local and "-x" not in local and "btl_tcp_if_include" not in local
    hr = horovodrun_argv(3, ["-m", "x"], "gloo", "n1:1,n2:1,n3:1", "eth0")
    assert hr[1:8] == ["-np", "3", "-H", "n1:1,n2:1,n3:1", "--gloo", "--network-interface",
                       "eth0"]
    assert horovodrun_argv(2, ["-m", "x"])[3:6] == ["-H", "localhost:2", "--gloo"]
