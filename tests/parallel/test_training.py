"""Training inside the ranks: ``hvd-lm train`` (the command line's own entry point,
``hvd_lm.cli.main``, on every rank of a real 2-rank job) and what reads its runs, under Horovod
(horovodrun's Gloo controller, mpirun) and the torch engine (torchrun, mpirun).

* 2 ranks x batch 2 == 1 process x batch 4 after 6 Adam steps (the one-process run made by
  :func:`prepare`), on every launch: float rounding only (1e-5); with fp16 on the wire the bound
  of tests/test_train.py's docstring (every |diff| <= steps x lr, 99% within 1e-3).
* The torch engine's 2-rank run is Horovod's bit for bit (sums of two fp32 addends and halving
  are exact whatever the engine); a checkpoint of either engine resumes on the other exactly;
  ``hvd-lm eval`` on 2 ranks gives the same BPC on both; 1-bit Adam is the same run on both.
* A NaN loss on rank 0 poisons the allreduced gradient on both ranks: both skip the step and
  count it, the LR schedule holds.
* A one-rank run resumed on 2 ranks continues at the same point of the epoch with the rule's LR
  for the new global batch (the recurrent state reset, with a warning).
* Featurization split over the ranks (rank 0 two batches, rank 1 one: an allgather of unequal
  parts) gathers back one process's features.
* ``hvd-lm eval`` in one process of a 2-rank run's checkpoint gives the val BPC training logged
  (:func:`after`: eval's default rows are the training's), and a 2-rank run resumed in one
  process counts every character once.
* 1-bit Adam / LAMB checkpoints hold no per-rank error buffers; a resume restarts the error
  feedback from zero, with a warning,
  and 1-bit Adam trains within 0.05 BPC of Adam; a finite divergence stops both ranks at the
  same step; tflops are per rank and ``--peak-tflops`` overrides the peak.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hvd_lm.cli import main
from hvd_lm.formats.checkpoint import load, resolve
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.train.data import RankStreams
from hvd_lm.train.schedule import lr_factor
from tests.conftest import records
from tests.parallel.conftest import ENGINE, LAUNCHER, SHARED

LAUNCHES = [("horovodrun-gloo", "horovod"), ("torchrun", "torch"), ("mpirun", "horovod"),
            ("mpirun", "torch")]

TINY = ["--hidden-size", "32", "--embed-dim", "8", "--seq-len", "16", "--log-every", "1",
        "--lr", "3e-3", "--threads", "1", "--eval-chars", "2000", "--device", "cpu"]
STEPS = ["--max-steps", "6", "--checkpoint-every", "3", "--compression", "none"]
SQRT_LR = ["--batch-size", "2", "--lr-rule", "sqrt", "--lr-ref-batch", "2", "--lr-decay", "none"]
ONEBIT = ["--batch-size", "2", "--max-steps", "8", "--optimizer", "onebit-adam",
          "--onebit-warmup-steps", "3", "--compression", "none"]
HOROVOD, TORCH = "horovodrun-gloo-horovod", "torchrun-torch"


def prepare(shared: Path) -> None:
    """In the launching process, before any rank: the shards and the one-process runs the ranks
    compare with (each a real ``python -m hvd_lm train``)."""
    from tests._mp import run
    from tests.shardutil import default_shards, make_shards, review_texts

    shards = default_shards(shared / "shards")

    def train(out, *extra):
        run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir",
             shared / out, *TINY, *extra], timeout=300)

    train("one", "--batch-size", "4", *STEPS)
    train("one-rank", *SQRT_LR, "--max-steps", "6")
    texts = review_texts(700)
    make_shards(shared / "reviews", {"train": [texts[0:200], texts[200:400], texts[400:600]],
                                     "val": [texts[600:700]]})


def after(shared: Path) -> None:
    """In one process, after the ranks: ``hvd-lm eval``'s default rows are the training's (32
    in all, 16 on each of its 2 ranks), so evaluating the 2-rank run's checkpoint gives the val
    BPC it logged; ``--batch-size 16`` another figure, as each row starts at zero."""
    from tests._mp import run
    run_dir, shards = shared / HOROVOD / "logged", shared / "shards"
    (last,) = [r for r in records(run_dir) if r["kind"] == "eval"]

    def evaluate(*extra):
        out = run([sys.executable, "-m", "hvd_lm", "eval", run_dir, shards, *extra],
                  timeout=120).stdout
        return json.loads(out.strip().splitlines()[-1])

    got = evaluate()
    assert got["rows"] == 32 and last["val_chars"] == got["chars"]
    assert last["val_bpc"] == pytest.approx(got["bpc"], rel=1e-6)
    other = evaluate("--batch-size", "16")
    assert other["rows"] == 16 and abs(other["bpc"] - got["bpc"]) > 1e-5
    # 2 ranks x 3 steps, resumed in one process for 3 more: every character counted once
    # (batch 2 rows x 16 bytes per window, every window full at this size)
    chars = shared / HOROVOD / "chars"
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir", chars, *TINY,
         "--batch-size", "2", "--max-steps", "6", "--resume", "auto"], timeout=120)
    ends = records(chars, "end")
    assert [e["chars_trained"] for e in ends] == [2 * 3 * 2 * 16, 2 * 3 * 2 * 16 + 3 * 2 * 16]


# ---- helpers ------------------------------------------------------------------------------------

def here(name: str) -> Path:
    """This launch's run folder ``name`` (every launch of the module keeps its own)."""
    return SHARED / f"{LAUNCHER}-{ENGINE}" / name


