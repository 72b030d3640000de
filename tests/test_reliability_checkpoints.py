"""Failure behaviour of checkpoints (README "Failure behaviour"): clear load errors, the
fallback to an older one, no config rewrite, an exact character count across world sizes, and
a finite divergence that stops the run keeping the checkpoint written before it."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from hvd_lm.formats import checkpoint as ck
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.train import preflight
from hvd_lm.train.loop import TRAIN
from tests.conftest import records
from tests.reliability_common import (  # noqa: F401 - the fixtures these tests take
    HVD_LM,
    TINY,
    hvd_lm,
    one_error_line,
)

# ---- 8/9. checkpoints: clear load errors, fallback, no config rewrite, exact chars ---------------

def test_eval_on_files_that_are_not_checkpoints(shards, tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    proc = hvd_lm("eval", tmp_path / "x.json", shards, timeout=60)
    one_error_line(proc, "x.json: not an hvd_lm checkpoint (JSON")
    shard = sorted(Path(shards).glob("val-*.h5"))[0]
    proc = hvd_lm("eval", shard, shards, timeout=60)
    one_error_line(proc, "not an hvd_lm checkpoint (an HDF5 file")
    good = ck.save({"model": {"w": torch.ones(300)}, "step": 1, "config": {}}, tmp_path / "r", 1)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:200])
    proc = hvd_lm("eval", cut, shards, timeout=60)
    one_error_line(proc, "cut.pt: truncated or damaged checkpoint")
    assert "weights_only" not in proc.stderr


@pytest.mark.slow
def test_resume_auto_skips_a_damaged_newest_checkpoint(shards, tmp_path):
    out = tmp_path / "r"
    ok = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "4",
                "--checkpoint-every", "2")
    assert ok.returncode == 0, ok.stderr
    newest = ck.resolve(out)
    assert newest.name == "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "6",
                  "--checkpoint-every", "2", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "step_00000004.pt: truncated or damaged checkpoint" in proc.stderr
    start = records(out, "start")[-1]
    assert start["resumed_from"].endswith("step_00000002.pt") and start["step"] == 2


def test_start_record_holds_the_preflight_memory_estimate(shards, tmp_path):
    """The start record's step_memory_bytes is the preflight's estimate per rank for that run
    (preflight.check_memory with the run's settings, one rank on the CPU)."""
    argv = ["--shards", str(shards), "--out-dir", str(tmp_path / "r"), *map(str, TINY),
            "--max-steps", "1"]
    assert hvd_lm("train", *argv).returncode == 0
    parser = argparse.ArgumentParser()
    TRAIN.add_arguments(parser)
    cfg = TRAIN.settings(parser.parse_args(argv))
    est = preflight.check_memory(cfg, load_manifest(shards), torch.device("cpu"), 1, 1)
    assert records(tmp_path / "r", "start")[0]["step_memory_bytes"] == est.total > 0


def test_failed_resume_with_another_shape_changes_nothing(shards, tmp_path):
    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "2").returncode == 0
    before = (out / "config.yaml").read_text()
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "4",
                  "--resume", "auto", "--hidden-size", "64")
    assert proc.returncode == 1
    one_error_line(proc, "written for a model of another shape", "rnn.w_x.weight is [128, 8] there")
    assert (out / "config.yaml").read_text() == before


# ---- 10. issue 27: a finite divergence stops the run --------------------------------------------

def test_finite_divergence_stops_on_default_settings(shards, tmp_path):
    """`--lr 1e6 --max-steps 300`, nothing else changed: the loss explodes to millions of nats,
    every value finite; the run stops after 3 logged steps (of 10) above 2 ln 256 nats with one
    line and exit 1, never reaches step 300 and writes no checkpoint."""
    out = tmp_path / "r"
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--log-every", "10",
                  "--lr", "1e6", "--max-steps", "300")
    assert proc.returncode == 1, proc.stderr
    one_error_line(proc, "training diverged", "above --divergence-loss 11.09", "3 logged step",
                   "steps 10-30")
    train = records(out, "train")
    assert [r["step"] for r in train] == [10, 20, 30]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 2 * math.log(256) for r in train)
    end = records(out, "end")[-1]
    assert end["stop"] == "diverged" and end["step"] == 30
    assert ck.list_checkpoints(out) == [] and json.loads((out / "summary.json").read_text())[
        "stop"] == "diverged"


