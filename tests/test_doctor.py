"""`hvd-lm doctor` on this machine, with a stand-in ``ssh`` first on PATH (the cluster in a box,
tests/test_cluster.py and tests/test_journey.py, runs it against real hosts): how it calls ssh
and how it reports ssh's failure. A host that does not resolve is not local, so the doctor
reaches it through the ``ssh`` it finds on PATH."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._mp import REPO, launch_env

FAR = "far-host.invalid"  # never resolves (RFC 6761): always reached over ssh


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def fake_ssh(tmp: Path, body: str) -> dict[str, str]:
    """An ``ssh`` on PATH that appends its argv (one line, words NUL-separated) to
    ``tmp/ssh.log``, then runs ``body``; the environment to run the doctor with."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    ssh = bindir / "ssh"
    ssh.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" >> {tmp}/ssh.log; echo >> {tmp}/ssh.log\n'
                   f"{body}\n")
    ssh.chmod(0o755)
    return launch_env(PATH=f"{bindir}:{os.environ['PATH']}")


def doctor(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvd_lm", "doctor", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def ssh_calls(tmp: Path) -> list[list[str]]:
    log = tmp / "ssh.log"
    return [line.strip("\0").split("\0") for line in log.read_text().splitlines()
            if line] if log.exists() else []


def test_the_host_goes_after_double_dash_and_a_dash_name_is_refused(tmp_path):
    env = fake_ssh(tmp_path, 'echo "ssh: connect to host $6 port 22: Connection refused" >&2\n'
                   "exit 255")
    proc = doctor(env, "--hosts", f"{FAR}:1,localhost:1", "--timeout", "20")
    calls = ssh_calls(tmp_path)
    assert len(calls) == 1 and calls[0][-3:-1] == ["--", FAR], calls  # then the agent's command
    assert proc.returncode == 1, proc.stderr
    # a name that ssh would read as an option: refused before any ssh runs, in one line
    (tmp_path / "ssh.log").unlink()
    proc = doctor(env, "--hosts", "-oProxyCommand=touch /tmp/pwned:1,localhost:1")
    assert proc.returncode == 2 and not ssh_calls(tmp_path)
    assert proc.stderr.strip() == ("hvd-lm doctor: ERROR: host name '-oProxyCommand=touch "
                                   "/tmp/pwned' is not a host name (it starts with '-' or holds "
                                   "whitespace): refused before any ssh"), proc.stderr


def test_ssh_error_is_read_to_its_end(tmp_path):
    """ssh's reason can reach stderr after stdout closed and ssh exited (here a child of it
    writes it 0.3 s later, as a ControlMaster or ProxyCommand child may): the error names it,
    never "no message"."""
    env = fake_ssh(tmp_path, "exec >&-\n(sleep 0.3; echo 'ssh: connect to host far port 22: "
                   "No route to host' >&2) &\nexit 255")
    proc = doctor(env, "--hosts", f"{FAR}:1,localhost:1", "--timeout", "20")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"hvd-lm doctor: ERROR: ssh {FAR}: the doctor's agent on {FAR} "
                                   "exited 255: ssh: connect to host far port 22: No route to "
                                   "host"), proc.stderr


def test_the_report_says_every_host_reads_the_shards_only_when_every_host_does():
    """The doctor printed "shards ... readable on every host" directly above "ERROR n2 lacks
    --shards": the summary line now counts the hosts whose agent read them."""
    from hvd_lm.jobs.doctor_checks import Report, render

    def facts(shards):
        return {"python": "3.11.7", "executable": "/venv/bin/python", "hvd_lm": "0.1.0",
                "hvd_lm_digest": "abc", "packages": {"torch": "2.13.0"},
                "interfaces": {"eth0": {"addrs": ["10.77.0.1"], "speed_mbit": 0}},
                "gpus": 0, "shards": shards}
    ok = {"manifest_sha256": "f" * 64, "shards": 3, "bytes": 2e6}
    lacking = Report([("n1", 1), ("n2", 1)], facts={"n1": facts(ok), "n2": facts(
        {"error": "no such folder"})}, errors=["n2 lacks --shards /tmp/priv/baby, which n1 has"])
    text = render(lacking)
    assert "readable on every host" not in text
    assert "shards (2.0 MB) readable on n1 only (the ERROR below names the rest)" in text
    both = Report([("n1", 1), ("n2", 1)], facts={"n1": facts(ok), "n2": facts(ok)})
    assert "shards (2.0 MB) readable on every host" in render(both)


