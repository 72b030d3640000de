"""The pieces of the training step (hvd_lm.train.step): unscale and clip, step or skip, the
re-cut window index and the fault hooks, each against a computation done here by hand (numpy or
plain arithmetic)."""
import contextlib
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.utils._python_dispatch

from hvd_lm.train import faults, step
from hvd_lm.train.data import recut_bytes, window_in_new_cut

#: fp32/bf16's loss scaler: disabled, every call passes through
NO_SCALING = torch.amp.GradScaler("cpu", enabled=False)


def _params(grads):
    ps = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g, dtype=torch.float32)
        ps.append(p)
    return ps


def test_unscale_and_clip_returns_the_norm_before_clipping_and_clips_to_max_norm():
    grads = [[3.0, 4.0], [12.0]]
    ps = _params(grads)
    norm = step.unscale_and_clip(torch.optim.SGD(ps, lr=1.0), ps, 1.0, NO_SCALING)
    want = float(np.linalg.norm(np.concatenate([np.array(g) for g in grads])))  # 13
    assert norm == pytest.approx(want)
    clipped = np.concatenate([p.grad.numpy() for p in ps])
    assert np.linalg.norm(clipped) == pytest.approx(1.0, rel=1e-5)
    assert clipped == pytest.approx(np.array([3, 4, 12]) / 13, rel=1e-5)


def test_unscale_and_clip_with_zero_max_norm_only_measures():
    ps = _params([[3.0, 4.0]])
    norm = step.unscale_and_clip(torch.optim.SGD(ps, lr=1.0), ps, 0.0, NO_SCALING)
    assert norm == pytest.approx(5.0)
    assert ps[0].grad.tolist() == [3.0, 4.0]


def test_unscale_and_clip_takes_the_optimizers_agreed_norm():
    """A 1-bit optimiser's compressed phase: the norm every rank agrees on is the one returned."""
    ps = _params([[3.0, 4.0]])
    opt = torch.optim.SGD(ps, lr=1.0)
    seen = []
    opt.agree_grad_norm = lambda local: seen.append(local) or 7.0
    assert step.unscale_and_clip(opt, ps, 0.0, NO_SCALING) == 7.0
    assert seen == [pytest.approx(5.0)]


def test_step_or_skip_skips_a_non_finite_step_and_applies_a_finite_one():
    ps = _params([[1.0, -2.0]])
    opt = torch.optim.SGD(ps, lr=0.5)
    assert step.step_or_skip(opt, NO_SCALING, math.inf) is False
    assert ps[0].tolist() == [0.0, 0.0]  # untouched
    assert step.step_or_skip(opt, NO_SCALING, math.inf, check_finite=False) is True
    assert ps[0].tolist() == [-0.5, 1.0]  # x - lr g
    assert step.step_or_skip(opt, NO_SCALING, 2.2) is True
    assert ps[0].tolist() == [-1.0, 2.0]


@pytest.mark.parametrize("window,old,new,want", [
    (7, 10, 10, 7),     # same cut: unchanged
    (25, 10, 5, 12),    # 2 epochs + 5/10 of one -> 2 x 5 + round(2.5) (banker's: 2)
    (13, 10, 20, 26),   # 1 epoch + 3/10 -> 20 + 6
    (0, 4, 9, 0),
])
def test_window_in_new_cut_keeps_epochs_and_the_fraction_of_the_epoch(window, old, new, want):
    assert window_in_new_cut(window, old, new) == want


def epoch_marks(total: int, streams: int, windows: int, seq_len: int) -> np.ndarray:
    """bool [total]: the targets the first ``windows`` windows of each of ``streams`` streams
    cover, the streams cut by hand (the first (total - 1) mod streams one longer)."""
    base, extra = divmod(total - 1, streams)
    marks, start = np.zeros(total, bool), 1
    for s in range(streams):
        length = base + (s < extra)
        marks[start:start + min(length, windows * seq_len)] = True
        start += length
    return marks