def test_finite_divergence_keeps_the_checkpoint_written_before_it(shards, tmp_path):
    """3 good steps (checkpointed), then the run continued with --lr 1e6 and
    --keep-checkpoints 1: the checkpoint of step 4 (the weights after the first 1e6 step) is
    moved to checkpoints/diverged/, the good step-3 checkpoint survives the pruning and is
    latest again, bit for bit what the first job wrote."""
    out = tmp_path / "r"
    first = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "3",
                   "--checkpoint-every", "1", "--keep-checkpoints", "1")
    assert first.returncode == 0, first.stderr
    good = ck.resolve(out)
    assert good.name == "step_00000003.pt"
    good_bytes = good.read_bytes()
    proc = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "300",
                  "--lr", "1e6", "--checkpoint-every", "1", "--keep-checkpoints", "1",
                  "--resume", "auto")
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc, "training diverged", "steps 5-7", str(good),
                          "1 written since moved to")
    assert "is latest" in line
    assert ck.resolve(out) == good and good.read_bytes() == good_bytes
    assert ck.list_checkpoints(out) == [good]
    aside = ck.checkpoint_dir(out) / "diverged" / "step_00000004.pt"
    assert aside.exists()
    assert float(ck.load(aside)["model"]["embed.weight"].abs().max()) > 1e3  # really diverged
    assert [r["step"] for r in records(out, "checkpoint_held")] == [5, 6]


def test_divergence_guard_rules():
    """The rule on its own: NaN counts as above, a good log resets the count, a run ending
    above the bound is diverged, checkpoints are held while above, the state round-trips."""
    from hvd_lm.train.guard import DivergenceGuard

    g = DivergenceGuard(11.09, 3, 0, start_step=0)
    g.logged(10, 5.6)
    g.logged(20, 50.0)
    assert not g.may_checkpoint() and g.reason is None
    g.logged(30, float("nan"))
    g.logged(40, 5.0)  # recovered: count reset
    assert g.may_checkpoint() and g.confirmed_below() == 40
    for s in (50, 60, 70):
        g.logged(s, float("inf"))
    assert g.reason == "loss"
    h = DivergenceGuard(11.09, 3, 0)
    h.load_state_dict(g.state_dict())
    assert h.above == g.above and h.last_good_step == 40
    end = DivergenceGuard(11.09, 3, 0)
    end.logged(5, 12.0)
    end.at_end()
    assert end.reason == "loss"
    off = DivergenceGuard(11.09, 0, 0)  # loss rule off: a high loss holds nothing back
    off.logged(10, 50.0)
    assert off.may_checkpoint() and off.confirmed_below() == 10 and not off.above
    skips = DivergenceGuard(11.09, 0, 2)
    skips.attempt(False)
    skips.attempt(True)
    skips.attempt(False)
    assert skips.reason is None
    skips.attempt(False)
    assert skips.reason == "skipped"


def test_pruning_keeps_the_newest_confirmed_checkpoint(tmp_path):
    for step in (1, 2, 3):
        ck.save({"model": {"w": torch.ones(2)}}, tmp_path, step, keep=1, protect_below=3)
    names = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert names == ["step_00000002.pt", "step_00000003.pt"]  # 2 kept: newest below 3
    ck.save({"model": {"w": torch.ones(2)}}, tmp_path, 4, keep=1)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000004.pt"]


def test_the_checkpoint_a_job_resumed_from_is_confirmed(tmp_path):
    """Resumed at step 4 with --keep-checkpoints 1: before any loss is logged, step 4's
    checkpoint (not this job's) is the confirmed one: pruning keeps it, and a divergence
    moves this job's checkpoints aside and points latest back at it."""
    from hvd_lm.train.guard import DivergenceGuard

    ck.save({"model": {"w": torch.ones(2)}}, tmp_path, 4, keep=1)
    guard = DivergenceGuard(max_loss=11.09, logs=1, max_skipped=0, start_step=4)
    for step in (5, 6):
        ck.save({"model": {"w": torch.ones(2)}}, tmp_path, step, keep=1,
                protect_below=guard.confirmed_below())
        guard.wrote(step)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000004.pt",
                                                               "step_00000006.pt"]
    guard.logged(6, 20.0)
    latest, moved = guard.settle(tmp_path)
    assert latest.name == "step_00000004.pt" and [p.name for p in moved] == ["step_00000006.pt"]
    assert ck.resolve(tmp_path) == latest


