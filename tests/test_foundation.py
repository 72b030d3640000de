"""Foundation: the Horovod stack is built right, and DistributedOptimizer matches one process."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import tomllib
import yaml

from hvd_lm.install.check_build import (
    missing_components,
    parse_check_build,
)
from tests._mp import REPO, run

CANNED = """Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [ ] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [ ] Gloo
"""


def test_parse_check_build_canned_text():
    info = parse_check_build(CANNED)
    assert info.version == "0.28.1"
    assert info.frameworks == {"TensorFlow": False, "PyTorch": True, "MXNet": False}
    assert info.controllers == {"MPI": True, "Gloo": False}
    assert missing_components(info) == ["Gloo controller"]
    assert missing_components(info, need_nccl=True) == ["Gloo controller", "NCCL tensor operations"]
    with pytest.raises(ValueError):
        parse_check_build("usage: horovodrun [-h]")


def test_real_check_build_has_pytorch_mpi_gloo():
    """``hvd-lm check-build`` as docs/install.md runs it (the docs test only parses that line):
    the venv's real ``horovodrun --check-build``, parsed, lists PyTorch, MPI and Gloo."""
    out = run([sys.executable, "-m", "hvd_lm", "check-build"]).stdout
    m = re.fullmatch(r"Horovod 0\.28\.1: built with (.*)\n", out)
    assert m, out
    assert {"PyTorch", "MPI", "Gloo"} <= set(m.group(1).split(", "))


def test_environment_yml_matches_pyproject():
    """environment.yml names every pyproject dependency (conda or its pip: list), same lower
    bound."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    want = {}
    for spec in deps["dependencies"] + deps["optional-dependencies"]["test"]:
        name, ver = re.match(r"([A-Za-z0-9_.-]+)>=(\S+)", spec).groups()
        want[{"torch": "pytorch"}.get(name.lower(), name.lower())] = ver
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    have = {}
    items = []
    for item in env["dependencies"]:                  # conda packages and the pip: sub-list
        items += item.get("pip", []) if isinstance(item, dict) else [item]
    for item in items:
        m = re.match(r"([A-Za-z0-9_.-]+)(?:>=(\S+))?", item)
        if m:
            have[m.group(1).lower()] = m.group(2)
    for name, ver in want.items():
        assert name in have, f"environment.yml lacks {name} (pyproject.toml needs it)"
        assert have[name] == ver, f"{name}: environment.yml >={have[name]}, pyproject >={ver}"


def test_setup_scripts_pass_shellcheck():
    import shutil

    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    subprocess.run(["shellcheck", REPO / "scripts/setup.sh", REPO / "scripts/build_horovod.sh",
                    REPO / "scripts/gpu_check.sh", REPO / "scripts/fetch_offline_wheels.sh",
                    REPO / ".ci/run"], check=True)


def test_setup_says_in_one_line_when_python_cannot_make_a_venv(tmp_path):
    """Issue 22, defect 7 (before: `python3 -m venv` failed with its own paragraph and left a
    venv without pip, on which the next setup run failed obscurely). Ubuntu's python3 without
    python3.X-venv, emulated by an ``ensurepip`` that cannot be imported: setup stops with one
    ERROR line naming the package, and makes no venv."""
    import os
    import sys

    stub = tmp_path / "stub" / "ensurepip"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n")
    venv = tmp_path / "venv"
    env = dict(os.environ, PYTHON=sys.executable, VENV=str(venv),
               PYTHONPATH=str(tmp_path / "stub"))
    proc = subprocess.run(["bash", REPO / "scripts/setup.sh"], env=env, capture_output=True,
                          text=True, timeout=300)
    errors = [x for x in (proc.stdout + proc.stderr).splitlines() if "ERROR" in x]
    ver = "%d.%d" % sys.version_info[:2]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout + proc.stderr
    assert f"apt-get install python{ver}-venv" in errors[0]
    assert not venv.exists()


def test_setup_makes_the_cluster_in_a_box_runnable_from_any_folder(tmp_path):
    """setup.sh puts the checkout at the end of the venv's sys.path (``_hvd_lm_checkout.pth``),
    so ``python -m tests.cluster`` works from any folder, not only the repository root (issue
    36). A venv without pip stops setup just after that step, in one line."""
    import os
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, VENV=str(venv), HVD_LM_NO_APT="1")
    proc = subprocess.run(["bash", REPO / "scripts/setup.sh"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "has no pip" in proc.stdout + proc.stderr, proc.stderr
    found = subprocess.run([venv / "bin/python", "-c", "import importlib.util as u; "
                            "print(u.find_spec('tests.cluster').origin)"], cwd="/", env=env,
                           capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == str(REPO / "tests" / "cluster.py"), found.stderr

