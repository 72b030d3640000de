"""Launch templates, and `hvd-lm launch` rendering and sweeps (their scaling report:
tests/test_scaling_report.py).

The templates run for real as 2-rank jobs (mpirun.sh, horovodrun_local.sh, pbs.qsub with a
fabricated $PBS_NODEFILE); every template and rendered script must pass shellcheck."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_lm.cli import main
from hvd_lm.jobs import job_scripts as L
from hvd_lm.train.schedule import scaled_lr
from tests import conftest
from tests._mp import REPO, launch_env, run
from tests.slurm_cluster import Unavailable, ensure_tools

LAUNCH = REPO / "launch"
TEMPLATES = sorted(LAUNCH.glob("*.sh")) + [LAUNCH / "slurm.sbatch", LAUNCH / "pbs.qsub"]
TINY = " ".join([*conftest.TINY, "--max-steps", "6", "--log-every", "1", "--lr", "1e-2"])


def cli(*argv: str) -> int:
    """Run `hvd-lm <argv>` in this process (the real command table, hvd_lm.cli)."""
    return main(list(argv))


@pytest.fixture(scope="module")
def shellcheck():
    try:
        return ensure_tools({"shellcheck": "shellcheck"})["shellcheck"]
    except Unavailable as e:
        pytest.skip(f"shellcheck unavailable: {e}")


def check_shell(shellcheck: str, *paths: Path) -> None:
    # From the repository root, so `# shellcheck source=launch/env.sh` is followed (-x).
    proc = subprocess.run([shellcheck, "-x", *map(str, paths)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- templates run as-is -------------------------------------------------------------------------
def assert_two_rank_run(run_dir: Path, output: str) -> None:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = [r for r in recs if r["kind"] == "start"]
    end = [r for r in recs if r["kind"] == "end"]
    losses = [r["loss"] for r in recs if r["kind"] == "train"]
    assert [s["world_size"] for s in start] == [2], output
    assert len(end) == 1 and end[0]["stop"] == "done" and end[0]["world_size"] == 2, output
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("template,knobs", [
    ("mpirun.sh", {}),
    ("horovodrun_local.sh", {"CONTROLLER": "gloo"}),
    ("horovodrun_multinode.sh", {"HOSTS": "localhost:2", "NETWORK_INTERFACE": "lo"}),
])
def test_template_runs_two_ranks(template, knobs, shards, tmp_path):
    env = launch_env(NP="2", OUT_DIR=str(tmp_path / "run"),
                     TRAIN_ARGS=f"--shards {shards} {TINY}", **knobs)
    proc = run(["bash", LAUNCH / template], timeout=240, env=env, cwd=tmp_path)
    assert_two_rank_run(tmp_path / "run", proc.stdout + proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("template,knobs,cause", [
    ("horovodrun_local.sh", {"CONTROLLER": "gloo", "HVD_LM_FAULT_RANK": "1",
                             "HVD_LM_FAULT_STEP": "3"},
     r"lost rank 1 on host \S+ \(127\.0\.0\.1 refuses the connection: the host is up but the "
     r"rank's process is gone\): a collective failed at step 4 after \d+\.\d s \(its peer's "
     r"connection closed\); the newest complete checkpoint is \S+step_00000002\.pt; "),
    ("mpirun.sh", {"EXTRA": "--inject-nan-steps 3,4 --max-skipped-steps 2",  # mpirun waits
                   "OMPI_MCA_odls_base_sigkill_timeout": "1"},  # this long after a failed rank
     r"training diverged: 2 steps in a row had non-finite gradients \(step 3\)"),
])
def test_a_failed_launch_ends_with_its_first_failure(template, knobs, cause, shards, tmp_path):
    """A rank killed at step 3 (horovodrun: rank 0 names it, and says the collective failed at
    once, not after Gloo's 30 s timeout) or a run that diverges on both ranks (mpirun): the
    template's last lines are the closing block read from the ``failure`` record rank 0 wrote to
    metrics.jsonl: who, after which step, the newest checkpoint, how to resume, the cause."""
    out, extra = tmp_path / "run", knobs.pop("EXTRA", "")
    env = launch_env(NP="2", OUT_DIR=str(out), **knobs,
                     TRAIN_ARGS=f"--shards {shards} {TINY} --checkpoint-every 2 {extra}")
    proc = run(["bash", LAUNCH / template], timeout=240, env=env, cwd=tmp_path, check=False)
    recs, last = conftest.records(out, "failure"), proc.stderr.rstrip().splitlines()[-5:]
    if not recs and template == "horovodrun_local.sh":  # horovodrun's SIGTERM came first: its
        assert last[-1] == f"cause: horovodrun: rank 1 on host {os.uname().nodename} exited " \
            "with status 3"  # words (nothing probed or recorded: hvd_lm.comm.peers.failure)
        return
    rec, = recs
    ckpt = out / "checkpoints" / "step_00000002.pt"
    assert rec["rank"] == 0 and rec["step"] == 3 and rec["checkpoint"] == str(ckpt), rec
    assert rec["resume"].endswith(f"--out-dir {out} --shards {shards} {' '.join(TINY.split())}"
                                  f" --checkpoint-every 2 {extra}".rstrip() + " --resume auto")
    assert proc.returncode != 0 and last[:4] == [
        f"==== hvd-lm: the job failed (exit status {proc.returncode}) ====",
        f"where: rank 0 on host {rec['host']}, after step 3 (recorded in "
        f"{out / 'metrics.jsonl'})",
        f"newest complete checkpoint: {ckpt}",
        f"resume: run the same launch again with OUT_DIR={out}: it continues with --resume auto",
    ], proc.stderr[-3000:]
    assert re.match(rf"cause: {cause}", last[4]) and last[4] == f"cause: {rec['error']}", last[4]


@pytest.mark.slow
def test_pbs_template_runs_on_fabricated_nodefile(shards, tmp_path):
    """No PBS server can be installed here: run the job script the way PBS would, with
    $PBS_NODEFILE listing localhost twice (select=1:mpiprocs=2) and PBS_O_WORKDIR set."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\nlocalhost\n")
    env = launch_env(PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(tmp_path), PBS_JOBID="42.pbs",
                     PBS_JOBNAME="hvdlm", LAUNCH_DIR=str(LAUNCH),
                     TRAIN_ARGS=f"--shards {shards} {TINY}")
    proc = run(["bash", LAUNCH / "pbs.qsub"], timeout=240, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "PBS job 42.pbs: 2 ranks on localhost" in out, out
    assert_two_rank_run(tmp_path / "runs" / "hvdlm-42.pbs", out)


def test_batch_templates_refuse_to_run_outside_their_scheduler(tmp_path):
    env = launch_env(LAUNCH_DIR=str(LAUNCH))
    for name, var in (("slurm.sbatch", "SLURM_JOB_ID"), ("pbs.qsub", "PBS_NODEFILE")):
        env.pop(var, None)
        proc = run(["bash", LAUNCH / name], timeout=30, env=env, cwd=tmp_path, check=False)
        assert proc.returncode != 0 and var in proc.stderr, proc.stderr
        # Submitted from elsewhere (the scheduler runs a copy): say where env.sh was looked for.
        proc = run(["bash", LAUNCH / name], timeout=30, check=False, cwd=tmp_path,
                   env={k: v for k, v in env.items() if k != "LAUNCH_DIR"})
        assert proc.returncode == 2 and f"LAUNCH_DIR={tmp_path}/launch" in proc.stderr


def test_bind_gpu_maps_local_rank_to_cuda_visible_devices(tmp_path):
    wrapper = ["bash", LAUNCH / "bind_gpu.sh", "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"]
    env = launch_env(OMPI_COMM_WORLD_LOCAL_RANK="1")
    assert run(wrapper, env=env, timeout=30).stdout.strip() == "1"
    env = launch_env(SLURM_LOCALID="2", GPU_IDS="0,2,4,6")
    assert run(wrapper, env=env, timeout=30).stdout.strip() == "4"
    env = {k: v for k, v in launch_env().items()
           if k not in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                        "HOROVOD_LOCAL_RANK")}
    proc = run(wrapper, env=env, timeout=30, check=False)
    assert proc.returncode == 2 and "no local rank" in proc.stderr


