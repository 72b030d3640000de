"""What the failure-behaviour tests (tests/test_reliability*.py) share: tiny training flags, the
shards fixture, run records, the command runner and the one-ERROR-line check."""
from __future__ import annotations

import subprocess
import sys

from tests import conftest
from tests._mp import launch_env, one_error_line, run  # noqa: F401 - one_error_line for the tests

TINY = [*conftest.TINY, "--log-every", "1", "--lr", "3e-3"]
HVD_LM = [sys.executable, "-m", "hvd_lm"]




def hvd_lm(*args, timeout=180, **env) -> subprocess.CompletedProcess:
    return run([*HVD_LM, *map(str, args)], timeout=timeout, env=launch_env(**env), check=False)


