"""Model FLOP utilisation in the training log (hvd_lm.model.mfu): every ``train`` record's
``tflops`` and ``mfu`` against a hand computation of the model's FLOPs, per rank, against the
published peak table or a measured CPU matmul, and in TensorBoard."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from hvd_lm.model import mfu
from tests import conftest
from tests._mp import launch_env, run
from tests.conftest import records

TINY = [*conftest.TINY, "--log-every", "2", "--max-steps", "6"]




def flops_per_char_by_hand(E: int, H: int, V: int = 256) -> int:
    """mLSTM matmuls per character, forward: x W_x (E x 4H), x W_mx (E x H), h W_mh (H x H),
    m W_h (H x 4H), h W_dec (H x V) multiply-adds; x 2 FLOPs each, x 3 for forward + backward."""
    return 3 * 2 * (E * 4 * H + E * H + H * H + H * 4 * H + H * V)


def test_published_peaks_and_the_precision_column():
    """Datasheet figures (dense), looked up by torch's device names; fp32 means TF32 only when
    torch allows it; a column a card lacks has no figure (V100 bf16) or falls back (V100 tf32)."""
    P = mfu.published_peak
    assert P("NVIDIA H100 80GB HBM3", "bf16").tflops == 989.5
    assert P("NVIDIA H100 80GB HBM3", "fp32").tflops == 67.0
    assert P("NVIDIA H100 PCIe", "tf32").tflops == 378.0
    assert P("NVIDIA H100 NVL", "fp16").tflops == 835.5
    assert P("NVIDIA H200", "bf16").tflops == 989.5
    assert P("NVIDIA A100-SXM4-80GB", "tf32").tflops == 156.0
    assert P("NVIDIA A100 80GB PCIe", "bf16").tflops == 312.0
    assert P("Tesla V100-SXM2-32GB", "fp16").tflops == 125.0
    assert P("Tesla V100-PCIE-16GB", "fp32").tflops == 14.0
    v100 = P("Tesla V100-SXM2-16GB", "tf32")
    assert v100.tflops == 15.7 and "fp32 dense" in v100.source and "datasheet" in v100.source
    assert P("Tesla V100-SXM2-16GB", "bf16") is None
    assert P("NVIDIA GeForce RTX 4090", "bf16") is None
    assert mfu.matmul_column("fp32", tf32=False) == "fp32"
    assert mfu.matmul_column("fp32", tf32=True) == "tf32"
    assert mfu.matmul_column("bf16", tf32=True) == "bf16"
    assert mfu.device_peak(torch.device("cpu"), "fp32", 123.0) == mfu.Peak(123.0, "--peak-tflops")


def test_a_cpu_peak_is_measured_once_per_machine_and_raised_by_a_faster_run(tmp_path,
                                                                          monkeypatch):
    """The CPU peak is measured at the first start only (a requeued run's MFU is against the
    same figure whatever the load then), kept per dtype and threads, and a run that reaches more
    raises it (MFU never above 1)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(mfu, "matmul_gflops", lambda *a, **k: calls.append(k) or 50.0)
    first = mfu.device_peak(torch.device("cpu"), "fp32", threads=1)
    again = mfu.device_peak(torch.device("cpu"), "fp32", threads=1)
    assert first == again and first.tflops == 0.05 and len(calls) == 1
    assert "once on this machine" in first.source and str(tmp_path) in first.source
    mfu.device_peak(torch.device("cpu"), "fp32", threads=2)  # another key: measured
    assert len(calls) == 2 and len(json.loads(mfu.peak_cache_path().read_text())) == 2
    rate, peak = mfu.rate_against(1000.0, 4e7, first)  # 0.04 TFLOP/s: below the peak
    assert peak == first and rate["mfu"] == pytest.approx(0.8)
    rate, peak = mfu.rate_against(2000.0, 4e7, first)  # 0.08: the kept figure was low
    assert rate["mfu"] == 1.0 and peak.tflops == pytest.approx(0.08)
    assert mfu.device_peak(torch.device("cpu"), "fp32", threads=1).tflops == \
        pytest.approx(0.08) and len(calls) == 2


def test_flops_per_char_is_the_hand_count():
    from hvd_lm.model.lm import LanguageModel, ModelConfig
    m = LanguageModel(ModelConfig(embed_dim=8, hidden_size=32))
    assert m.flops_per_char() == flops_per_char_by_hand(8, 32) == 87552


@pytest.mark.slow
def test_train_records_tflops_and_mfu_against_a_measured_cpu_peak(shards, tmp_path):
    """One process on a CPU: the start record holds the matmul measured at start; each train
    record's tflops = chars/s x FLOPs per char (by hand) / 1e12 and mfu = tflops / that peak,
    both in the printed line and as TensorBoard scalars (a stand-in SummaryWriter records the
    tags, tensorboard is not installed here)."""
    tags = tmp_path / "tags.json"
    code = (
        "import json, sys\n"
        "import hvd_lm.train.metrics as L\n"
        "seen = []\n"
        "class W:\n"
        "    def __init__(self, d): pass\n"
        "    def add_scalar(self, tag, v, step): seen.append(tag)\n"
        f"    def close(self): open({str(tags)!r}, 'w').write(json.dumps(seen))\n"
        "L.SummaryWriter = W\n"
        "from hvd_lm.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "r"
    proc = run([sys.executable, "-c", code, "train", "--shards", shards, "--out-dir", out,
                *TINY, "--tensorboard", "true"], timeout=300, env=launch_env())
    start = records(out, "start")[0]
    assert start["peak_source"].startswith("measured: float32 torch.mm 1024^3 on the CPU, 1 ")
    assert 1e-3 < start["peak_tflops"] < 100  # one core's fp32 BLAS: GFLOP/s to a few TFLOP/s
    fpc = flops_per_char_by_hand(8, 32)
    assert start["flops_per_char"] == fpc
    train = records(out, "train")
    assert len(train) == 3
    for r in train:
        tflops = r["chars_per_s"] * fpc / 1e12
        assert r["tflops"] == pytest.approx(tflops, rel=1e-12)
        assert r["mfu"] == pytest.approx(tflops / start["peak_tflops"], rel=1e-12)
    assert f"mfu={r['mfu']:.4g}" in proc.stdout and f"tflops={r['tflops']:.4g}" in proc.stdout
    seen = set(json.loads(tags.read_text()))
    assert {"train/tflops", "train/mfu", "start/peak_tflops"} <= seen


