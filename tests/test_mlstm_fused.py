"""The fused mLSTM recurrence (hvd_lm.model.mlstm_fused, hvd_lm.model.mlstm_kernels) against its
oracles: float64 gradcheck of the Function with reset and mask; the reference path's forward
states and every parameter gradient on random inputs and on real shards; the kernels against
their pure-torch specification (torch.compile, and Triton under its CPU interpreter); the
CUDA-graph fallback logic; training. Tests marked ``cuda`` run only where CUDA is available."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks import bench_train as bt
from hvd_lm.formats.manifest import load_manifest
from hvd_lm.model import mlstm_kernels as K
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.model.mlstm_fused import (
    LAYOUTS,
    MLSTMWindow,
    WindowGraphs,
    default_layout,
    mlstm_window,
    saved_bytes,
    steps_empty,
    to_layout,
)
from hvd_lm.model.mlstm_graphs import signature
from hvd_lm.train.data import RankStreams
from hvd_lm.train.step import window_nll
from tests._mp import launch_env, run
from tests.scripts.mlstm_cases import (
    StaticBufferCapture,
    cell_case,
    cell_diff,
    window_diff,
    window_inputs,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("reset_p,mask_p", [(0.0, 1.0), (0.3, 0.6)])
def test_gradcheck_float64_with_reset_and_mask(reset_p, mask_p, layout):
    """Every input's gradient (projections, state, both weights) against finite differences,
    with the per-step matrices stored in either layout."""
    tensors, mask, reset = window_inputs(5, 2, 3, reset_p=reset_p, mask_p=mask_p)
    if reset is not None:
        reset[2, 1] = True  # at least one reset inside the window
    if mask is not None:
        mask[3, 0] = False  # and one held step
    kernels = K.get_kernels("torch")

    def fn(xg, xm, h0, c0, w_mh, w_h):
        hs, (h, c) = mlstm_window(xg, xm, (h0, c0), w_mh, w_h, kernels, mask, reset,
                                  layout=layout)
        return hs, h, c

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.fixture(params=[1, 2], ids=["1thread-rows", "2threads-features"])
def torch_threads(request):
    """Torch's thread count for the test (restored after): the fused model then picks its
    layout by :func:`default_layout`'s own rule, 1 -> rows, 2 -> features."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    assert default_layout("cpu", K.get_kernels("torch")) == LAYOUTS[request.param - 1]
    yield request.param
    torch.set_num_threads(before)


def pair(seed=0, **cfg) -> tuple[LanguageModel, LanguageModel]:
    """The same weights in a fused and a reference model."""
    torch.manual_seed(seed)
    fused = LanguageModel(ModelConfig(rnn_impl="fused", **cfg))
    ref = LanguageModel(ModelConfig(rnn_impl="reference", **cfg))
    ref.load_state_dict(fused.state_dict())
    with torch.no_grad():  # non-trivial biases, gains and decoder
        for p, q in zip(fused.parameters(), ref.parameters()):
            noise = 0.05 * torch.randn_like(p)
            p.add_(noise)
            q.add_(noise)
    return fused, ref


def grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (those the pass reached)."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_within(a, b, tol, what):
    """max |a - b| <= tol x max(1, max |b|): absolute for O(1) tensors, relative to the largest
    element beyond (fp32 sums of hundreds of terms: a gradient of 14 carries ~1e-6 noise)."""
    diff, scale = float((a - b).detach().abs().max()), max(1.0, float(b.detach().abs().max()))
    assert diff <= tol * scale, \
        f"{what}: max |fused - reference| = {diff:.3g} > {tol:g} x {scale:.3g}"


