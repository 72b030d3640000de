"""CUDA code paths against the CPU fp32 reference (marker ``cuda``: skipped without a GPU; run
them on a GPU node with ``pytest -m cuda`` or ``scripts/gpu_check.sh``).

Bounds, per-step training loss relative to the CPU fp32 run on the same batches and weights:
fp32 1e-4 (cuBLAS and CPU BLAS sum in different orders; TF32 is off for matmuls by default),
bf16 3e-2 (8-bit mantissa in the matmuls, fp32 loss and cell state), fp16 1e-2 with dynamic loss
scaling (10-bit mantissa)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from hvd_lm.formats.checkpoint import resolve
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.model import device as devices
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.model.load import load_model
from hvd_lm.train.data import RankStreams
from hvd_lm.train.step import StepSpec, train_step
from hvd_lm.transfer.features import featurize
from tests._mp import horovodrun_cmd, launch_env, run

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TINY = ["--hidden-size", "64", "--embed-dim", "16", "--seq-len", "32", "--batch-size", "4",
        "--log-every", "1", "--lr", "3e-3", "--eval-chars", "4000"]
BOUND = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}


def batches(shards, n: int = 6, B: int = 4, T: int = 32):
    streams = RankStreams(load_manifest(shards), "train", 0, 1, B, T)
    return [streams.window(0, i) for i in range(n)]


def losses(device: str, precision: str, data) -> list[float]:
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(hidden_size=64, embed_dim=16)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = devices.make_scaler(torch.device(device), precision)
    state = model.init_state(4, device)
    spec = StepSpec(torch.device(device), precision, grad_clip=0.0)
    out = []
    for b in data:  # the training loop's step, without clipping
        r = train_step(model, opt, scaler, [b], state, spec)
        state = r.state
        out.append(float(r.nats) / b.chars)
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_steps_match_the_cpu_reference(shards, precision):
    data = batches(shards)
    ref = np.array(losses("cpu", "fp32", data))
    got = np.array(losses("cuda", precision, data))
    rel = np.abs(got - ref) / ref
    assert rel.max() < BOUND[precision], (precision, rel)


def test_grad_scaler_skips_an_injected_overflow(shards, tmp_path):
    out = tmp_path / "fp16"
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out, *TINY,
         "--max-steps", "5", "--precision", "fp16", "--device", "cuda", "--inject-nan-steps",
         "2"], timeout=300)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in recs if r["kind"] == "skip"]
    train = [r for r in recs if r["kind"] == "train"]
    assert len(skips) == 1 and skips[0]["step"] == 2
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert skips[0]["loss_scale"] == 65536.0 / 2  # halved on the overflow


def test_eval_bpc_gpu_equals_cpu(shards, tmp_path):
    out = tmp_path / "run"
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out, *TINY,
         "--max-steps", "3", "--device", "cpu"], timeout=300)
    res = {}
    for dev in ("cpu", "cuda"):
        p = run([sys.executable, "-m", "hvd_lm", "eval", out, shards, "--device", dev,
                 "--output", tmp_path / f"{dev}.json"], timeout=300)
        assert p.returncode == 0
        res[dev] = json.loads((tmp_path / f"{dev}.json").read_text())
    assert res["cpu"]["chars"] == res["cuda"]["chars"]
    assert abs(res["cpu"]["bpc"] - res["cuda"]["bpc"]) < 1e-4


def test_transfer_features_gpu_equal_cpu(shards, tmp_path):
    out = tmp_path / "run"
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir", out, *TINY,
         "--max-steps", "2", "--device", "cpu"], timeout=300)
    texts = ["great product, works fine", "terrible.", "", "ok " * 300]
    model, _ = load_model(out)
    for kind in ("cell", "hidden", "mean", "max"):
        cpu = featurize(model, texts, kind, batch_size=2, device="cpu").features
        gpu = featurize(model.to("cuda"), texts, kind, batch_size=2, device="cuda").features
        model.to("cpu")
        np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-5, err_msg=kind)


@pytest.mark.parametrize("first,second", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_gpu_and_cpu(shards, tmp_path, first, second):
    """4 steps on one device, resumed for 4 more on the other: it loads and continues, and the
    final weights match 8 steps straight on the CPU within the fp32 device bound."""
    common = [*TINY, "--max-steps", "8"]
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir",
         tmp_path / "straight", *common, "--device", "cpu"], timeout=300)
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir",
         tmp_path / "moved", *TINY, "--max-steps", "8", "--device", first,
         "--checkpoint-every", "4"], timeout=300)
    half = tmp_path / "moved" / "checkpoints" / "step_00000004.pt"
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir",
         tmp_path / "resumed", *common, "--device", second, "--resume", half], timeout=300)
    a = torch.load(resolve(tmp_path / "straight"), weights_only=True, map_location="cpu")
    b = torch.load(resolve(tmp_path / "resumed"), weights_only=True, map_location="cpu")
    assert b["step"] == 8
    for k in a["model"]:
        np.testing.assert_allclose(b["model"][k].numpy(), a["model"][k].numpy(), rtol=1e-3,
                                   atol=1e-4, err_msg=k)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_nccl_equal_one_process_with_double_batch(shards, tmp_path):
    base = ["--max-steps", "4", "--compression", "none", "--device", "cuda"]
    argv = ["-m", "hvd_lm", "train", "--shards", str(shards), "--out-dir",
            str(tmp_path / "two"), *TINY, "--batch-size", "2", *base]
    run(horovodrun_cmd(2, argv, "gloo"), timeout=300, env=launch_env())
    run([sys.executable, "-m", "hvd_lm", "train", "--shards", shards, "--out-dir",
         tmp_path / "one", *TINY, "--batch-size", "4", *base], timeout=300)
    a = torch.load(resolve(tmp_path / "two"), weights_only=True, map_location="cpu")["model"]
    b = torch.load(resolve(tmp_path / "one"), weights_only=True, map_location="cpu")["model"]
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
