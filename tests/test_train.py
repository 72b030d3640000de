"""Training: exact resume, overflow skipping counted a step late, preemption and rank death as
users launch them (real horovodrun/mpirun jobs), BPC. 2 ranks == 1 process on the concatenated
batch, a NaN step on 2 ranks, a resume on another world size: tests/parallel/test_training.py."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

import hvd_lm
from hvd_lm.formats.checkpoint import list_checkpoints, load, resolve
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.train.data import RankStreams
from hvd_lm.train.evaluate import bpc
from tests._mp import horovodrun_cmd, launch_env, mpirun_cmd, run
from tests.conftest import records
from tests.shardutil import make_shards, review_texts

TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--log-every", "1",
        "--lr", "3e-3", "--threads", "1", "--eval-chars", "2000", "--device", "cpu"]


def train_argv(shards, out, *extra) -> list:
    return ["-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out, *TINY, *extra]


def one_process(shards, out, *extra, **env):
    return run([sys.executable, *train_argv(shards, out, *extra)], timeout=300,
               env=launch_env(**env))


def params_of(run_dir) -> dict[str, torch.Tensor]:
    return load(resolve(run_dir))["model"]




def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_resume_is_exact(shards, tmp_path):
    """2N steps straight == N steps, stop, resume, N more steps (fp32, CPU): identical params."""
    common = ["--batch-size", "3", "--max-steps", "8", "--warmup-steps", "2"]
    one_process(shards, tmp_path / "straight", *common, "--checkpoint-every", "4")
    half = resolve(tmp_path / "straight" / "checkpoints" / "step_00000004.pt")
    one_process(shards, tmp_path / "resumed", *common, "--resume", str(half))
    a, b = params_of(tmp_path / "straight"), params_of(tmp_path / "resumed")
    assert max_diff(a, b) == 0.0
    assert records(tmp_path / "resumed", "start")[0]["resumed_from"] == str(half)
    assert [r["step"] for r in records(tmp_path / "resumed", "train")] == [5, 6, 7, 8]
    ck = torch.load(resolve(tmp_path / "resumed"), weights_only=True)  # plain dicts only
    assert ck["step"] == 8 and ck["window"] == 8


@pytest.mark.slow
def other_warnings(stderr):
    """The warning lines of ``stderr`` but the one a tiny corpus earns by design: its val split
    is under 64 KiB (formats.shards.SMALL_SPLIT_BYTES), too few bytes to measure BPC on."""
    return [line for line in stderr.splitlines()
            if "WARNING" in line and "too few to measure BPC on" not in line]


def test_max_steps_cycles_the_data_and_resumes_exactly(tmp_path):
    """On a corpus of a few reviews, ``--max-steps`` past one epoch trains every step (the data
    cycled; the LR decays over all of them; the start record says ``bound: max_steps``), a
    resume in the second epoch equals the straight run exactly, the checkpoint of the last step
    is written (and printed) once; an explicit ``--epochs 1`` still ends the run first, with a
    warning that ``--max-steps`` is not reached."""
    texts = review_texts(4)
    tiny = make_shards(tmp_path / "tiny", {"train": [texts[0:2]], "val": [texts[2:4]]})
    wpe = RankStreams(load_manifest(tiny), "train", 0, 1, 4, 16).windows_per_epoch
    assert 5 <= wpe <= 60, wpe
    every, steps = wpe + 2, 2 * (wpe + 2)  # a checkpoint in epoch 2, the last one in epoch 3
    common = ["--batch-size", "4", "--max-steps", str(steps), "--warmup-steps", "2"]
    proc = one_process(tiny, tmp_path / "straight", *common, "--checkpoint-every", str(every))
    start, = records(tmp_path / "straight", "start")
    assert start["bound"] == "max_steps" and start["total_steps"] == steps, start
    assert records(tmp_path / "straight", "end")[0]["step"] == steps
    train = records(tmp_path / "straight", "train")
    assert len(train) == steps and train[-1]["epoch"] > 2 and train[-1]["lr"] == 0.0
    assert [r["step"] for r in records(tmp_path / "straight", "checkpoint")] == [every, steps]
    assert proc.stdout.count(f"[checkpoint] step={steps} ") == 1, proc.stdout[-2000:]
    assert not other_warnings(proc.stderr), proc.stderr
    mid = tmp_path / "straight" / "checkpoints" / f"step_{every:08d}.pt"
    one_process(tiny, tmp_path / "resumed", *common, "--resume", str(mid))
    assert max_diff(params_of(tmp_path / "straight"), params_of(tmp_path / "resumed")) == 0.0
    proc = one_process(tiny, tmp_path / "epoch", *common, "--epochs", "1")
    assert other_warnings(proc.stderr) == [
        f"hvd-lm train: WARNING: --max-steps {steps} is not reached: --epochs 1 ends the run at "
        f"step {wpe} ({wpe} windows per epoch / 1); leave --epochs unset to let --max-steps "
        "decide"], proc.stderr
    assert records(tmp_path / "epoch", "start")[0]["bound"] == "epochs"
    assert records(tmp_path / "epoch", "end")[0]["step"] == wpe


def test_threads_follow_the_usable_cores_and_a_missing_tensorboard_is_said(shards, tmp_path):
    """Confined to one core (``taskset``, as a SLURM cpuset or an MPI binding confines a rank),
    the default ``--threads 0`` gives 1 thread (``os.cpu_count()`` would give this machine's 2),
    and ``--threads 2`` there warns in one line. ``--tensorboard true`` without the package
    (a stub that fails to import stands in where it is installed) says so in one line."""
    stub = tmp_path / "stub" / "tensorboard"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no tensorboard (test stub)')\n")
    env = launch_env()
    env["PYTHONPATH"] = f"{stub.parent}:{env['PYTHONPATH']}"
    argv = [str(a) for a in ["taskset", "-c", "0", sys.executable,
                             *train_argv(shards, tmp_path / "a"), "--batch-size", "2",
                             "--max-steps", "2"]]
    proc = run([*argv, "--threads", "0", "--tensorboard", "true"], env=env, timeout=120)
    assert records(tmp_path / "a", "start")[0]["threads"] == 1
    lines = proc.stderr.strip().splitlines()
    assert (
        "hvd-lm train: WARNING: --tensorboard true, but the tensorboard package is not installed "
        "(pip install tensorboard): no TensorBoard events are written; "
        f"{tmp_path / 'a' / 'metrics.jsonl'} has every record") in lines, proc.stderr
    assert not any("usable cores" in x for x in lines), proc.stderr  # 1 thread, 1 core: no warning
    assert not (tmp_path / "a" / "tensorboard").exists()
    argv[argv.index(str(tmp_path / "a"))] = str(tmp_path / "b")
    proc = run([*argv, "--threads", "2"], env=env, timeout=120)
    assert (
        f"hvd-lm train: WARNING: 1 rank(s) x 2 threads on {socket.gethostname()} exceed its 1 "
        "usable cores: steps can run 20-50x slower; use --threads 1 (0 picks that)"
    ) in proc.stderr.strip().splitlines(), proc.stderr


@pytest.mark.slow
def test_counting_a_step_late_equals_counting_every_step(shards, tmp_path):
    """Issue 43: with the skip decided on the device, the loop reads a step's outcome a step
    late where nothing depends on it (hvd_lm.train.counting). NaN losses at attempts 2 and 5,
    a record every 4 steps (attempts 2 and 5 are then read late, and undone before the next
    update), against a record every step (every outcome read at once): the same parameters
    bit for bit (every update used the same learning rate), the same skip records, and the
    4-step run's records equal the other's at those steps (step, LR, skipped steps)."""
    common = ["--batch-size", "2", "--max-steps", "9", "--warmup-steps", "4",
              "--inject-nan-steps", "2,5"]
    one_process(shards, tmp_path / "late", *common, "--log-every", "4")
    one_process(shards, tmp_path / "each", *common)  # TINY: --log-every 1
    assert max_diff(params_of(tmp_path / "late"), params_of(tmp_path / "each")) == 0.0
    skips = [records(tmp_path / d, "skip") for d in ("late", "each")]
    assert [(r["step"], r["skipped_steps"]) for r in skips[0]] == [(2, 1), (4, 2)]
    assert [{k: r[k] for k in ("step", "skipped_steps", "grad_norm")} for r in skips[0]] == \
        [{k: r[k] for k in ("step", "skipped_steps", "grad_norm")} for r in skips[1]]
    each = {r["step"]: r for r in records(tmp_path / "each", "train")}
    late = records(tmp_path / "late", "train")
    assert [r["step"] for r in late] == [4, 8, 9]
    for r in late:
        assert (r["lr"], r["skipped_steps"]) == (each[r["step"]]["lr"],
                                                 each[r["step"]]["skipped_steps"])
    assert records(tmp_path / "late", "end")[0]["skipped_steps"] == 2


@pytest.mark.slow
@pytest.mark.serial  # compares ranks' step times
def test_train_records_name_the_slowest_ranks_compute(shards, tmp_path):
    """One rank sleeps 0.15 s in every step, rank 1 on even steps and rank 0 on odd ones (a
    straggler that moves), records of 2 steps: each ``train`` record's ``compute_time_max``
    (each step's slowest rank outside the allreduce wait, s/step) holds the whole sleep, where
    the slowest rank's mean over the record would hold half of it; ``compute_time_mean`` is
    about half way (the other rank spent the 0.15 s waiting in the allreduce, which
    ``allreduce_wait`` shows), and the step is no shorter than its slowest rank. One process:
    the two are the same."""
    sleep = 0.15
    argv = train_argv(shards, tmp_path / "two", "--batch-size", "2", "--max-steps", "8",
                      "--log-every", "2")
    run(horovodrun_cmd(2, argv, "gloo"), timeout=300,
        env=launch_env(HVD_LM_STEP_SLEEP=str(sleep), HVD_LM_STEP_SLEEP_RANK="1,0"))
    train = records(tmp_path / "two", "train")[1:]
    assert len(train) == 3
    for r in train:
        assert sleep <= r["compute_time_max"] <= r["step_time"], r
        assert r["compute_time_max"] - r["compute_time_mean"] > 0.8 * sleep / 2, r
        assert r["allreduce_wait"] > 0.8 * sleep / 2 / r["step_time"], r  # rank 0's wait
    one_process(shards, tmp_path / "one", "--batch-size", "2", "--max-steps", "3")
    for r in records(tmp_path / "one", "train"):
        assert r["compute_time_max"] == pytest.approx(r["compute_time_mean"], rel=1e-9), r
        assert r["compute_time_max"] <= r["step_time"], r


def _rank_pids(launcher: psutil.Process) -> list[int]:
    return [p.pid for p in launcher.children(recursive=True)
            if "hvd_lm" in " ".join(p.cmdline()) and "horovodrun" not in " ".join(p.cmdline())
            and p.name().startswith("python")]


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly_on_all_ranks(shards, tmp_path):
    out = tmp_path / "pre"
    argv = train_argv(shards, out, "--batch-size", "2", "--max-steps", "100000")
    proc = subprocess.Popen([str(c) for c in horovodrun_cmd(2, argv, "gloo")], env=launch_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (out / "metrics.jsonl").exists() and len(records(out, "train")) >= 3:
                break
            time.sleep(0.5)
        pids = _rank_pids(psutil.Process(proc.pid))
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGTERM)  # preemption reaches one rank first
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    end = records(out, "end")[0]
    assert end["stop"] == "signal"
    ck = load(resolve(out))
    assert ck["step"] == end["step"] and ck["rnn_state"][0].shape == (4, 32)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun"])
def test_dead_rank_fails_the_job_without_hanging(shards, tmp_path, launcher):
    argv = train_argv(shards, tmp_path / "dead", "--batch-size", "2", "--max-steps", "100000")
    cmd = mpirun_cmd(2, argv) if launcher == "mpirun" else horovodrun_cmd(2, argv, "gloo")
    proc = run(cmd, timeout=150, check=False,  # a hang would be killed and fail the test
               env=launch_env(HVD_LM_FAULT_RANK="1", HVD_LM_FAULT_STEP="3"))
    assert proc.returncode != 0
    assert "injected fault at step 3" in proc.stdout + proc.stderr


def test_uniform_model_gives_exactly_8_bpc(shards):
    model = LanguageModel(ModelConfig(hidden_size=16, embed_dim=4))
    with torch.no_grad():
        model.decoder.weight.zero_()
        model.decoder.bias.zero_()
    streams = RankStreams(load_manifest(shards), "val", 0, 1, 3, 50, shuffle_shards=False)
    value, chars = bpc(model, streams, torch.device("cpu"), distributed=False)
    assert value == pytest.approx(8.0, abs=1e-12)
    assert chars == streams.chars_per_epoch


def test_eval_cli_matches_in_process_bpc(shards, tmp_path):
    one_process(shards, tmp_path / "r", "--batch-size", "2", "--max-steps", "3",
                "--checkpoint-every", "1", "--keep-checkpoints", "2")
    assert [p.name for p in list_checkpoints(tmp_path / "r")] == ["step_00000002.pt",
                                                                  "step_00000003.pt"]
    proc = run([sys.executable, "-m", "hvd_lm", "eval", tmp_path / "r", shards, "--split", "val",
                "--batch-size", "3", "--baselines", "xz,gzip"], timeout=120,
               env={**launch_env(), "HVD_LM_PROGRESS_EVERY_S": "1e-9"})
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    model = LanguageModel(ModelConfig(hidden_size=32, embed_dim=8))
    model.load_state_dict(params_of(tmp_path / "r"))
    streams = RankStreams(load_manifest(shards), "val", 0, 1, 3, 16, shuffle_shards=False)
    want, chars = bpc(model, streams, torch.device("cpu"), distributed=False)
    assert got["chars"] == chars and got["bpc"] == pytest.approx(want, rel=1e-6)
    assert 0 < got["bpc"] < 8.5 and math.isfinite(got["bpc"])
    # its progress into a log (stderr is a pipe): whole lines, chars/s, the last one at 100%
    shown = [x for x in proc.stderr.splitlines() if x.startswith("hvd-lm eval (rank 0): ")]
    assert "\r" not in proc.stderr and shown and all(" chars/s, " in x for x in shown)
    assert shown[-1].startswith(f"hvd-lm eval (rank 0): {chars:,} of {chars:,} chars (100%)")
    # --baselines: xz -9 and gzip -9 on the split's bytes, read here from the shards themselves
    import gzip
    import lzma

    import h5py
    data = b"".join(np.asarray(h5py.File(s.path, "r")["tokens"]).tobytes()
                    for s in load_manifest(shards).split("val"))
    assert got["baselines"] == {
        "xz": pytest.approx(8 * len(lzma.compress(data, preset=9)) / len(data), rel=1e-12),
        "gzip": pytest.approx(8 * len(gzip.compress(data, 9, mtime=0)) / len(data), rel=1e-12)}


def test_the_logged_val_bpc_is_what_eval_reports_whatever_the_batch(shards, tmp_path):
    """Training's last evaluation reads the val split as `hvd-lm eval` does (32 rows in all,
    --eval-batch-size), not cut into --batch-size rows: its val_bpc equals eval's on the final
    checkpoint, where the split cut into the 8 training rows gives another figure (before: the
    logged 1.696 beside eval's 1.660 of the H200's 4096-d run, 256 rows against 16)."""
    one_process(shards, tmp_path / "r", "--batch-size", "8", "--max-steps", "40", "--eval-chars",
                "0", "--lr", "1e-2")
    (last,) = records(tmp_path / "r", "eval")
    proc = run([sys.executable, "-m", "hvd_lm", "eval", tmp_path / "r", shards], timeout=120)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["val_chars"] == got["chars"]
    assert last["val_bpc"] == pytest.approx(got["bpc"], rel=1e-6)
    model = LanguageModel(ModelConfig(hidden_size=32, embed_dim=8))
    model.load_state_dict(params_of(tmp_path / "r"))
    eight = RankStreams(load_manifest(shards), "val", 0, 1, 8, 16, shuffle_shards=False)
    other, _ = bpc(model, eight, torch.device("cpu"), distributed=False)
    assert abs(other - got["bpc"]) > 1e-4


@pytest.mark.slow
def test_validation_is_the_same_on_1_2_and_4_ranks(shards, tmp_path):
    """30 validation rows in all (--eval-batch-size), split over the ranks (4 ranks: 8, 7, 8, 7
    rows): the val BPC a one-process run logged is what `hvd-lm eval` of its checkpoint reports
    on 1, 2 and 4 ranks of horovodrun (the same rows, summed in another order: within 1e-4), the
    same characters each time. Before, each rank cut 16 rows of its own: 4 ranks scored the split
    cut into 64 rows, another figure."""
    one_process(shards, tmp_path / "r", "--batch-size", "4", "--max-steps", "10",
                "--eval-chars", "0", "--eval-batch-size", "30", "--lr", "1e-2")
    (last,) = records(tmp_path / "r", "eval")
    for n in (1, 2, 4):
        argv = ["-m", "hvd_lm", "eval", str(tmp_path / "r"), str(shards), "--threads", "1"]
        out = run(horovodrun_cmd(n, argv) if n > 1 else [sys.executable, *argv],
                  timeout=300).stdout
        line = [x for x in out.splitlines() if '"bpc"' in x][-1]
        got = json.loads(line[line.index("{"):])
        assert (got["world_size"], got["rows"], got["chars"]) == (n, 30, last["val_chars"])
        assert got["bpc"] == pytest.approx(last["val_bpc"], abs=1e-4), n


@pytest.mark.slow
def test_a_run_resized_4_to_2_to_3_ranks_says_what_each_new_cut_rereads_and_skips(shards,
                                                                               tmp_path):
    """3 steps on 4 horovodrun ranks, 3 more on 2, 3 more on 3 (``--resume auto``, 2 rows per
    rank): each resume continues at the same point of the epoch and rank 0 alone says in one
    line which window of which cut it left and took, and how many bytes of the epoch the new cut
    re-reads and skips, the figures those of the streams cut by hand here (bool marks of every
    target, :func:`tests.test_step.epoch_marks`)."""
    import re

    from tests.test_step import epoch_marks
    manifest = load_manifest(shards)
    total = sum(s.tokens for s in manifest.split("train"))
    out, saved = tmp_path / "r", None
    for n, steps in ((4, 3), (2, 6), (3, 9)):
        argv = train_argv(shards, out, "--batch-size", "2", "--max-steps", str(steps),
                          *(["--resume", "auto"] if saved else []))
        proc = run(horovodrun_cmd(n, argv), timeout=300)
        said = [x for x in (proc.stdout + proc.stderr).splitlines() if "cut anew" in x]
        wpe = RankStreams(manifest, "train", 0, n, 2, 16).windows_per_epoch
        if saved:
            assert len(said) == 1, said
            m = re.search(r"written by (\d+) rows, this job has (\d+) .*\(window (\d+) of (\d+) "
                          r"-> (\d+) of (\d+)\): this epoch re-reads ([\d,]+) bytes and skips "
                          r"([\d,]+)", said[0])
            old_rows, rows, old, old_wpe, new, new_wpe = map(int, m.groups()[:6])
            assert (old_rows, rows, old_wpe, new_wpe) == (saved["rows"], 2 * n,
                                                          saved["windows_per_epoch"], wpe)
            assert old == saved["window"] and new == round(old * wpe / old_wpe)
            a, b = epoch_marks(total, old_rows, old, 16), epoch_marks(total, rows, new, 16)
            assert [int(x.replace(",", "")) for x in m.groups()[6:]] == [
                int(np.sum(a & ~b)), int(np.sum(b & ~a))]
        ck = load(resolve(out))
        assert ck["step"] == steps and ck["window"] < ck["windows_per_epoch"]  # in epoch 0
        saved = {"rows": ck["rnn_state"][0].shape[0], "window": ck["window"],
                 "windows_per_epoch": ck["windows_per_epoch"]}


@pytest.mark.slow
def test_a_bad_resume_on_three_ranks_is_one_error_line(shards, tmp_path):
    """Rank 0 reads the checkpoint to resume and the others learn its outcome (#61: they no
    longer read the file): a missing one stops all three ranks, rank 0 alone printing the line
    (the others' copy of it is not printed again)."""
    argv = train_argv(shards, tmp_path / "r", "--batch-size", "2", "--max-steps", "2",
                      "--resume", str(tmp_path / "missing.pt"))
    proc = run(horovodrun_cmd(3, argv), timeout=300, check=False)
    errors = [x for x in (proc.stdout + proc.stderr).splitlines() if "ERROR:" in x]
    assert proc.returncode != 0 and len(errors) == 1, errors  # (horovodrun adds a traceback)
    assert errors[0].startswith("[0]<stderr>:hvd-lm train: ERROR: no checkpoint at ")
    assert not (tmp_path / "r").exists()


def test_a_checkpoint_resumes_on_another_device(tmp_path):
    """A checkpoint read for a job on another device (here the meta device standing in for a
    GPU, which the CPU lacks) restores the RNG states exactly (torch takes CPU generator states
    only: loading onto the job's device raised TypeError), the weights and Adam's state, and
    puts the recurrent state rows on the job's device."""
    import random

    from hvd_lm.formats.checkpoint import save
    from hvd_lm.train.guard import DivergenceGuard
    from hvd_lm.train.resume import Position, Resume, payload
    from hvd_lm.train.schedule import LRPlan

    torch.manual_seed(3)
    model = LanguageModel(ModelConfig(hidden_size=8, embed_dim=4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 5)), model.init_state(2, torch.device("cpu")))[0] \
        .float().sum().backward()
    opt.step()
    sched = LRPlan(1e-3, 0, 10, "linear")
    rows = (torch.randn(2, 8), torch.randn(2, 8))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # fp32's
    save(payload(Position(step=1, window=1), model, opt, sched, scaler,
                 DivergenceGuard(10.0, 3, 0), rows, {}, 1), tmp_path, 1)
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    resume = Resume(tmp_path, "meta")  # the job trains on another device
    fresh = LanguageModel(ModelConfig(hidden_size=8, embed_dim=4))
    resume.restore_model(fresh)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    resume.restore_optimizer(fresh_opt, LRPlan(1e-3, 0, 10, "linear"))
    h, c = resume.rnn_rows(0, 1, 2)
    resume.restore_rng()
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want
    assert h.device.type == c.device.type == "meta" and tuple(h.shape) == (2, 8)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    moments = [s["exp_avg"] for s in fresh_opt.state.values()]
    assert moments and all(m.device.type == "cpu" for m in moments)
    assert torch.equal(moments[0], next(iter(opt.state.values()))["exp_avg"])


def _no_horovod(tmp_path) -> str:
    """A folder whose ``horovod`` package fails to import (put first on PYTHONPATH)."""
    (tmp_path / "block" / "horovod").mkdir(parents=True)
    (tmp_path / "block" / "horovod" / "__init__.py").write_text(
        "raise ImportError('No module named horovod (blocked by the test)')\n")
    return str(tmp_path / "block")


def test_one_process_trains_and_evaluates_without_horovod(shards, tmp_path):
    """Where Horovod is not installed (a workstation, a GPU node before its build), one process
    trains, checkpoints, resumes and evaluates as the one rank of its world (on the torch
    engine): the same parameters as the run with Horovod, bit for bit (neither adds hooks at
    size 1), the start record names the torch engine; two ranks without it stop with one ERROR
    line."""
    common = ["--batch-size", "3", "--max-steps", "6", "--warmup-steps", "2", "--precision",
              "bf16", "--checkpoint-every", "3"]
    one_process(shards, tmp_path / "with", *common)
    block = {"PYTHONPATH": os.pathsep.join([_no_horovod(tmp_path), str(hvd_lm.REPO_ROOT)])}
    one_process(shards, tmp_path / "without", *common, **block)
    assert max_diff(params_of(tmp_path / "with"), params_of(tmp_path / "without")) == 0.0
    start = records(tmp_path / "without", "start")[0]
    assert start["engine"] == "torch", start
    half = tmp_path / "without" / "checkpoints" / "step_00000003.pt"
    one_process(shards, tmp_path / "resumed", *common, "--resume", half, **block)
    assert max_diff(params_of(tmp_path / "with"), params_of(tmp_path / "resumed")) == 0.0
    ev = run([sys.executable, "-m", "hvd_lm", "eval", tmp_path / "without", shards],
             timeout=120, env=launch_env(**block))
    assert 0 < json.loads(ev.stdout.strip().splitlines()[-1])["bpc"] < 8.5
    two = subprocess.run([sys.executable, *train_argv(shards, tmp_path / "two")],
                         env=launch_env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0",
                                        **block), capture_output=True, text=True, timeout=120)
    errors = [x for x in two.stderr.splitlines() if "ERROR:" in x]
    assert two.returncode == 1 and "Traceback" not in two.stderr and len(errors) == 1, two.stderr
    assert "Horovod is not installed" in errors[0] and "2 ranks" in errors[0]