def test_every_dead_host_is_named_in_one_run_with_8_ssh_connecting_at_most(tmp_path):
    """12 hosts whose ssh is refused after 0.3 s: one line names all 12 (before, the first
    only: k dead nodes took k runs), and no more than 8 of the doctor's ssh ever connect at
    once (sshd's MaxStartups drops unauthenticated connections beyond 10)."""
    (tmp_path / "inflight").mkdir()
    env = fake_ssh(tmp_path, f"touch {tmp_path}/inflight/$$; ls {tmp_path}/inflight | wc -l >> "
                   f"{tmp_path}/at_once.log; sleep 0.3; rm {tmp_path}/inflight/$$\n"
                   'echo "ssh: connect to host $6 port 22: Connection refused" >&2; exit 255')
    far = [f"far{i}.invalid" for i in range(1, 13)]
    proc = doctor(env, "--hosts", ",".join(["localhost:1", *far]), "--timeout", "30")
    at_once = [int(x) for x in (tmp_path / "at_once.log").read_text().split()]
    assert len(at_once) == 12 and max(at_once) <= 8, at_once
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "hvd-lm doctor: ERROR: 12 of 13 hosts did not answer: far[1-12].invalid;"
        " the first: ssh far1.invalid: the doctor's agent on far1.invalid exited 255: ssh: "
        "connect to host far1.invalid port 22: Connection refused"), proc.stderr
    proc = doctor(env, "--hosts", "localhost,far1.invalid,far2.invalid", "--timeout", "30")
    assert proc.stderr.strip() == "hvd-lm doctor: ERROR: 2 of 3 hosts did not answer: " + "; ".join(
        f"ssh {h}: the doctor's agent on {h} exited 255: ssh: connect to host {h} port 22: "
        "Connection refused" for h in far[:2]), proc.stderr


def test_slurm_node_lists_are_read_with_their_brackets():
    """What ``$SLURM_JOB_NODELIST`` holds, ``n[001-004,7]``, with slots: python-hostlist expands
    it (before, the comma inside the brackets split it: ``ssh n[001-004: Could not resolve
    hostname``); a bracket left open is one line naming it."""
    from hvd_lm.comm.hosts import parse_hosts
    assert parse_hosts("n[001-004,7]:8,login") == [
        ("n001", 8), ("n002", 8), ("n003", 8), ("n004", 8), ("n7", 8), ("login", 1)]
    with pytest.raises(ValueError, match=r"'n\[1-4:8' is not SLURM's host list syntax"):
        parse_hosts("n[1-4:8")


def test_no_host_receives_more_than_8_of_the_agents_ssh_checks(tmp_path):
    """10 hosts (ssh stood in by a script that runs the command here): host 0 reaches every
    host, every other host its 3 ring neighbours each side, so no host receives more than 8
    (every pair would give each host 9)."""
    env = fake_ssh(tmp_path, 'for a; do last=$a; done; exec bash -c "$last"')
    names = [f"far{i}.invalid" for i in range(10)]
    proc = doctor(env, "--hosts", ",".join(names), "--format", "json", "--timeout", "50")
    pairs = set(json.loads(proc.stdout)["ssh"])
    want = {f"{names[0]} -> {b}" for b in names[1:]} | {
        f"{names[i]} -> {names[(i + d) % 10]}" for i in range(1, 10) for d in (1, 2, 3, 7, 8, 9)}
    assert pairs == want, sorted(pairs ^ want)
    assert max(sum(p.endswith(f"> {b}") for p in pairs) for b in names) == 7


def test_a_host_listed_twice_is_refused_and_a_node_list_adds_up(tmp_path):
    env = launch_env()
    proc = doctor(env, "--hosts", ",".join(["localhost:8"] * 64))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "hvd-lm doctor: ERROR: --hosts lists localhost 64 times: give each host once, with all "
        "its ranks as its slots (localhost:N)"), proc.stderr
    nodefile = tmp_path / "nodefile"  # $PBS_NODEFILE: a line per rank
    nodefile.write_text("localhost\n" * 3)
    proc = doctor(env, "--hostfile", str(nodefile), "--format", "json")
    assert json.loads(proc.stdout)["hosts"] == [["localhost", 3]], proc.stderr


def test_srun_starts_one_agent_per_node_and_no_ssh_runs(tmp_path):
    """``--launcher srun`` under a stand-in srun (its tasks run here, each with the
    SLURMD_NODENAME of its node of --nodelist): the agents connect back, the first node alone
    opens the rendezvous port, and no ssh runs."""
    env = fake_ssh(tmp_path, "exit 255")
    (tmp_path / "bin" / "srun").write_text(
        f'#!/bin/bash\nprintf "%s\\n" "$*" > {tmp_path}/srun.log\n'
        'while [[ $1 == --* ]]; do [[ $1 == --nodelist=* ]] && nodes=${1#--nodelist=}; shift; '
        'done\nfor n in ${nodes//,/ }; do SLURMD_NODENAME=$n "$@" & done\nwait\n')
    (tmp_path / "bin" / "srun").chmod(0o755)
    port, here = free_port(), socket.gethostname()
    proc = doctor(env, "--hosts", f"localhost:1,{here}:1", "--launcher", "srun",
                  "--rendezvous-port", str(port), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {h: f["node"] for h, f in report["facts"].items()} == {"localhost": "localhost",
                                                                  here: here}
    assert report["facts"]["localhost"]["rendezvous"] == {"port": port, "error": None}
    assert report["facts"][here]["rendezvous"] is None and report["ssh"] == {}
    assert (tmp_path / "srun.log").read_text().startswith(
        f"--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=localhost,{here} ")
    assert not ssh_calls(tmp_path)


def test_mpirun_starts_the_agents_and_names_the_hosts_it_cannot_reach(tmp_path):
    """``--launcher mpirun`` (OpenMPI, one application context per host): two names of this
    machine answer, each agent under its own name; hosts OpenMPI's own ssh cannot reach are
    named in one line with mpirun's first line."""
    here = socket.gethostname()
    proc = doctor(launch_env(), "--hosts", f"localhost:1,{here}:1", "--launcher", "mpirun",
                  "--format", "json")
    assert {h: f["node"] for h, f in json.loads(proc.stdout)["facts"].items()} == {
        "localhost": "localhost", here: here}, proc.stderr
    env = fake_ssh(tmp_path, 'echo "ssh: connect to host far port 22: Connection refused" >&2\n'
                   "exit 255")
    proc = doctor(env, "--hosts", "far1.invalid:1,far2.invalid:1", "--launcher", "mpirun")
    assert proc.returncode == 1 and re.fullmatch(
        r"hvd-lm doctor: ERROR: no agent reported from far\[1-2\]\.invalid \(2 of 2 hosts; "
        r"mpirun started them and exited \d+; its first line: ssh: connect to host far port 22: "
        r"Connection refused\)", proc.stderr.strip()), proc.stderr


def test_one_listener_and_probe_for_the_ranks_and_the_doctors_agents():
    """One implementation (issue 62): :mod:`hvd_lm.comm.peers`' listener and probe are a rank's
    (PeerWatch, probe: who is lost) and the doctor agent's (who was reached, by its token)."""
    from hvd_lm.comm.peers import PeerWatch, probe, serve
    from hvd_lm.jobs import doctor_agent

    watch = PeerWatch(3)
    agent = serve(socket.create_server(("127.0.0.1", 0)), {"host": "n1", "token": "t0"})
    me, port = {"rank": 3, "host": "localhost", "port": watch.port}, agent.getsockname()[1]
    assert probe(me) is None
    assert probe({**me, "rank": 4}) == f"127.0.0.1:{watch.port} answered as another process"
    assert probe({**me, "port": port}) == f"127.0.0.1:{port} answered as another process"
    assert doctor_agent.probe("127.0.0.1", port) == {"ok": True, "host": "n1", "token": "t0"}
    assert doctor_agent.probe("127.0.0.1", watch.port) == {"ok": True, "rank": 3,
                                                            "host": watch.host}
    with socket.socket() as closed:  # bound, not listening: a host up, its process gone
        closed.bind(("127.0.0.1", 0))
        gone = closed.getsockname()[1]
        assert probe({**me, "port": gone}) == ("127.0.0.1 refuses the connection: the host is "
                                               "up but the rank's process is gone")
        assert doctor_agent.probe("127.0.0.1", gone) == {"ok": False,
                                                         "error": "Connection refused"}
    watch.close()  # its thread, blocked in accept(), is woken: the port answers no more
    assert doctor_agent.probe("127.0.0.1", watch.port)["ok"] is False
    agent.close()
