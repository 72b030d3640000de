"""The elastic template's Gloo timeout, as horovodrun gets it: a host returning to an elastic
job must not end it (issue 63). Horovod 0.28.1 starts a returning host's worker only after the
running workers entered the new rendezvous, and they wait for it HOROVOD_GLOO_TIMEOUT_SECONDS
(default 30): a worker slower to start than that ends the whole job (every worker aborts,
"failure count == N -> stop running"; docs/reliability.md "Elastic: a host that comes back").
``launch/horovodrun_elastic.sh`` therefore passes ``--gloo-timeout-seconds GLOO_TIMEOUT``
(default 300 s) to horovodrun, which exports it to every worker, those started later included.
Checked on the template and on what ``hvd-lm launch`` renders from it, run with a stand-in
horovodrun that records its arguments (the cluster test in tests/test_multinode.py runs it for
real)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.comm.engine import HOROVOD_DEFAULT_GLOO_TIMEOUT_S
from hvd_lm.jobs.job_scripts import knob_defaults
from tests._mp import REPO, launch_env, run

TEMPLATE = REPO / "launch" / "horovodrun_elastic.sh"


def horovodrun_argv(tmp: Path, script: Path, **knobs: str) -> list[str]:
    """The arguments ``script`` starts horovodrun with (one host listed: no preflight)."""
    (tmp / "shards").mkdir(exist_ok=True)
    (tmp / "shards" / "manifest.json").write_text("{}")
    (tmp / "hosts.txt").write_text("localhost:2\n")
    stand_in = tmp / "horovodrun"
    stand_in.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp}/argv\n")
    stand_in.chmod(0o755)
    env = launch_env(HOROVODRUN=str(stand_in), PYTHON=sys.executable, HOSTS_FILE=str(
        tmp / "hosts.txt"), OUT_DIR=str(tmp / "run"), SHARDS=str(tmp / "shards"),
        NETWORK_INTERFACE="lo", **knobs)
    for knob in ("GLOO_TIMEOUT", "ELASTIC_TIMEOUT", "TRAIN_ARGS", "DISCOVERY", "CONFIG"):
        if knob not in knobs:
            env.pop(knob, None)
    run(["bash", script], env=env, cwd=tmp, timeout=60)
    return (tmp / "argv").read_text().splitlines()


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_template_gives_every_worker_a_gloo_timeout_above_horovods(tmp_path):
    default = knob_defaults(TEMPLATE.read_text())["GLOO_TIMEOUT"]
    assert int(default) == 300 > HOROVOD_DEFAULT_GLOO_TIMEOUT_S
    argv = horovodrun_argv(tmp_path, TEMPLATE)
    assert flag(argv, "--gloo-timeout-seconds") == "300"
    assert flag(argv, "--elastic-timeout") == "600"
    # the training command follows horovodrun's own flags, and names no timeout of its own
    assert argv.index("--gloo-timeout-seconds") < argv.index("hvd_lm")
    assert "--gloo-timeout-s" not in argv


@pytest.mark.parametrize("knobs,want", [({"GLOO_TIMEOUT": "45"}, "45"), ({}, "300")])
def test_the_rendered_elastic_job_carries_it(tmp_path, capsys, knobs, want):
    script = tmp_path / "job.sh"
    capsys.readouterr()
    assert main(["launch", "--scheduler", "horovodrun-elastic", "--gpus", "2", "--min-np", "1",
                 "--network-interface", "lo", "--out", str(script), "--", "--shards",
                 str(tmp_path / "shards")]) == 0
    assert knob_defaults(script.read_text())["GLOO_TIMEOUT"] == "300"
    assert flag(horovodrun_argv(tmp_path, script, **knobs), "--gloo-timeout-seconds") == want


def test_the_slurm_elastic_launch_carries_it_too(tmp_path, capsys):
    """``--scheduler slurm --elastic`` (LAUNCHER=elastic in launch/slurm.sbatch): the same knob
    and default, on horovodrun's command line."""
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--scheduler", "slurm", "--elastic", "--gpus", "16",
                 "--gpus-per-node", "8", "--out", str(script), "--", "--shards", "d"]) == 0
    text = script.read_text()
    assert knob_defaults(text)["GLOO_TIMEOUT"] == "300"
    launch = text[text.index("  elastic)"):text.index(";;", text.index("  elastic)"))]
    assert '--gloo-timeout-seconds "$GLOO_TIMEOUT"' in launch


def gate(tmp_path: Path, hosts: str, **env) -> list[str]:
    """One call of launch/gate_hosts.sh (what horovodrun runs every second) over a discovery
    that prints ``hosts``, ssh a stand-in that fails for the host named ``bad``."""
    (tmp_path / "hosts").write_text(hosts)
    bin_ = tmp_path / "bin"
    if not bin_.exists():
        bin_.mkdir()
        (bin_ / "ssh").write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/ssh_calls\n"
                                  "for a; do [ \"$a\" = bad ] && exit 1; done\nexit 0\n")
        (bin_ / "ssh").chmod(0o755)
    proc = run(["bash", REPO / "launch" / "gate_hosts.sh", tmp_path / "state", sys.executable,
                "cat", tmp_path / "hosts"], env=launch_env(
                    PATH=f"{bin_}:{os.environ['PATH']}", **env), timeout=60)
    return proc.stdout.split()


def wait_for(path: Path, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)
    assert path.exists(), path


def test_a_returning_host_is_listed_once_a_worker_can_start_there(tmp_path):
    """Horovod starts a returning host's worker only after the running workers entered the new
    rendezvous, and one that fails to start ends the whole job at any Gloo timeout: the gate
    lists the job's first hosts at once, a host that comes back only after a worker could start
    there (``ssh host PYTHON -c 'import horovod.torch, hvd_lm.cli'``, in the background: the
    call returns at once), and never one where it cannot (tried again after GATE_RETRY_S)."""
    state, calls = tmp_path / "state", tmp_path / "ssh_calls"
    assert gate(tmp_path, "a:1\nb:1\n") == ["a:1", "b:1"]  # the start: the preflight's hosts
    assert gate(tmp_path, "a:1\n") == ["a:1"]  # b lost
    assert gate(tmp_path, "a:1\nb:1\n") == ["a:1"]  # b back: checked first
    wait_for(state / "ok.b")
    assert gate(tmp_path, "a:1\nb:1\n") == ["a:1", "b:1"]
    assert gate(tmp_path, "a:1\nb:1\n") == ["a:1", "b:1"]  # listed: not checked again
    assert [c.split()[6] for c in calls.read_text().splitlines()] == ["b"]  # (after 3 -o)
    assert "import horovod.torch, hvd_lm.cli" in calls.read_text()
    assert gate(tmp_path, "a:1\nb:1\nbad:1\n") == ["a:1", "b:1"]
    wait_for(state / "failed.bad")
    assert gate(tmp_path, "a:1\nb:1\nbad:1\n") == ["a:1", "b:1"]  # not again within 30 s
    assert len(calls.read_text().splitlines()) == 2
    log = (state / "gate.log").read_text()
    assert "bad: returned, but a worker cannot start there" in log and "b: a worker can" in log
    assert gate(tmp_path, "a:1\nbad:1\n", GATE_RETRY_S="0") == ["a:1"]  # b gone, bad retried
    end = time.monotonic() + 30
    while len(calls.read_text().splitlines()) < 3 and time.monotonic() < end:
        time.sleep(0.05)
    assert len(calls.read_text().splitlines()) == 3 and not (state / "ok.b").exists()