@pytest.mark.parametrize("total,T,old_rows,old_w,rows,w", [
    (1000, 16, 8, 3, 4, 6),     # 4 ranks -> 2: the same point, other streams
    (1000, 16, 4, 6, 6, 4),     # 2 -> 3
    (5000, 7, 12, 10, 12, 10),  # the same cut: nothing re-read or skipped
    (777, 5, 3, 40, 5, 0),      # a new cut at the epoch's start: all re-read, none skipped
    (777, 5, 2, 0, 7, 9),
])
def test_recut_bytes_counts_what_a_resume_reads_twice_and_skips(total, T, old_rows, old_w,
                                                                rows, w):
    before, after = epoch_marks(total, old_rows, old_w, T), epoch_marks(total, rows, w, T)
    want = (int(np.sum(before & ~after)), int(np.sum(after & ~before)))
    assert recut_bytes(total, T, old_rows, old_w, rows, w) == want


def test_faults_are_a_no_op_object_unless_a_test_asks(monkeypatch):
    for name in ("HVD_LM_FAULT_RANK", "HVD_LM_FAULT_STEP", "HVD_LM_STEP_SLEEP"):
        monkeypatch.delenv(name, raising=False)
    none = faults.for_rank(0, "")
    assert type(none) is faults.NoFaults
    x = torch.tensor(1.5)
    assert none.loss(x, 0) is x
    some = faults.for_rank(0, "1,3")
    assert isinstance(some, faults.Faults)
    assert math.isnan(float(some.loss(x, 3))) and float(some.loss(x, 2)) == 1.5
    assert float(faults.for_rank(1, "3").loss(x, 3)) == 1.5  # rank 0 only
    monkeypatch.setenv("HVD_LM_STEP_SLEEP", "0.001")
    assert isinstance(faults.for_rank(0, ""), faults.Faults)


# ---- issue 43: the skip decided on the device ---------------------------------------------------

class NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any read of a tensor's value by the host: ``aten._local_scalar_dense`` (what
    ``item()``, ``float()``, ``bool()`` and ``if tensor`` dispatch to, in Python or C++), and
    ``tolist()``/``numpy()`` (which read memory without dispatching), while active."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError(f"host read: {func}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.saved = torch.Tensor.tolist, torch.Tensor.numpy

        def refuse(*a, **k):
            raise AssertionError("host read: tolist/numpy")

        torch.Tensor.tolist = torch.Tensor.numpy = refuse
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self.saved
        return super().__exit__(*exc)


def test_no_host_reads_catches_what_it_should():
    x = torch.tensor([1.0, float("nan")])
    for read in (lambda: float(x.sum()), lambda: bool(torch.isfinite(x).all()), lambda: x.tolist(),
                 lambda: x.max().item()):
        with pytest.raises(AssertionError, match="host read"), NoHostReads():
            read()
    with NoHostReads():
        torch.isfinite(x).all() & torch.isfinite(x.sum())  # device work only: fine


