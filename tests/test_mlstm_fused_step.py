"""The fused mLSTM in the step (hvd_lm.model.mlstm_fused; tests/test_mlstm_fused.py has its
oracles): training against the reference (on 2 ranks: tests/parallel/test_training.py, the
fused recurrence being the default), the benchmark's bookkeeping, the
CUDA tests (skipped without a GPU), and issue 43's step: kernels per time step, no
window-sized copy, the pre-activations saved."""
from __future__ import annotations

import pytest
import torch

from benchmarks import bench_train as bt
from hvd_lm.model import mlstm_kernels as K
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.model.mlstm_fused import (
    mlstm_window,
)
from tests.conftest import records
from tests.scripts.mlstm_cases import (
    SPEC,
    cell_case,
    cell_diff,
    train_windows,
    window_inputs,
)
from tests.test_mlstm_fused import (  # noqa: F401 - the fixtures and helpers these tests share
    assert_within,
    grads,
    needs_cuda,
    pair,
    torch_threads,
)
from tests.test_train import max_diff, one_process, params_of, records

# ---- training ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_twenty_training_steps_fused_vs_reference(shards, tmp_path):
    """20 Adam steps (lr 3e-3, H=32, one process) from the same start, fused vs reference.

    The two differ only by fp32 rounding in the gradients (~1e-7 relative, the tests above);
    Adam's update is m / (sqrt(v) + eps) x lr, so a difference can only grow where a gradient
    element is ~0 and the ratio is ill-conditioned. Bound: max |diff| <= 1e-5 over every
    parameter (measured 2.2e-7; 20 x lr = 6e-2 would be the worst case) and the logged losses
    within 1e-6 relative."""
    runs = {}
    for impl in ("fused", "reference"):
        one_process(shards, tmp_path / impl, "--batch-size", "3", "--max-steps", "20",
                    "--rnn-impl", impl, "--log-every", "5")
        runs[impl] = params_of(tmp_path / impl)
    assert max_diff(runs["fused"], runs["reference"]) <= 1e-5
    losses = {impl: [r["loss"] for r in records(tmp_path / impl, "train")] for impl in runs}
    assert len(losses["fused"]) == 4
    assert losses["fused"] == pytest.approx(losses["reference"], rel=1e-6)
    assert records(tmp_path / "fused", "start")[0]["world_size"] == 1


# ---- the benchmark's bookkeeping ----------------------------------------------------------------

def test_bench_variants_and_ratios():
    cfg = bt.BenchTrainConfig(rnn_impl=["fused", "reference"], rnn_kernels=["torch", "triton"],
                              cuda_graphs=[False, True])
    labels = [label for label, _ in bt.variants(cfg)]
    assert labels == ["fused/torch", "fused/torch+graphs", "fused/triton",
                      "fused/triton+graphs", "reference"]

    def rec(chars, ranks, backend="horovod", steps=()):
        return {"backend": backend, "ranks": ranks, "chars_per_s_total": chars,
                "chars_per_s_per_rank": chars / ranks, "flops_per_char": 1e6,
                "allreduce_wait_share": None, "step_times_s": list(steps)}

    trials = {("fused/torch", "horovod", 1): [rec(130, 1, steps=[1.0, 2.0]), rec(150, 1),
                                              rec(140, 1, steps=[1.0])],
              ("reference", "horovod", 1): [rec(100, 1, steps=[1.5, 2.2]), rec(90, 1),
                                            rec(110, 1, steps=[0.9])],
              ("fused/torch", "horovod", 2): [rec(260, 2)],
              ("reference", "horovod", 2): [rec(200, 2)],
              ("fused/torch", "ddp", 2): [rec(250, 2, "ddp")]}
    s = bt.summarize_train(trials, peak=1.0)
    ratios = {(x["variant"], x["ranks"]): x["ratio"] for x in s["impl_ratios"]}
    assert ratios == {("fused/torch", 1): pytest.approx(1.4), ("fused/torch", 2): 1.3}
    assert s["impl_ratios"][0]["paired_ratios"] == pytest.approx([1.3, 150 / 90, 140 / 110])
    assert s["impl_ratios"][0]["paired_ratio_median"] == pytest.approx(1.3)
    # step by step: reference time / fused time of the steps that alternated in one process
    assert s["impl_ratios"][0]["step_ratios"] == pytest.approx([1.5, 1.1, 0.9])
    assert s["impl_ratios"][0]["step_ratio_median"] == pytest.approx(1.1)
    assert "step_ratios" not in s["impl_ratios"][1]  # 2 ranks: no step times recorded
    assert s["horovod_over_ddp"] == pytest.approx(260 / 250)
    eff = {(r["variant"], r["ranks"]): r["weak_scaling_efficiency"] for r in s["runs"]
           if r["backend"] == "horovod"}
    assert eff[("fused/torch", 2)] == pytest.approx(130 / 140)
    assert s["runs"][0]["chars_per_s_total_trials"] == [130, 150, 140]


