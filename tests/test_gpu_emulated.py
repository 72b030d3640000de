"""The GPU code path proven before a GPU (issue 22): what the CUDA path does that the CPU path
did not, run here.

* CUDA graphs' static buffers: :class:`StaticBufferCapture` stands in for
  ``torch.cuda.make_graphed_callables`` with its buffer semantics (inputs copied into static
  input buffers, outputs and input gradients returned as detached views of static buffers that
  the next replay overwrites: ``torch/cuda/graphs.py``, ``make_graphed_autograd_function``), so
  gradient accumulation through :class:`WindowGraphs` is checked against the eager window.
* fp16 weight gradients summed over a whole window (T*B rows) against the fp32 computation.
* The production path under Triton's CPU interpreter (``TRITON_INTERPRET=1``, each in its own
  process): ``hvd-lm train --rnn-kernels triton`` against ``--rnn-impl reference``, ``hvd-lm
  eval`` and ``hvd-lm transfer`` featurisation through the Triton kernels against the torch
  kernels, ``python -m benchmarks gpu --device cpu --rnn-kernels triton``.

The real-GPU checks of the same paths are ``pytest -m cuda`` (tests/test_cuda.py,
tests/test_mlstm_fused.py) via ``scripts/gpu_check.sh --stage cuda``.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from hvd_lm.formats.manifest import load_manifest
from hvd_lm.model import mlstm_kernels as K
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.model.mlstm_fused import WindowGraphs, mlstm_window, out_dtype_gemm, weight_grad_mm
from hvd_lm.train.data import RankStreams
from tests._mp import SHARED, launch_env, run
from tests.scripts.mlstm_cases import StaticBufferCapture, train_windows
from tests.shardutil import make_shards, review_texts
from tests.test_train import max_diff, params_of, records, train_argv

INTERPRET = {"TRITON_INTERPRET": "1"}
needs_triton = pytest.mark.skipif(not K.triton_available(),
                                  reason="triton is an optional (GPU) dependency")


# ---- CUDA graphs: static buffers and gradient accumulation --------------------------------------

def test_static_buffer_capture_is_faithful_on_one_window():
    """One forward + backward through the stand-in equals the eager window (so the
    accumulation test below tests WindowGraphs, not the stand-in)."""
    torch.manual_seed(0)
    a = LanguageModel(ModelConfig(hidden_size=16, embed_dim=4))
    b = LanguageModel(ModelConfig(hidden_size=16, embed_dim=4))
    b.load_state_dict(a.state_dict())
    a.rnn.graphs = WindowGraphs(device_type="cpu", capture=StaticBufferCapture())
    tokens = torch.randint(0, 256, (3, 9))
    for m in (a, b):
        logits, _ = m(tokens)
        logits.pow(2).mean().backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=n)
    assert a.rnn.graphs.stats == {"captures": 1, "graphed": 1}


@pytest.mark.parametrize("weight_norm", [False, True])
def test_replayed_windows_accumulate_gradients_like_eager(weight_norm):
    """Defect 3 of issue 22 (failed before the fix: the recurrent weights' .grad became the
    replay's static buffer, so 4 accumulated windows gave 2x the last one's gradient, not the
    sum). Four training windows without zero_grad, the state carried, a reset inside: every
    parameter's accumulated gradient and the final state equal the eager window's (1e-6)."""
    torch.manual_seed(0)
    cfg = dict(hidden_size=16, embed_dim=4, weight_norm=weight_norm)
    graphed, eager = LanguageModel(ModelConfig(**cfg)), LanguageModel(ModelConfig(**cfg))
    eager.load_state_dict(graphed.state_dict())
    capture = StaticBufferCapture()
    graphed.rnn.graphs = WindowGraphs(device_type="cpu", capture=capture)
    tokens = torch.randint(0, 256, (4, 3, 9), generator=torch.Generator().manual_seed(1))
    reset = torch.zeros(3, 8, dtype=torch.bool)
    reset[1, 3] = True
    states = [train_windows(model, tokens, reset) for model in (graphed, eager)]
    assert graphed.rnn.graphs.stats == {"captures": 1, "graphed": 4} and capture.captures == 1
    for (n, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=n)
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=1e-6)


# ---- fp16 weight gradients over a whole window ---------------------------------------------------

def test_fp16_window_weight_gradients_are_summed_in_fp32():
    """Defect 4 of issue 22 (failed before the fix: inf). An fp16 window (T*B = 1,024 rows)
    whose recurrent weight gradients reach ~2e5, beyond fp16's 65,504, as loss scaling makes
    them: the fused window's dW_h and dW_mh are finite and within 1e-3 (relative Frobenius) of
    the same window computed with fp32 GEMMs from the same fp16-rounded inputs (measured
    3-4e-4: the fp16 data gradients dG, dA are the only rounding left, as in the reference
    path under autocast)."""
    T, B, H = 32, 32, 8
    g = torch.Generator().manual_seed(0)
    xg = torch.randn(T, B, 4 * H, generator=g).half()
    xm = (2 + torch.rand(T, B, H, generator=g)).half()
    h0, c0 = torch.rand(B, H, generator=g), torch.rand(B, H, generator=g)
    w_mh, w_h = 0.5 * torch.rand(H, H, generator=g), 0.3 * torch.randn(4 * H, H, generator=g)
    grads = {}
    for dtype in (torch.float16, torch.float32):
        ins = [xg.to(dtype).requires_grad_(), xm.to(dtype).requires_grad_()]
        ws = [w_mh.clone().requires_grad_(), w_h.clone().requires_grad_()]
        hs, _ = mlstm_window(*ins, (h0, c0), *ws, K.get_kernels("torch"), layout="rows")
        (3000.0 * hs.float()).sum().backward()
        grads[dtype] = [w.grad for w in ws]
    for got, want in zip(grads[torch.float16], grads[torch.float32]):
        assert float(want.abs().max()) > 65504  # the sum would overflow an fp16 output
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
        assert float((got - want).norm() / want.norm()) < 1e-3


def test_weight_grad_paths():
    """fp32 output whatever the operands: cuBLAS's fp32-output GEMM on CUDA where torch has
    it, fp32 operands elsewhere; the values equal an fp64 product of the same operands."""
    assert out_dtype_gemm("cuda") and not out_dtype_gemm("cpu")  # torch >= 2.8
    x = torch.randn(3, 4, dtype=torch.float64)
    assert weight_grad_mm(x, x.t()).dtype == torch.float64  # fp32/fp64: the GEMM's own dtype
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 300, generator=g).bfloat16(), torch.randn(300, 5, generator=g).bfloat16()
    out = weight_grad_mm(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)


# ---- the production path under Triton's interpreter ----------------------------------------------

@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    """One short review per shard (~100 bytes): shard starts, hence resets, fall inside the
    training windows, not only at their first column."""
    texts = [t[:120] for t in review_texts(60)]
    return make_shards(tmp_path_factory.mktemp("small"),
                       {"train": [[t] for t in texts[:50]], "val": [[t] for t in texts[50:]]})


EMULATED = ["--batch-size", "3", "--max-steps", "20", "--log-every", "5"]


@pytest.fixture(scope="module")
def emulated_runs(small_shards, tmp_path_factory):
    """``hvd-lm train`` 20 steps with the Triton kernels (interpreted) and with the reference
    recurrence, same seed and data."""
    out = tmp_path_factory.mktemp("emulated")
    for name, flags, env in (("triton", ["--rnn-kernels", "triton"], INTERPRET),
                             ("reference", ["--rnn-impl", "reference"], {})):
        run([sys.executable, *train_argv(small_shards, out / name, *EMULATED, *flags)],
            timeout=600, env=launch_env(**env))
    return out


@needs_triton
def test_emulated_training_with_triton_kernels_tracks_the_reference(small_shards,
                                                                     emulated_runs):
    """Defect 1 of issue 22 (failed before the fix: the Triton kernels raised "need contiguous
    tensors" on the first window). 20 Adam steps, resets inside windows: parameters within
    1e-5 of the reference recurrence's and logged losses within 1e-6 relative (the bounds of
    the torch kernels' test_twenty_training_steps_fused_vs_reference; the Triton kernels'
    written-out tanh is within 1.1e-7 of torch's)."""
    streams = RankStreams(load_manifest(small_shards), "train", 0, 1, 3, 16)
    inside = [w for w in range(20) if streams.window(0, w).reset[:, 1:].any()]
    assert len(inside) >= 3  # the windows really carry resets inside them
    tri, ref = emulated_runs / "triton", emulated_runs / "reference"
    assert records(tri, "start")[0]["params"] == records(ref, "start")[0]["params"]
    assert max_diff(params_of(tri), params_of(ref)) <= 1e-5
    losses = [[r["loss"] for r in records(d, "train")] for d in (tri, ref)]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-6)


