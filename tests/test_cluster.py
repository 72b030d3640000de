"""The cluster in a box (tests/cluster.py) and the preflight that runs on it (`hvd-lm doctor`).

The hosts are real to every program that runs on them: their own hostname, address, sshd,
routing and link; ssh between them is key-based, both ways; each has a decoy ``docker0``
(``172.17.0.1`` everywhere) that the others cannot reach. The doctor must pick ``eth0`` there,
refuse ``docker0`` with one line naming it, and stop with one line, within its bound, when ssh,
the code's version, the shards or the GPUs do not match, or a host lacks a path (the working
folder, the shards) the others have."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._mp import REPO, launch_env
from tests.cluster import Cluster
from tests.cluster_host import DECOY_ADDR, DECOY_IF, our_namespaces, rate_bits
from tests.shardutil import default_shards

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
PY = sys.executable


def on(cluster: Cluster, node: str, *argv, timeout: float = 60, check: bool = True, **kw):
    """Run on a node with the launch environment (venv first on PATH, the checkout importable)."""
    return cluster.run(node, list(argv), timeout=timeout, check=check,
                       env=kw.pop("env", None) or launch_env(), **kw)


def doctor(cluster: Cluster, *args: str, node: str = "n1", cwd=None, timeout: float = 60):
    t0 = time.monotonic()
    proc = on(cluster, node, PY, "-m", "hvd_lm", "doctor", *args, timeout=timeout, check=False,
              cwd=cwd)
    return proc, time.monotonic() - t0


def one_error_line(proc) -> str:
    lines = [x for x in proc.stderr.splitlines() if "ERROR" in x]
    assert len(lines) == 1 and proc.stderr.strip() == lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


# ---- the box ------------------------------------------------------------------------------------
def test_down_leaves_nothing_and_up_takes_seconds(cluster):
    holders = {n.name: n.holder for n in cluster.nodes.values()}
    assert Cluster.up(3, root=cluster.root).nodes["n1"].holder == holders["n1"]  # reused
    t0 = time.monotonic()
    cluster.down()
    assert our_namespaces() == [] and not cluster.root.exists()
    for pid in (p for n in cluster.nodes.values() for p in (n.holder, n.sshd)):
        assert not Path(f"/proc/{pid}").exists()
    cluster.down()  # idempotent
    fresh = Cluster.up(3, root=cluster.root)
    cluster.nodes, cluster.rate = fresh.nodes, fresh.rate  # the session's object, rebound
    assert time.monotonic() - t0 < 20
    assert sorted(our_namespaces()) == ["hvdlm-n1", "hvdlm-n2", "hvdlm-n3", "hvdlm-sw"]


def test_nodes_are_separate_hosts_with_ssh_both_ways(cluster):
    for i, (src, dst) in enumerate([("n1", "n2"), ("n2", "n3"), ("n3", "n1"), ("n2", "n1")]):
        out = on(cluster, src, "ssh", dst, "hostname; ip -4 -o addr show eth0").stdout
        assert out.splitlines()[0] == dst and f"10.77.0.{dst[1]}/24" in out
    for n in cluster.names:
        addrs = on(cluster, n, "ip", "-4", "-o", "addr").stdout
        assert re.search(rf"\b{DECOY_IF}\s+inet {re.escape(DECOY_ADDR)}", addrs), addrs
        assert on(cluster, n, "hostname").stdout.strip() == n
    # the decoy: the same address on every node, so from n1 it is n1 itself: n2 listens on all
    # its addresses, n1 reaches it by name but not through 172.17.0.1
    srv = cluster.popen("n2", [PY, "-c", "import socket; s=socket.create_server(('0.0.0.0', "
                               "5602)); print('up', flush=True); s.accept()[0].sendall(b'n2')"])
    try:
        assert srv.stdout.readline().strip() == "up"
        probe = ("import socket,sys\ntry: print(socket.create_connection((sys.argv[1], 5602), "
                 "3).recv(2).decode())\nexcept OSError as e: print(type(e).__name__)")
        decoy = DECOY_ADDR.split("/")[0]
        assert on(cluster, "n1", PY, "-c", probe, decoy).stdout.strip() == \
            "ConnectionRefusedError"
        assert on(cluster, "n1", PY, "-c", probe, "n2").stdout.strip() == "n2"
    finally:
        srv.kill()
        srv.wait()
    # nothing of the cluster in this machine's own namespace
    assert "10.77.0." not in subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True,
                                            text=True).stdout


def test_links_are_shaped_with_tbf(cluster):
    code = ("import socket,sys,time\n"
            "if sys.argv[1]=='srv':\n"
            " s=socket.create_server(('0.0.0.0',5601));c,_=s.accept();n=0\n"
            " while (b:=c.recv(1<<16)): n+=len(b)\n"
            " print(n)\n"
            "else:\n"
            " c=socket.create_connection(('n2',5601));t=time.time()\n"
            " c.sendall(b'x'*(2<<20));c.shutdown(1);c.recv(1);print(time.time()-t)\n")
    try:
        cluster.shape("50mbit")
        qd = on(cluster, "n1", "tc", "qdisc", "show", "dev", "eth0").stdout
        assert "tbf" in qd and "50Mbit" in qd, qd
        srv = cluster.popen("n2", [PY, "-c", code, "srv"])
        time.sleep(0.5)
        took = float(on(cluster, "n1", PY, "-c", code, "cli").stdout)
        assert srv.communicate(timeout=30)[0].strip() == str(2 << 20)
        # 16.8 Mbit at 50 Mbit/s: at least 0.3 s less the 32 KiB burst (unshaped: ~0.01 s)
        assert took >= 0.8 * (2 << 20) * 8 / rate_bits("50mbit"), took
    finally:
        cluster.shape(None)
    assert "tbf" not in on(cluster, "n1", "tc", "qdisc", "show", "dev", "eth0").stdout


def test_an_unplugged_node_is_unreachable_until_plugged_back(cluster):
    sleeper = cluster.popen("n3", ["sleep", "60"])
    try:
        cluster.link("n3", up=False)
        t0 = time.monotonic()
        proc = on(cluster, "n1", "ssh", "n3", "true", check=False, timeout=30)
        assert proc.returncode == 255 and time.monotonic() - t0 < 15, proc.stderr
        assert sleeper.poll() is None  # its processes keep running
        cluster.link("n3", up=True)
        assert on(cluster, "n1", "ssh", "n3", "hostname").stdout.strip() == "n3"
    finally:
        cluster.link("n3", up=True)
        sleeper.kill()
        sleeper.wait()


# ---- hvd-lm doctor -------------------------------------------------------------------------------
def test_doctor_picks_the_shared_interface_not_the_decoy(cluster, tmp_path):
    shards = default_shards(tmp_path / "shards")
    proc, took = doctor(cluster, "--hosts", "n1:1,n2:1,n3:1", "--shards", str(shards),
                        "--format", "shell")
    assert proc.returncode == 0, proc.stderr
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", proc.stdout, re.M))
    assert exports == {"NETWORK_INTERFACE": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                       "GLOO_SOCKET_IFNAME": "eth0", "OMPI_MCA_btl_tcp_if_include": "eth0",
                       "OMPI_MCA_oob_tcp_if_include": "eth0"}, proc.stdout
    report = proc.stderr
    assert "6 of 6 host pairs ok" in report and "shared       eth0 " in report
    assert re.search(r"not shared   docker0: n\d -> 172\.17\.0\.1 \(docker0 of n\d\): Connection "
                     r"refused \(172\.17\.0\.1 is also n\d's own address\)", report), report
    assert "4 shards" in report  # 3 train + 1 val, readable on every host
    assert "  use          eth0:\n    horovodrun --network-interface eth0\n    mpirun -mca " \
           "btl_tcp_if_include eth0 -mca oob_tcp_if_include eth0\n    NCCL_SOCKET_IFNAME=eth0 " \
           "GLOO_SOCKET_IFNAME=eth0" in report
    assert took < 30


def test_doctor_refuses_the_decoy_with_one_line(cluster):
    proc, took = doctor(cluster, "--hosts", "n1:1,n2:1", "--network-interface", "docker0",
                        "--format", "shell")
    line = one_error_line(proc)
    assert proc.returncode == 1 and proc.stdout == ""
    assert line.startswith("hvd-lm doctor: ERROR: --network-interface: interface docker0 does "
                           "not connect the hosts: n") and "shared by all hosts: eth0" in line
    # a variable already set is checked too, and one that is right is kept
    env = launch_env(NCCL_SOCKET_IFNAME="docker0")
    proc = on(cluster, "n1", PY, "-m", "hvd_lm", "doctor", "--hosts", "n1,n2", "--format",
              "shell", env=env, check=False)
    assert "NCCL_SOCKET_IFNAME=docker0 (from the environment): interface docker0 does not " \
           "connect" in one_error_line(proc)
    proc = on(cluster, "n1", PY, "-m", "hvd_lm", "doctor", "--hosts", "n1,n2", "--format",
              "shell", env=launch_env(NCCL_SOCKET_IFNAME="eth0"))
    assert "NCCL_SOCKET_IFNAME" not in proc.stdout and "export NETWORK_INTERFACE=eth0" in \
        proc.stdout


def test_doctor_names_a_host_without_ssh_or_link(cluster):
    cluster.sshd("n3", running=False)
    try:
        proc, took = doctor(cluster, "--hosts", "n1:1,n2:1,n3:1")
        line = one_error_line(proc)
        assert proc.returncode == 1 and line == (
            "hvd-lm doctor: ERROR: ssh n3: the doctor's agent on n3 exited 255: ssh: connect to "
            "host n3 port 22: Connection refused"), line
        assert took < 20
    finally:
        cluster.sshd("n3", running=True)
    cluster.link("n2", up=False)
    try:
        proc, took = doctor(cluster, "--hosts", "n1,n2", "--format", "shell", timeout=90)
        line = one_error_line(proc)
        assert "ssh n2:" in line and "Connection timed out" in line, line
        assert took < 30  # ssh's ConnectTimeout (5 s) bounds it
    finally:
        cluster.link("n2", up=True)
    deadline = time.monotonic() + 20
    while not cluster.healthy():
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_doctor_names_a_host_with_other_code_shards_or_too_few_gpus(cluster, tmp_path):
    # another checkout of hvd_lm on n2 (one source file differs): same version string, other code
    stale = tmp_path / "stale"
    shutil.copytree(REPO / "hvd_lm", stale / "hvd_lm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(stale / "hvd_lm" / "util" / "units.py", "a") as f:
        f.write("\n# an older edit\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\n[ "$(hostname)" = n2 ] && export PYTHONPATH={stale}\n'
                       f'exec {PY} "$@"\n')
    wrapper.chmod(0o755)
    # (from another folder: `python -m` puts the working directory, here the checkout, first)
    proc, _ = doctor(cluster, "--hosts", "n1,n2", "--python", str(wrapper), "--format", "shell",
                     cwd=tmp_path)
    line = one_error_line(proc)
    assert "hosts differ: hvd_lm_digest " in line and " on n2 vs " in line and " on n1" in line
    # shards only n1 can read (in its own /tmp, as on a node's local disk)
    on(cluster, "n1", PY, "-c", "from tests.shardutil import default_shards; from pathlib import "
       "Path; default_shards(Path('/tmp/local-shards'))", cwd=REPO)
    proc, _ = doctor(cluster, "--hosts", "n1,n2", "--shards", "/tmp/local-shards", "--format",
                     "shell")
    assert "ERROR: n2 lacks --shards /tmp/local-shards, which n1 has: every rank starts in the " \
        "working folder and reads the data, config and run folder at the same path, so they " \
        "must be on a filesystem every host shares (or copied to the same path on n2)" \
        in one_error_line(proc)
    proc, _ = doctor(cluster, "--hosts", "n1:2,n2:2", "--device", "cuda", "--format", "shell")
    assert "n1: 2 slots but 0 GPU(s): one rank per GPU" in one_error_line(proc)


def test_template_stops_with_one_line_when_no_interface_is_shared(cluster, tmp_path):
    """The decoy named as the interface: the preflight stops the launch before any rank
    starts, with the doctor's one line and exit 2 (without the preflight, OpenMPI over docker0
    hangs)."""
    shards = default_shards(tmp_path / "shards")
    env = launch_env(NP="2", HOSTS="n1:1,n2:1", NETWORK_INTERFACE="docker0", PYTHON=PY,
                     OUT_DIR=str(tmp_path / "run"), TRAIN_ARGS=f"--shards {shards} --device cpu")
    for template in ("horovodrun_multinode.sh", "mpirun.sh"):
        t0 = time.monotonic()
        proc = on(cluster, "n1", "bash", REPO / "launch" / template, env=env, check=False,
                  cwd=tmp_path, timeout=90)
        line = one_error_line(proc)
        assert proc.returncode == 2 and "interface docker0 does not connect the hosts" in line
        assert "command:" not in proc.stdout and time.monotonic() - t0 < 30
        assert not (tmp_path / "run").exists()