@pytest.mark.parametrize("weight_norm", [False, True])
def test_fused_equals_reference_fp32_random(weight_norm, torch_threads):
    """Forward states and all parameter gradients within 1e-6 (fp32; :func:`assert_within`),
    with resets inside the window, padding, a non-zero incoming state and gradients into the
    final state; the fused window in either layout (the CPU default follows the thread
    count)."""
    fused, ref = pair(hidden_size=48, embed_dim=16, weight_norm=weight_norm)
    B, T = 5, 40
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (B, T), generator=g)
    reset = torch.rand(B, T, generator=g) < 0.1
    reset[2, 17] = True
    mask = torch.rand(B, T, generator=g) < 0.85
    state = (torch.randn(B, 48, generator=g), torch.randn(B, 48, generator=g))
    w_out = torch.randn(B, T, 48, generator=g)
    outs = []
    for model in (fused, ref):
        hs, (h, c) = model.encode(tokens, state, mask=mask, reset=reset)
        ((hs * w_out).sum() + 0.3 * h.sum() - 0.2 * c.sum()).backward()
        outs.append((hs, h, c, grads(model)))
    (hs_f, h_f, c_f, g_f), (hs_r, h_r, c_r, g_r) = outs
    for what, a, b in (("hs", hs_f, hs_r), ("h", h_f, h_r), ("c", c_f, c_r)):
        assert_within(a, b, 1e-6, what)
    assert g_f.keys() == g_r.keys() and len(g_f) >= 6  # all but the decoder's (encode only)
    for name in g_f:
        assert float(g_f[name].abs().max()) > 0, name
        assert_within(g_f[name], g_r[name], 1e-6, name)


def test_fused_equals_reference_on_real_shards(shards):
    """Consecutive TBPTT windows of real review bytes (one with a shard start inside it): the
    window loss, the carried state and every parameter gradient within 1e-6 (fp32)."""
    streams = RankStreams(load_manifest(shards), "train", 0, 1, 4, 96, shuffle_shards=False)
    inside = next(w for w in range(1, streams.windows_per_epoch)
                  if streams.window(0, w).reset[:, 1:].any())
    fused, ref = pair(hidden_size=64, embed_dim=16)
    results = []
    for model in (fused, ref):
        state = model.init_state(4)
        total = 0.0
        for w in range(inside - 2, inside + 1):
            batch = streams.window(0, w)
            nats, state = window_nll(model, batch, state, torch.device("cpu"), "fp32")
            (nats / batch.chars).backward()
            total += float(nats)
        results.append((total, state, grads(model)))
    (n_f, s_f, g_f), (n_r, s_r, g_r) = results
    assert n_f == pytest.approx(n_r, rel=1e-6)
    assert_within(s_f[0], s_r[0], 1e-6, "h")
    assert_within(s_f[1], s_r[1], 1e-6, "c")
    for name in g_f:
        assert_within(g_f[name], g_r[name], 1e-6, name)


def test_bf16_autocast_close_to_fp32_reference(torch_threads):
    """CPU bf16 autocast: the fused path (fp32 cell state, bf16 GEMMs) stays within 1e-2
    relative error (Frobenius) of the fp32 reference, forward and weight gradients (either
    layout)."""
    fused, ref = pair(hidden_size=64, embed_dim=16)
    tokens = torch.randint(0, 256, (6, 48), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hs_f, (h_f, c_f) = fused.encode(tokens)
    assert hs_f.dtype == torch.bfloat16 and c_f.dtype == torch.float32
    hs_f.float().pow(2).sum().backward()
    hs_r, (h_r, c_r) = ref.encode(tokens)
    hs_r.pow(2).sum().backward()

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert rel(hs_f, hs_r) < 1e-2 and rel(c_f, c_r) < 1e-2
    for name in ("rnn.w_h.weight", "rnn.w_mh.weight", "rnn.w_x.weight"):
        p_f = dict(fused.named_parameters())[name].grad
        p_r = dict(ref.named_parameters())[name].grad
        assert rel(p_f, p_r) < 3e-2, name


def test_inference_path_equals_training_path():
    """Under no_grad the Function keeps O(1) buffers in T; the results are the training path's
    to fp32 rounding (in the CPU features layout the per-step GEMMs then read and write
    matrices of another leading dimension, B instead of T*B, which MKL may sum in another
    order; measured 1.2e-7)."""
    model, _ = pair(hidden_size=32, embed_dim=8)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    reset = torch.zeros(3, 20, dtype=torch.bool)
    reset[1, 7] = True
    hs, (h, c) = model.encode(tokens, reset=reset)
    with torch.no_grad():
        hs0, (h0, c0) = model.encode(tokens, reset=reset)
    for a, b in ((hs, hs0), (h, h0), (c, c0)):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6)


