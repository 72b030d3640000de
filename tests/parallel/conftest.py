"""Rank sessions: every rank of one 2-rank job (``horovodrun``, ``mpirun`` or ``torchrun``) runs
one module of this folder as its own pytest session, as Horovod's CI runs its collective tests
(``horovodrun -np 2 -H localhost:2 --gloo python -m pytest test/parallel/test_torch.py``): the
ranks start once per module, not once per test, and every test still runs on real ranks over
real collectives (Horovod over Gloo or MPI, torch.distributed over Gloo). tests/test_parallel.py
launches them; a module is never collected by the main suite.

Both ranks collect the same tests in the same order. After each test they exchange whether it
passed on every rank (one allreduce): a test that failed anywhere stops the session on every
rank, so the ranks never wait on each other in different tests. Each rank writes its own JUnit
report (``--junitxml X`` becomes ``X.rank<R>``), which the launching test reads to name the rank
and the test that failed.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hvd_lm.comm import engine
from hvd_lm.comm.world import RankContext

#: The engine a session's collectives run on and its launcher (tests/test_parallel.py sets them
#: per launch), and the folder every launch of the module shares.
ENGINE = os.environ.get("HVD_LM_TEST_ENGINE", "horovod")
LAUNCHER = os.environ.get("HVD_LM_TEST_LAUNCHER", "")
SHARED = Path(os.environ.get("HVD_LM_RANK_SHARED", "."))


@pytest.fixture(scope="session")
def ctx() -> RankContext:
    """This rank's place in the job, the engine initialised once for the session."""
    return _init()


def _init() -> RankContext:
    c = engine.init(backend=ENGINE)
    import torch
    torch.set_num_threads(1)
    return c


def pytest_configure(config):
    """One JUnit report and one temporary folder per rank."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("HOROVOD_RANK") \
        or os.environ.get("RANK") or "0"
    if getattr(config.option, "xmlpath", None):
        config.option.xmlpath = f"{config.option.xmlpath}.rank{rank}"
    if getattr(config.option, "basetemp", None):
        config.option.basetemp = f"{config.option.basetemp}.rank{rank}"


_failed: set[str] = set()


def pytest_runtest_logreport(report):
    if report.failed:
        _failed.add(report.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test, every rank learns whether it failed on any rank (an allreduce), and the
    session stops on all of them if it did."""
    yield
    mine = 1.0 if item.nodeid in _failed else 0.0
    try:
        bad = engine.allreduce_sum([mine], name="test_verdict")[0]
    except Exception as e:  # noqa: BLE001 - a collective lost in the failed test: stop here
        bad, why = max(mine, 1.0), f"the ranks lost each other ({type(e).__name__})"
    else:
        why = f"it failed on {bad:.0f} of {_init().size} rank(s)"
    if bad > 0:
        item.session.shouldfail = f"{item.nodeid}: {why}; the session stops on every rank"
        item.session.shouldstop = item.session.shouldfail