def train(out: Path, *extra) -> None:
    """``hvd-lm train`` on every rank of this job, on this session's engine; returns once every
    rank is back (rank 0's files are complete)."""
    from hvd_lm.comm import engine
    assert main(["train", "--shards", str(SHARED / "shards"), "--out-dir", str(out), *TINY,
                 *map(str, extra), "--backend", ENGINE]) == 0
    engine.barrier()




def model_of(path: Path) -> dict[str, torch.Tensor]:
    return load(resolve(path))["model"]


def bytes_beside_rows(path: Path) -> int:
    """Bytes of a run's newest checkpoint's tensors besides the recurrent rows (what a rank adds
    to every checkpoint must be its rows alone)."""
    def size(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
        return sum(map(size, items))
    return size({k: v for k, v in load(resolve(path)).items() if k != "rnn_state"})


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def only(*launches: str):
    return pytest.mark.skipif(f"{LAUNCHER}-{ENGINE}" not in launches,
                              reason=f"runs under {', '.join(launches)}")


# ---- the tests ---------------------------------------------------------------------------------

def test_two_ranks_equal_one_process_on_the_double_batch(ctx):
    train(here("two"), "--batch-size", "2", *STEPS)
    two, one = model_of(here("two")), model_of(SHARED / "one")
    assert max(float((two[k] - one[k]).abs().max()) for k in one) <= 1e-5
    init = load(resolve(here("two") / "checkpoints" / "step_00000003.pt"))["model"]
    assert max(float((one[k] - init[k]).abs().max()) for k in one) > 1e-3  # it moved
    # the 2-rank file is the one-process file with each rank's rows gathered in rank order
    assert bytes_beside_rows(here("two")) == bytes_beside_rows(SHARED / "one")
    assert load(resolve(here("two")))["rnn_state"][0].shape == (4, 32)
    start, = records(here("two"), "start")
    assert (start["world_size"], start["global_batch"], start["engine"]) == (2, 4, ENGINE)
    # the logged training loss is the global one: the same in both runs
    np.testing.assert_allclose([r["loss"] for r in records(here("two"), "train")],
                               [r["loss"] for r in records(SHARED / "one", "train")], rtol=1e-3)


@only(HOROVOD, TORCH)
def test_fp16_on_the_wire_stays_within_its_bound(ctx):
    """fp16 rounds each gradient to 11 significant bits and flushes those below 6e-8 to 0;
    Adam's update m/sqrt(v) is ~lr whatever the gradient's size, so a flushed element can
    differ by up to lr per step: every |diff| <= 6 x lr, 99% of them within 1e-3."""
    train(here("fp16"), "--batch-size", "2", *STEPS[:-1], "fp16")
    two, one = model_of(here("fp16")), model_of(SHARED / "one")
    diff = torch.cat([(two[k] - one[k]).abs().flatten() for k in one])
    assert float(diff.max()) <= 6 * 3e-3 and float((diff > 1e-3).float().mean()) < 0.01


@only(TORCH)
def test_the_torch_engines_run_is_horovods_bit_for_bit(ctx):
    assert same(model_of(here("two")), model_of(SHARED / HOROVOD / "two"))
    assert records(here("two"), "start")[0]["launcher"].startswith("torch (gloo; torchrun; ")


@only("mpirun-horovod", "mpirun-torch")
def test_a_run_resumes_exactly_on_the_other_engine(ctx):
    """Horovod's step-3 checkpoint continued on the torch engine (under mpirun: MPI tells the
    ranks where rank 0 is) ends where Horovod's own run ends, and the torch engine's on Horovod
    where the torch engine's does: bit for bit."""
    other = TORCH if ENGINE == "horovod" else HOROVOD
    half = SHARED / other / "two" / "checkpoints" / "step_00000003.pt"
    train(here("resumed"), "--batch-size", "2", *STEPS, "--resume", half)
    assert same(model_of(here("resumed")), model_of(SHARED / other / "two"))
    start, = records(here("resumed"), "start")
    assert start["engine"] == ENGINE and start["resumed_from"] == str(half)
    if ENGINE == "torch":
        assert start["launcher"].startswith("torch (gloo; openmpi")


def test_eval_on_two_ranks_gives_the_same_bpc_on_both_engines(ctx, capsys):
    assert main(["eval", str(SHARED / "one"), str(SHARED / "shards"), "--max-bytes", "3000",
                 "--device", "cpu", "--backend", ENGINE]) == 0
    if ctx.rank == 0:
        line = [x for x in capsys.readouterr().out.splitlines() if '"bpc"' in x][-1]
        got = json.loads(line[line.index("{"):])
        assert got["world_size"] == 2 and got["chars"] > 2000
        here("eval.json").parent.mkdir(parents=True, exist_ok=True)
        here("eval.json").write_text(json.dumps(got))
        if ENGINE == "torch" and LAUNCHER == "torchrun":
            theirs = json.loads((SHARED / HOROVOD / "eval.json").read_text())
            assert (got["bpc"], got["chars"]) == (theirs["bpc"], theirs["chars"])


@only(HOROVOD, TORCH)
def test_onebit_adam_is_the_same_run_on_both_engines(ctx):
    """3 warmup steps (gradients averaged by each engine's distributed optimizer), then 5
    compressed ones (alltoall + allgather of the 1-bit momentum); the checkpoint holds no
    per-rank error buffers."""
    train(here("onebit"), *ONEBIT)
    phases = [r["onebit_phase"] for r in records(here("onebit"), "train")]
    assert phases == ["warmup"] * 3 + ["compressed"] * 5
    assert "onebit_errors" not in load(resolve(here("onebit")))["optimizer"]
    assert bytes_beside_rows(here("onebit")) == bytes_beside_rows(here("two"))  # Adam's state
    if ENGINE == "torch":
        assert same(model_of(here("onebit")), model_of(SHARED / HOROVOD / "onebit"))


@only(HOROVOD)
def test_a_nan_step_is_skipped_and_counted_on_both_ranks(ctx):
    train(here("nan"), "--batch-size", "2", "--max-steps", "5", "--inject-nan-steps", "2",
          "--compression", "none")
    skips = records(here("nan"), "skip")
    assert len(skips) == 1 and skips[0]["step"] == 2 and skips[0]["skipped_steps"] == 1
    train_recs = records(here("nan"), "train")
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5]
    want = [3e-3 * lr_factor(s, 0, 5) for s in range(1, 6)]  # LR after applied step s
    np.testing.assert_allclose([r["lr"] for r in train_recs], want, rtol=1e-9, atol=1e-12)
    assert records(here("nan"), "end")[0]["skipped_steps"] == 1
    assert all(torch.isfinite(v).all() for v in model_of(here("nan")).values())