def test_one_step_at_a_time_equals_the_window():
    """Text generation calls encode with T = 1 and carries the state: the same states as one
    window, resets and padding included."""
    model, _ = pair(hidden_size=32, embed_dim=8)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 256, (3, 12), generator=g)
    reset = torch.rand(3, 12, generator=g) < 0.2
    mask = torch.rand(3, 12, generator=g) < 0.8
    with torch.no_grad():
        hs, (h, c) = model.encode(tokens, mask=mask, reset=reset)
        state, steps = None, []
        for t in range(12):
            out, state = model.encode(tokens[:, t:t + 1], state, mask[:, t:t + 1],
                                      reset[:, t:t + 1])
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), hs, rtol=0, atol=1e-6)
    torch.testing.assert_close(state[1], c, rtol=0, atol=1e-6)


def test_shape_errors():
    (xg, xm, h0, c0, w_mh, w_h), _, _ = window_inputs(3, 2, 4)
    k = K.get_kernels("torch")
    with pytest.raises(ValueError, match="shapes"):
        mlstm_window(xg, xm[:, :1], (h0, c0), w_mh, w_h, k)
    with pytest.raises(ValueError, match="c0"):
        mlstm_window(xg, xm, (h0, c0.float()), w_mh, w_h, k)


# ---- the kernels --------------------------------------------------------------------------------

@pytest.mark.parametrize("keep,rk", [(False, False), (True, False), (False, True),
                                     (True, True)])
def test_torch_kernels_equal_the_specification(keep, rk):
    """The eager torch kernels (out= and in-place ops) against the pure-expression spec."""
    assert cell_diff(K.get_kernels("torch"), *cell_case(6, 9, keep, rk)) <= 1e-6


def test_kernel_names_resolve():
    assert K.resolve("auto", "cpu") == "torch"
    assert K.resolve("compile", "cpu") == "compile"
    with pytest.raises(ValueError, match="kernels"):
        K.resolve("cudnn", "cpu")
    with pytest.raises(ValueError, match="rnn_kernels"):
        LanguageModel(ModelConfig(rnn_kernels="cudnn"))
    with pytest.raises(ValueError, match="rnn_impl"):
        LanguageModel(ModelConfig(rnn_impl="fast"))


@pytest.mark.slow
def test_compile_kernels_equal_torch_kernels():
    """torch.compile of the cell functions (never the loop) gives the torch path's numbers, in
    the cell and through the whole window's forward and backward, fp32 and with bf16
    projections (the cell case has the window case's shapes, B=4 and H=8, so Inductor compiles
    each function once per dtype: a compile costs tens of seconds on 2 cores)."""
    compiled = K.get_kernels("compile")
    assert cell_diff(compiled, *cell_case(4, 8, True, True)) <= 1e-6
    assert window_diff(compiled) <= 1e-6
    # bf16 projections: the activations recomputed, the gate gradients written over the
    # pre-activations (two views of one memory once gave Inductor two inputs: 6.5 relative
    # error); as accurate as the torch kernels' bf16 window against the fp32 one
    assert window_diff(compiled, compute=torch.bfloat16) <= 1.01 * window_diff(
        K.get_kernels("torch"), compute=torch.bfloat16)


