"""The warm interpreter the tests run their commands in (tests/_warm.py) gives what a fresh
``python -m ...`` gives: the same output, exit status and trained parameters, bit for bit; and
it steps aside where it could not (an environment read at start-up, ``HVD_LM_TEST_FRESH=1``).
Also scripts/suite_cpu.py's table, on a log written by hand."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hvd_lm.formats.checkpoint import load, resolve
from tests import _warm, conftest
from tests._mp import REPO, launch_env
from tests.shardutil import default_shards

TINY = [*conftest.TINY, "--hidden-size", "16", "--embed-dim", "4", "--max-steps", "3",
        "--eval-chars", "500"]


def fresh(cmd, cwd, env, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def warm(cmd, cwd, env, timeout=120) -> subprocess.CompletedProcess:
    proc = _warm.run(cmd, cwd, env, timeout)
    assert proc is not None, "ran fresh, not warm"
    return proc


def test_a_warm_training_run_is_a_fresh_one(tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_LM_TEST_FRESH", raising=False)
    shards = default_shards(tmp_path / "shards")
    env = launch_env()
    procs = {}
    for how, runner in (("fresh", fresh), ("warm", warm)):
        out = tmp_path / how
        procs[how] = runner([sys.executable, "-m", "hvd_lm", "train", "--shards", str(shards),
                             "--out-dir", str(out), *TINY], tmp_path, env)
        assert procs[how].returncode == 0, procs[how].stderr
    a, b = (load(resolve(tmp_path / how))["model"] for how in ("fresh", "warm"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    # the same records on stdout, less their timings; stderr's warnings the same
    keys = [[w.split("=")[0] for w in line.split()] for line in procs["fresh"].stdout.splitlines()]
    assert keys == [[w.split("=")[0] for w in line.split()]
                    for line in procs["warm"].stdout.splitlines()]
    assert procs["fresh"].stderr.replace(str(tmp_path / "fresh"), "X") == \
        procs["warm"].stderr.replace(str(tmp_path / "warm"), "X")


@pytest.mark.parametrize("args", [
    ["eval", "no-such-run", "no-such-shards"],           # one ERROR line, exit 1
    ["train", "--hidden-size", "-3"],                    # the parser's error, exit 2
    ["--help"],                                          # stdout, exit 0
])
def test_errors_and_exit_status_are_the_fresh_ones(args, tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_LM_TEST_FRESH", raising=False)
    env = launch_env()
    cmd = [sys.executable, "-m", "hvd_lm", *args]
    want, got = fresh(cmd, tmp_path, env), warm(cmd, tmp_path, env)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)


def test_a_module_that_does_not_exist_is_said_as_python_says_it(tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_LM_TEST_FRESH", raising=False)
    cmd = [sys.executable, "-m", "hvd_lm.no_such_module"]
    want, got = fresh(cmd, tmp_path, launch_env()), warm(cmd, tmp_path, launch_env())
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert got.returncode == 1 and "No module named hvd_lm.no_such_module" in got.stderr


def test_a_run_past_its_timeout_is_killed_and_raises(tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_LM_TEST_FRESH", raising=False)
    shards = default_shards(tmp_path / "shards")
    cmd = [sys.executable, "-m", "hvd_lm", "train", "--shards", str(shards), "--out-dir",
           str(tmp_path / "r"), *TINY]
    with pytest.raises(subprocess.TimeoutExpired):
        warm(cmd, tmp_path, launch_env(HVD_LM_STEP_SLEEP="30"), timeout=3)


def test_what_must_start_fresh_does(tmp_path, monkeypatch):
    monkeypatch.delenv("HVD_LM_TEST_FRESH", raising=False)
    cmd = [sys.executable, "-m", "hvd_lm", "--help"]
    other = launch_env(PYTHONPATH=f"{tmp_path}:{REPO}")                  # read at start-up
    assert _warm.run(cmd, tmp_path, other, 60) is None
    assert _warm.run(cmd, tmp_path, launch_env(), 60) is not None
    assert _warm.run(cmd, tmp_path, launch_env(OMP_NUM_THREADS="7"), 60) is None
    assert _warm.run([sys.executable, "-c", "pass"], tmp_path, launch_env(), 60) is None
    other_venv = tmp_path / "venv" / "bin" / "python"     # another environment's interpreter
    other_venv.parent.mkdir(parents=True)
    other_venv.symlink_to(sys.executable)
    assert _warm.run([str(other_venv), *cmd[1:]], tmp_path, launch_env(), 60) is None
    assert _warm.run(["python", *cmd[1:]], tmp_path, launch_env(), 60) is not None  # on PATH
    assert _warm.run([sys.executable, "-m", "json.tool"], tmp_path, launch_env(), 60) is None
    monkeypatch.setenv("HVD_LM_TEST_FRESH", "1")
    assert _warm.run(cmd, tmp_path, launch_env(), 60) is None


def test_suite_cpu_sums_by_command(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import suite_cpu
    finally:
        sys.path.remove(str(REPO / "scripts"))
    log = tmp_path / "procs.tsv"
    log.write_text("1\t5.0\t1\t1\t/r/hvd_lm/__main__.py train --shards s\n"
                   "2\t4.0\t1\t1\t/v/bin/hvd-lm train --x\n"
                   "3\t0.5\t0\t0\t/v/bin/horovodrun -np 2\n"
                   "4\t2.5\t1\t0\t/r/hvd_lm/__main__.py eval r s\n"
                   "5\t1.5\t16\t2.0\t1\t1\t/r/hvd_lm/__main__.py ev\n")  # two appends interleaved
    table = suite_cpu.summarise(log).splitlines()
    assert table[1].split() == ["2", "9.0", "2", "2", "hvd_lm", "train"]
    assert table[2].split() == ["1", "2.5", "1", "0", "hvd_lm", "eval"]
    assert table[3].split() == ["1", "0.5", "0", "0", "horovodrun"]
    assert table[-1].split()[:4] == ["4", "12.0", "3", "2"]
    assert table[-1].endswith("; 1 torn line(s) skipped")


def test_the_loky_workers_a_command_started_end_with_it():
    """scikit-learn's parallel fits start joblib's loky workers; in a fresh interpreter they end
    with it, while a forked child's exit waited for their 300 s idle timeout (a 4-second
    transfer took 5 minutes warm): the warm child stops them itself."""
    import joblib
    import psutil

    joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(abs)(i) for i in range(4))
    workers = [p for p in psutil.Process().children(recursive=True)
               if "popen_loky_posix" in " ".join(p.cmdline())]
    assert workers
    _warm._stop_loky_workers()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive
