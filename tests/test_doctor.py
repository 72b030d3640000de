"""`hvd-lm doctor` on this machine, with a stand-in ``ssh`` first on PATH (the cluster in a box,
tests/test_cluster.py and tests/test_journey.py, runs it against real hosts): how it calls ssh
and how it reports ssh's failure. A host that does not resolve is not local, so the doctor
reaches it through the ``ssh`` it finds on PATH."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests._mp import REPO, launch_env

FAR = "far-host.invalid"  # never resolves (RFC 6761): always reached over ssh


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
