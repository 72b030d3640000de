"""The rank sessions (tests/parallel/conftest.py): each module of tests/parallel runs as one real
2-rank job per launcher listed here, every rank a pytest session of that module, as Horovod's CI
runs its collective tests. A failure names the rank, the test and its message (each rank's JUnit
report), then the job's output."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests._mp import REPO, horovodrun_cmd, launch_env, mpirun_cmd, run, torchrun_cmd

pytestmark = pytest.mark.slow

#: module -> the (launcher, engine) jobs it runs under.
MODULES: dict[str, list[tuple[str, str]]] = {}


def _register():
    """Each module of tests/parallel declares its launches in a ``LAUNCHES`` line (read as text:
    the modules import what only a rank session may set up)."""
    for path in sorted((REPO / "tests/parallel").glob("test_*.py")):
        for line in path.read_text().splitlines():
            if line.startswith("LAUNCHES = "):
                MODULES[path.name] = eval(line.split("=", 1)[1])  # a literal list of pairs
    return [(m, launcher, engine) for m, pairs in MODULES.items() for launcher, engine in pairs]


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


@pytest.mark.parametrize("module,launcher,engine", _register())
def test_rank_session(module, launcher, engine, tmp_path):
    xml = tmp_path / "junit.xml"
    argv = ["-m", "pytest", f"tests/parallel/{module}", "-q", "-p", "no:cacheprovider",
            "--junitxml", str(xml), "--basetemp", str(tmp_path / "ranks")]
    proc = run(_command(launcher, argv), timeout=600, check=False, cwd=REPO,
               env=launch_env(HVD_LM_TEST_ENGINE=engine, HVD_LM_RANK_SESSION="1"))
    failed = failures(xml)
    reports = list(tmp_path.glob("junit.xml.rank*"))
    assert proc.returncode == 0 and not failed and len(reports) == 2, (
        "\n".join(failed or [f"{len(reports)} rank report(s), exit {proc.returncode}"])
        + f"\n--- output\n{(proc.stdout + proc.stderr)[-6000:]}")