def test_triton_kernels_under_the_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 (tests/scripts/triton_interpreted.py, its own
    process): every cell case (fp32 state; fp32 and bf16 gates/outputs/gate gradients, with
    and without mask and reset, a partial last block; the activations saved, or recomputed
    from the pre-activations with the gate gradients written over them) against the
    specification, and the fused window with them against the torch kernels, outputs and all
    input gradients (fp32: 1e-6; bf16 projections, the recomputing path, against the fp32
    window: 2e-2 relative, bf16's own accuracy, measured 8e-3)."""
    pytest.importorskip("triton", reason="triton is an optional (GPU) dependency")
    proc = run([sys.executable, "-m", "tests.scripts.triton_interpreted"], timeout=600,
               env=launch_env(TRITON_INTERPRET="1"))
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(diffs) == 16
    bad = {case: d for case, d in diffs.items() if not d[0] <= d[1]}
    assert not bad, bad


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        K.get_kernels("triton", "cpu")


# ---- CUDA graphs: capture, replay and fallback (capture itself needs a GPU) ----------------------

def graph_case(T, seed=0):
    """A window's arguments (fp32, resets, padding, leaves requiring grad) for WindowGraphs."""
    tensors, mask, reset = window_inputs(T, 3, 4, dtype=torch.float32, reset_p=0.3, mask_p=0.8,
                                         seed=seed)
    return tensors, mask, reset


def run_window(graphs, T, seed=0, grad=True):
    """hs, h, c and the six inputs' gradients of one window through ``graphs`` (None: eager)."""
    tensors, mask, reset = graph_case(T, seed)
    with torch.set_grad_enabled(grad):
        hs, (h, c) = mlstm_window(*tensors[:2], tensors[2:4], *tensors[4:],
                                  K.get_kernels("torch"), mask, reset, graphs=graphs)
        if not grad:
            return [hs, h, c]
        (hs.pow(2).sum() + h.sum() - c.sum()).backward()
    return [hs, h, c] + [t.grad for t in tensors]


def test_window_graphs_capture_once_replay_and_fall_back(capsys):
    """With a capture that has CUDA graphs' buffer semantics (StaticBufferCapture): the first
    window of a signature is captured once and replayed for every later one of that signature;
    another shape (the last window, eval), grad off, or a capture that failed run eagerly (the
    failure reported once). Every result, replayed or eager, equals the eager window's."""
    capture = StaticBufferCapture()
    graphs = WindowGraphs(device_type="cpu", capture=capture)
    for T, seed, grad in ((5, 0, True), (5, 1, True), (5, 2, True), (4, 3, True),
                          (5, 4, False)):
        got, want = run_window(graphs, T, seed, grad), run_window(None, T, seed, grad)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # grad off never reaches the graphs (nothing to save): only the T=4 window counts as eager
    assert graphs.stats == {"captures": 1, "graphed": 3, "eager": 1} and capture.captures == 1

    def broken(fn, sample):
        raise RuntimeError("capture failed")

    failing = WindowGraphs(device_type="cpu", capture=broken)
    for seed in range(2):
        for a, b in zip(run_window(failing, 5, seed), run_window(None, 5, seed)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert failing.stats == {"eager": 2} and len(failing.failed) == 1
    assert capsys.readouterr().err.count("CUDA graph capture of the mLSTM window failed") == 1
    assert signature(graph_case(5)[0]) != signature(graph_case(4)[0])


def test_cuda_graphs_option_is_eager_off_cuda():
    """--cuda-graphs true on a CPU model: every window runs eagerly, with the same numbers."""
    torch.manual_seed(0)
    a = LanguageModel(ModelConfig(hidden_size=16, embed_dim=4, cuda_graphs=True))
    b = LanguageModel(ModelConfig(hidden_size=16, embed_dim=4))
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 256, (2, 6))
    la, _ = a(tokens)
    lb, _ = b(tokens)
    assert torch.equal(la, lb)
    assert a.rnn.graphs.stats == {"eager": 1} and b.rnn.graphs is None


def test_fused_rejects_reset_on_reference_path():
    model = LanguageModel(ModelConfig(hidden_size=8, embed_dim=4, rnn_impl="reference"))
    x = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="reset"):
        model.rnn(x, model.init_state(2), reset=torch.zeros(3, 2, dtype=torch.bool))


def test_function_saves_only_when_needed():
    """``save`` is what makes the backward possible; without it backward is never reached."""
    tensors, _, _ = window_inputs(3, 2, 4, dtype=torch.float32)
    k = K.get_kernels("torch")
    hs, h, c = MLSTMWindow.apply(*tensors, None, None, k, True, "rows")
    assert hs.requires_grad and hs.grad_fn is not None


def test_layouts_store_the_same_matrices():
    """``features``: each step one column-major [B, F] matrix, all steps one row-major
    [F, n*B] matrix (what the weight-gradient GEMMs read); ``to_layout`` copies only when
    needed and keeps the values."""
    x = steps_empty(3, 4, 5, torch.float32, "cpu", "features")
    assert x.shape == (3, 4, 5) and x.stride() == (4, 1, 12)
    assert x.view(12, 5).t().is_contiguous() and x[1].stride() == (1, 12)
    assert steps_empty(3, 4, 5, torch.float32, "cpu", "rows").is_contiguous()
    y = torch.randn(3, 4, 5)
    f = to_layout(y, "features")
    assert torch.equal(f, y) and f.stride() == (4, 1, 12) and to_layout(f, "features") is f
    assert to_layout(f, "rows").is_contiguous() and torch.equal(to_layout(f, "rows"), y)
    with pytest.raises(ValueError, match="layout"):
        steps_empty(1, 1, 1, torch.float32, "cpu", "columns")


