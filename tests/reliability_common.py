"""What the failure-behaviour tests (tests/test_reliability*.py) share: tiny training flags, the
shards fixture, run records, the command runner and the one-ERROR-line check."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._mp import launch_env, one_error_line, run  # noqa: F401 - one_error_line for the tests
from tests.shardutil import default_shards

TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--batch-size", "2",
        "--log-every", "1", "--lr", "3e-3", "--threads", "1", "--eval-chars", "2000", "--device",
        "cpu"]
HVD_LM = [sys.executable, "-m", "hvd_lm"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return default_shards(tmp_path_factory.mktemp("shards"))


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if kind is None or r["kind"] == kind]


def hvd_lm(*args, timeout=180, **env) -> subprocess.CompletedProcess:
    return run([*HVD_LM, *map(str, args)], timeout=timeout, env=launch_env(**env), check=False)