# ---- CUDA (skipped without a GPU) ---------------------------------------------------------------

@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kernels", ["auto", "torch", "compile"])
def test_cuda_bf16_fused_close_to_fp32_reference(kernels):
    """bf16 autocast on CUDA (auto = the Triton kernels): relative error < 1e-2 against the
    fp32 reference, forward states."""
    fused, ref = pair(hidden_size=256, embed_dim=64, rnn_kernels=kernels)
    fused, ref = fused.cuda(), ref.cuda()
    tokens = torch.randint(0, 256, (16, 64), device="cuda")
    reset = torch.zeros(16, 64, dtype=torch.bool, device="cuda")
    reset[3, 20] = True
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hs_f, (h_f, c_f) = fused.encode(tokens, reset=reset)
    hs_r, (h_r, c_r) = ref.encode(tokens, reset=reset)
    for a, b in ((hs_f, hs_r), (h_f, h_r), (c_f, c_r)):
        assert float((a.float() - b).norm() / b.norm()) < 1e-2


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_path_equals_eager_fused_path():
    """Four training windows replayed from one CUDA graph give the eager fused path's
    gradients and states; an eval batch of another shape falls back to eager."""
    torch.manual_seed(0)
    graphed = LanguageModel(ModelConfig(hidden_size=128, embed_dim=32, cuda_graphs=True)).cuda()
    eager = LanguageModel(ModelConfig(hidden_size=128, embed_dim=32)).cuda()
    eager.load_state_dict(graphed.state_dict())
    tokens = torch.randint(0, 256, (4, 8, 33), device="cuda")
    reset = torch.zeros(8, 32, dtype=torch.bool, device="cuda")
    reset[2, 5] = True
    states = [train_windows(model, tokens, reset) for model in (graphed, eager)]
    assert graphed.rnn.graphs.stats == {"captures": 1, "graphed": 4}
    for (n, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    torch.testing.assert_close(states[0], states[1], rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # grad off never reaches the graphs (nothing to save): same numbers
        a, _ = graphed(tokens[0, :3, :-1])
        b, _ = eager(tokens[0, :3, :-1])
    torch.testing.assert_close(a, b)
    assert graphed.rnn.graphs.stats == {"captures": 1, "graphed": 4}


@pytest.mark.cuda
@needs_cuda
def test_cuda_bound_triton_launches_equal_the_jits(monkeypatch):
    """The Triton cell kernels bound once per window (issue 43: Launch) give the results of
    launching every step through Triton's JIT, bit for bit (same kernels, same arguments): a
    bf16 window with resets, forward and every input gradient."""
    from hvd_lm.model import mlstm_fused

    results = []
    for bind in (True, False):
        if not bind:
            monkeypatch.setattr(mlstm_fused, "uniform_steps", lambda *a: False)
        tensors, mask, reset = window_inputs(16, 8, 64, dtype=torch.float32, reset_p=0.1,
                                             seed=3)
        tensors = [t.detach().cuda().requires_grad_() for t in tensors]
        xg, xm = (t.detach().bfloat16().requires_grad_() for t in tensors[:2])
        hs, (h, c) = mlstm_window(xg, xm, tensors[2:4], *tensors[4:],
                                  K.get_kernels("triton", "cuda"), None, reset.cuda())
        (hs.float().pow(2).sum() + h.sum() - c.sum()).backward()
        results.append([hs, h, c, xg.grad, xm.grad] + [t.grad for t in tensors[2:]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---- issue 43: fewer kernels per step, no copies, the pre-activations saved ---------------------

def test_recomputed_activations_give_the_saved_ones_gradients():
    """A narrower compute dtype saves the gate pre-activations instead of the fp32 activations:
    the cell backward recomputes them with the forward's own expressions and writes the gate
    gradients over them. The torch kernels give the saved path's gradients bit for bit (the
    same ops in the same order as their forward), with and without mask and reset; every
    kernel pair agrees with the specification with or without recomputing."""
    k = K.get_kernels("torch")
    for keep, rk in ((False, False), (True, True)):
        (g, cprev, hstate, keep_t, rk_t), (dhs, dhp, dcp) = cell_case(6, 9, keep, rk)
        B, H = cprev.shape
        act, tc = torch.empty(B, 4 * H), torch.empty(B, H)
        outs = [torch.empty(B, H) for _ in range(4)]
        k.forward(g, cprev, hstate, keep_t, rk_t, act, tc, *outs)
        grads = []
        for recompute in (False, True):
            dg, dc = (g.clone() if recompute else torch.empty(B, 4 * H)), torch.empty(B, H)
            dhold = torch.zeros(B, H) if keep else None
            k.backward(dhs, dhp, dcp, rk_t, keep_t, None if recompute else act,
                       None if recompute else tc, cprev, dg, dc, dhold,
                       dg if recompute else None)
            grads.append([dg, dc] + ([dhold] if keep else []))
        for a, b in zip(*grads):
            assert torch.equal(a, b)
        fwd_in, bwd_in = cell_case(6, 9, keep, rk)
        assert cell_diff(k, fwd_in, bwd_in, recompute=True) <= 1e-6
        assert cell_diff(SPEC, fwd_in, bwd_in, recompute=True) <= 1e-6


def test_the_window_writes_only_into_a_projection_it_owns():
    """The gate GEMM accumulates into xg in place (no copy, no add kernel per step): a caller's
    xg is left as it was (the window works on a copy), an owned one (LanguageModel's fresh
    projection, already in the window's layout) holds the gate pre-activations afterwards; the
    results are the same."""
    (xg, xm, h0, c0, w_mh, w_h), _, _ = window_inputs(4, 2, 3, dtype=torch.float32)
    xg = xg.detach()
    before = xg.clone()
    k = K.get_kernels("torch")
    hs, _ = mlstm_window(xg, xm, (h0, c0), w_mh, w_h, k, layout="rows")
    assert torch.equal(xg, before)
    owned = xg.clone()
    hs2, _ = mlstm_window(owned, xm, (h0, c0), w_mh, w_h, k, layout="rows", owned=True)
    assert torch.equal(hs, hs2) and not torch.equal(owned, before)
    # the first step's pre-activations: x W_x^T + b (the projection) + m_0 W_h^T
    m0 = xm[0] * (h0 @ w_mh.t())
    torch.testing.assert_close(owned[0], before[0] + m0 @ w_h.t())


def counted_kernels() -> K.Kernels:
    """The torch kernels, each call inside a ``record_function`` scope: counted as one kernel
    each (what the Triton kernels are on a GPU) by :func:`cpu_launches`."""
    def forward(*a):
        with torch.profiler.record_function("cell_forward"):
            K.torch_cell_forward(*a)

    def backward(*a):
        with torch.profiler.record_function("cell_backward"):
            K.torch_cell_backward(*a)

    return K.Kernels("counted", forward, backward)


def step_launches(T: int, precision: str, monkeypatch) -> int:
    """Kernels one training step (train_step: forward, loss, backward, clip, fused Adam) of an
    H=16 fused model launches on the CPU at window length T (:func:`count_launches`)."""
    from benchmarks.profile_step import count_launches
    from hvd_lm.model import device as devices
    from hvd_lm.model import lm as lm_mod
    from hvd_lm.train.data import Batch
    from hvd_lm.train.step import StepSpec, train_step

    monkeypatch.setattr(lm_mod, "get_kernels", lambda name, device: counted_kernels())
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(hidden_size=16, embed_dim=4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler, cpu = devices.make_scaler(torch.device("cpu"), precision), torch.device("cpu")
    data = torch.randint(0, 256, (2, T + 1), generator=torch.Generator().manual_seed(0))
    batch = Batch(data[:, :-1], data[:, 1:], torch.zeros(2, T, dtype=torch.bool), 2 * T)
    state = [model.init_state(2)]

    def step():
        state[0] = train_step(model, opt, scaler, [batch], state[0],
                              StepSpec(cpu, precision, 1.0)).state

    step()  # Adam's state made, as in every later step
    return count_launches(step, cpu, ("cell_forward", "cell_backward"))


@pytest.mark.parametrize("precision,per_step", [("fp32", 8), ("bf16", 9)])
def test_kernels_per_time_step(precision, per_step, monkeypatch, torch_threads):
    """The training step's kernels per time step, counted by torch.profiler on the CPU (the
    window at T=4 and T=8: the difference / 4; the cell kernels one each): forward a_t GEMM,
    the multiply, the gate GEMM accumulating into xg in place, the cell; backward the cell,
    dm GEMM, the multiply, the dh GEMM. bf16 on the CPU: + the cast of dh to fp32 (a GPU
    writes it from the GEMM: 8). Before issue 43: 9 and 10 (the gate GEMM copied xg into its
    output first; bf16 the same cast)."""
    a, b = step_launches(4, precision, monkeypatch), step_launches(8, precision, monkeypatch)
    assert (b - a) / 4 == per_step


def test_the_step_copies_no_window_sized_tensor():
    """No [T, B, H], [T, B, 4H] or [T, B, 256] tensor is copied in an fp32 training step (the
    data stays in [T, B] order from the embedding through the decoder and the loss, and the
    gate GEMM writes in place): no copy_ (or clone) of T B H elements or more in the profile
    of forward, backward and update, but the one inside each bias GEMM (``addmm`` on a CPU
    writes the broadcast bias into its output, then accumulates the product: its form of a
    GPU GEMM's bias epilogue). Before issue 43: the decoder's input, the logits and the
    gradient of hs were each copied out of a transposed view, and the input projection's bias
    was added by a separate kernel."""
    from hvd_lm.train.data import Batch
    from hvd_lm.train.step import StepSpec, train_step

    T, B, H = 16, 8, 16  # T B > 4H: a window-sized tensor is larger than any weight
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(hidden_size=H, embed_dim=4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    data = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(0))
    batch = Batch(data[:, :-1], data[:, 1:], torch.zeros(B, T, dtype=torch.bool), B * T)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        train_step(model, opt, scaler, [batch], model.init_state(B),
                   StepSpec(torch.device("cpu"), "fp32", 1.0))
    copies = [e for e in prof.events() if e.name in ("aten::copy_", "aten::clone")]
    assert copies  # the profile sees the small ones
    in_gemm = [e for e in copies if e.cpu_parent is not None and e.cpu_parent.name == "aten::addmm"]
    assert len(in_gemm) == 2  # the input projection's and the decoder's
    big = [(e.name, e.input_shapes) for e in copies if e not in in_gemm and e.input_shapes
           and e.input_shapes[0] and torch.Size(e.input_shapes[0]).numel() >= T * B * H]
    assert not big, big
