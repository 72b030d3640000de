"""``python -m MODULE ARGS`` without the interpreter's start-up: the command runs in a fork of a
warm interpreter that has already imported torch, torch._dynamo, Horovod, scikit-learn and hvd_lm
(the standard library's ``multiprocessing`` forkserver; "Contexts and start methods" in its docs).

Why: a fresh ``python -m hvd_lm train`` spends about 5 CPU-s on imports on this machine before its
first step (torch 2.4 s; torch._dynamo 2.5 s, which ``torch.optim``'s ``step`` imports), and the
suite starts over a hundred single-process CLI runs (``scripts/profile_suite.sh`` counts them).

What the command gets, as from ``subprocess.run(argv, cwd=cwd, env=env, capture_output=True)``:
its arguments (``runpy.run_module(MODULE, run_name="__main__")``, as ``-m`` does), its environment
(``os.environ`` replaced), its working directory, stdout and stderr captured, stdin empty, at-exit
handlers run, and its exit status (``SystemExit``'s code, 1 with the traceback for an exception,
``-N`` for a signal). What it does not get is a fresh interpreter: modules are imported once, under
the server's environment (``local_mpi_env()``, what tests give their commands). So a call runs as
a real subprocess instead (:func:`run` returns None) when its environment differs from that one in
a variable read at interpreter start or at import (:data:`START_PREFIXES`: ``PYTHONPATH``,
``OMP_NUM_THREADS``, ``TRITON_INTERPRET``...), for a module outside :data:`MODULES`, and for every
call when ``HVD_LM_TEST_FRESH=1`` (the whole suite on fresh interpreters, as users start them).
Launchers' ranks (``horovodrun``, ``mpirun``, ``torchrun``) always start fresh: only the command a
test starts itself comes here.
"""
from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

#: Modules run warm (``python -m`` these, or a submodule).
MODULES = ("hvd_lm", "data_prep")
#: Imported once by the server: what nearly every command imports first.
PRELOAD = ["torch", "torch._dynamo", "horovod.torch", "numpy", "h5py", "sklearn.linear_model",
           "hvd_lm.cli", "hvd_lm.train.loop", "hvd_lm.transfer.run"]
#: Environment variables read at interpreter start or when those modules are imported.
START_PREFIXES = ("PYTHON", "OMP_", "MKL_", "TORCH_", "TRITON_", "LD_", "KMP_", "OPENBLAS_")

_server_env: dict[str, str] | None = None


def _start_keys(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(START_PREFIXES)}


def _server():
    """The forkserver context and the start-up variables of its server, started once per process
    under :func:`hvd_lm.jobs.job_scripts.local_mpi_env` (the environment tests give their commands:
    ``tests._mp.launch_env``)."""
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    if _server_env is None:
        from hvd_lm.jobs.job_scripts import local_mpi_env

        env = local_mpi_env()
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:  # the server process inherits this environment
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_env = _start_keys(env)
    return ctx, _server_env


def _child(module: str, args: list[str], env: dict[str, str], cwd: str, out: str,
           err: str) -> None:
    """Runs in the forked child: become ``python -m module args`` and run it."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    code = 0
    try:
        if importlib.util.find_spec(module) is None:  # as the interpreter says it for -m
            print(f"{sys.executable}: No module named {module}", file=sys.stderr)
            sys.exit(1)
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        _stop_loky_workers()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def _stop_loky_workers() -> None:
    """Stop the worker processes joblib's loky started for the command (scikit-learn's parallel
    fits): in a fresh interpreter they end with it, but a forked child's exit waits for them to
    time out idle (loky's 300 s), so the command would seem to take 5 minutes longer here."""
    executor = getattr(sys.modules.get("joblib.externals.loky.reusable_executor"), "_executor",
                       None)
    if executor is not None:
        executor.shutdown(wait=True, kill_workers=True)


def _is_this_python(program: str, env: dict[str, str]) -> bool:
    """``program`` (a path, or a name looked up on ``env``'s PATH) is this interpreter's path:
    another virtual environment's ``python`` (a link to the same binary) has other packages."""
    path = program if os.sep in program else shutil.which(program, path=env.get("PATH"))
    return path is not None and os.path.abspath(path) == os.path.abspath(sys.executable)


def run(cmd: list[str], cwd: Path | str, env: dict[str, str],
        timeout: float) -> subprocess.CompletedProcess | None:
    """``cmd`` (``[python, "-m", MODULE, *args]``) run warm, as ``subprocess.run(cmd, cwd=cwd,
    env=env, capture_output=True, text=True, timeout=timeout)`` would run it fresh; None where it
    must start fresh (see the module docstring).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds (it is killed first).
    """
    if (os.environ.get("HVD_LM_TEST_FRESH") == "1" or len(cmd) < 3 or cmd[1] != "-m"
            or cmd[2].split(".")[0] not in MODULES or not _is_this_python(cmd[0], env)):
        return None
    ctx, server_env = _server()
    if _start_keys(env) != server_env:
        return None
    with tempfile.TemporaryDirectory(prefix="hvd-lm-warm-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        p = ctx.Process(target=_child, args=(cmd[2], cmd[3:], env, str(cwd), out, err))
        p.start()
        p.join(timeout)
        timed_out = p.exitcode is None
        if timed_out:
            p.kill()
            p.join()
        stdout, stderr = (Path(f).read_text(errors="replace") if os.path.exists(f) else ""
                          for f in (out, err))
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, p.exitcode, stdout, stderr)


def run_or_fresh(argv: list[str], cwd: Path | str, env: dict[str, str],
                 timeout: float) -> subprocess.CompletedProcess:
    """``argv`` run warm where :func:`run` can (``hvd-lm X`` is ``python -m hvd_lm X``), else as
    ``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    cmd = [sys.executable, "-m", "hvd_lm", *argv[1:]] if Path(argv[0]).name == "hvd-lm" else argv
    return run(cmd, cwd, env, timeout) or subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
