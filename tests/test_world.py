"""hvd_lm.comm.world: the one reader of the launchers' rank/size variables, read strictly (issue
56): every one an integer in its range, ``MASTER_ADDR`` a host name that resolves within a bound,
``HVD_LM_*`` durations finite and above 0, each error one line naming the variable and its value.

Each family's variables are written out here by hand from the launchers' documentation (the
table in the module docstring), so a wrong name or a wrong lookup order in ``LAUNCHER_VARS``
fails these tests.
"""
import sys

import pytest

from hvd_lm.comm.world import (
    LauncherEnvError,
    RankContext,
    env_seconds,
    from_environment,
    rendezvous_endpoint,
    resolve_host,
    started_by_mpi,
    under_openmpi,
    world_size,
)
from tests.hostile_common import TINY, hvd_lm, one_error_line

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
    # A stray RANK without WORLD_SIZE (common in user shells) is not a launcher, nor an empty
    # WORLD_SIZE (a template's `export WORLD_SIZE=`).
    assert from_environment({"RANK": "5"}) == RankContext()
    assert from_environment({"RANK": "5", "WORLD_SIZE": " "}) == RankContext()


def test_one_rank_under_mpirun_is_not_an_mpi_job_but_is_under_openmpi():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert not started_by_mpi(env)
    assert under_openmpi(env)
    assert not under_openmpi(FAMILIES["pmi"])
    assert not under_openmpi({})


def test_inconsistent_rank_names_the_variables():
    with pytest.raises(ValueError, match=r"PMI_RANK='4' is not a rank: outside 0..3 "
                                         r"\(PMI_SIZE='4'\)"):
        from_environment({"PMI_RANK": "4", "PMI_SIZE": "4"})


