"""``hvd-lm train --backend torch`` through the command line users run: 2 ranks under
launch/torchrun.sh equal 2 Horovod ranks bit for bit and one process on the double batch within
rounding; a checkpoint of either engine resumes on the other exactly (the torch engine under
mpirun); ``hvd-lm eval --backend torch`` on 2 ranks gives Horovod's BPC, and transfer's
featurization over 2 ranks one process's features; 1-bit Adam is Horovod's run bit for bit; a
killed rank is one line naming it and its host, then the launch's closing block; what only
Horovod does (elastic) and what only the torch engine does (bf16 on the wire) are refused in one
line elsewhere."""
from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from hvd_lm.formats.checkpoint import load, resolve
from tests._mp import REPO, horovodrun_cmd, launch_env, mpirun_cmd, run, torchrun_cmd
from tests.shardutil import default_shards

TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--log-every", "1",
        "--lr", "3e-3", "--threads", "1", "--eval-chars", "2000", "--device", "cpu"]
STEPS = ["--max-steps", "6", "--checkpoint-every", "3", "--compression", "none"]
LAUNCH = REPO / "launch"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return default_shards(tmp_path_factory.mktemp("shards"))


def train_argv(shards, out, *extra) -> list:
    return ["-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out, *TINY, *extra]


def records(run_dir, kind) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


def model_of(path) -> dict[str, torch.Tensor]:
    return load(resolve(path))["model"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """6 steps (checkpoints at 3 and 6) of 2 ranks x batch 2: on the torch engine through
    launch/torchrun.sh, and on Horovod (horovodrun --gloo); and one process x batch 4."""
    d = tmp_path_factory.mktemp("runs")
    env = launch_env(NPROC_PER_NODE="2", OUT_DIR=str(d / "torch"), PYTHON=sys.executable,
                     TRAIN_ARGS=" ".join(map(str, ["--shards", shards, *TINY, "--batch-size",
                                                   "2", *STEPS])))
    out = run(["bash", LAUNCH / "torchrun.sh"], timeout=240, env=env, cwd=d)
    run(horovodrun_cmd(2, train_argv(shards, d / "horovod", "--batch-size", "2", *STEPS)),
        timeout=240)
    run([sys.executable, *train_argv(shards, d / "one", "--batch-size", "4", *STEPS)],
        timeout=240)
    return d, out.stdout + out.stderr


@pytest.mark.slow
def test_two_torch_engine_ranks_equal_horovods_and_one_process(runs):
    """The same 2-rank run on both engines is the same run, bit for bit (sums of two fp32
    addends and halving are exact whatever the engine); against one process on the double batch
    the difference is rounding (1e-5, as tests/test_train.py)."""
    d, output = runs
    assert "torchrun, 2 rank(s) per node on this machine (torch engine)" in output
    start, = records(d / "torch", "start")
    assert start["engine"] == "torch" and start["world_size"] == 2 and start["global_batch"] == 4
    assert start["launcher"].startswith("torch (gloo; torchrun; rendezvous ")
    assert records(d / "horovod", "start")[0]["engine"] == "horovod"
    t, h, one = model_of(d / "torch"), model_of(d / "horovod"), model_of(d / "one")
    assert same(t, h)
    assert max(float((t[k] - one[k]).abs().max()) for k in t) <= 1e-5
    assert [r["loss"] for r in records(d / "torch", "train")] == pytest.approx(
        [r["loss"] for r in records(d / "one", "train")], rel=1e-3)


@pytest.mark.slow
def test_a_run_resumes_exactly_on_the_other_engine(runs, shards, tmp_path):
    """Horovod's step-3 checkpoint continued on the torch engine (under mpirun: MPI tells the
    ranks where rank 0 is) ends where Horovod's own run ends, and the torch engine's step-3
    checkpoint continued on Horovod ends where the torch engine's does: bit for bit."""
    d, _ = runs
    half = "checkpoints/step_00000003.pt"
    run(mpirun_cmd(2, train_argv(shards, tmp_path / "h2t", "--batch-size", "2", *STEPS,
                                 "--backend", "torch", "--resume", d / "horovod" / half)),
        timeout=240)
    run(horovodrun_cmd(2, train_argv(shards, tmp_path / "t2h", "--batch-size", "2", *STEPS,
                                     "--resume", d / "torch" / half)), timeout=240)
    assert same(model_of(tmp_path / "h2t"), model_of(d / "horovod"))
    assert same(model_of(tmp_path / "t2h"), model_of(d / "torch"))
    start, = records(tmp_path / "h2t", "start")
    assert start["engine"] == "torch" and start["launcher"].startswith("torch (gloo; openmpi")
    assert start["resumed_from"].endswith(half)


@pytest.mark.slow
def test_eval_on_the_torch_engine_gives_horovods_bpc(runs, shards):
    d, _ = runs
    argv = ["-m", "hvd_lm", "eval", d / "torch", shards, "--max-bytes", "3000", "--device", "cpu"]
    t = run(torchrun_cmd(2, [*argv, "--backend", "torch"]), timeout=240).stdout
    h = run(horovodrun_cmd(2, argv), timeout=240).stdout
    got = [json.loads(x[x.index("{"):]) for x in (t + h).splitlines() if '"bpc"' in x]
    assert len(got) == 2 and got[0]["world_size"] == got[1]["world_size"] == 2
    assert got[0]["bpc"] == got[1]["bpc"] and got[0]["chars"] == got[1]["chars"] > 2000


@pytest.mark.slow
def test_a_killed_rank_is_one_line_and_the_launch_ends_with_its_cause(shards, tmp_path):
    """Rank 1 exits at step 3 (a fault hook) under launch/torchrun.sh: rank 0's collective fails
    at once (the peer's connection closed), it prints one line naming rank 1 and its host and
    records it; torchrun stops the job; the template's last lines are the closing block."""
    out = tmp_path / "run"
    env = launch_env(NPROC_PER_NODE="2", OUT_DIR=str(out), PYTHON=sys.executable,
                     HVD_LM_FAULT_RANK="1", HVD_LM_FAULT_STEP="3",
                     TRAIN_ARGS=" ".join(map(str, ["--shards", shards, *TINY, "--batch-size", "2",
                                                   "--max-steps", "1000", "--checkpoint-every",
                                                   "2"])))
    proc = run(["bash", LAUNCH / "torchrun.sh"], timeout=240, env=env, cwd=tmp_path, check=False)
    text = proc.stdout + proc.stderr
    lines = [x for x in text.splitlines() if "ERROR: lost rank" in x]
    assert proc.returncode != 0 and len(lines) == 1, text[-4000:]
    assert re.match(r"hvd-lm train: ERROR: lost rank 1 on host \S+ \(\S+ refuses the "
                    r"connection: the host is up but the rank's process is gone\): a collective "
                    r"failed at step 4 after \d+\.\d s \(its peer's connection closed\)",
                    lines[0]), lines[0]
    rec, = records(out, "failure")
    assert rec["rank"] == 0 and rec["step"] == 3
    last = proc.stderr.rstrip().splitlines()[-5:]
    assert last[0] == f"==== hvd-lm: the job failed (exit status {proc.returncode}) ===="
    assert last[2] == f"newest complete checkpoint: {out / 'checkpoints' / 'step_00000002.pt'}"
    assert last[4] == f"cause: {rec['error']}" and rec["error"] in lines[0]


def test_what_one_engine_lacks_is_refused_in_one_line(shards, tmp_path):
    """Elastic training is Horovod's driver; bf16 on the wire is the torch engine's: each
    refused before anything runs, in one line (exit 2)."""
    for extra, says in (
            (["--backend", "torch", "--elastic", "true"],
             ("run.elastic is Horovod's elastic driver: train elastic jobs with --backend "
              "horovod")),
            (["--compression", "bf16"], "dist.compression bf16 needs --backend torch")):
        proc = run([sys.executable, *train_argv(shards, tmp_path / "x", "--max-steps", "2",
                                                *extra)], timeout=120, check=False)
        errors = [x for x in proc.stderr.splitlines() if "ERROR" in x]
        assert proc.returncode == 2 and len(errors) == 1 and says in errors[0], proc.stderr


@pytest.mark.slow
def test_onebit_adam_is_the_same_run_on_both_engines(shards, tmp_path):
    """1-bit Adam, 3 warmup steps (gradients averaged by each engine's distributed optimizer)
    then 5 compressed ones (alltoall + allgather of the 1-bit momentum): the torch engine's run
    is Horovod's bit for bit, and its checkpoint holds both ranks' error buffers."""
    common = ["--batch-size", "2", "--max-steps", "8", "--optimizer", "onebit-adam",
              "--onebit-warmup-steps", "3", "--compression", "none"]
    run(torchrun_cmd(2, train_argv(shards, tmp_path / "t", *common, "--backend", "torch")),
        timeout=240)
    run(horovodrun_cmd(2, train_argv(shards, tmp_path / "h", *common)), timeout=240)
    assert same(model_of(tmp_path / "t"), model_of(tmp_path / "h"))
    phases = [r["onebit_phase"] for r in records(tmp_path / "t", "train")]
    assert phases == ["warmup"] * 3 + ["compressed"] * 5
    errors = load(resolve(tmp_path / "t"))["optimizer"]["onebit_errors"]
    assert errors["world_size"] == 2 and float(errors["worker"].abs().max()) > 0


@pytest.mark.slow
def test_transfer_features_on_the_torch_engine_equal_one_process(tmp_path):
    """Featurization split over 2 torch-engine ranks (rank 0 two batches, rank 1 one: an
    allgather of unequal parts) gathers back one process's features (as tests/test_transfer.py
    under horovodrun)."""
    import numpy as np

    from hvd_lm.transfer import features as F
    from tests.test_transfer import TEXTS, tiny_model, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "run")
    texts = TEXTS + ["The end.", "Not bad at all."] + ["Short"]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    run(torchrun_cmd(2, [REPO / "tests/scripts/featurize_dist.py", ckpt, tmp_path / "texts.json",
                         tmp_path / "dist.npz", "--batch-size", "4", "--backend", "torch"]),
        timeout=240)
    got = np.load(tmp_path / "dist.npz")
    assert int(got["world_size"]) == 2
    for kind in F.FEATURE_KINDS:
        ref = F.featurize(tiny_model(), texts, kind, batch_size=4).features
        np.testing.assert_allclose(got[kind], ref, rtol=0, atol=1e-6, err_msg=kind)


@pytest.mark.slow
def test_a_stalled_peer_fails_after_the_gloo_timeout_in_one_line(shards, tmp_path):
    """Rank 1 sleeps 6 s in every step; --gloo-timeout-s 2 is the torch engine's collective
    timeout: rank 0's collective gives up after it, says so in one line (its peer still
    answers: not a lost host) and the job fails instead of hanging."""
    env = launch_env(HVD_LM_STEP_SLEEP="6", HVD_LM_STEP_SLEEP_RANK="1")
    proc = run(torchrun_cmd(2, train_argv(shards, tmp_path / "run", "--batch-size", "2",
                                          "--max-steps", "6", "--backend", "torch",
                                          "--gloo-timeout-s", "2")),
               timeout=120, env=env, check=False)
    lines = [x for x in proc.stderr.splitlines() if "ERROR" in x and "hvd-lm train" in x]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert ("every other rank still answers (the failure is not a lost host): a collective "
            "failed at step 1 (torch.distributed gave up after its timeout, "
            "--gloo-timeout-s=2 s)") in lines[0]
