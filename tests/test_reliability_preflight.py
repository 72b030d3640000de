"""Checked before anything is written, and said in one line: impossible shapes, a step that
cannot fit in memory (the estimate against saved tensors, the H200's peaks and peak RSS), every
CLI error, and the small ones (a truncated checkpoint, the free-space warning, a non-byte
vocabulary, nothing to train)."""
from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

from hvd_lm.formats import checkpoint as ck
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.train import preflight
from tests._mp import REPO, run
from tests.reliability_common import (  # noqa: F401 - the fixtures these tests take
    HVD_LM,
    TINY,
    hvd_lm,
    one_error_line,
)
from tests.shardutil import split_tokens

# ---- 11. issue 27: shapes and memory checked before anything is written --------------------------

@pytest.mark.parametrize("flags,needles", [  # needles of the train split's targets n
    (["--vocab-size", "10"],
     lambda n: ["model.vocab_size is 10", "byte ids 0..255", "--vocab-size 256"]),
    (["--seq-len", "1000000", "--batch-size", "32"],
     lambda n: ["data.seq_len 1,000,000 (--seq-len)", f"{n:,} targets / (1 rank(s) x 32 rows",
                f"= {n // 32:,} bytes per row", f"--seq-len {n // 32:,} or less"]),
    (["--batch-size", "5000"], lambda n: [f"5000 rows (--batch-size)) = {n // 5000} bytes per row",
                                          "or fewer --batch-size rows or ranks"]),
    (["--eval-chars", "2"], lambda n: ["run.eval_batch_size 32 (--eval-batch-size) rows",
                                       "--eval-chars 2", "lower --eval-batch-size"]),
], ids=["vocab", "seq-len", "batch-size", "eval-chars"])
def test_impossible_shapes_are_refused_before_anything_is_written(shards, tmp_path, flags,
                                                                   needles):
    """Today: --vocab-size 10 fails mid-training with "index out of range in self", and
    --seq-len 1000000 is OOM-killed; both leave the run folder behind. The figures are the
    fixture's own (its train shards' bytes less one, read with h5py): real reviews or, without
    ../shared, generated text."""
    targets = split_tokens(shards, "train") - 1
    assert 1 <= targets // 5000 < 16, f"{targets} targets: 5000 rows must get 1-15 bytes each"
    proc = hvd_lm("train", "--shards", shards, "--out-dir", tmp_path / "r", *TINY,
                  "--max-steps", "3", *flags, timeout=120)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc, *needles(targets))
    assert not (tmp_path / "r").exists()


def test_a_step_that_cannot_fit_in_memory_is_refused_with_the_estimate(shards, tmp_path):
    from hvd_lm.train import memory
    from hvd_lm.train.settings import TrainConfig
    from hvd_lm.util.atomic import human

    train = split_tokens(shards, "train")
    T = min(70000, train - 1)  # the longest window the fixture's one row holds (shape check)
    flags = ["--hidden-size", "16384", "--embed-dim", "64", "--batch-size", "1", "--seq-len",
             str(T)]
    cfg = TrainConfig()
    cfg.model.hidden_size, cfg.data.batch_size, cfg.data.seq_len = 16384, 1, T
    est = memory.step_memory(cfg, "cpu", 1, (train, min(split_tokens(shards, "val"), 2000)))
    if est.total <= psutil.virtual_memory().available:
        pytest.skip(f"this machine has more than {human(est.total)} available")
    proc = hvd_lm("train", "--shards", shards, "--out-dir", tmp_path / "r", "--device", "cpu",
                  "--eval-chars", "2000", "--threads", "1", *flags, timeout=120)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc, f"one training step needs about {human(est.total)} per rank",
                   "activations", "optimizer", "available on this node", "lower --batch-size",
                   "--seq-len", "--check-memory false")
    assert not (tmp_path / "r").exists()


