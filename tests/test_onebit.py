"""1-bit compressed allreduce, 1-bit Adam / 1-bit LAMB and LAMB, against numpy implementations of
the papers' equations (Tang et al. 2021 Algorithm 1; Li et al. 2021; You et al. 2019); on 2 real
ranks (horovodrun, mpirun, torchrun): tests/parallel/test_optimizers.py; their training runs:
tests/test_onebit_training.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pytorch_optimizer import Lamb

from hvd_lm.comm import onebit_compression as ob
from hvd_lm.comm.engine import ring_allreduce_wire_bytes
from hvd_lm.options import ConfigError, from_dict
from hvd_lm.train.optim import OnebitAdam, OnebitLamb
from hvd_lm.train.settings import TrainConfig
from tests.scripts.onebit_rounds import inputs as round_inputs

# ---- numpy reference: the paper's equations, written independently of
# hvd_lm.comm.onebit_compression -------


def np_compress(x: np.ndarray, chunk: int, valid: int) -> np.ndarray:
    """C[x]: sign(x) (sign 0 = +1) times ||x_c||_2 / sqrt(m_c) per chunk of ``chunk`` elements,
    m_c = real elements of the chunk (the first ``valid`` of x); 0 on padding."""
    out = np.zeros_like(x)
    for start in range(0, len(x), chunk):
        m = min(max(valid - start, 0), chunk)
        if m:
            seg = x[start:start + chunk]
            scale = np.sqrt(np.sum(seg.astype(np.float64) ** 2) / m)
            out[start:start + chunk] = np.where(seg >= 0, 1.0, -1.0) * scale
    out[valid:] = 0
    return out


def np_onebit_rounds(xs: np.ndarray, chunk: int):
    """Algorithm 1's compressed allreduce over rounds. ``xs``: [T, n, N]. Returns the outputs
    [T, N], worker errors [n, n P] and server errors [n, P] after the last round."""
    T, n, N = xs.shape
    P = 8 * math.ceil(math.ceil(N / n) / 8)
    chunk = chunk or P
    valid = [max(0, min(P, N - j * P)) for j in range(n)]
    we, se = np.zeros((n, n * P)), np.zeros((n, P))
    outs = []
    for t in range(T):
        sent = np.zeros((n, n * P))
        for i in range(n):
            u = we[i].copy()
            u[:N] += xs[t, i]
            for j in range(n):
                sent[i, j * P:(j + 1) * P] = np_compress(u[j * P:(j + 1) * P], chunk, valid[j])
            we[i] = u - sent[i]
        out = np.zeros(n * P)
        for j in range(n):
            s = sent[:, j * P:(j + 1) * P].mean(0) + se[j]
            out[j * P:(j + 1) * P] = np_compress(s, chunk, valid[j])
            se[j] = s - out[j * P:(j + 1) * P]
        outs.append(out[:N])
    return np.stack(outs), we, se


# ---- the compression itself ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_sign_packing_matches_numpy_packbits(n):
    x = torch.from_numpy(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    x[0] = 0.0  # sign(0) = +1
    packed = ob.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(x.numpy() >= 0))
    np.testing.assert_array_equal(ob.unpack_signs(packed, n).numpy(),
                                  np.where(x.numpy() >= 0, 1.0, -1.0))
    with pytest.raises(ValueError):
        ob.unpack_signs(packed, 8 * packed.numel() + 1)


@pytest.mark.parametrize("numel,n,chunk", [(37, 2, 4), (37, 3, 0), (1000, 4, 64), (5, 4, 2)])
def test_wire_format_and_decompression_match_numpy(numel, n, chunk):
    """One part on the wire: P/8 packed sign bytes, then one little-endian fp32 scale per chunk;
    decoding it gives numpy's C[x]."""
    lay = ob.Layout(numel, n, chunk)
    rng = np.random.default_rng(numel)
    for rank in range(n):
        valid = lay.valid(rank)
        x = np.zeros(lay.part, np.float32)
        x[:valid] = rng.standard_normal(valid) * np.linspace(0.1, 10, valid)
        wire, approx = ob.encode(torch.from_numpy(x), lay, valid)
        assert wire.dtype == torch.uint8 and wire.numel() == lay.part_bytes
        np.testing.assert_array_equal(wire[:lay.part // 8].numpy(), np.packbits(x >= 0))
        want = np_compress(x, lay.chunk_elems, valid)
        scales = np.frombuffer(wire[lay.part // 8:].numpy().tobytes(), "<f4")
        assert len(scales) == math.ceil(lay.part / lay.chunk_elems)
        np.testing.assert_allclose(ob.decode(wire, lay, valid).numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(approx.numpy(), want, rtol=1e-6)
        # the compressed chunk keeps the real elements' L2 norm
        assert np.linalg.norm(want) == pytest.approx(np.linalg.norm(x), rel=1e-5)


def simulate_allreduce(xs: list[torch.Tensor], states: list[ob.ErrorFeedback]) -> torch.Tensor:
    """The compressed allreduce of n ranks' tensors ``xs`` (each [N]) in one process, the
    library's three steps with the collectives done by indexing (``alltoall``: rank j gets row j
    of every rank's output; ``allgather``: every rank gets every rank's part), as
    ``onebit_compression.compressed_allreduce`` runs them on n ranks; updates every state."""
    sent = [st.worker_compress(x) for st, x in zip(states, xs)]
    parts = [st.server_reduce(torch.stack([s[j] for s in sent])) for j, st in enumerate(states)]
    return states[0].assemble(torch.stack(parts))


@pytest.mark.parametrize("n,numel,chunk", [(1, 37, 8), (2, 37, 4), (3, 100, 0), (4, 3, 8),
                                           (5, 1000, 64)])
def test_simulated_allreduce_matches_numpy_algorithm(n, numel, chunk):
    """Every rank's compression, both error buffers and the output equal the numpy algorithm for
    any world size and tensor size (padding: 3 elements on 4 ranks leaves 3 parts empty)."""
    T = 6
    xs = np.stack([np.stack([round_inputs(1, t, r, numel).numpy() for r in range(n)])
                   for t in range(T)])
    states = [ob.ErrorFeedback(ob.Layout(numel, n, chunk), r) for r in range(n)]
    outs = np.stack([simulate_allreduce([torch.from_numpy(x) for x in xs[t]], states).numpy()
                     for t in range(T)])
    want, we, se = np_onebit_rounds(xs, chunk)
    np.testing.assert_allclose(outs, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.stack([s.worker_error.numpy() for s in states]), we, atol=1e-5)
    np.testing.assert_allclose(np.stack([s.server_error.numpy() for s in states]), se, atol=1e-5)
    assert all(not s.worker_error[numel:].any() for s in states)  # padding stays exactly 0


def test_error_feedback_keeps_errors_bounded_and_the_running_mean_converges():
    """Over 400 rounds on 3 ranks: sum of outputs = sum of exact means - mean worker error -
    server error (the error-feedback identity), the errors stay bounded, and so the running mean
    of the outputs approaches the exact running mean like 1/T. Without error feedback (errors
    reset every round) the gap does not shrink: the test can tell the two apart."""
    n, numel, T = 3, 200, 400
    lay = ob.Layout(numel, n, 16)

    def run_rounds(feedback: bool):
        states = [ob.ErrorFeedback(lay, r) for r in range(n)]
        tot_out, tot_exact, gaps, err_max = np.zeros(numel), np.zeros(numel), {}, 0.0
        x_max = 0.0
        for t in range(T):
            xs = [round_inputs(2, t, r, numel) for r in range(n)]
            if not feedback:
                states = [ob.ErrorFeedback(lay, r) for r in range(n)]
            tot_out += simulate_allreduce(xs, states).numpy()
            tot_exact += torch.stack(xs).mean(0).numpy()
            x_max = max(x_max, max(float(x.abs().max()) for x in xs))
            err_max = max(err_max, *(float(s.worker_error.abs().max()) for s in states),
                          *(float(s.server_error.abs().max()) for s in states))
            if t + 1 in (40, T):
                gaps[t + 1] = float(np.abs(tot_out - tot_exact).max() / (t + 1))
        return states, tot_out, tot_exact, gaps, err_max, x_max

    states, tot_out, tot_exact, gaps, err_max, x_max = run_rounds(True)
    werr = np.stack([s.worker_error.numpy()[:numel] for s in states]).mean(0)
    serr = np.concatenate([s.server_error.numpy() for s in states])[:numel]
    np.testing.assert_allclose(tot_out, tot_exact - werr - serr, atol=2e-3)
    assert err_max < 3 * x_max  # bounded: no drift over 400 rounds
    assert gaps[T] <= 2 * err_max / T + 1e-5
    assert gaps[T] < gaps[40] / 5
    *_, gaps_no_feedback, _, _ = run_rounds(False)
    assert gaps_no_feedback[T] > 10 * gaps[T]


def test_wire_bytes_are_20x_below_fp32_and_10x_below_fp16():
    """Per step and rank, for the H=1024 mLSTM's 5.85M values on 2 and 128 ranks."""
    numel = 5_853_440
    for n in (2, 128):
        onebit = ob.Layout(numel, n, ob.DEFAULT_CHUNK).wire_bytes()
        fp32 = ring_allreduce_wire_bytes(4 * numel, n)
        fp16 = ring_allreduce_wire_bytes(2 * numel, n)
        assert fp32 / onebit > 31 and fp16 / onebit > 15.5
    lay = ob.Layout(100, 3, 0)
    assert (lay.part, lay.padded, lay.part_bytes, lay.wire_bytes()) == (40, 120, 9, 36)
    assert ob.Layout(100, 1, 8).wire_bytes() == 0
    for bad in [(0, 2, 8), (10, 0, 8), (10, 2, -1)]:
        with pytest.raises(ValueError):
            ob.Layout(*bad)


# ---- optimisers against numpy / torch ------------------------------------------------------------


def _problem(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    data = [torch.randn(5, 6, generator=torch.Generator().manual_seed(seed + t))
            for t in range(40)]
    return model, data


def _steps(model, opt, data):
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _clone(model):
    other, _ = _problem()
    other.load_state_dict(model.state_dict())
    return other


def test_onebit_adam_warmup_is_torch_adam_and_compressed_phase_matches_numpy():
    """Warmup: bit for bit torch.optim.Adam. Compressed phase (one process: no compression),
    against numpy: m = b1 m + (1 - b1)(g + wd x); x -= lr/(1 - b1^t) m / (sqrt(v_Tw/(1 - b2^Tw))
    + eps), v frozen at T_w."""
    model, data = _problem()
    ref = _clone(model)
    opt = OnebitAdam(model.parameters(), lr=1e-2, weight_decay=0.01, warmup_steps=10)
    adam = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.01)
    _steps(model, opt, data[:10])
    _steps(ref, adam, data[:10])
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert opt.compressing and opt.steps_taken == 10
    b1, b2, eps, lr, wd = 0.9, 0.999, 1e-8, 1e-2, 0.01
    st = {p: {k: v.double().numpy().copy() for k, v in opt.state[p].items() if k != "step"}
          for p in model.parameters()}
    x = {p: p.detach().double().numpy().copy() for p in model.parameters()}
    for t, batch in enumerate(data[10:20], start=11):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        for p in model.parameters():  # numpy, at the same point, with this step's gradient
            g = p.grad.double().numpy() + wd * x[p]
            st[p]["exp_avg"] = b1 * st[p]["exp_avg"] + (1 - b1) * g
            denom = np.sqrt(st[p]["exp_avg_sq"] / (1 - b2 ** 10)) + eps
            x[p] = x[p] - lr / (1 - b1 ** t) * st[p]["exp_avg"] / denom
        opt.step()
        for p in model.parameters():
            np.testing.assert_allclose(p.detach().numpy(), x[p], rtol=1e-5, atol=1e-6)
            x[p] = p.detach().double().numpy().copy()  # follow torch (float32 rounding)
            st[p]["exp_avg"] = opt.state[p]["exp_avg"].double().numpy().copy()
        assert np.array_equal(opt.state[next(iter(x))]["exp_avg_sq"].numpy(),
                              st[next(iter(x))]["exp_avg_sq"].astype(np.float32))


def np_lamb_step(x, m, v, g, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0):
    """LAMB (You et al. 2019, Algorithm 2, without bias correction as in its v3): returns new
    (x, m, v, trust ratio) with phi(z) = min(z, 10)."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (np.sqrt(v) + eps) + wd * x
    wn, un = min(np.linalg.norm(x), 10.0), np.linalg.norm(u)
    ratio = 1.0 if wn == 0 or un == 0 else wn / (un + eps)
    return x - lr * ratio * u, m, v, ratio


def test_lamb_update_and_trust_ratio_match_numpy():
    """pytorch_optimizer.Lamb as built by --optimizer lamb, and 1-bit LAMB's warmup, against
    numpy: parameters and each layer's trust ratio for 10 steps with weight decay. Lamb's
    default (adam_debias=False) divides the step by 1 - beta1^t: 10x numpy's at t = 1."""
    from hvd_lm.train.optim import build_optimizer
    from hvd_lm.train.settings import OptimConfig

    model, data = _problem(3)
    onebit_model = _clone(model)
    lamb = build_optimizer(model, OptimConfig(optimizer="lamb", weight_decay=0.05), 5e-3)
    assert isinstance(lamb, Lamb)
    onebit = OnebitLamb(onebit_model.parameters(), lr=5e-3, weight_decay=0.05, warmup_steps=50)
    x = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    m = {n: np.zeros_like(v) for n, v in x.items()}
    v = {n: np.zeros_like(v) for n, v in x.items()}
    for batch in data[:10]:
        for mdl, opt in ((model, lamb), (onebit_model, onebit)):
            opt.zero_grad()
            mdl(batch).pow(2).mean().backward()
        grads = {n: p.grad.double().numpy() for n, p in model.named_parameters()}
        lamb.step()
        onebit.step()
        for n, p in model.named_parameters():
            x[n], m[n], v[n], ratio = np_lamb_step(x[n], m[n], v[n], grads[n], 5e-3, wd=0.05)
            assert float(lamb.state[p]["trust_ratio"]) == pytest.approx(ratio, rel=1e-4)
            np.testing.assert_allclose(p.detach().numpy(), x[n], rtol=1e-5, atol=1e-6)
            x[n] = p.detach().double().numpy().copy()
        for a, b in zip(model.parameters(), onebit_model.parameters()):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5,
                                       atol=1e-7)
    assert OnebitLamb.trust_ratio(torch.zeros(3), torch.ones(3), 1e-6) == 1.0
    assert OnebitLamb.trust_ratio(torch.full((4,), 100.0), torch.ones(4), 0.0) == 5.0  # 10 / 2
    default = Lamb(_clone(model).parameters(), lr=5e-3)
    assert not default.param_groups[0].get("adam_debias", False)  # why build_optimizer sets it


def test_onebit_lamb_freezes_ratio_and_follows_deepspeeds_compression_phase():
    """After warmup: frozen trust ratio = bias-corrected EMA (beta 0.9) of the warmup ratios;
    momentum scaling to the layers' mean RMS; fresh variance from the reconstructed gradient;
    coefficient = frozen ratio x factor, factor clipped to [0.5, 4] and to +-10% per step
    (numpy, one process)."""
    model, data = _problem(5)
    opt = OnebitLamb(model.parameters(), lr=5e-3, warmup_steps=8)
    ratios = {p: [] for p in model.parameters()}
    for batch in data[:8]:
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        for p in model.parameters():  # the ratio this step will use, from numpy
            st = opt.state[p]
            mm = (0.9 * st["exp_avg"] + 0.1 * p.grad) if st else 0.1 * p.grad
            vv = (0.999 * st["exp_avg_sq"] + 0.001 * p.grad ** 2) if st else 0.001 * p.grad ** 2
            u = (mm / (vv.sqrt() + 1e-6)).double().numpy()
            ratios[p].append(min(np.linalg.norm(p.detach().numpy()), 10) /
                             (np.linalg.norm(u) + 1e-6))
        opt.step()
    w = 1 - 0.9 ** 8
    for p in model.parameters():
        ema = sum(0.1 * 0.9 ** (7 - k) * r for k, r in enumerate(ratios[p]))
        assert opt.frozen_ratio(p) == pytest.approx(ema / w, rel=1e-5)
    params = list(model.parameters())
    x = [p.detach().double().numpy().copy() for p in params]
    m = [opt.state[p]["exp_avg"].double().numpy().copy() for p in params]
    v = [opt.state[p]["exp_avg_sq"].double().numpy().copy() for p in params]
    vf = [a.copy() for a in v]
    rms = [np.linalg.norm(a) / np.sqrt(a.size) for a in m]
    last = [1.0] * len(params)
    for batch in data[8:14]:
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        for i, p in enumerate(params):
            g = p.grad.double().numpy()
            m_new = 0.9 * m[i] + 0.1 * g
            g_rec = (m_new - 0.9 * m[i]) / 0.1
            vf[i] = 0.999 * vf[i] + 0.001 * g_rec ** 2
            denom = np.sqrt(v[i]) + 1e-6
            factor = np.max(denom / (np.sqrt(vf[i]) + 1e-6))
            factor = min(max(factor, 0.5), 4.0)
            factor = min(max(factor, 0.9 * last[i]), 1.1 * last[i])
            last[i] = factor
            coeff = opt.frozen_ratio(p) * factor
            x[i] = x[i] - 5e-3 * coeff * m_new / denom
            m[i] = m_new
        opt.step()
        for i, p in enumerate(params):
            assert opt.state[p]["scaling_coeff"] == pytest.approx(np.mean(rms) / rms[i])
            assert opt.state[p]["last_coeff"] == pytest.approx(
                opt.state[p]["frozen_ratio"] * last[i], rel=1e-5)
            np.testing.assert_allclose(p.detach().numpy(), x[i], rtol=1e-4, atol=1e-6)
            x[i] = p.detach().double().numpy().copy()
            m[i] = opt.state[p]["exp_avg"].double().numpy().copy()


def test_onebit_settings_are_checked():
    with pytest.raises(ValueError, match="warmup_steps"):
        OnebitAdam(torch.nn.Linear(2, 2).parameters(), warmup_steps=0)
    base = {"data": {"shards": "x"}, "optim": {"optimizer": "onebit-adam"}}
    assert from_dict(TrainConfig, base).optim.onebit_warmup_steps == 100
    with pytest.raises(ValueError, match="run.precision fp16"):
        from_dict(TrainConfig, base | {"run": {"precision": "fp16"}}).check()
    with pytest.raises(ValueError, match="dist.allreduce_op"):
        from_dict(TrainConfig, base | {"dist": {"allreduce_op": "adasum"}}).check()
    with pytest.raises(ConfigError, match="optim.onebit_chunk"):
        from_dict(TrainConfig, {"optim": {"onebit_chunk": -1}})
    with pytest.raises(ConfigError, match="optim.optimizer"):
        from_dict(TrainConfig, {"optim": {"optimizer": "onebit-sgd"}})