def test_env_sh_exports_set_knobs_and_unsets_empty_ones():
    env = {k: v for k, v in launch_env(NCCL_DEBUG="INFO", NCCL_SOCKET_IFNAME="").items()
           if k not in ("OMP_NUM_THREADS", "HOROVOD_TIMELINE")}
    proc = run(["bash", "-c", f"source {LAUNCH / 'env.sh'}; env"], env=env, timeout=30)
    exported = dict(x.split("=", 1) for x in proc.stdout.splitlines() if "=" in x)
    assert exported["NCCL_DEBUG"] == "INFO" and exported["OMP_NUM_THREADS"] == "1"
    assert "NCCL_SOCKET_IFNAME" not in exported and "HOROVOD_TIMELINE" not in exported



def _launched(tmp_path: Path, **knobs: str) -> subprocess.CompletedProcess:
    """horovodrun_local.sh with a HOROVODRUN stub that prints the command it was given."""
    stub = tmp_path / "horovodrun_stub"
    stub.write_text('#!/bin/sh\necho "LAUNCHED $*"\n')
    stub.chmod(0o755)
    env = launch_env(NP="2", OUT_DIR=str(tmp_path / "run"), HOROVODRUN=str(stub),
                     PYTHON=sys.executable, **knobs)
    return run(["bash", LAUNCH / "horovodrun_local.sh"], env=env, cwd=tmp_path, timeout=60,
               check=False)