def test_the_memory_check_counts_the_cuda_graph_pool(shards, monkeypatch):
    """With --cuda-graphs on a GPU the graphed window's private pool counts (before: the
    estimate was the eager one, so a graphed run that needs about twice as much started and ran
    out of memory). H=4096, B=256, T=256 bf16: the graphed estimate is about 1.5x the eager one
    (measured on an H200: 21.1 / 14.1 GiB); a card with memory between the two takes the eager
    run and refuses the graphed one, naming the pool; on the CPU graphs never apply."""
    from hvd_lm.options import ConfigError
    from hvd_lm.train import memory, preflight
    from hvd_lm.train.settings import TrainConfig
    from hvd_lm.util.atomic import human

    cfg = TrainConfig()
    cfg.model.hidden_size, cfg.data.batch_size, cfg.data.seq_len = 4096, 256, 256
    cfg.run.precision = "bf16"
    cuda = torch.device("cuda")
    eager = memory.step_memory(cfg, "cuda").total
    cfg.model.cuda_graphs = True
    graphed = memory.step_memory(cfg, "cuda")
    assert 1.4 < graphed.total / eager < 1.6
    assert memory.step_memory(cfg, "cpu").graph_pool == 0
    free = (eager + graphed.total) // 2
    monkeypatch.setattr(memory, "free_memory", lambda device: (free, f"free on {device}"))
    with pytest.raises(ConfigError, match=f"needs about {human(graphed.total)} per rank") as e:
        preflight.check_memory(cfg, load_manifest(shards), cuda, 1, 1)
    assert f"graph_pool {human(graphed.graph_pool)}" in str(e.value)
    cfg.model.cuda_graphs = False
    assert preflight.check_memory(cfg, load_manifest(shards), cuda, 1, 1).total == eager


def test_gpu_memory_estimate_against_the_h200s_peaks():
    """The preflight's estimate of the fused step on CUDA (eager and graphed, fp32, fp16 and
    bf16, B=128 and 256 at H=4096, T=256) against the peak memory `hvd-lm bench gpu` measured on
    an H200 (docs/results/gpu_h200/): never below the peak (a run the check lets through must
    fit) and at most 5% above it. Before: the eager estimate was 6-9% below the peak and the
    graphed one 32-42% above. Those peaks predate issue 43, which took bytes off the step
    (hvd_lm.train.memory.gpu_savings: the activations, a workspace buffer, a copy, the graph
    pool's merged buffers): the estimate plus those bytes is checked against them (the next
    card's JSON holds the new peaks beside the new estimate)."""
    from benchmarks.bench_gpu import Variant, estimated_memory
    from hvd_lm.train.memory import compute_bytes, gpu_savings

    rows = [r for b in (256, 128) for r in json.loads(
        (REPO / f"docs/results/gpu_h200/bench_gpu_b{b}.json").read_text())["train"]
        if r["impl"].startswith("fused/triton") and "peak_memory_gib" in r]
    assert len(rows) == 8
    for r in rows:
        graphed = r["impl"].endswith("+graphs")
        v = Variant("mlstm", "fused", "triton", graphed)
        est = estimated_memory(v, r["hidden_size"], 64, r["batch_size"], r["seq_len"],
                               r["precision"], torch.device("cuda"))
        before = est + gpu_savings(r["seq_len"], r["batch_size"], r["hidden_size"],
                                   compute_bytes(r["precision"]), graphed)
        assert 1.0 <= before / 2 ** 30 / r["peak_memory_gib"] <= 1.05, (
            r["impl"], r["batch_size"], r["precision"], before / 2 ** 30)


def test_the_async_checkpoints_host_copy_counts_once_per_node(shards, monkeypatch):
    """On the CPU the background checkpoint's host copy is rank 0's alone: the memory check adds
    it once per node, not once per local rank (before: 4 ranks were refused memory that fits
    them by 3 copies)."""
    from hvd_lm.options import ConfigError
    from hvd_lm.train import memory
    from hvd_lm.train.settings import TrainConfig

    cfg = TrainConfig()
    cfg.model.hidden_size, cfg.data.batch_size, cfg.data.seq_len = 1024, 4, 32
    manifest = load_manifest(shards)
    est = preflight.check_memory(cfg, manifest, torch.device("cpu"), 4, 4)
    assert est.checkpoint_copy > 0
    need = 4 * est.total - 3 * est.checkpoint_copy
    monkeypatch.setattr(memory, "free_memory", lambda d: (need, "available on this node"))
    assert preflight.check_memory(cfg, manifest, torch.device("cpu"), 4, 4).total == est.total
    monkeypatch.setattr(memory, "free_memory", lambda d: (need - 1, "available on this node"))
    with pytest.raises(ConfigError, match="4 rank\\(s\\) share"):
        preflight.check_memory(cfg, manifest, torch.device("cpu"), 4, 4)
    cfg.run.async_checkpoint = False
    assert memory.step_memory(cfg, "cpu", 4).checkpoint_copy == 0


