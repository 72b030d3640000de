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

import sys
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
