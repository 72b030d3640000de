"""A new user's first job across hosts, replayed on the cluster in a box (tests/cluster.py) as
README.md and docs/ state it, step by step; each step fails where a user would stumble.

Every command runs on a node (n1 unless said) from a work folder the nodes share (under
pytest's temporary folders), with the venv first on PATH, as a user's shell would have it:

1. the doctor, started from a folder only n1 has, names that folder and the shared filesystem
   (not a symptom such as a missing manifest);
2. data preparation across two hosts with the commands of docs/data_prep.md ("Across hosts":
   the doctor, then mpirun with ``-x PATH`` and the interface it printed), byte-identical to one
   process;
3. SLURM, started with ``python -m tests.cluster slurm`` (left running, its ``SLURM_CONF``
   printed), runs the script ``hvd-lm launch --scheduler slurm`` renders on two nodes (mpirun
   inside the allocation, after the preflight), after ``launch`` refused a ``--time-margin``
   under which the training would run into SLURM's warning signal; an admin's preemption
   (``scontrol requeue``) is said as a requeue, and the job finishes with ``--resume auto``;
4. the same run continued with ``launch/horovodrun_multinode.sh`` across n1 and n2; n2's cable
   pulled: the job fails within Gloo's timeout, its last lines the closing block (the lost
   host, the newest checkpoint, how to resume);
4b. the same command again, SIGTERM to the launcher: acknowledged within a second, every rank
   checkpoints, the launch ends as a clean stop (exit 0) whatever horovodrun's own status;
4c. ``launch/mpirun.sh`` across n1 and n2 as root (OpenMPI's permission given by the
   template) continues the run with ``--resume auto`` to its last step;
5. eval (with the xz/gzip baselines), transfer on a user's own labelled sets (Blitzer .review
   pairs, a labelled CSV, carved by ``--split``, TF-IDF beside) and classify of that run, on
   n2 (the run folder is shared).

Tests it took over (each proved the same thing on its own): tests/test_multinode.py's
``test_data_prep_across_two_hosts_is_byte_identical`` (step 2) and
``test_lost_link_fails_in_bounded_time_naming_the_host_then_resume_finishes`` (step 4), and
tests/test_slurm.py's ``test_preempted_job_checkpoints_requeues_and_resumes_with_mpirun``
(step 3, now on two nodes)."""
from __future__ import annotations

import csv
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hvd_lm.formats.checkpoint import list_checkpoints
from tests import conftest
from tests._mp import REPO, SHARED, launch_env, run
from tests.cluster import Cluster
from tests.conftest import records
from tests.slurm_cluster import SLURM_TOOLS, ensure_tools

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
MUSIC = SHARED / "data/amazon/mcauley2014_5core/reviews_Digital_Music_5.json.gz"
SST2 = SHARED / "data/sst2"
BOOKS = SHARED / "data/amazon/blitzer_mdsd/sorted_data_acl/books"
TINY = " ".join([*conftest.TINY, "--lr", "3e-3", "--log-every", "10"])
PREP = "--shard-size 256K --split 20,1,1 --no-progress"




def doc_commands(doc: str, first_words: str) -> list[str]:
    """The commands (continuation lines joined, comments dropped) of the fenced bash block of
    ``doc`` that holds a command starting with ``first_words``."""
    text = (REPO / doc).read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        cmds = [re.sub(r"\s+#.*$", "", c).strip()
                for c in block.replace("\\\n", " ").splitlines() if c.strip()]
        if any(c.startswith(first_words) for c in cmds):
            return cmds
    raise AssertionError(f"{doc}: no bash block with a command starting {first_words!r}")


class Journey:
    """The user's shell: commands on a node, from the shared work folder, timed per step."""

    def __init__(self, cluster: Cluster, work: Path):
        self.cluster, self.work, self.took = cluster, work, {}

    def sh(self, command: str, node: str = "n1", timeout: float = 240, check: bool = True,
           cwd=None, unset: tuple = (), **env: str) -> subprocess.CompletedProcess:
        full = {k: v for k, v in launch_env(**env).items() if k not in unset}
        return self.cluster.run(node, ["bash", "-c", command], timeout=timeout, check=check,
                                cwd=cwd or self.work, env=full)

    def step(self, name: str, t0: float) -> None:
        self.took[name] = round(time.monotonic() - t0, 1)