@needs_triton
def test_emulated_eval_through_triton_kernels(small_shards, emulated_runs, tmp_path):
    """``hvd-lm eval --rnn-kernels triton`` (interpreted) gives the torch kernels' BPC of the
    same checkpoint to 1e-6."""
    res = {}
    for kernels in ("triton", "torch"):
        out = tmp_path / f"{kernels}.json"
        run([sys.executable, "-m", "hvd_lm", "eval", emulated_runs / "triton", small_shards,
             "--device", "cpu", "--rnn-kernels", kernels, "--batch-size", "4", "--output", out],
            timeout=600, env=launch_env(**INTERPRET))
        res[kernels] = json.loads(out.read_text())
    assert res["triton"]["chars"] == res["torch"]["chars"] > 0
    assert res["triton"]["bpc"] == pytest.approx(res["torch"]["bpc"], abs=1e-6)


@needs_triton
def test_emulated_transfer_features_through_triton_kernels(emulated_runs, tmp_path):
    """``hvd-lm transfer --rnn-kernels triton`` featurises SST-2 sentences of different lengths
    (padding masks in every batch) through the interpreted Triton kernels: the features it
    caches equal the torch kernels' to 1e-5, and the transfer reports agree."""
    sst2 = SHARED / "data/sst2"
    if not sst2.is_dir():
        pytest.skip(f"needs {sst2}")
    feats, reports = {}, {}
    for kernels in ("triton", "torch"):
        out, cache = tmp_path / kernels, tmp_path / f"cache-{kernels}"
        run([sys.executable, "-m", "hvd_lm", "transfer", emulated_runs / "triton", "--out", out,
             "--dataset", "sst2", "--data-dir", sst2, "--max-examples", "24", "--features",
             "mean", "--batch-size", "8", "--device", "cpu", "--rnn-kernels", kernels,
             "--cache-dir", cache, "--no-progress"], timeout=600, env=launch_env(**INTERPRET))
        feats[kernels] = {p.name: np.load(p) for p in sorted(cache.glob("*.npy"))}
        reports[kernels] = json.loads((out / "transfer.json").read_text())
    assert feats["triton"].keys() == feats["torch"].keys() and len(feats["torch"]) >= 2
    for name, f in feats["torch"].items():
        np.testing.assert_allclose(feats["triton"][name], f, rtol=0, atol=1e-5, err_msg=name)
    accuracy = [reports[k]["classifier"]["accuracy"] for k in ("triton", "torch")]
    assert accuracy[0] == accuracy[1]


