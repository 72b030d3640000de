"""The rank sessions (tests/parallel/conftest.py): each module of tests/parallel runs as real 2-rank
jobs, one per launch it lists (``LAUNCHES``: horovodrun's Gloo controller, mpirun, torchrun; the
Horovod or the torch engine), every rank a pytest session of that module, as Horovod's CI runs
its collective tests. The launches of a module run in order and share one folder
(``HVD_LM_RANK_SHARED``): what one-process references a module needs are made first, in this
process, by its ``prepare(shared)``, and a later launch may compare with an earlier one's runs
(the torch engine's run with Horovod's); ``after(shared)`` checks what only one process can
(a one-process eval of a 2-rank run). A failure names the launch, the rank, the test and its
message (each rank's JUnit report), then the job's output."""
from __future__ import annotations

import importlib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests._mp import REPO, horovodrun_cmd, launch_env, mpirun_cmd, run, torchrun_cmd

pytestmark = pytest.mark.slow

MODULES = sorted(p.stem for p in (REPO / "tests/parallel").glob("test_*.py"))


def _command(launcher: str, argv: list[str]) -> list:
    if launcher == "horovodrun-gloo":
        return horovodrun_cmd(2, argv, "gloo")
    if launcher == "horovodrun-mpi":
        return horovodrun_cmd(2, argv, "mpi")
    if launcher == "mpirun":
        return mpirun_cmd(2, argv)
    if launcher == "torchrun":
        return torchrun_cmd(2, argv)
    raise ValueError(launcher)


def failures(xml_base: Path) -> list[str]:
    """``rank R: NODEID: first line of the failure`` for every failed or errored test of every
    rank's JUnit report."""
    out = []
    for report in sorted(xml_base.parent.glob(xml_base.name + ".rank*")):
        rank = report.name.rsplit(".rank", 1)[1]
        for case in ET.parse(report).getroot().iter("testcase"):
            for bad in list(case.findall("failure")) + list(case.findall("error")):
                msg = (bad.get("message") or "").strip().splitlines()
                out.append(f"rank {rank}: {case.get('classname')}::{case.get('name')}: "
                           f"{msg[0] if msg else bad.tag}")
    return out


def session(module: str, launcher: str, engine: str, shared: Path, tmp: Path) -> None:
    """One launch of ``module``'s rank sessions; raises AssertionError naming what failed."""
    xml = tmp / "junit.xml"
    argv = ["-m", "pytest", f"tests/parallel/{module}.py", "-q", "-p", "no:cacheprovider",
            "--junitxml", str(xml), "--basetemp", str(tmp / "ranks")]
    proc = run(_command(launcher, argv), timeout=600, check=False, cwd=REPO,
               env=launch_env(HVD_LM_TEST_ENGINE=engine, HVD_LM_TEST_LAUNCHER=launcher,
                              HVD_LM_RANK_SESSION="1", HVD_LM_RANK_SHARED=str(shared)))
    failed = failures(xml)
    reports = list(tmp.glob("junit.xml.rank*"))
    assert proc.returncode == 0 and not failed and len(reports) == 2, (
        f"{module} under {launcher} ({engine} engine):\n"
        + "\n".join(failed or [f"{len(reports)} rank report(s), exit {proc.returncode}"])
        + f"\n--- output\n{(proc.stdout + proc.stderr)[-6000:]}")


@pytest.mark.parametrize("module", MODULES)
def test_rank_sessions(module, tmp_path):
    mod = importlib.import_module(f"tests.parallel.{module}")
    shared = tmp_path / "shared"
    shared.mkdir()
    if hasattr(mod, "prepare"):
        mod.prepare(shared)
    for i, (launcher, engine) in enumerate(mod.LAUNCHES):
        tmp = tmp_path / f"{i}-{launcher}-{engine}"
        tmp.mkdir()
        session(module, launcher, engine, shared, tmp)
    if hasattr(mod, "after"):
        mod.after(shared)