def _shards_args(proc: subprocess.CompletedProcess) -> list[str]:
    words = next(x for x in proc.stdout.splitlines() if x.startswith("LAUNCHED ")).split()
    return [words[i + 1] for i, w in enumerate(words) if w == "--shards"]


def test_shards_knob_default_trainargs_and_config_precedence(tmp_path):
    for d in ("data/amazon", "mine", "fromcfg"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "manifest.json").write_text("{}")
    # Nothing names the shards: the SHARDS knob's default, README's prepared folder.
    assert _shards_args(_launched(tmp_path)) == ["data/amazon"]
    assert _shards_args(_launched(tmp_path, SHARDS="mine")) == ["mine"]
    # TRAIN_ARGS wins over SHARDS (only its own --shards reaches train).
    assert _shards_args(_launched(tmp_path, SHARDS="mine", TRAIN_ARGS="--shards fromcfg")) == [
        "fromcfg"]
    # A CONFIG that sets data.shards wins over SHARDS: no --shards flag would override it.
    cfg = tmp_path / "my.yaml"
    cfg.write_text("data:\n  shards: fromcfg\n")
    assert _shards_args(_launched(tmp_path, CONFIG=str(cfg), SHARDS="mine")) == []
    cfg.write_text("model:\n  hidden_size: 64\n")
    assert _shards_args(_launched(tmp_path, CONFIG=str(cfg), SHARDS="mine")) == ["mine"]


@pytest.mark.parametrize("knobs,named", [
    ({}, "data/amazon/manifest.json not found (shards from SHARDS)"),
    ({"TRAIN_ARGS": "--max-steps 5 --shards gone"}, "gone/manifest.json not found (shards from "
                                                   "TRAIN_ARGS)"),
])
def test_missing_shards_stop_the_launch_with_one_line(knobs, named, tmp_path):
    proc = _launched(tmp_path, **knobs)
    assert proc.returncode == 2 and "LAUNCHED" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and named in proc.stderr, proc.stderr
    assert "data_prep prepare" in proc.stderr and "Traceback" not in proc.stderr

