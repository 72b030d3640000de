"""SLURM's compressed node lists (``n[001-004,7]:8``, what ``$SLURM_JOB_NODELIST`` holds) read
wherever a host list is (issue 63, item 4): ``hvd-lm doctor --hosts``/``--hostfile``, ``hvd-lm
launch --hosts`` and the launch templates' ``HOSTS`` and ``HOSTFILE``, all through one parser
(:func:`hvd_lm.comm.hosts.parse_hosts`); each expansion is checked against python-hostlist's
own and a hand-written list. A list that is not one stops with one line naming the flag or
variable and the syntax. The templates run with stand-ins for mpirun, ssh and torchrun."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hostlist
import pytest

from hvd_lm.cli import main
from hvd_lm.jobs.job_scripts import knob_defaults
from tests._mp import REPO, one_error_line, run
from tests.test_doctor import doctor, fake_ssh, ssh_calls

NODES = "far[01-02,7].invalid"  # never resolves (RFC 6761): the doctor reaches them over ssh
EXPANDED = ["far01.invalid", "far02.invalid", "far7.invalid"]
SYNTAX = "is not SLURM's host list syntax, e.g. n[001-004,7]:8 (unbalanced brackets)"


def test_expected_lists_are_python_hostlists_own():
    assert hostlist.expand_hostlist(NODES) == EXPANDED
    assert hostlist.expand_hostlist("n[001-002,7]") == ["n001", "n002", "n7"]


def test_the_doctor_reads_a_slurm_node_list_with_slots(tmp_path):
    """Each name of the item gets its slots; ssh reaches each expanded name (before the
    comma inside the brackets split the list: ``ssh far[01-02: Could not resolve``)."""
    env = fake_ssh(tmp_path, 'for a; do last=$a; done; exec bash -c "$last"')  # runs it here
    proc = doctor(env, "--hosts", f"{NODES}:2,localhost", "--format", "json", "--timeout", "40")
    assert json.loads(proc.stdout)["hosts"] == [[h, 2] for h in EXPANDED] + [["localhost", 1]]
    agents = {c[c.index("--") + 1] for c in ssh_calls(tmp_path) if c[-1] != "true"}
    assert agents == set(EXPANDED), agents


def test_the_doctor_reads_compressed_names_in_a_hostfile(tmp_path):
    env = fake_ssh(tmp_path, 'echo "ssh: connect to host $6 port 22: Connection refused" >&2\n'
                   "exit 255")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{NODES} slots=2\n")
    proc = doctor(env, "--hostfile", str(hostfile), "--timeout", "20")
    assert proc.returncode == 1 and "3 of 3 hosts did not answer" in proc.stderr, proc.stderr
    assert sorted(c[c.index("--") + 1] for c in ssh_calls(tmp_path)) == EXPANDED


@pytest.mark.parametrize("flag,value,line", [
    ("--hosts", "n[001-004", f"--hosts 'n[001-004' {SYNTAX}"),
    ("--hosts", "n1,n[001-004,7:8", f"--hosts 'n[001-004,7:8' {SYNTAX}"),
    ("--hostfile", "far[1-2.invalid slots=2", f"'far[1-2.invalid:2' {SYNTAX}"),
])
def test_the_doctor_refuses_a_malformed_list_in_one_line(flag, value, line, tmp_path):
    env = fake_ssh(tmp_path, "exit 255")
    if flag == "--hostfile":
        (tmp_path / "hosts.txt").write_text(f"# nodes\n{value}\n")
        value = str(tmp_path / "hosts.txt")
        line = f"--hostfile {value}:2: {line}"
    proc = doctor(env, flag, value)
    assert proc.returncode == 2 and proc.stderr.strip() == f"hvd-lm doctor: ERROR: {line}", (
        proc.stderr)
    assert not ssh_calls(tmp_path)


# ---- hvd-lm launch ---------------------------------------------------------------------------
def _render(tmp: Path, scheduler: str, hosts: str, gpus: int = 24) -> str:
    out = tmp / "job"
    assert main(["launch", "--scheduler", scheduler, "--gpus", str(gpus), "--gpus-per-node", "8",
                 "--hosts", hosts, "--out", str(out), "--", "--shards", "data/s"]) == 0
    return out.read_text()


@pytest.mark.parametrize("scheduler", ["mpirun", "horovodrun-multinode", "torchrun"])
@pytest.mark.parametrize("hosts", ["n[001-002,7]", "n[001-002,7]:8", "n001,n[002],n7"])
def test_launch_renders_a_slurm_node_list_as_host_slots(scheduler, hosts, tmp_path):
    want = ",".join(f"{h}:8" for h in hostlist.expand_hostlist("n[001-002,7]"))
    assert knob_defaults(_render(tmp_path, scheduler, hosts))["HOSTS"] == want
    assert want == "n001:8,n002:8,n7:8"


@pytest.mark.parametrize("hosts,line", [
    ("n[001-002,7", f"--hosts 'n[001-002,7' {SYNTAX}"),
    ("n[001-002,7]:4", "--hosts 'n[001-002,7]:4': the job runs 8 ranks on each node; give the "
                       "node names alone (n[001-004,7]) or with :8"),
    ("n[1-2]", "--hosts lists 2 hosts but the job needs 3 node(s) (24 GPUs at 8 per node)"),
])
def test_launch_refuses_a_host_list_it_cannot_render_in_one_line(hosts, line, tmp_path, capsys):
    capsys.readouterr()
    assert main(["launch", "--scheduler", "mpirun", "--gpus", "24", "--gpus-per-node", "8",
                 "--hosts", hosts, "--out", str(tmp_path / "job")]) == 2
    assert capsys.readouterr().err.strip() == f"hvd-lm launch: ERROR: {line}"
    assert not (tmp_path / "job").exists()


# ---- the templates -----------------------------------------------------------------------------
def _template(tmp: Path, script: Path | str, **knobs: str):
    """``script`` (a template or a rendered job) with a launcher stand-in that prints its
    command (``LAUNCHED ...``) and an ``ssh`` that fails; the process."""
    (tmp / "data" / "s").mkdir(parents=True, exist_ok=True)
    (tmp / "data" / "s" / "manifest.json").write_text("{}")
    stub = tmp / "launcher"  # mpirun, and PYTHON for torchrun: -c runs, the rest is printed
    stub.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                    'echo "LAUNCHED $*"\n')
    stub.chmod(0o755)
    env = fake_ssh(tmp, 'echo "ssh: connect to host $6 port 22: Connection refused" >&2\n'
                   "exit 255")
    for var in ("SLURM_JOB_ID", "PBS_JOBID", "NETWORK_INTERFACE", "MASTER_PORT", "HOSTS",
                "HOSTFILE"):
        env.pop(var, None)
    env.update(MPIRUN=str(stub), HOROVODRUN=str(stub), PYTHON=sys.executable, SHARDS="data/s",
               OUT_DIR=str(tmp / "run"))
    env.update(knobs)
    return run(["bash", script], env=env, cwd=tmp, timeout=120, check=False)


def _launched(proc) -> list[str]:
    return next(x for x in proc.stdout.splitlines() if x.startswith("LAUNCHED")).split()


def test_mpirun_template_expands_hosts_and_a_hostfile(tmp_path):
    want = ",".join(f"{h}:2" for h in hostlist.expand_hostlist(NODES))
    proc = _template(tmp_path, REPO / "launch" / "mpirun.sh", NP="6", PREFLIGHT="0",
                     HOSTS=f"{NODES}:2")
    words = _launched(proc)
    assert words[words.index("-H") + 1] == want == "far01.invalid:2,far02.invalid:2,far7.invalid:2"
    (tmp_path / "hosts.txt").write_text(f"{NODES} slots=2\n")
    proc = _template(tmp_path, REPO / "launch" / "mpirun.sh", NP="6", PREFLIGHT="0",
                     HOSTFILE="hosts.txt")
    words = _launched(proc)
    assert words[words.index("-H") + 1] == want and "-hostfile" not in words
    (tmp_path / "plain.txt").write_text("localhost slots=2\n")  # no brackets: as it was
    for script in ("mpirun.sh", "horovodrun_multinode.sh"):  # (this one ignored a HOSTFILE)
        words = _launched(_template(tmp_path, REPO / "launch" / script, PREFLIGHT="0",
                                    HOSTFILE="plain.txt"))
        assert words[words.index("-hostfile") + 1] == "plain.txt" and "-H" not in words, script
    words = _launched(_template(tmp_path, REPO / "launch" / "horovodrun_multinode.sh",
                                PREFLIGHT="0"))  # neither: this machine, as documented
    assert words[words.index("-H") + 1] == "localhost:2" and "-hostfile" not in words


def test_the_templates_preflight_reads_the_expanded_list(tmp_path):
    """PREFLIGHT=1: the doctor gets every name (its ssh fails here: it names them all)."""
    proc = _template(tmp_path, REPO / "launch" / "mpirun.sh", NP="6", HOSTS=f"{NODES}:2",
                     PREFLIGHT_TIMEOUT="20")
    assert proc.returncode == 2 and "LAUNCHED" not in proc.stdout
    one_error_line(proc, "3 of 3 hosts did not answer", *(f"ssh {h}:" for h in EXPANDED))
    assert sorted(c[c.index("--") + 1] for c in ssh_calls(tmp_path)) == EXPANDED


def test_torchrun_meets_at_the_first_expanded_host(tmp_path):
    proc = _template(tmp_path, REPO / "launch" / "torchrun.sh", PYTHON=str(tmp_path / "launcher"),
                     NNODES="3", NPROC_PER_NODE="2", HOSTS=f"{NODES}:2")
    words = _launched(proc)
    assert words[words.index("--rdzv-endpoint") + 1] == f"{EXPANDED[0]}:29500", proc.stderr


def test_a_rendered_script_expands_hosts_given_at_run_time(tmp_path):
    _render(tmp_path, "mpirun", "n[001-002,7]")
    words = _launched(_template(tmp_path, tmp_path / "job", PREFLIGHT="0"))
    assert words[words.index("-H") + 1] == "n001:8,n002:8,n7:8"
    words = _launched(_template(tmp_path, tmp_path / "job", PREFLIGHT="0", HOSTS="m[1-2]:4"))
    assert words[words.index("-H") + 1] == "m1:4,m2:4"


@pytest.mark.parametrize("knob,value,line", [
    ("HOSTS", "n[001-004", f"launch: ERROR: HOSTS 'n[001-004' {SYNTAX}"),
    ("HOSTFILE", "hosts.txt", f"launch: ERROR: HOSTFILE hosts.txt:1: 'n[1-2:8' {SYNTAX}"),
])
def test_a_template_refuses_a_malformed_list_in_one_line(knob, value, line, tmp_path):
    (tmp_path / "hosts.txt").write_text("n[1-2 slots=8\n")
    proc = _template(tmp_path, REPO / "launch" / "mpirun.sh", **{knob: value})
    assert proc.returncode == 2 and proc.stderr.strip() == line, proc.stderr
    assert "LAUNCHED" not in proc.stdout and not ssh_calls(tmp_path)
