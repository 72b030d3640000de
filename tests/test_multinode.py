"""Every launcher across hosts, and the faults only a second host has, on the cluster in a box
(tests/cluster.py: n1-n3, each with its own sshd, address and a decoy docker0).

Each launch trains the same tiny model for 6 steps on 2 ranks x batch 2 on two hosts, and must
equal one process with batch 4 (no gradient compression: float rounding only, 1e-5), the
independent reference: ``horovodrun -H n1:1,n2:1`` with the Gloo and the MPI controller,
``launch/horovodrun_multinode.sh`` and ``launch/mpirun.sh`` as they are (their preflight picks
eth0 over docker0), ``launch/slurm.sbatch -N 2`` rendered by ``hvd-lm launch`` on a SLURM with
one slurmd per node, and a ``hvd-lm launch``-rendered multi-node script. Faults: elastic
training on three hosts loses one host's link and gets the host back through the discovery
script; SIGTERM to the launcher on n1 leaves no process on any node. (data_prep across two hosts
and a non-elastic job losing a peer's link, then resumed, are steps of a user's first job in
tests/test_journey.py.)"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.formats.checkpoint import load, resolve
from tests._mp import REPO, launch_env, run
from tests.cluster import Cluster
from tests.conftest import records

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
PY = sys.executable
BIN = Path(PY).parent
LAUNCH = REPO / "launch"
TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--log-every", "1",
        "--lr", "3e-3", "--threads", "1", "--eval-chars", "2000", "--device", "cpu",
        "--compression", "none"]
STEPS = ["--max-steps", "6"]
#: what `hvd-lm doctor` prints for this cluster (checked in tests/test_cluster.py)
IFACE = {"OMPI_MCA_btl_tcp_if_include": "eth0", "OMPI_MCA_oob_tcp_if_include": "eth0"}


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """One process, batch 4: the independent computation every 2-rank run must equal."""
    out = tmp_path_factory.mktemp("ref") / "one"
    run([PY, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out, *TINY, *STEPS,
         "--batch-size", "4"], timeout=120)
    return out




def assert_equals_reference(run_dir: Path, reference: Path, out: str = "",
                            hosts: tuple = ("n1", "n2")) -> None:
    """2 ranks on two hosts == 1 process with the double batch (1e-5), same global losses."""
    start, = records(run_dir, "start")
    assert start["world_size"] == 2 and start["global_batch"] == 4, out
    assert start["hosts"] == list(hosts), (start, out)
    end, = records(run_dir, "end")
    assert end["stop"] == "done" and end["step"] == 6, out
    two, one = load(resolve(run_dir))["model"], load(resolve(reference))["model"]
    assert max(float((two[k] - one[k]).abs().max()) for k in one) <= 1e-5
    l2 = [r["loss"] for r in records(run_dir, "train")]
    l1 = [r["loss"] for r in records(reference, "train")]
    assert len(l2) == 6 and max(abs(a - b) / b for a, b in zip(l2, l1)) < 1e-4, (l2, l1)


def on(cluster: Cluster, argv: list, tmp: Path, timeout: float = 180, node: str = "n1",
       check: bool = True, **env: str):
    return cluster.run(node, argv, timeout=timeout, cwd=tmp, check=check,
                       env=launch_env(**env))


def template_env(shards: Path, out: Path, extra: list[str] = (), **knobs: str) -> dict:
    return {"NP": "2", "PYTHON": PY, "HOROVODRUN": str(BIN / "horovodrun"), "OUT_DIR": str(out),
            "TRAIN_ARGS": " ".join(["--shards", str(shards), *TINY, *extra]), **knobs}


# ---- launchers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovodrun_across_two_hosts_equals_one_process(cluster, shards, reference, tmp_path,
                                                        controller):
    out = tmp_path / "run"
    proc = on(cluster, [BIN / "horovodrun", "-np", "2", "-H", "n1:1,n2:1", f"--{controller}",
                        "--network-interface", "eth0", PY, "-m", "hvd_lm", "train", "--shards",
                        shards, "--out-dir", out, *TINY, *STEPS, "--batch-size", "2"], tmp_path)
    assert_equals_reference(out, reference, proc.stdout + proc.stderr)


@pytest.mark.parametrize("template", ["horovodrun_multinode.sh", "mpirun.sh"])
def test_template_across_two_hosts_equals_one_process(cluster, shards, reference, tmp_path,
                                                      template):
    """As they are, with HOSTS only: the preflight picks eth0 over docker0 (OpenMPI, left to
    itself, tries docker0 and hangs)."""
    out = tmp_path / "run"
    env = template_env(shards, out, [*STEPS, "--batch-size", "2"], HOSTS="n1:1,n2:1")
    proc = on(cluster, ["bash", LAUNCH / template], tmp_path, **env)
    text = proc.stdout + proc.stderr
    assert "use          eth0:" in text and "n1 -> n2" not in text, text
    assert_equals_reference(out, reference, text)


def test_slurm_sbatch_on_two_nodes_equals_one_process(cluster, shards, reference, tmp_path):
    """`hvd-lm launch --scheduler slurm` for 2 nodes x 1 rank, submitted to a SLURM with one
    slurmd per node: srun (PMIx) starts one rank on each of two nodes, after the preflight."""
    slurm = cluster.slurm()
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--scheduler", "slurm", "--gpus", "2", "--gpus-per-node", "1",
                 "--device", "cpu", "--walltime", "10", "--job-name", "hvdlm-2n", "--run-dir",
                 str(tmp_path / "run"), "--out", str(script), "--", "--shards", str(shards),
                 *TINY, *STEPS, "--batch-size", "2"]) == 0
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text
    job = slurm.sbatch(script, tmp_path, launch_env())
    info = slurm.wait_job(job, timeout=180)
    log = (tmp_path / f"hvdlm-2n-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "2 nodes (n[1-2]), 2 ranks via srun" in log and "use          eth0:" in log, log
    assert_equals_reference(tmp_path / "run", reference, log)


def test_hvd_lm_launch_renders_a_two_node_job_that_runs(cluster, shards, reference, tmp_path):
    script = tmp_path / "job.sh"
    assert main(["launch", "--scheduler", "horovodrun-multinode", "--gpus", "2",
                 "--gpus-per-node", "1", "--hosts", "n1,n2", "--device", "cpu", "--run-dir",
                 str(tmp_path / "run"), "--out", str(script), "--", "--shards", str(shards),
                 *TINY, *STEPS, "--batch-size", "2"]) == 0
    text = script.read_text()
    assert 'HOSTS="${HOSTS:-n1:1,n2:1}"' in text and 'NP="${NP:-2}"' in text
    proc = cluster.run("n1", ["bash", script], cwd=tmp_path, timeout=180,
                       env={k: v for k, v in launch_env().items() if k not in ("NP", "HOSTS")})
    assert_equals_reference(tmp_path / "run", reference, proc.stdout + proc.stderr)


# ---- faults --------------------------------------------------------------------------------------
def wait_for(pred, what: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended ({proc.returncode}) while waiting for {what}:\n"
                                 f"{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def trained(run_dir: Path, step: int = 1) -> bool:
    return (run_dir / "metrics.jsonl").is_file() and any(
        r["step"] >= step for r in records(run_dir, "train"))


def start_seconds(cluster: Cluster, node: str, tmp: Path) -> float:
    """Seconds a worker of the job takes now to reach Horovod's rendezvous on ``node`` when n1
    starts it the way horovodrun does: ssh, Python, the imports a rank makes before hvd.init."""
    t0 = time.monotonic()
    on(cluster, ["ssh", node, f"cd {REPO} && {PY} -c 'import hvd_lm.cli, hvd_lm.train.loop, "
                 "horovod.torch'"], tmp, timeout=600)
    return time.monotonic() - t0


def step_seconds(run_dir: Path) -> float:
    """The job's median step so far: seconds between consecutive train records."""
    t = [r["time"] for r in records(run_dir, "train")]
    gaps = sorted(b - a for a, b in zip(t, t[1:]))
    return gaps[len(gaps) // 2]


def test_elastic_three_hosts_lose_a_link_and_get_the_host_back(cluster, shards, tmp_path):
    """launch/horovodrun_elastic.sh on n1-n3 (1 slot each), hosts from a file the test edits as a
    scheduler would: n3's cable is pulled and n3 dropped from the list; training goes on on two
    hosts from the last commit; the cable is back and n3 listed again: three hosts again.

    Every wait and the run's length are sized from what the test measures, not fixed seconds, so
    that the verdict does not depend on the machine's load: ``start``, a worker's start on n3 taken
    before the launch (:func:`start_seconds`), and ``step``, the job's median step. The job's Gloo
    timeout (the template's GLOO_TIMEOUT) is 8 x start: the running workers wait that long for
    n3's new worker at the rendezvous that takes n3 back (a worker later than that ends the whole
    job: docs/reliability.md), and the cut link is noticed after it. Each step sleeps start / 10
    and the run is long enough that n3 is back before its last step even if its worker takes the
    whole Gloo timeout to start (steps at full speed had let a run end first under load)."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("n1:1\nn2:1\nn3:1\n")
    start = start_seconds(cluster, "n3", tmp_path)
    gloo, elastic = max(10, math.ceil(8 * start)), 120
    # 30 steps on three hosts, at most 5 rolled back, 10 on two, then at least the Gloo timeout
    # and 4 starts more (n3's worker, the commit that lets it in, the state's sync) and 20 to spare
    sleep = max(0.05, start / 10)
    run_dir, steps = tmp_path / "run", 45 + math.ceil((gloo + 4 * start) / sleep) + 20
    env = template_env(shards, run_dir, ["--batch-size", "2", "--max-steps", str(steps),
                                         "--commit-every", "5"],
                       NP="3", MIN_NP="2", MAX_NP="3", HOSTS_FILE=str(hosts),
                       BLACKLIST_COOLDOWN="1 2", ELASTIC_TIMEOUT=str(elastic),
                       GLOO_TIMEOUT=str(gloo))
    proc = cluster.popen("n1", ["bash", LAUNCH / "horovodrun_elastic.sh"], cwd=tmp_path,
                         env=launch_env(HVD_LM_STEP_SLEEP=f"{sleep:.3f}", **env),
                         stderr=subprocess.STDOUT)
    # the world re-forms within Gloo's timeout (the cut noticed), ELASTIC_TIMEOUT (the longest
    # Horovod's driver waits for the rendezvous) and the state's sync and a step: usually the
    # timeout and a few seconds; 79 s once at a 10 s timeout, and 78.8 s at 24 s under four busy
    # loops (unexplained; Horovod's BasicClient probes from the cut-off host, 3 x 20 s, would fit)
    reform = gloo + elastic + 10 * start
    print(f"a worker's start on n3: {start:.1f} s; GLOO_TIMEOUT {gloo} s; {steps} steps of "
          f"{sleep:.2f} s sleep or more")  # shown on a failure
    try:
        # preflight over ssh, horovodrun's and three workers' starts on two shared cores: about
        # ten starts in a row, the first rendezvous, and 30 steps (3 starts of sleep, and compute)
        wait_for(lambda: trained(run_dir, 30), "30 steps on 3 hosts", proc, gloo + 50 * start)
        step = step_seconds(run_dir)
        t_cut = time.time()
        cluster.link("n3", up=False)
        hosts.write_text("n1:1\nn2:1\n")
        wait_for(lambda: any(r["world_size"] == 2 for r in records(run_dir, "resize")),
                 "the resize to 2 hosts", proc, reform)
        lost_after = next(r for r in records(run_dir, "resize") if r["world_size"] == 2)
        cluster.link("n3", up=True)
        wait_for(lambda: trained(run_dir, lost_after["step"] + 10), "10 steps on 2 hosts", proc,
                 10 * start + 10 * 30 * step)
        print(f"step {step:.3f} s; the cut noticed and the world re-formed in "
              f"{lost_after['time'] - t_cut:.1f} s")
        t_back = time.time()
        hosts.write_text("n1:1\nn2:1\nn3:1\n")
        # Horovod's discovery (every second), the workers' next commit (5 steps), n3's worker
        # (under the Gloo timeout, or the job ends), the state's sync
        wait_for(lambda: any(r["world_size"] == 3 and r["previous_world_size"] == 2
                             for r in records(run_dir, "resize")),
                 f"n3 back (Gloo timeout {gloo} s; a worker's start on n3 before the launch: "
                 f"{start:.1f} s)", proc, reform + 5 * 30 * step)
        back = next(r for r in records(run_dir, "resize") if r["previous_world_size"] == 2)
        print(f"n3 back at step {back['step']}, {back['time'] - t_back:.1f} s after it was "
              "listed again")
        left = steps - max(r["step"] for r in records(run_dir, "train"))
        try:
            out, _ = proc.communicate(timeout=left * 30 * step + 10 * start)
        except subprocess.TimeoutExpired as e:  # say where it stood: the job's last lines
            tail = (e.output or b"")[-6000:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            pytest.fail(f"the job did not end within {left} x 30 steps of {step:.2f} s after n3 "
                        f"came back; its last lines:\n{tail}\nmetrics: "
                        f"{records(run_dir, 'resize')} last train step "
                        f"{max((r['step'] for r in records(run_dir, 'train')), default=None)}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        cluster.link("n3", up=True)
    assert proc.returncode == 0, out[-5000:]
    end, = records(run_dir, "end")
    assert end["stop"] == "done" and end["step"] == steps
    train = records(run_dir, "train")
    sizes = [r["world_size"] for r in train]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    down = lost_after
    took = down["time"] - t_cut
    assert took < reform, (took, gloo, start)
    # rolled back to the last commit (every 5 steps), not to zero; the loss went on from there
    before = [r for r in train if r["time"] < t_cut][-1]
    assert before["step"] - 5 <= down["step"] <= before["step"] + 1
    after = [r for r in train if r["time"] > down["time"]][:3]
    last = [r for r in train if r["step"] <= down["step"]][-3:]
    mean = lambda rs: sum(r["loss"] for r in rs) / len(rs)  # noqa: E731
    assert after[0]["step"] == down["step"] + 1
    assert abs(mean(after) - mean(last)) < 0.3 and mean(after) < train[0]["loss"] - 0.3, (
        [r["loss"] for r in last], [r["loss"] for r in after], train[0]["loss"])
    assert load(resolve(run_dir))["step"] == steps
    assert cluster.wait_idle(gloo + 10 * start) == {}


@pytest.mark.parametrize("template", ["horovodrun_multinode.sh", "mpirun.sh"])
def test_sigterm_to_the_launcher_leaves_no_process_on_any_node(cluster, shards, tmp_path,
                                                                template):
    run_dir = tmp_path / "run"
    env = template_env(shards, run_dir, ["--batch-size", "2", "--max-steps", "100000",
                                         "--log-every", "5"], HOSTS="n1:1,n2:1")
    proc = cluster.popen("n1", ["bash", LAUNCH / template], cwd=tmp_path, env=launch_env(**env),
                         stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: trained(run_dir, 10), "training on both hosts", proc)
        assert cluster.processes("n2"), "no rank on n2"
        os.kill(proc.pid, signal.SIGTERM)  # the template exec'd the launcher: this is it
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert cluster.wait_idle(30) == {}, out[-3000:]
    end, = records(run_dir, "end")
    assert end["stop"] == "signal" and end["world_size"] == 2, out[-3000:]
    ck = load(resolve(run_dir))
    assert ck["step"] == end["step"]


def test_bench_multinode_runs_on_a_shaped_link(cluster, shards, tmp_path):
    """`python -m benchmarks multinode` for real, shortened: 2 hosts, links shaped to 500 Mbit/s
    (tbf), an H=512 mLSTM (6.5 MB of float32 gradients, batch 1 x 16 bytes per rank), two rounds of
    each measurement: Horovod's allreduce of 32 bytes (alpha) and at 5 sizes (512 KiB-8 MiB,
    around the gradient; beta fitted to them less the 32-byte time), and 40 training steps
    across n1 and n2 (the host's step from inside them, ``--colocated``: each step's slowest
    rank less its allreduce wait; the communication is the model's, from the fit). The bench
    runs end to end and its figures hang together: the fit's bandwidth within the tbf rate and
    50% of it, the link a visible part of the step, and the prediction within a factor of 2 of
    the measured step (the allreduce left out of the model, with the link over half the step,
    misses that). How close the prediction is (the bench's 10% target) is a benchmark figure,
    docs/performance.md's, not asserted here: a 2-core machine other jobs share read 31% off
    once (compute inflated by the load)."""
    out = tmp_path / "bench.json"
    cluster.shape("500mbit")
    try:
        t0 = time.monotonic()
        cluster.run("n1", [PY, "-m", "benchmarks", "multinode", "--hosts", "n1:1,n2:1",
                           "--network-interface", "eth0", "--nodes", "2", "--shards", shards,
                           "--steps", "40", "--repeats", "2", "--iters", "5", "--colocated",
                           "--label", "500mbit", "--json", out], cwd=REPO, env=launch_env(),
                           timeout=240)
        took = time.monotonic() - t0
    finally:
        cluster.shape(None)
    row, = json.loads(out.read_text())["rows"]
    rate_GBps = 500e6 / 8 / 1e9
    assert 0.5 * rate_GBps < row["fit"]["beta_GBps"] <= 1.02 * rate_GBps, row["fit"]
    assert row["comm_s"] > row["compute_s"], row  # the link is a visible part of the step
    figures = {k: row[k] for k in ("compute_s", "compute_s_runs", "comm_s", "loop_s",
                                   "predicted_s", "measured_s", "measured_s_runs")}
    assert 0 < row["latency_s"] == row["fit"]["intercept_s"] < row["comm_s"], row
    assert len(row["ratio_rounds"]) == 2, row
    assert 0.5 < row["predicted_s"] / row["measured_s"] < 2.0, (figures, row["fit"], took)