@pytest.mark.parametrize("env,needle", [
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a rank: outside 0..1 (WORLD_SIZE='2')"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a rank: an integer in 0..1"),
    ({"RANK": "1.0", "WORLD_SIZE": "2"}, "RANK='1.0' is not a rank"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' but RANK is not set"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a world size: outside 1..2147483647"),
    ({"WORLD_SIZE": "x"}, "WORLD_SIZE='x' is not a world size: an integer in 1.."),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS='0' is not a"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "-3"}, "OMPI_COMM_WORLD_LOCAL_RANK='-3' is not a local rank"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_WORLD_SIZE='4' is not a local world size: outside 1..2"),
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x"},
     "SLURM_STEP_TASKS_PER_NODE='2(x' is not SLURM's list of tasks per node"),
    ({"RANK": "0\n", "WORLD_SIZE": "2\nERROR: forged"}, "WORLD_SIZE='2\\nERROR: forged'"),
])
def test_a_launcher_variable_out_of_its_range_is_one_line_naming_it(env, needle):
    """Before (issue 56): ``RANK=-1`` or ``x`` (with ``WORLD_SIZE=2``) was read as rank 0 (a
    Gloo key timeout 30 s later), ``WORLD_SIZE=0`` or ``x`` as no launcher (a world of one)."""
    with pytest.raises(LauncherEnvError) as e:
        from_environment(env)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_slurm_tasks_per_node_are_read_for_this_node():
    """``SLURM_STEP_TASKS_PER_NODE=1,4``: node 1 runs 4 tasks (its local ranks 0..3); the list
    is walked, never expanded (``1(x999999999)``)."""
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "5", "SLURM_NODEID": "1",
           "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "1,4"}
    assert from_environment(env) == RankContext(3, 5, 2, 4, "slurm")
    env.update(SLURM_STEP_NUM_TASKS="8", SLURM_STEP_TASKS_PER_NODE="1(x999999999)",
               SLURM_LOCALID="0", SLURM_NODEID="7")
    assert from_environment(env) == RankContext(3, 8, 0, 1, "slurm")
    with pytest.raises(LauncherEnvError, match="names no task count >= 1 for node 2"):
        from_environment({**env, "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "1,4"})


@pytest.mark.parametrize("value", ["-1", "0", "abc", "nan", "inf", "1e9"])
def test_hvd_lm_durations_are_finite_seconds_above_0(value):
    """Before: ``HVD_LM_MPI_CONNECT_TIMEOUT=-1`` (or 0) gave "did not reach each other within
    -1 s", ``abc`` "could not convert string to float", ``nan`` was accepted."""
    env = {"HVD_LM_MPI_CONNECT_TIMEOUT": value}
    with pytest.raises(LauncherEnvError, match=f"HVD_LM_MPI_CONNECT_TIMEOUT='{value}' is not a "
                                               "duration: give seconds, a finite number above 0"):
        env_seconds("HVD_LM_MPI_CONNECT_TIMEOUT", 120.0, environ=env)
    assert env_seconds("HVD_LM_MPI_CONNECT_TIMEOUT", 120.0, environ={}) == 120.0
    assert env_seconds("X", 1.0, environ={"X": " 2.5 "}) == 2.5


def test_a_rendezvous_host_is_checked_then_resolved_within_a_bound(monkeypatch):
    """``MASTER_ADDR='127.0.0.1 x'`` is no host name; a name that does not resolve, or a
    resolver that does not answer, is one line naming MASTER_ADDR within the bound."""
    import time

    from hvd_lm.comm import world

    with pytest.raises(LauncherEnvError, match=r"MASTER_ADDR='127.0.0.1 x' is not a host name"):
        rendezvous_endpoint({"MASTER_ADDR": "127.0.0.1 x"})
    with pytest.raises(LauncherEnvError, match=r"MASTER_PORT='x' is not a TCP port"):
        rendezvous_endpoint({"MASTER_ADDR": "n1", "MASTER_PORT": "x"})
    assert rendezvous_endpoint({"MASTER_ADDR": " n1 "}) == ("n1", 29500, "MASTER_ADDR")
    resolve_host("127.0.0.1", 29500, "MASTER_ADDR")
    monkeypatch.setattr(world.socket, "getaddrinfo", lambda *a, **k: time.sleep(5))
    t0 = time.monotonic()
    with pytest.raises(LauncherEnvError, match=r"MASTER_ADDR='n1' did not resolve to an address "
                                               r"within 0.2 s"):
        resolve_host("n1", 29500, "MASTER_ADDR", timeout_s=0.2)
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("backend,env,needle", [
    ("torch", {"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a rank"),
    ("torch", {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a rank"),
    ("torch", {"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a world size"),
    ("torch", {"WORLD_SIZE": "x"}, "WORLD_SIZE='x' is not a world size"),
    ("torch", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "nosuchhost.invalid"},
     "MASTER_ADDR='nosuchhost.invalid' does not resolve to an address"),
    ("torch", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1 x"},
     "MASTER_ADDR='127.0.0.1 x' is not a host name or address"),
    # the Horovod engine reads them as strictly before hvd.init()
    ("horovod", {"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a rank"),
])
def test_a_rank_with_a_bad_launcher_variable_stops_at_once(shards, tmp_path, backend, env,
                                                          needle):
    """Through ``hvd-lm train --backend torch`` (what torchrun's ranks run; Horovod's too): one
    ERROR line naming the variable and its value, at once, no run folder (before: a Gloo key timeout
    after 30 s, a world of one trained with rc 0, or no ERROR at all within 360 s for an
    unresolvable MASTER_ADDR)."""
    out = tmp_path / "r"
    proc = hvd_lm("train", "--backend", backend, "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "2", timeout=90, MASTER_PORT="29561", **env)
    one_error_line(proc, f"hvd-lm train: ERROR: launcher environment: {needle}")
    assert not out.exists()


def test_mpirun_and_horovodrun_argv_across_hosts():
    """With hosts: ``-H``, every forwarded variable passed with ``-x`` (names and prefixes of
    FORWARDED only, sorted), the interface for OpenMPI's BTL and out-of-band channel; horovodrun
    gets ``-H`` and ``--network-interface``. Without: this node only, as before."""
    from hvd_lm.jobs.job_scripts import horovodrun_argv, mpirun_argv

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


def test_a_failures_probes_are_bounded_by_the_hosts_not_the_world():
    """128 ranks on 16 hosts of 8: a host's first rank probes its own host's 7 other ranks and
    the next host's 8 (a ring), so each rank is probed by at most 2 probers and a failure makes
    2 x 128 - 16 connections in all, where every survivor probing every peer made 16,256."""
    from collections import Counter

    from hvd_lm.comm.peers import probe_targets
    table = [{"rank": r, "host": f"n{r // 8}", "port": 1} for r in range(128)]
    probes = {r: probe_targets(table, r) for r in range(0, 128, 8)}  # each host's rank 0
    assert all(len(t) == 15 for t in probes.values())
    assert {p["host"] for p in probes[120]} == {"n15", "n0"}  # the ring closes
    seen = Counter(p["rank"] for t in probes.values() for p in t)
    assert set(seen) == set(range(128)) and max(seen.values()) == 2
    assert sum(seen.values()) == 2 * 128 - 16
    assert probe_targets(table[:8], 3) == [p for p in table[:8] if p["rank"] != 3]  # one host


def test_root_call_gives_rank_0s_outcome_to_every_rank():
    """world.root_call (engine.root_call and data_prep's Context.root_call): rank 0 runs the
    function; its result reaches the others only when shared; its error is rank 0's own there and
    the given class, with the same message, on the others. The broadcast is rank 0's object
    carried over by hand (rank 0 runs first, then rank 1 receives what it sent)."""
    from hvd_lm.comm.world import root_call

    sent = []

    def bcast_root(x):
        sent.append(x)
        return x

    def boom():
        raise OSError("run folder r is locked")

    for share in (False, True):
        sent.clear()
        assert root_call(True, bcast_root, lambda: 7, KeyError, share) == 7
        assert root_call(False, lambda _: sent[-1], lambda: 1 / 0, KeyError, share) == (
            7 if share else None)
    sent.clear()
    with pytest.raises(OSError, match="locked"):
        root_call(True, bcast_root, boom, KeyError)
    with pytest.raises(KeyError, match="locked"):
        root_call(False, lambda _: sent[-1], boom, KeyError)