@needs_triton
def test_emulated_bench_gpu_with_triton_kernels(tmp_path):
    """``python -m benchmarks gpu --device cpu --rnn-kernels triton`` completes, every variant with
    a figure (none recorded as an error)."""
    out = tmp_path / "bench.json"
    run([sys.executable, "-m", "benchmarks", "gpu", "--device", "cpu", "--rnn-kernels",
         "triton", "--hidden-size", "16", "--embed-dim", "4", "--seq-len", "8", "--batch-sizes",
         "2", "--precisions", "fp32", "--steps", "1", "--warmup", "0", "--repeats", "1",
         "--matmul-size", "32", "--copy-mib", "1", "--json", out], timeout=600,
        env=launch_env(**INTERPRET))
    data = json.loads(out.read_text())
    assert {r["impl"] for r in data["train"]} == {"fused/triton", "reference", "cudnn"}
    assert not [r for r in data["train"] if "error" in r]


# ---- Triton launches bound once per window (issue 43) --------------------------------------------

@needs_triton
def test_triton_launches_bind_after_the_first(monkeypatch):
    """Launch: the first launch of a window goes through Triton's JIT (``fn[grid](...)``, which
    returns the compiled kernel); every later one calls that kernel's launcher directly, with
    the grid, the stream and the metadata bound once and the arguments in the JIT's order
    (``CompiledKernel.__getitem__``'s runner's call). Not bound: a window whose steps may
    specialise differently (not ``uniform``), a launch hook set (a profiler's), or no compiled
    kernel returned (Triton's interpreter). Stand-ins for the JIT function and the compiled
    kernel record what they are called with (no GPU here)."""
    import triton

    from hvd_lm.model import mlstm_triton as tk

    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            calls.append(("bound", a))

    class Jit:
        def __init__(self, returns):
            self.returns = returns

        def __getitem__(self, grid):
            def launch(*a, **kw):
                calls.append(("jit", grid, a, kw))
                return self.returns
            return launch

    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda: type("Stream", (), {"cuda_stream": 77})())
    launch = tk.Launch(Jit(Compiled()), 5, (10, 2, True), uniform=True)
    for x in (1, 2, 3):
        launch("a", x)
    assert calls[0] == ("jit", (5,), ("a", 1, 10, 2, True), {"num_warps": tk.NUM_WARPS})
    assert calls[1:] == [("bound", (5, 1, 1, 77, "fn", "meta", None, None, None, "a", x, 10, 2,
                                    True)) for x in (2, 3)]
    for jit, uniform in ((Jit(Compiled()), False), (Jit(None), True)):
        calls.clear()
        launch = tk.Launch(jit, 5, (1,), uniform=uniform)
        launch("a")
        launch("b")
        assert [c[0] for c in calls] == ["jit", "jit"]
    hook = triton.knobs.runtime.launch_enter_hook
    if hasattr(hook, "calls"):  # Triton >= 3.5: a chain of hooks, one in it now
        monkeypatch.setattr(hook, "calls", [print])
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", print)
    calls.clear()
    launch = tk.Launch(Jit(Compiled()), 5, (1,), uniform=True)
    launch("a")
    launch("b")
    assert [c[0] for c in calls] == ["jit", "jit"]