@only(HOROVOD)
def test_a_run_whose_validation_one_process_reads_back(ctx):
    """The whole val split at the end of a 2 x 4-row run: :func:`after` evaluates it in one
    process."""
    train(here("logged"), "--batch-size", "4", "--max-steps", "6", "--eval-chars", "0")
    assert [r["val_chars"] > 0 for r in records(here("logged"), "eval")] == [True]


@only("mpirun-horovod")
def test_a_one_rank_run_resumed_on_two_keeps_the_epoch_point_and_rescales_the_lr(ctx, capfd):
    """1 rank x 2 rows for 6 steps (:func:`prepare`), then ``--resume auto`` on 2 ranks: the
    streams are cut for 4 rows, so the window index moves to the same point of the epoch (the
    cut's windows per epoch computed here independently), the peak LR is the rule's for the new
    global batch, and the recurrent state restarts from zero with a warning."""
    run_dir = here("resized")
    from hvd_lm.comm import engine
    if ctx.rank == 0:
        shutil.copytree(SHARED / "one-rank", run_dir)
    engine.barrier()
    train(run_dir, *SQRT_LR, "--max-steps", "9", "--resume", "auto")
    if ctx.rank == 0:
        assert "recurrent state reset" in capfd.readouterr().err
    manifest = load_manifest(SHARED / "shards")
    wpe1 = RankStreams(manifest, "train", 0, 1, 2, 16).windows_per_epoch
    wpe2 = RankStreams(manifest, "train", 0, 2, 2, 16).windows_per_epoch
    assert wpe1 != wpe2
    epoch, w = divmod(6, wpe1)
    ck = load(resolve(run_dir))
    assert ck["step"] == 9 and ck["world_size"] == 2 and ck["windows_per_epoch"] == wpe2
    assert ck["window"] == epoch * wpe2 + round(w * wpe2 / wpe1) + 3
    recs = records(run_dir, "train")
    assert [r["lr"] for r in recs] == pytest.approx([3e-3] * 6 + [3e-3 * math.sqrt(2)] * 3)
    assert [r["world_size"] for r in recs] == [1] * 6 + [2] * 3


