"""Shared pytest fixtures: where the repository and the shared data (``../shared``) are, and the
cluster in a box (tests/cluster.py) for the ``cluster`` tests."""

import atexit
import contextlib
import json
import os
from pathlib import Path

import pytest

#: --time-budget / --done-file / --budget-report: a suite in parts (scripts/gpu_check.sh)
pytest_plugins = ["tests._budget"]

#: The default --threads fixed, in this process and every command it starts: the usable cores
#: less those the other pytest-xdist workers keep busy (what a measurement would mostly find;
#: hvd_lm/comm/threads.py). Measured, the threads would follow the other tests' load, and a
#: result compared to the last bit could follow them; tests/test_threads.py measures for real.
os.environ.setdefault("HVD_LM_IDLE_CORES", str(max(1, len(os.sched_getaffinity(0)) // int(
    os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"

#: The tiny run most training tests make (a file adds its own flags after these: argparse keeps
#: the last of a flag): H=32, 2 rows of 16 bytes, one thread, on the CPU.
TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--batch-size", "2",
        "--threads", "1", "--eval-chars", "2000", "--device", "cpu"]


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The records of ``run_dir``'s ``metrics.jsonl`` (of one ``kind`` when given; none while
    the file does not exist; a last line still being written is left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    recs = [json.loads(x) for x in lines if x.endswith("}")]
    return [r for r in recs if kind is None or r["kind"] == kind]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Real review text in small shards (tests/shardutil.py: 3 train shards, 1 val), once per
    test module."""
    from tests.shardutil import default_shards
    return default_shards(tmp_path_factory.mktemp("shards"))


def pytest_ignore_collect(collection_path, config):
    """tests/parallel runs only as rank sessions (tests/test_parallel.py launches them)."""
    if "parallel" in collection_path.parts and os.environ.get("HVD_LM_RANK_SESSION") != "1":
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """Every ``cluster`` test is ``serial`` too: ``make test`` runs the serial tests alone, after
    the others ran two at a time (the box is one set of namespaces, and its shaped links are
    measured)."""
    for item in items:
        if item.get_closest_marker("cluster") and not item.get_closest_marker("serial"):
            item.add_marker(pytest.mark.serial)


#: what a test that skips for want of ../shared adds to its reason, where it says only what
#: is missing (a clone on its own: one line, the cause and the fix)
SHARED_FIX = "put the shared folder, or a link to it, beside the checkout to run it"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip whose reason names a path under ``../shared`` but not the fix gets the fix."""
    rep = yield
    if rep.skipped and isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
        path, line, reason = rep.longrepr
        if str(SHARED_DIR) in reason and SHARED_FIX not in reason:
            rep.longrepr = (path, line, f"{reason} (../shared, absent here): {SHARED_FIX}")
    return rep


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One tiny trained run for every test that only reads a model (eval, transfer, pruning,
    resume sources...), trained once per session (per xdist worker) through the command line:
    ``shards``, ``run`` (20 steps of :data:`TINY`, checkpoints of steps 10 and 20 kept, latest
    20) and ``exported`` (``hvd-lm export`` of it). Tests copy what they change."""
    import sys
    from types import SimpleNamespace

    from tests._mp import run
    from tests.shardutil import default_shards

    d = tmp_path_factory.mktemp("trained_run")
    shards = default_shards(d / "shards")
    hvd_lm = [sys.executable, "-m", "hvd_lm"]
    run([*hvd_lm, "train", "--shards", shards, "--out-dir", d / "run", *TINY, "--log-every",
         "10", "--max-steps", "20", "--checkpoint-every", "10", "--keep-checkpoints", "0"],
        timeout=300)
    run([*hvd_lm, "export", d / "run", d / "exported"], timeout=120)
    return SimpleNamespace(shards=shards, run=d / "run", exported=d / "exported")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the repository; skips the test when it is absent (a clone on
    its own: every other test runs on shipped or generated data)."""
    data = SHARED_DIR / "data"
    if not data.is_dir():
        pytest.skip(f"reads the project's shared review corpus, not found at {data} (a clone "
                    f"without ../shared): {SHARED_FIX}")
    return data


@pytest.fixture(scope="session")
def cluster():
    """Three namespace hosts n1-n3 with sshd, a decoy docker0 and unshaped links
    (:class:`tests.cluster.Cluster`), shared by every ``cluster`` test of the session and torn
    down at its end (and at exit, should the session die first); skips with the reason where
    network namespaces cannot be made."""
    from tests.cluster import Cluster
    from tests.cluster_host import Unavailable, check_available, down, session_lock

    with contextlib.ExitStack() as stack:
        try:
            check_available()
            stack.enter_context(session_lock())
        except Unavailable as e:
            pytest.skip(f"no cluster in a box here: {e}")
        stack.callback(down)  # whatever state `up` left, nothing stays behind
        c = Cluster.up(3)
        atexit.register(c.down)
        stack.callback(c.down)
        yield c