def test_uniform_steps_needs_16_byte_step_strides():
    """A binding serves every step only when each per-step slice keeps step 0's alignment."""
    from hvd_lm.model.mlstm_fused import uniform_steps

    assert uniform_steps(torch.empty(3, 4, 8), None, torch.empty(3, 4, 1))  # 128 B, 16 B
    assert not uniform_steps(torch.empty(3, 3, 1))  # 12 B a step (an fp32 flag of B = 3)
    assert not uniform_steps(torch.empty(3, 5, 1, dtype=torch.bool))


# ---- the kernels built for the H100, here -----------------------------------------------------

@needs_triton
def test_cell_kernels_compile_for_sm90_without_spills(repo_root, tmp_path):
    """``hvd-lm kernels``: every cell kernel the CUDA path can launch (forward and backward x
    fp32/bf16/fp16 x mask/reset cases, BLOCK and warps as launched) compiles ahead of time for
    sm_90 (H100) with Triton's own ptxas, without register spills (no local memory, no stack);
    the table in docs/results/triton_sm90.json (quoted in docs/mlstm_fused.md) is this build's
    when the Triton version is the one it was made with."""
    import triton

    from hvd_lm.cli import main

    out = tmp_path / "sm90.json"
    assert main(["kernels", "--arch", "90", "--json", str(out)]) == 0
    built = json.loads(out.read_text())
    rows = built["kernels"]
    assert len(rows) == 2 * 3 * 4 and built["arch"] == 90
    spills = [r for r in rows if r["stack"] or r["local"]]
    assert not spills, spills
    assert all(0 < r["registers"] <= 255 for r in rows)
    table = json.loads((repo_root / "docs/results/triton_sm90.json").read_text())
    if table["triton"] == triton.__version__:
        assert [(r["kernel"], r["compute"], r["registers"]) for r in table["kernels"]] == \
            [(r["kernel"], r["compute"], r["registers"]) for r in rows]


