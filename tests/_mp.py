"""Launch real multi-process jobs (`horovodrun`, `mpirun`, `torchrun`) from tests.

Every launch has a timeout: a hung collective fails the test instead of hanging CI.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hvd_lm.jobs.job_scripts import local_mpi_env
from tests import _warm

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
BIN = Path(sys.executable).parent


def launch_env(**extra: str) -> dict[str, str]:
    """Environment for launched ranks: :func:`hvd_lm.jobs.job_scripts.local_mpi_env` (the venv first
    on PATH, the repo importable, one thread per rank, OpenMPI as root, idle ranks yielding)."""
    return local_mpi_env(**extra)


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure (or ``check`` and rc != 0) raise with its whole output.
    ``python -m hvd_lm ...`` (or ``data_prep``) runs in a warm interpreter's fork
    (:mod:`tests._warm`: the same command without ~5 s of imports; ``HVD_LM_TEST_FRESH=1`` starts
    every one fresh)."""
    proc = _warm.run_or_fresh([str(c) for c in cmd], cwd, env or launch_env(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The command failed with exactly one ERROR line (no traceback) holding every needle."""
    assert proc.returncode != 0, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "ERROR:" in x]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def horovodrun_cmd(np_: int, argv: list[str], controller: str = "gloo") -> list[str]:
    """``horovodrun -np N --gloo|--mpi python ARGV...`` on localhost."""
    return [BIN / "horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", f"--{controller}",
            sys.executable, *argv]


def mpirun_cmd(np_: int, argv: list[str]) -> list[str]:
    """Plain OpenMPI ``mpirun -np N python ARGV...`` with Horovod's recommended flags."""
    return ["mpirun", "-np", str(np_), "-bind-to", "none", "-map-by", "slot",
            "-mca", "pml", "ob1", "-mca", "btl", "^openib", sys.executable, *argv]


def torchrun_cmd(np_: int, argv: list[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node N ARGV...`` on this machine (this interpreter's
    ``torch.distributed.run``; ``ARGV`` a script, or ``-m module ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(np_), "--max-restarts", "0", *argv]
