"""Launch real multi-process jobs (`horovodrun`, `mpirun`) from tests.

Every launch has a timeout: a hung collective fails the test instead of hanging CI.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
BIN = Path(sys.executable).parent


def launch_env(**extra: str) -> dict[str, str]:
    """Environment for launched ranks: the venv first on PATH, the repo importable, one thread per
    rank, and OpenMPI allowed to run as root (CI runs as root) and inside containers."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    # Containers often forbid the ptrace-based single-copy transport of OpenMPI's vader BTL.
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    # Ranks share this machine's 2 cores: let idle MPI ranks yield instead of busy-polling.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure (or ``check`` and rc != 0) raise with its whole output."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or launch_env(), text=True,
                          capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def horovodrun_cmd(np_: int, argv: list[str], controller: str = "gloo") -> list[str]:
    """``horovodrun -np N --gloo|--mpi python ARGV...`` on localhost."""
    return [BIN / "horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", f"--{controller}",
            sys.executable, *argv]


def mpirun_cmd(np_: int, argv: list[str]) -> list[str]:
    """Plain OpenMPI ``mpirun -np N python ARGV...`` with Horovod's recommended flags."""
    return ["mpirun", "-np", str(np_), "-bind-to", "none", "-map-by", "slot",
            "-mca", "pml", "ob1", "-mca", "btl", "^openib", sys.executable, *argv]
