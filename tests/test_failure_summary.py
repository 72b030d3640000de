"""The closing block of a launch (hvd_lm/jobs/failure_summary.py) read from the run's own records
and the launcher's own words: a clean stop on a signal is said as one (exit 3: the template then
exits 0), a rank srun or mpirun lost is named with its host, a start mpirun refused as root says
the fix. Through the command the templates call."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests._mp import REPO


def summary(out, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvd_lm.jobs.failure_summary", str(out),
                           *map(str, args)], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


def write_records(out, *recs) -> None:
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_signal_stop_on_every_rank_is_a_clean_stop_whatever_the_exit_status(tmp_path):
    """horovodrun across hosts exited 255 after every rank checkpointed on SIGTERM, and the block
    said 'the job failed ... a rank killed outright'."""
    t0 = time.time()
    write_records(tmp_path / "run", {"kind": "start", "step": 0, "time": t0},
                  {"kind": "end", "step": 12, "time": t0 + 5, "stop": "signal", "world_size": 2})
    p = summary(tmp_path / "run", "--rc", "255", "--since", t0 - 1)
    assert p.returncode == 3, p.stderr
    assert p.stdout.startswith("==== hvd-lm: stopped on a signal: every rank checkpointed at "
                               "step 12 (2 ranks;"), p.stdout
    assert "failed" not in p.stdout
    # an earlier run's clean stop is not this launch's
    p = summary(tmp_path / "run", "--rc", "255", "--since", t0 + 10)
    assert p.returncode == 0 and "the job failed (exit status 255)" in p.stdout


@pytest.mark.slow
def test_the_launchers_words_name_the_lost_rank_or_the_refused_start(tmp_path):
    write_records(tmp_path / "run", {"kind": "start", "step": 0, "time": time.time()})
    cases = {
        "srun: error: n2: task 1: Killed":
            "cause: srun: rank 1 on host n2: Killed",
        "[1,0]<stderr>:mpirun noticed that process rank 1 with PID 4242 on node n2 exited on "
        "signal 9 (Killed).":
            "cause: mpirun: rank 1 on host n2 was killed by signal 9 (Killed)",
        "mpirun has detected an attempt to run as root.":
            "cause: mpirun refused to start: OpenMPI does not run as root unless told to; set "
            "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
    }
    for said, cause in cases.items():
        errors = tmp_path / "errors"
        errors.write_text(f"some output\n{said}\n")
        p = summary(tmp_path / "run", "--rc", "1", "--errors", errors)
        assert p.returncode == 0, p.stderr
        last = p.stdout.rstrip().splitlines()
        assert last[1].endswith("; the launcher's own words follow"), last
        assert last[-1].startswith(cause), (said, last[-1])


def test_the_rank_horovodrun_or_torchrun_saw_killed_first_is_named_with_its_host(tmp_path):
    """A rank SIGKILLed under horovodrun or torchrun: the launcher's line names it (its host from
    the run's start record when the line has none), ahead of what the other ranks then recorded:
    rank 0's probe of ranks the launcher had already stopped named ranks 1 to 8, not rank 7."""
    t0 = time.time()
    hosts = ["n1"] * 4 + ["n2"] * 4 + ["n3"] * 8
    misled = {"kind": "failure", "step": 57, "time": t0 + 2, "rank": 0, "host": "n1",
              "error": "lost ranks 1,2,3,4,5,6,7,8 on host n1 (refuses the connection): ...",
              "lost": [{"rank": r, "host": "n1", "why": "refuses"} for r in range(1, 9)]}
    write_records(tmp_path / "run", {"kind": "start", "step": 0, "time": t0, "hosts": hosts},
                  misled)
    torchrun_block = ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-07\n"
                      "  host      : n2\n  rank      : 7 (local_rank: 3)\n"
                      "  exitcode  : -9 (pid: 4242)\n  error_file: <N/A>\n")
    for said, cause in {
            "Process 7 exit with status code 137.":
                "cause: horovodrun: rank 7 on host n2 was killed by signal 9 (SIGKILL)",
            torchrun_block: "cause: torchrun: rank 7 on host n2 was killed by signal 9 (SIGKILL)",
            "Process 7 exit with status code 1.":  # an error, not a kill: the records speak
                "cause: lost ranks 1,2,3,4,5,6,7,8 on host n1"}.items():
        errors = tmp_path / "errors"
        errors.write_text(f"some output\n{said}\n")
        p = summary(tmp_path / "run", "--rc", "1", "--since", t0 - 1, "--errors", errors)
        last = p.stdout.rstrip().splitlines()
        assert last[-1].startswith(cause), (said, last)
        assert "lost" in cause or last[-1].count("rank") == 1, last[-1]  # that one alone


def test_the_lost_ranks_every_host_found_are_joined_and_no_other(tmp_path):
    """Each host's first rank probes its own host and the next one (hvd_lm.comm.peers): the
    block's cause joins what every prober recorded (rank 5 from n1's probe, rank 9 from n2's),
    the rest of the line from rank 0's record."""
    t0 = time.time()
    rec = {"kind": "failure", "step": 12, "time": t0 + 1, "checkpoint": "c/step_10.pt"}
    write_records(
        tmp_path / "run", {"kind": "start", "step": 0, "time": t0},
        {**rec, "rank": 0, "host": "n1", "lost": [{"rank": 5, "host": "n2", "why": "gone"}],
         "error": "lost rank 5 on host n2 (gone): a collective failed at step 12 after 0.1 s"},
        {**rec, "rank": 4, "host": "n2", "lost": [{"rank": 9, "host": "n3", "why": "gone"}],
         "error": "lost rank 9 on host n3 (gone): a collective failed at step 12 after 0.1 s"},
        {**rec, "rank": 8, "host": "n3", "lost": [], "error": "every probed rank answers"})
    p = summary(tmp_path / "run", "--rc", "1", "--since", t0 - 1)
    assert p.stdout.rstrip().splitlines()[-1] == (
        "cause: lost rank 5 on host n2 (gone); rank 9 on host n3 (gone): a collective failed "
        "at step 12 after 0.1 s")
    # a host cut off (its link down) that still reached the shared disk records the mirror
    # image: rank 0 lost; rank 0 recorded too, so rank 0's view stands
    write_records(
        tmp_path / "cut", {"kind": "start", "step": 0, "time": t0},
        {**rec, "rank": 0, "host": "n1", "lost": [{"rank": 1, "host": "n2", "why": "gone"}],
         "error": "lost rank 1 on host n2 (gone): a collective failed at step 12 after 0.1 s"},
        {**rec, "rank": 1, "host": "n2", "lost": [{"rank": 0, "host": "n1", "why": "gone"}],
         "error": "lost rank 0 on host n1 (gone): a collective failed at step 12 after 0.1 s"})
    p = summary(tmp_path / "cut", "--rc", "1", "--since", t0 - 1)
    assert p.stdout.rstrip().splitlines()[-1] == (
        "cause: lost rank 1 on host n2 (gone): a collective failed at step 12 after 0.1 s")