def test_default_layout_follows_device_threads_and_kernels():
    """features only on a multi-threaded CPU with strided kernels (section 5's measurement)."""
    torch_k = K.get_kernels("torch")
    assert default_layout("cpu", torch_k, threads=2) == "features"
    assert default_layout("cpu", torch_k, threads=1) == "rows"
    assert default_layout("cuda", torch_k, threads=8) == "rows"
    rowwise = K.Kernels("rowwise", K.cell_forward, K.cell_backward, strided=False)
    assert default_layout("cpu", rowwise, threads=2) == "rows"
    assert not K.get_kernels("compile").strided


def test_layouts_give_the_same_window():
    """The fused window in ``rows`` and ``features`` (fp32, resets, padding, incoming state):
    outputs and the gradients of all six inputs within 1e-6; the final state is contiguous
    in both."""
    results = []
    for layout in LAYOUTS:
        tensors, mask, reset = window_inputs(11, 3, 8, dtype=torch.float32, reset_p=0.2,
                                             mask_p=0.8, seed=7)
        hs, (h, c) = mlstm_window(*tensors[:2], tensors[2:4], *tensors[4:],
                                  K.get_kernels("torch"), mask, reset, layout=layout)
        assert h.is_contiguous() and c.is_contiguous()
        (hs.pow(2).sum() + h.sum() - c.sum()).backward()
        results.append([hs, h, c] + [t.grad for t in tensors])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,mask_p,reset_p", [(torch.float32, 1.0, 0.0),
                                                  (torch.bfloat16, 0.8, 0.2)])
def test_saved_bytes_equal_the_formula(layout, dtype, mask_p, reset_p):
    """What one window keeps for its backward, counted by torch's saved-tensor hooks (every
    tensor the Function saves, less the recurrent weights: the parameters' own storage), equals
    :func:`saved_bytes` (the formula of docs/mlstm_fused.md section 2), in both layouts, with
    fp32 and bf16 compute dtypes, with and without mask and reset."""
    T, B, H = 7, 3, 8
    tensors, mask, reset = window_inputs(T, B, H, dtype=torch.float32, reset_p=reset_p,
                                         mask_p=mask_p, seed=5)
    if reset is not None:
        reset[3, 1] = True
    xg, xm, h0, c0, w_mh, w_h = tensors
    xg, xm = xg.detach().to(dtype).requires_grad_(), xm.detach().to(dtype).requires_grad_()
    seen = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlstm_window(xg, xm, (h0, c0), w_mh, w_h, K.get_kernels("torch"), mask, reset,
                     layout=layout)
    counted = sum(t.untyped_storage().nbytes() for t in seen
                  if t is not None and t is not w_mh and t is not w_h)
    assert counted == saved_bytes(T, B, H, torch.float32, dtype, mask is not None,
                                  reset is not None)
    # the figures docs/mlstm_fused.md states: bf16 saves the pre-activations (5.4 GB at B=256,
    # 8.6 GB when it saved the fp32 activations), fp32 the activations
    assert saved_bytes(256, 256, 4096, torch.float32, torch.bfloat16) / 1e9 == \
        pytest.approx(5.4, abs=0.05)
    assert saved_bytes(256, 256, 4096) == 256 * 256 * 4096 * 40 + 256 * 4096 * 8


@pytest.mark.slow
def test_bench_worker_alternates_variants_in_one_process():
    """One mpirun launch of the bench worker with two variants: one record each, labelled,
    with every timed step's time (the step-by-step pairing the table reports)."""
    step = bt.StepConfig(hidden_size=16, embed_dim=8, batch_size=2, seq_len=8, steps=3, warmup=1)
    recs = bt.launch("horovod", 1, step, 300, variants=[
        {"rnn_impl": "fused", "rnn_kernels": "torch"}, {"rnn_impl": "reference"}])
    assert [r["variant"] for r in recs] == ["fused/torch", "reference"]
    assert all(len(r["step_times_s"]) == 3 and r["chars_per_s_total"] > 0 for r in recs)