def test_featurizing_over_the_ranks_gathers_one_processs_features(ctx):
    """11 texts in batches of 4 (rank 0 gets two batches, rank 1 one), all four kinds, to 1e-6."""
    from hvd_lm.transfer import features as F
    from tests.test_transfer import TEXTS, tiny_model

    texts = TEXTS + ["The end.", "Not bad at all."] + ["Short"]
    model = tiny_model()
    for kind in F.FEATURE_KINDS:
        got = F.featurize(model, texts, kind, batch_size=4, ctx=ctx, progress=False).features
        ref = F.featurize(model, texts, kind, batch_size=4).features
        if ctx.rank == 0:
            assert got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=kind)


@only(HOROVOD)
@pytest.mark.parametrize("optimizer", ["onebit-adam", "onebit-lamb"])
def test_onebit_resume_restarts_the_error_feedback(ctx, capfd, optimizer):
    """Warmup 3 steps: 8 steps straight, and 5 steps, checkpoint, resume, 3 more. The checkpoint
    holds no error buffers (per-rank state; DeepSpeed resets them on load too), so the resume in
    the compressed phase says in one line that the error feedback restarts from zero, stays in
    the compressed phase, and ends with finite weights, not bit for bit the straight run's. The
    metrics show the phases and the bytes on the wire."""
    common = ["--batch-size", "2", "--max-steps", "8", "--optimizer", optimizer,
              "--onebit-warmup-steps", "3", "--compression", "none"]
    straight = here(f"{optimizer}-straight")
    train(straight, *common, "--checkpoint-every", "5")
    half = resolve(straight / "checkpoints" / "step_00000005.pt")
    assert "onebit_errors" not in load(half)["optimizer"]
    capfd.readouterr()
    resumed = here(f"{optimizer}-resumed")
    train(resumed, *common, "--resume", half)
    if ctx.rank == 0:
        assert "error feedback restarts from zero" in "".join(capfd.readouterr())
    a, b = load(resolve(straight))["model"], load(resolve(resumed))["model"]
    assert not same(a, b)
    assert all(torch.isfinite(v).all() for v in b.values())
    assert [r["onebit_phase"] for r in records(resumed, "train")][-3:] == ["compressed"] * 3
    recs = records(straight, "train")
    assert [r["onebit_phase"] for r in recs] == ["warmup"] * 3 + ["compressed"] * 5
    fp32_ring = recs[0]["wire_bytes"]  # 2(n-1)/n x 4 bytes x params at n = 2
    assert fp32_ring == 4 * records(straight, "start")[0]["params"]
    assert fp32_ring / recs[-1]["wire_bytes"] > 20