# ---- rendering -------------------------------------------------------------------------------
def test_128_gpus_at_8_per_node_is_16_nodes(tmp_path):
    assert L.job_size(128, 8) == L.JobSize(gpus=128, nodes=16, tasks_per_node=8)
    assert L.job_size(2, 8) == L.JobSize(gpus=2, nodes=1, tasks_per_node=2)
    assert cli("launch", "--scheduler", "slurm", "--gpus", "128", "--gpus-per-node", "8",
               "--walltime", "4:00:00", "--partition", "gpu", "--out", str(tmp_path / "j"),
               "--", "--shards", "data/shards") == 0
    text = (tmp_path / "j").read_text()
    for line in ("#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=4:00:00", "#SBATCH --partition=gpu"):
        assert re.search(rf"^{line}\s", text, re.M), line
    assert '\nTRAIN_ARGS="${TRAIN_ARGS:- --shards data/shards --time-limit 14100s}"' in text
    pbs = L.render(L.RenderSpec("pbs", L.job_size(128, 8), partition="gpu", cpus_per_task=4))
    assert "\n#PBS -l select=16:ncpus=32:ngpus=8:mpiprocs=8\n" in pbs and "\n#PBS -q gpu\n" in pbs
    assert 'NP="${NP:-128}"' in L.render(L.RenderSpec("mpirun", L.job_size(128, 8)))


def test_a_cpu_job_reports_ranks_not_gpus(tmp_path, capsys):
    assert cli("launch", "--scheduler", "slurm", "--gpus", "2", "--gpus-per-node", "1",
               "--device", "cpu", "--out", str(tmp_path / "j"), "--", "--shards", "s") == 0
    assert capsys.readouterr().err.strip() == (
        f"wrote {tmp_path / 'j'} (2 ranks = 2 node(s) x 1 (CPU, no GPU requested)); start it "
        f"with: sbatch {tmp_path / 'j'}")
    text = (tmp_path / "j").read_text()
    assert "# 2 ranks = 2 node(s) x 1 (CPU, no GPU requested); global batch 64 (32 per rank)" \
        in text and "2 GPUs" not in text