# ---- scripts/gpu_check.sh: stages that resume each other -----------------------------------------

@pytest.mark.slow
def test_gpu_check_stages_run_separately_and_merge(repo_root, tmp_path):
    """``gpu_check.sh --stage cuda`` then ``--stage bench`` as two invocations (as two
    10-minute runs on a GPU node would be): each reuses the venv (setup is idempotent), records
    its exit status, and the summary merges both; here the cuda tests skip (no GPU) and the
    bench runs on the CPU (BENCH_ARGS), its table in summary.md."""
    import os
    import subprocess

    wheels, out = tmp_path / "whl", tmp_path / "out"
    wheels.mkdir()
    env = dict(launch_env(), BENCH_ARGS="--device cpu --hidden-size 16 --embed-dim 4 "
               "--seq-len 8 --batch-sizes 2 --precisions fp32 --matmul-size 32 --copy-mib 1 "
               "--warmup 0", PYTHON=sys.executable)
    env.pop("PIP_FIND_LINKS", None)
    for stage in ("cuda", "bench"):
        proc = subprocess.run(["bash", repo_root / "scripts/gpu_check.sh", "--stage", stage,
                               wheels, out], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["stages"]) == {"setup", "cuda", "bench"}
    assert all(r["exit_status"] == 0 for r in summary["stages"].values())
    assert summary["cuda"]["tests"] > 0 and summary["cuda"]["failures"] == 0
    if not torch.cuda.is_available():
        assert summary["cuda"]["skipped"] == summary["cuda"]["tests"]
    assert {r["impl"] for r in summary["bench_gpu"]["train"]} == {"fused/torch", "reference",
                                                                  "cudnn"}
    md = (out / "summary.md").read_text()
    assert "| cuda | 0 |" in md and "| bench | 0 |" in md and "GEMM ceiling" in md
    assert "estimated GiB" in md
    bad = subprocess.run(["bash", repo_root / "scripts/gpu_check.sh", "--stage", "bogus"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--stage must be one of" in bad.stdout
    assert os.path.exists(out / "setup.log")


@pytest.mark.slow
def test_gpu_check_suite_runs_in_parts_within_its_budget(repo_root, tmp_path):
    """Issue 32 (before: the suite stage ran setup, then pytest for up to 540 s, then 30 s of
    kill grace, and its summary could be lost past a 10-minute call). With a budget that lets
    one test start per run, each run of ``--stage suite`` runs one more test of the two chosen,
    records its part and writes the summary; the third run finds nothing left and still ends
    green. A whole stage whose budget is spent by setup still writes its summary."""
    import os
    import subprocess

    wheels, out = tmp_path / "whl", tmp_path / "out"
    wheels.mkdir()
    env = dict(launch_env(), PYTHON=sys.executable, SUITE_BUDGET="0",
               SUITE_ARGS="tests/test_atomic.py")
    env.pop("PIP_FIND_LINKS", None)
    cmd = ["bash", repo_root / "scripts/gpu_check.sh", "--stage", "suite", wheels, out]
    for part, left in ((1, 1), (2, 0), (3, 0)):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["suite"]["parts"] == part and summary["suite"]["left"] == left
        assert summary["suite"]["tests"] == min(part, 2)
    md = (out / "summary.md").read_text()
    assert "2 tests in 3 part(s), 0 failed" in md and "all tests run" in md
    assert len((out / "suite_done.txt").read_text().split()) == 2
    # a stage budget that setup alone spends: the work still gets its floor, the summary its
    # reserve, and the invocation ends
    env.update(STAGE_BUDGET="1", SUITE_BUDGET="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert os.path.exists(out / "suite-4.xml") and "| suite |" in proc.stdout