@pytest.mark.parametrize("cell,impl,precision", [
    ("mlstm", "fused", "fp32"), ("mlstm", "fused", "bf16"), ("mlstm", "reference", "fp32"),
    ("mlstm", "reference", "bf16"), ("lstm", "fused", "fp32")])
def test_activation_estimate_matches_saved_tensor_hooks(cell, impl, precision):
    """The estimate of activations saved for backward vs the bytes torch's saved-tensor hooks
    see in one real training window (each storage once, parameters excluded): within 2%."""
    from hvd_lm.model.lm import LanguageModel, ModelConfig
    from hvd_lm.train.data import Batch
    from hvd_lm.train.memory import activation_bytes, compute_bytes
    from hvd_lm.train.step import window_nll

    T, B, H, E = 64, 16, 128, 64
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(cell=cell, hidden_size=H, embed_dim=E, rnn_impl=impl))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[:, 0] = True
    batch = Batch(torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T)), reset, B * T)
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        window_nll(model, batch, model.init_state(B), torch.device("cpu"), precision)
    est = activation_bytes(T, B, H, E, 256, compute_bytes(precision), impl, cell)
    assert est == pytest.approx(sum(seen.values()), rel=0.02)


_FIXED_PEAK: dict[str, int] = {}  # bytes: a tiny run's peak RSS (the interpreter, torch, Horovod)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/time").exists(), reason="/usr/bin/time not installed")
@pytest.mark.serial  # peak RSS beside other tests' processes read 1.154 once (bound 1.15)
@pytest.mark.parametrize("flags", [
    ["--hidden-size", "512", "--batch-size", "32", "--seq-len", "256"],
    ["--hidden-size", "256", "--batch-size", "32", "--seq-len", "256", "--rnn-impl",
     "reference"],
    ["--hidden-size", "1024", "--batch-size", "8", "--seq-len", "128"],
])
def test_step_memory_estimate_against_peak_rss(shards, tmp_path, flags):
    """The whole estimate against the peak resident memory (`/usr/bin/time -v`) of a real
    one-step `hvd-lm train`, minus that of a tiny one (the interpreter, torch, Horovod), over
    several runs: never more than 15% below it (measured 0.92-1.03 alone, up to 1.28 above: the
    allocator's slack is not modelled)."""
    import re

    from hvd_lm.train import memory
    from hvd_lm.train.settings import TrainConfig

    def peak(extra, run_no: int) -> int:
        proc = run(["/usr/bin/time", "-v", *HVD_LM, "train", "--shards", shards, "--out-dir",
                    tmp_path / f"{'_'.join(extra[1::2])}_{run_no}", "--max-steps", "1",
                    "--val-split", "", "--threads", "1", "--device", "cpu", "--tensorboard",
                    "false", *extra],
                   timeout=240)
        return 1024 * int(re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                                    proc.stderr).group(1))

    def estimate(extra) -> int:
        cfg = TrainConfig()
        values = dict(zip(extra[0::2], extra[1::2]))
        cfg.model.hidden_size = int(values["--hidden-size"])
        cfg.model.embed_dim = int(values.get("--embed-dim", 64))
        cfg.model.rnn_impl = values.get("--rnn-impl", "fused")
        cfg.data.batch_size, cfg.data.seq_len = int(values["--batch-size"]), int(
            values["--seq-len"])
        return memory.step_memory(cfg, "cpu", 1, (split_tokens(shards, "train"),)).total

    base = ["--hidden-size", "8", "--embed-dim", "8", "--batch-size", "1", "--seq-len", "8"]
    # several runs: the step's peak is the largest (what a run must have room for), the fixed
    # cost the smallest (a one-off lazy import or malloc arena is not the step's). The reference
    # loop's peak is bimodal inside a full suite: ratio 1.235, 1.238, 1.239 there (also with
    # three runs), 0.92-1.03 and once 1.284 alone; two runs per case since. An estimate above
    # the peak is the safe side for the preflight (it refuses a run that might not fit): below
    # is bounded tightly (0.85), above by 1.35
    if "base" not in _FIXED_PEAK:  # the same tiny run for every case: measured once
        _FIXED_PEAK["base"] = min(peak(base, i) for i in range(2))
    measured = max(peak(flags, i) for i in range(2)) - _FIXED_PEAK["base"]
    ratio = (estimate(flags) - estimate(base)) / measured
    assert 0.85 <= ratio <= 1.35, f"estimate / measured = {ratio:.3f}"