@pytest.mark.parametrize("gpus,gpn,nodes,msg", [
    (128, 8, 8, "--nodes 8 does not match 128 GPUs at 8 per node (that is 16 nodes x 8"),
    (12, 8, None, "12 GPUs do not fill 8-GPU nodes evenly"),
    (0, 8, None, "need --gpus >= 1"),
])
def test_bad_sizes_are_errors(gpus, gpn, nodes, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        L.job_size(gpus, gpn, nodes)


def test_launch_errors_are_reported_not_raised(capsys):
    assert cli("launch", "--scheduler", "horovodrun", "--gpus", "16", "--gpus-per-node", "8") == 2
    assert "horovodrun runs on one node" in capsys.readouterr().err
    assert cli("launch", "--scheduler", "slurm", "--gpus", "8", "--", "--no-such-flag") == 2
    assert "--no-such-flag" in capsys.readouterr().err
    assert cli("launch", "--scheduler", "slurm", "--gpus", "8", "--", "--out-dir", "x") == 2
    assert "--run-dir" in capsys.readouterr().err
    assert cli("launch", "--scheduler", "slurm", "--gpus", "8", "--", "--shards", "a$b") == 2
    assert "cannot be rendered" in capsys.readouterr().err


def test_rendering_changes_only_knobs_directives_and_header():
    spec = L.RenderSpec("slurm", L.job_size(16, 8), walltime="90", partition="p", config=None,
                        out_dir="runs/x", train_args=("--shards", "s"), header=("hello",))
    template = (LAUNCH / "slurm.sbatch").read_text().splitlines()
    rendered = L.render(spec).splitlines()
    assert rendered[1] == "# hello" and len(rendered) == len(template) + 1
    knob_names = set(L.knob_defaults("\n".join(template)))
    for old, new in zip(template, rendered[:1] + rendered[2:]):
        if old != new:
            name = new.split("=", 1)[0]
            assert name in knob_names or re.match(r"#SBATCH --(nodes|ntasks-per-node|gpus-per-"
                                                  r"node|time|partition|job-name)=", new), new
    assert L.knob_defaults("\n".join(rendered))["OUT_DIR"] == "runs/x"
    assert [x.split()[1] for x in rendered if x.startswith("#SBATCH --time")] == ["--time=90"]


@pytest.mark.parametrize("rule,cap", [("sqrt", "3e-3"), ("linear", None), ("none", None)])
def test_sweep_is_weak_scaling_with_scaled_lr(rule, cap, tmp_path, capsys):
    extra = ["--batch-size", "32", "--lr", "5e-4", "--lr-ref-batch", "128", "--lr-rule", rule]
    extra += ["--lr-cap", cap] if cap else []
    assert cli("launch", "--scheduler", "slurm", "--sweep", "1,8,16,32,64,128", "--steps", "200",
               "--out", str(tmp_path / "sweep"), "--", "--shards", "d", *extra) == 0
    printed = capsys.readouterr().out
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    got = [(j["gpus"], j["nodes"], j["global_batch"], j["lr"], j["steps"]) for j in sweep["jobs"]]
    want = [(g, max(1, g // 8), 32 * g, scaled_lr(5e-4, 128, 32 * g, rule,
                                                 float(cap) if cap else None), 200)
            for g in (1, 8, 16, 32, 64, 128)]
    assert got == want
    table = [line.split() for line in printed.splitlines() if re.match(r"^\s+\d+\s+\d+\s", line)]
    assert [float(row[3]) for row in table] == [float(f"{w[3]:.3g}") for w in want]
    g128 = (tmp_path / "sweep" / "slurm_g128.sbatch").read_text()
    assert "#SBATCH --nodes=16" in g128 and "--max-steps 200" in g128
    assert 'OUT_DIR="${OUT_DIR:-runs/scaling/g128}"' in g128


def test_every_template_and_rendered_script_passes_shellcheck(shellcheck, tmp_path):
    check_shell(shellcheck, *TEMPLATES)
    rendered = []
    for sched in L.SCHEDULERS:
        gpus = "8" if sched == "horovodrun" else "16"
        out = tmp_path / f"{sched}.sh"
        hosts = ["--hosts", "n1,n2"] if sched in ("mpirun", "horovodrun-multinode") else []
        assert cli("launch", "--scheduler", sched, "--gpus", gpus, "--gpus-per-node", "8",
                   "--walltime", "2:00:00", "--queue", "q", *hosts, "--out", str(out),
                   "--", "--shards", "data/shards", "--lr-rule", "sqrt") == 0
        rendered.append(out)
    assert cli("launch", "--scheduler", "pbs", "--sweep", "1,8,16", "--steps", "50",
               "--out", str(tmp_path / "sweep"), "--", "--shards", "d") == 0
    rendered += sorted(p for p in (tmp_path / "sweep").iterdir() if p.suffix != ".json")
    check_shell(shellcheck, *rendered)


def test_launch_is_installed_and_the_report_is_a_benchmark():
    proc = subprocess.run([sys.executable, "-m", "hvd_lm", "--help"], capture_output=True,
                          text=True, cwd=REPO, env=launch_env(), timeout=60)
    assert proc.returncode == 0 and "launch" in proc.stdout
    assert "scaling-report" not in proc.stdout and "bench" not in proc.stdout.split()


# ---- elastic -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_elastic_template_runs_two_ranks_from_a_hosts_file(shards, tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    env = launch_env(NP="2", MIN_NP="1", HOSTS_FILE=str(hosts), OUT_DIR=str(tmp_path / "run"),
                     NETWORK_INTERFACE="lo",  # one host: Horovod would wait for a second
                     HOROVODRUN=str(Path(sys.executable).parent / "horovodrun"),
                     PYTHON=sys.executable, TRAIN_ARGS=f"--shards {shards} {TINY}")
    proc = run(["bash", LAUNCH / "horovodrun_elastic.sh"], timeout=240, env=env, cwd=tmp_path)
    assert "--host-discovery-script" in proc.stdout and "--elastic true" in proc.stdout
    assert_two_rank_run(tmp_path / "run", proc.stdout + proc.stderr)