def test_first_job_across_hosts(cluster, tmp_path):
    if not (MUSIC.exists() and (SST2 / "val.csv").exists() and BOOKS.is_dir()):
        pytest.skip(f"needs {MUSIC}, {SST2} and {BOOKS} (../shared)")
    work = tmp_path / "work"
    work.mkdir()
    j = Journey(cluster, work)
    t_all = time.monotonic()

    # 1. started from a folder only n1 has: the doctor names it (and why it matters)
    t0 = time.monotonic()
    private = "/tmp/journey-private"  # n1's own /tmp, as a node's local disk
    j.sh(f"mkdir -p {private}")
    proc = j.sh(f"cd {private} && hvd-lm doctor --hosts n1:1,n2:1", check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"hvd-lm doctor: ERROR: n2 lacks the working folder {private}, which n1 has: every rank "
        "starts in the working folder and reads the data, config and run folder at the same "
        "path, so they must be on a filesystem every host shares (or copied to the same path "
        "on n2)"), proc.stderr
    j.sh(f"rm -rf {private}")
    j.step("1 doctor names the unshared folder", t0)

    # 2. data preparation across hosts, as docs/data_prep.md says: the doctor, then mpirun
    t0 = time.monotonic()
    doctor, mpirun = doc_commands("docs/data_prep.md", "mpirun -np 2 -H node1")
    nodes = {"node1": "n1", "node2": "n2"}
    doctor = re.sub(r"node\d", lambda m: nodes[m.group(0)], doctor)
    out = j.sh(doctor).stdout
    iface = re.search(r"^  use          (\w+):$", out, re.M)
    assert iface and iface.group(1) == "eth0", out  # never the decoy docker0
    mpirun = re.sub(r"node\d", lambda m: nodes[m.group(0)], mpirun)
    mpirun = mpirun.replace("eth0", iface.group(1)).replace("FILES...", f"{MUSIC} {PREP}")
    mpirun = mpirun.replace("/shared/fs/out", "data/amazon")
    proc = j.sh(mpirun, timeout=300)
    assert proc.stdout.count("prepared ") == 1, proc.stdout
    run([sys.executable, "-m", "data_prep", "prepare", MUSIC, *PREP.split(), "--out",
         tmp_path / "one"], timeout=300)
    two = {p.name: p.read_bytes() for p in sorted((work / "data/amazon").glob("*.h5"))}
    one = {p.name: p.read_bytes() for p in sorted((tmp_path / "one").glob("*.h5"))}
    assert len(one) > 2 and one == two
    man = json.loads((work / "data/amazon/manifest.json").read_text())
    assert man["run"]["world_size"] == 2
    j.step("2 prepare across hosts (docs/data_prep.md)", t0)

    # 3. SLURM: started from the command line, a rendered 2-node job, preempted and requeued
    t0 = time.monotonic()
    ensure_tools(SLURM_TOOLS)  # installed from this machine: the nodes reach no package mirror
    out = j.sh("python -m tests.cluster slurm").stdout
    conf = re.search(r"^export SLURM_CONF=(\S+)$", out, re.M)
    assert conf, out
    slurm = Cluster.attach(cluster.root)._slurm  # the daemons outlived the command
    assert slurm is not None and str(slurm.conf) == conf.group(1)
    cluster._slurm = slurm  # the session's cluster stops it at the end
    # a margin under which the training would run into SLURM's warning signal: refused
    bad = j.sh("hvd-lm launch --scheduler slurm --gpus 2 --gpus-per-node 1 --device cpu "
               "--walltime 0:06:00 --time-margin 1m --out bad.sbatch -- --shards data/amazon",
               check=False)
    assert bad.returncode == 2 and "(60 s) would let the training run into SLURM's warning " \
        "signal" in bad.stderr and not (work / "bad.sbatch").exists(), bad.stderr
    j.sh(f"hvd-lm launch --scheduler slurm --gpus 2 --gpus-per-node 1 --device cpu --walltime 10 "
         f"--job-name journey --launcher mpirun --run-dir runs/first --out job.sbatch -- "
         f"--shards data/amazon {TINY} --max-steps 120 --checkpoint-every 40")
    submit = j.sh("python -m tests.cluster run n1 -- sbatch job.sbatch", SLURM_CONF=conf.group(1),
                  HVD_LM_STEP_SLEEP="0.05")  # exported to the job: it trains for seconds
    job = re.search(r"Submitted batch job (\d+)", submit.stdout).group(1)
    first = work / "runs/first"
    slurm.wait_job(job, 180, lambda i: i.get("JobState") not in ("PENDING", "RUNNING") or (
        (first / "metrics.jsonl").is_file() and bool(records(first, "train"))))
    # preempted by an admin's `scontrol requeue`: SIGTERM with KillWait (5 s) to go, said as a
    # requeue; the requeued job continues from its newest checkpoint and completes
    j.sh(f"python -m tests.cluster run n1 -- scontrol requeue {job}", SLURM_CONF=conf.group(1))
    slurm.release_requeued(job, timeout=120)
    info = slurm.wait_job(job, timeout=240)
    log = (work / f"journey-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    assert "2 nodes (n[1-2]), 2 ranks via mpirun" in log and "use          eth0:" in log, log
    assert f"launch: got SIGTERM: SLURM is requeueing job {job} (scontrol requeue)" in log, log
    assert "scancel, or the node going down" not in log, log[-4000:]
    assert "--resume auto" in log.split("(restart 1)")[1]
    starts, ends = records(first, "start"), records(first, "end")
    assert [s["world_size"] for s in starts] == [2, 2] and starts[0]["hosts"] == ["n1", "n2"]
    assert ends[-1]["stop"] == "done" and ends[-1]["step"] == 120  # signal's checkpoint or not
    assert 0 < starts[1]["step"] < 120 and starts[1]["resumed_from"].endswith(
        f"step_{starts[1]['step']:08d}.pt")
    j.step("3 SLURM: a margin refused; scontrol requeue, resumed, completed", t0)

    # 4. the same run, longer, with horovodrun across the hosts; n2's cable pulled mid-run
    t0 = time.monotonic()
    args = f"--shards data/amazon {TINY} --max-steps 240 --checkpoint-every 20 --gloo-timeout-s 10"
    command = (f"NP=2 HOSTS=n1:1,n2:1 OUT_DIR=runs/first TRAIN_ARGS={shlex.quote(args)} "
               f"bash {REPO}/launch/horovodrun_multinode.sh")
    proc = cluster.popen("n1", ["bash", "-c", command], cwd=work, stderr=subprocess.STDOUT,
                         env=launch_env(HVD_LM_STEP_SLEEP="0.05"))
    try:
        deadline = time.monotonic() + 150
        while not (list_checkpoints(first) and int(list_checkpoints(first)[-1].stem[5:]) >= 140):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
            time.sleep(0.2)
        t_cut = time.monotonic()
        cluster.link("n2", up=False)
        output, _ = proc.communicate(timeout=90)
        took = time.monotonic() - t_cut
    finally:
        if proc.poll() is None:
            cluster.kill_jobs()
            proc.kill()
            proc.wait()
        cluster.link("n2", up=True)
    newest = list_checkpoints(first)[-1].relative_to(work)  # as OUT_DIR names it
    assert proc.returncode != 0 and took < 10 + 15, (took, output[-3000:])
    assert len(re.findall(r"hvd-lm train: ERROR:", output)) == 1, output[-5000:]
    last = output.rstrip().splitlines()[-5:]
    assert last[0] == f"==== hvd-lm: the job failed (exit status {proc.returncode}) ====", last
    # rank 0's view (n2, cut off, still reached the shared disk: it recorded the mirror image)
    assert re.fullmatch(r"where: rank 0 on host n1, after step \d+ \(recorded in "
                        r"runs/first/metrics.jsonl(; rank 1 recorded one too)?\)", last[1]), last
    assert last[2] == f"newest complete checkpoint: {newest}", last
    assert last[3] == ("resume: run the same launch again with OUT_DIR=runs/first: it continues "
                       "with --resume auto"), last
    assert re.fullmatch(r"cause: lost rank 1 on host n2 \(10\.77\.0\.2 does not answer within 3 "
                        r"s: its network link is down or the host is gone\): a collective failed "
                        r"at step \d+ \(Gloo gave up after HOROVOD_GLOO_TIMEOUT_SECONDS=10 s\); "
                        rf"the newest complete checkpoint is {re.escape(str(newest))}; .*",
                        last[4]), last
    assert cluster.wait_idle(30) == {}
    deadline = time.monotonic() + 30
    while not cluster.healthy():
        assert time.monotonic() < deadline, "n2 did not come back"
        time.sleep(0.5)
    j.step("4 horovodrun across hosts: a pulled link", t0)

    # 4b. the same command again, stopped with SIGTERM to the launcher (Ctrl-C's sibling): said
    # at once, every rank checkpoints, a clean stop (exit 0), not "the job failed"
    t0, started = time.monotonic(), time.time()
    proc = cluster.popen("n1", ["bash", "-c", command], cwd=work, stderr=subprocess.STDOUT,
                         env=launch_env(HVD_LM_STEP_SLEEP="0.05"))
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), x) for x in proc.stdout), daemon=True)
    reader.start()
    try:
        before = len(records(first, "end"))
        deadline = time.monotonic() + 120
        while len([r for r in records(first, "train") if r["time"] > started]) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(
                x for _, x in lines)[-4000:]
            time.sleep(0.2)
        # the launcher itself (nsenter and bash -c exec into it, or it is their child)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        launcher, = [c for c in tree if "horovodrun_multinode.sh" in " ".join(c.cmdline())
                     and c.name() == "bash"][:1]
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "".join(x for _, x in lines)[-4000:]
    finally:
        if proc.poll() is None:
            cluster.kill_jobs()
            proc.kill()
    reader.join(10)
    output = "".join(x for _, x in lines)
    acked = [t for t, x in lines if "SIGTERM received" in x]
    assert acked and acked[0] - sent < 2, output[-4000:]
    assert "==== hvd-lm: stopped on a signal: every rank checkpointed at step " in output
    assert "the job failed" not in output, output[-4000:]
    assert [e["stop"] for e in records(first, "end")[before:]] == ["signal"]
    j.step("4b a clean stop across hosts: acknowledged, exit 0", t0)

    # 4c. finished with launch/mpirun.sh across the hosts, as root (the box's user): the
    # template gives OpenMPI root's permission; it continues with --resume auto to the end
    t0 = time.monotonic()
    stopped_at = records(first, "end")[-1]["step"]
    proc = j.sh(f"NP=2 HOSTS=n1:1,n2:1 OUT_DIR=runs/first TRAIN_ARGS={shlex.quote(args)} "
                f"bash {REPO}/launch/mpirun.sh", timeout=300, HVD_LM_STEP_SLEEP="0.05",
                unset=("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"))
    assert "--resume auto" in proc.stdout and "as root" not in proc.stderr, proc.stderr[-3000:]
    starts, ends = records(first, "start"), records(first, "end")
    assert starts[-1]["step"] == stopped_at and ends[-1]["stop"] == "done"
    assert ends[-1]["step"] == 240
    j.step("4c mpirun across hosts as root: resumed to the end", t0)

    # 5. eval, transfer and classify of the run, on the other host
    t0 = time.monotonic()
    j.sh("hvd-lm eval runs/first data/amazon --split val --output runs/first/eval_val.json "
         "--device cpu --baselines xz,gzip", node="n2")
    ev = json.loads((first / "eval_val.json").read_text())
    assert 0 < ev["bpc"] < 8 and set(ev["baselines"]) == {"xz", "gzip"}, ev
    # the user's own labelled sets: Blitzer .review pairs, and one labelled CSV, each carved
    # into stratified train/val/test, the LM's test accuracy beside TF-IDF's
    for name, data in (("books", f"--train {BOOKS}"),
                       ("sst2", f"--train {SST2}/train.csv --text-field sentence")):
        j.sh(f"hvd-lm transfer runs/first {data} --split 80,10,10 --out runs/first/{name} "
             "--max-examples 200 --threads 1 --device cpu --no-progress", node="n2", timeout=300)
        rep = json.loads((first / name / "transfer.json").read_text())
        assert set(rep["dataset"]["splits"]) == {"train", "val", "test"}, rep["dataset"]
        assert 0 < rep["classifier"]["accuracy"]["test"] <= 1, rep["classifier"]
        assert 0.5 < rep["baseline"]["accuracy"]["test"] <= 1, rep["baseline"]
    proc = j.sh(f"hvd-lm classify runs/first runs/first/sst2 --input {SST2}/val.csv --text-field "
                "sentence --label-field label --output runs/first/val_predictions.csv "
                "--threads 1 --device cpu", node="n2", timeout=300)
    with open(SST2 / "val.csv", newline="") as f:  # the fixture's own count
        rows = sum(1 for _ in csv.DictReader(f))
    assert f"classified {rows} texts" in proc.stdout and "\r" not in proc.stderr, \
        proc.stderr[-2000:]
    assert len((first / "val_predictions.csv").read_text().splitlines()) == rows + 1
    j.step("5 eval, transfer, classify on n2", t0)
    j.took["total"] = round(time.monotonic() - t_all, 1)
    print(f"journey: {j.took}")