@only(HOROVOD)
def test_onebit_adam_trains_within_005_bpc_of_adam(ctx):
    """H=128, 150 steps on real reviews (:func:`prepare`'s larger shards), same seed, data and
    LR schedule: 1-bit Adam (30 warmup steps, then 120 compressed) ends within 0.05 validation
    BPC of Adam, and its compressed steps put >= 20x fewer bytes on the wire than fp32 gradients
    (docs/performance.md section 7.2 makes the same comparison larger)."""
    common = ["--hidden-size", "128", "--seq-len", "64", "--batch-size", "8", "--log-every",
              "50", "--lr", "2e-3", "--eval-chars", "0", "--max-steps", "150", "--epochs", "0",
              "--compression", "none", "--onebit-warmup-steps", "30"]
    bpc = {}
    for opt in ("adam", "onebit-adam"):
        assert main(["train", "--shards", str(SHARED / "reviews"), "--out-dir",
                     str(here(opt)), "--optimizer", opt, "--threads", "1", "--device", "cpu",
                     *common]) == 0
        from hvd_lm.comm import engine
        engine.barrier()
        bpc[opt] = records(here(opt), "eval")[-1]["val_bpc"]
    assert bpc["adam"] < 4.0  # it learned something (uniform: 8.0)
    assert abs(bpc["onebit-adam"] - bpc["adam"]) <= 0.05, bpc
    recs = records(here("onebit-adam"), "train")
    assert recs[-1]["onebit_phase"] == "compressed"
    assert records(here("adam"), "train")[-1]["wire_bytes"] / recs[-1]["wire_bytes"] > 20


@only(HOROVOD)
def test_tflops_are_per_rank_and_peak_tflops_overrides(ctx):
    """chars/s in the record is the sum over ranks, tflops is one rank's share; with
    ``--peak-tflops`` the MFU is against that figure and the start record says so."""
    from tests.test_mfu import flops_per_char_by_hand
    train(here("mfu"), "--peak-tflops", "0.05", "--max-steps", "3")
    start = records(here("mfu"), "start")[0]
    assert (start["peak_tflops"], start["peak_source"]) == (0.05, "--peak-tflops")
    fpc = flops_per_char_by_hand(8, 32)
    for r in records(here("mfu"), "train"):
        assert r["world_size"] == 2
        tflops = r["chars_per_s"] / 2 * fpc / 1e12
        assert r["tflops"] == pytest.approx(tflops, rel=1e-12)
        assert r["mfu"] == pytest.approx(tflops / 0.05, rel=1e-12)


@only(HOROVOD)
def test_a_finite_divergence_stops_every_rank_at_the_same_step(ctx, capfd):
    """Both decide from the allreduced loss, stop at the same step and fail the run (no rank
    left waiting in a collective): one line per rank."""
    assert main(["train", "--shards", str(SHARED / "shards"), "--out-dir",
                 str(here("diverged")), *TINY, "--batch-size", "2", "--lr", "1e6",
                 "--max-steps", "300"]) != 0
    assert "".join(capfd.readouterr()).count("training diverged") == 1  # this rank's line
    from hvd_lm.comm import engine
    engine.barrier()
    end = records(here("diverged"), "end")[-1]
    assert end["stop"] == "diverged" and end["step"] == 4 and end["world_size"] == 2


@only(HOROVOD)
def test_a_two_rank_run_that_one_process_resumes(ctx):
    """3 steps on 2 ranks; :func:`after` resumes it in one process and counts every character
    once."""
    train(here("chars"), "--batch-size", "2", "--max-steps", "3")


@only(HOROVOD)
def test_two_ranks_agree_on_the_plan_and_end_before_their_deadline(ctx, monkeypatch):
    """``--time-limit 25s`` on the planner's virtual clock (every step attempt 0.25 s of it):
    rank 0's plan reaches every rank through the control allreduce, both end at the same step
    with the LR at 0 and a checkpoint, the margin kept before the deadline, the periodic
    validations and checkpoints in between (what they cost the plan: the planner's own test in
    tests/test_deadline.py, by hand)."""
    monkeypatch.setenv("HVD_LM_VIRTUAL_STEP_S", "0.25")
    train(here("deadline"), "--batch-size", "2", "--time-limit", "25s", "--eval-every", "50",
          "--checkpoint-every", "40")
    from tests.test_deadline import check_ended_at_deadline
    summary = check_ended_at_deadline(here("deadline"), 25, 0.25)
    assert summary["world_size"] == 2
    assert [r["step"] for r in records(here("deadline"), "checkpoint")][:2] == [40, 80]
    assert [r["step"] for r in records(here("deadline"), "eval")][:1] == [50]