def test_discover_hosts_lists_usable_slurm_nodes(tmp_path):
    """launch/discover_hosts.sh against a stand-in `scontrol`: DOWN/DRAIN nodes and those in
    EXCLUDE_FILE are left out; slots from SLURM_NTASKS_PER_NODE ("8(x3)" -> 8)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        "#!/bin/sh\n"
        'if [ "$2" = hostnames ]; then printf "n1\\nn2\\nn3\\nn4\\n"; exit 0; fi\n'
        'case "$3" in n2) s=DOWN+NOT_RESPONDING;; n3) s=DRAINED;; *) s=ALLOCATED;; esac\n'
        'echo "NodeName=$3 Arch=x86_64 State=$s CPUTot=8"\n')
    (fake / "scontrol").chmod(0o755)
    excl = tmp_path / "exclude"
    excl.write_text("n4\n")
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", SLURM_JOB_NODELIST="n[1-4]",
               SLURM_NTASKS_PER_NODE="8(x4)")
    out = subprocess.run(["bash", LAUNCH / "discover_hosts.sh"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert out == "n1:8\nn4:8\n"
    out = subprocess.run(["bash", LAUNCH / "discover_hosts.sh"], capture_output=True, text=True,
                         env=dict(env, EXCLUDE_FILE=str(excl), SLOTS="4"), timeout=30,
                         check=True).stdout
    assert out == "n1:4\n"


def test_slurm_elastic_render(tmp_path):
    out = tmp_path / "job.sbatch"
    assert cli("launch", "--scheduler", "slurm", "--gpus", "16", "--gpus-per-node", "8",
               "--elastic", "--min-np", "8", "--out", str(out), "--", "--shards", "d") == 0
    text = out.read_text()
    assert 'LAUNCHER="${LAUNCHER:-elastic}"' in text and 'MIN_NP="${MIN_NP:-8}"' in text
    assert cli("launch", "--scheduler", "mpirun", "--gpus", "2", "--elastic") == 2
    assert cli("launch", "--scheduler", "slurm", "--gpus", "8", "--min-np", "9",
               "--elastic") == 2


@pytest.mark.slow
def test_a_process_the_launcher_leaves_behind_does_not_hold_the_jobs_output(tmp_path):
    """launch/lib.sh's hvd_lm_run_preemptible passes the launcher's output through line filters
    (they keep its ERROR lines for the closing block). A launcher that exits while a process it
    started still holds its stdout (as horovodrun can leave an ssh to a host whose link went
    down) must not keep the job's own output open: before, the filters ignored the SIGTERM meant
    to end them and the reader of the job's output waited for that process (a hung test)."""
    import time

    script = tmp_path / "job.sh"
    script.write_text(f"source {REPO / 'launch/lib.sh'}\n"
                      "hvd_lm_run_preemptible bash -c 'sleep 60 & echo launched; exit 0'\n"
                      "echo \"launcher rc=$?\"\n")
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert "launched" in out and "launcher rc=0" in out
    assert time.monotonic() - t0 < 20  # the job's output ended with it, not with the sleeper


def test_srun_that_exits_0_after_its_tasks_failed_to_launch_is_a_failure(tmp_path):
    """srun can exit 0 after a step whose tasks never started (seen with PMIx: "srun: error:
    task 0 launch failed: Unspecified error"); the job then COMPLETED as if it had trained.
    launch/lib.sh's hvd_lm_run_preemptible returns 1 with an ERROR line, which the closing
    block reads."""
    script = tmp_path / "job.sh"
    script.write_text(f"source {REPO / 'launch/lib.sh'}\n"
                      "hvd_lm_run_preemptible bash -c 'echo \"srun: error: task 0 launch "
                      "failed: Unspecified error\" >&2; exit 0'\n"
                      "echo \"launcher rc=$?\"; cat \"$HVD_LM_ERRORS\"\n")
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT_DIR": str(tmp_path / "run")})
    assert "launcher rc=1" in proc.stdout, proc.stdout + proc.stderr
    assert "launch: ERROR: srun exited 0, but its tasks failed to launch" in proc.stderr
    assert "srun's tasks failed to launch" in proc.stdout  # kept for the closing block