def tiny_run(seed=0):
    """A fused H=8 model, its fused Adam (the device decision's optimizer) and two windows."""
    from hvd_lm.model.lm import LanguageModel, ModelConfig
    from hvd_lm.train.data import Batch

    torch.manual_seed(seed)
    model = LanguageModel(ModelConfig(hidden_size=8, embed_dim=4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    data = torch.randint(0, 256, (2, 2, 7), generator=torch.Generator().manual_seed(seed))
    batches = [Batch(d[:, :-1], d[:, 1:], torch.zeros(2, 6, dtype=torch.bool), 12) for d in data]
    return model, opt, batches


@pytest.mark.parametrize("nan", [False, True])
def test_the_skip_is_decided_without_reading_the_device(nan):
    """The decision path of train_step (unscale and clip, step or skip, the lost-state check,
    the norm's copy to the host) reads no tensor on the host; a NaN step leaves parameters and
    Adam's state (moments and step count) as they were, a finite one equals the host-decided
    step; the result's outcome reads back as the host path's (applied, norm)."""
    results = []
    for on_device in (True, False):
        model, opt, batches = tiny_run()
        state = model.init_state(2)
        cpu = step.StepSpec(torch.device("cpu"), "fp32", 1.0)
        step.train_step(model, opt, NO_SCALING, batches[:1], state, cpu)  # Adam's state made
        before = ({n: p.detach().clone() for n, p in model.named_parameters()},
                  {i: {k: v.clone() for k, v in s.items()}
                   for i, s in enumerate(opt.state.values())})
        if not on_device:  # the host path's optimizer: the same Adam, not fused
            for g in opt.param_groups:
                g["fused"] = False
        spec = dataclasses.replace(cpu, loss_hook=(lambda x: x * float("nan")) if nan else None)
        g = step.backward(model, opt, NO_SCALING, batches[1:], state, spec)
        with NoHostReads() if on_device else contextlib.nullcontext():
            r = step.update(opt, NO_SCALING, g, spec)
        assert isinstance(r.applied, torch.Tensor) == on_device
        applied, norm = r.read().applied, r.read().grad_norm
        assert applied is (not nan) and math.isfinite(norm) is (not nan)
        params = {n: p.detach() for n, p in model.named_parameters()}
        if nan:
            assert all(torch.equal(params[n], before[0][n]) for n in params)
            for i, s in enumerate(opt.state.values()):
                assert all(torch.equal(v, before[1][i][k]) for k, v in s.items())
        results.append((params, norm))
    if not nan:
        (p_dev, n_dev), (p_host, n_host) = results
        assert n_dev == n_host
        for n in p_dev:
            torch.testing.assert_close(p_dev[n], p_host[n], rtol=1e-6, atol=1e-7)


def test_a_skipped_step_zeroes_a_lost_state_on_the_device():
    """After a skipped step a non-finite recurrent state restarts from zero (what the loop did
    on the host); a finite one is kept, and an applied step keeps whatever it has."""
    h, c = torch.rand(2, 3), torch.rand(2, 3)
    bad = h.clone()
    bad[1, 2] = float("inf")
    yes, no = torch.tensor(True), torch.tensor(False)
    with NoHostReads():
        kept = step._zero_lost_state((h, c), no)
        zeroed = step._zero_lost_state((bad, c), no)
        applied = step._zero_lost_state((bad, c), yes)
    assert torch.equal(kept[0], h) and torch.equal(kept[1], c)
    assert not zeroed[0].any() and not zeroed[1].any()
    assert torch.equal(applied[0], bad)


def test_which_optimizers_decide_on_the_device():
    ps = _params([[1.0]])
    assert step.decides_on_device(torch.optim.Adam(ps, fused=True))
    assert step.decides_on_device(torch.optim.SGD(ps, lr=0.1, fused=True))
    assert not step.decides_on_device(torch.optim.Adam(ps))  # foreach: no found_inf
    opt = torch.optim.Adam(ps, fused=True)
    opt.agree_grad_norm = lambda n: n  # a 1-bit optimizer's collective on the host
    assert not step.decides_on_device(opt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_cuda_step_makes_no_host_sync(kernels):
    """A bf16 training step of the fused model on CUDA (fused Adam, clipping, the device
    decision) runs under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call
    (a host read, a blocking copy, a stream synchronize) raises. Its outcome, read after,
    is a finite norm and an applied step; an injected NaN is skipped the same way."""
    from hvd_lm.model import device as devices
    from hvd_lm.model.lm import LanguageModel, ModelConfig
    from hvd_lm.train.data import Batch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(hidden_size=256, embed_dim=64, rnn_kernels=kernels)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = devices.make_scaler(dev, "bf16")
    data = torch.randint(0, 256, (16, 65))
    reset = torch.zeros(16, 64, dtype=torch.bool)
    reset[3, 20] = True
    batch = Batch(data[:, :-1], data[:, 1:], reset, 16 * 64)
    state = model.init_state(16, dev)
    spec = step.StepSpec(dev, "bf16", 1.0)
    for _ in range(2):  # warm-up: Triton compiles, Adam makes its state
        state = step.train_step(model, opt, scaler, [batch], state, spec).state
    torch.cuda.synchronize()
    results = []
    for hook in (None, lambda x: x * float("nan")):
        torch.cuda.set_sync_debug_mode("error")
        try:
            r = step.train_step(model, opt, scaler, [batch], state,
                                dataclasses.replace(spec, loss_hook=hook))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        results.append(r.read())
        state = r.state
    assert results[0].applied and math.isfinite(results[0].grad_norm)
    assert not results[1].applied and not math.isfinite(results[1].grad_norm)