# ---- 12. issue 27: every CLI error is one line ---------------------------------------------------

@pytest.mark.parametrize("argv,needles", [
    (["train", "--lr-rule", "bogus"], ["argument --lr-rule (optim.lr_rule): invalid choice: "
                                       "'bogus' (choose from 'none', 'linear', 'sqrt')"]),
    (["train", "--precision", "fp8"], ["--precision (run.precision)", "'fp32', 'fp16', 'bf16'"]),
    (["train", "--batch-szie", "3"], ["unrecognized arguments: --batch-szie 3",
                                      "did you mean --batch-size?"]),
    (["train", "--lr"], ["argument --lr (optim.lr): expected one argument"]),
    (["trian"], ["argument COMMAND: invalid choice: 'trian'", "hvd-lm --help lists the commands"]),
])
def test_argparse_errors_are_one_line(capsys, argv, needles):
    from hvd_lm.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    assert err.startswith(f"hvd-lm{' train' if argv[0] == 'train' else ''}: ERROR: ")
    for n in needles:
        assert n in err, err
    assert "--help lists the" in err


# ---- 13. issue 27: the small ones ----------------------------------------------------------------

def test_truncated_checkpoint_error_is_a_whole_sentence(shards, tmp_path):
    good = ck.save({"model": {"w": torch.ones(300)}, "step": 1, "config": {}}, tmp_path / "r", 1)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:200])
    proc = hvd_lm("eval", cut, shards, timeout=60)
    line = one_error_line(proc, "cut.pt: truncated or damaged checkpoint")
    assert line.endswith("(PytorchStreamReader failed reading zip archive: failed finding "
                         "central directory)"), line


def test_free_space_warning_states_the_real_checkpoint_size(shards, tmp_path, monkeypatch,
                                                            capsys):
    """The size the free-space check uses is within 3% of the checkpoint hvd-lm train wrote
    (it was 1.25 MB for this 231 kB file: a fixed 1 MiB for "the rest")."""
    import re

    from hvd_lm.model.lm import LanguageModel, ModelConfig
    from hvd_lm.train import rundir
    from hvd_lm.train.settings import TrainConfig

    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "2").returncode == 0
    real = ck.resolve(out).stat().st_size
    cfg = TrainConfig()
    cfg.run.out_dir = str(tmp_path / "r2")
    model = LanguageModel(ModelConfig(hidden_size=32, embed_dim=8))
    monkeypatch.setattr(rundir, "free_bytes", lambda d: 2 * real)
    rundir.open_run_folder(cfg, model, rows=2).release()
    err = capsys.readouterr().err
    m = re.search(r"checkpoints of about ([\d.]+) kB", err)
    assert m, err
    assert float(m.group(1)) * 1000 == pytest.approx(real, rel=0.03)


def test_eval_refuses_a_manifest_whose_vocabulary_is_not_bytes(shards, tmp_path):
    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "2").returncode == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in Path(shards).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = json.loads((bad / "manifest.json").read_text())
    data["vocab_size"] = 300
    (bad / "manifest.json").write_text(json.dumps(data))
    proc = hvd_lm("eval", out, bad, timeout=60)
    assert proc.returncode != 0
    one_error_line(proc, "manifest.json: field vocab_size is 300, expected 256")


def test_resume_with_nothing_to_train_says_so_and_writes_nothing(shards, tmp_path):
    """A run at step 6 resumed with --max-steps 3: one ERROR line, exit 2; with --max-steps 6
    (a finished run started again): a note, exit 0. Neither touches a file of the run."""
    out = tmp_path / "r"
    assert hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY,
                  "--max-steps", "6").returncode == 0
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    past = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "3",
                  "--resume", "auto")
    assert past.returncode == 2
    one_error_line(past, "step_00000006.pt is at step 6, past the end of this schedule",
                   "--max-steps 3", "nothing to train", "give --max-steps above 6")
    again = hvd_lm("train", "--shards", shards, "--out-dir", out, *TINY, "--max-steps", "6",
                   "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "is at step 6, the last of this schedule" in again.stderr
    assert "nothing to train" in again.stderr and "ERROR" not in again.stderr
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert after == before
