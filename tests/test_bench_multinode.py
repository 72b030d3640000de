"""``python -m benchmarks multinode``'s pure parts against hand computations; the bench itself runs
for real on the cluster in a box in tests/test_multinode.py
(``test_bench_multinode_runs_on_a_shaped_link``)."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from benchmarks.bench_multinode import (
    LATENCY_BYTES,
    MultinodeConfig,
    fit_sizes,
    measure_backward_window,
    predict_step,
    print_report,
    train_argv,
)
from benchmarks.results import fit_alpha_beta
from hvd_lm.model.lm import mlstm_parameters

GB = 1e9
#: a model of two gradient tensors: the decoder's (ready early, overlaps the recurrence's
#: backward) and the recurrent weights' (ready last)
PARAMS = [("rnn.w_h.weight", 1_000_000), ("decoder.weight", 50_000)]


def fit(a: float, b: float, n: int) -> dict:
    """A fit as :func:`fit_alpha_beta` returns it, from t(S) = a + b S at n ranks."""
    return {"intercept_s": a, "slope_s_per_byte": b, "alpha_s": a / (2 * (n - 1)),
            "beta_GBps": 2 * (n - 1) / n / b / GB}


@pytest.mark.parametrize("n", [2, 3, 8])
def test_predict_step_by_hand(n):
    """Compute 10 ms, t(S) = 2 ms + S / (50 MB/s): the decoder's 200 KB take 6 ms, all hidden
    behind the 6.7 ms of BPTT backward (2/3 of compute); the recurrent weights' 4 MB take 82 ms,
    all exposed; the loop's control allreduce every 10 steps and its two metrics allreduces every
    5 (each of 32 bytes) cost 0.5 of a 2 ms allreduce per step. The fit is read back as the ring's
    alpha and beta and must give the same times at every n."""
    a, b = 2e-3, 1 / 50e6
    out = predict_step(10e-3, PARAMS, fit(a, b, n), n, control_every=10, log_every=5)
    t_dec, t_rnn = a + b * 200_000, a + b * 4_000_000
    assert t_dec == pytest.approx(6e-3) and t_rnn == pytest.approx(82e-3)
    assert out["compute_s"] == pytest.approx(10e-3)
    assert out["exposed_comm_s"] == pytest.approx(t_rnn, rel=1e-9)
    assert out["hidden_comm_s"] == pytest.approx(t_dec, rel=1e-9)
    loop = (1 / 10 + 2 / 5) * (a + b * 32)
    assert out["loop_s"] == pytest.approx(loop, rel=1e-9)
    assert out["predicted_s"] == pytest.approx(10e-3 + t_rnn + loop, rel=1e-9)


def test_predict_step_exposes_what_backward_cannot_hide():
    """With 3 ms of compute the backward window is 2 ms: of the decoder's 6 ms allreduce 4 ms
    show, then the recurrent weights' 82 ms."""
    a, b = 2e-3, 1 / 50e6
    out = predict_step(3e-3, PARAMS, fit(a, b, 2), 2, control_every=10, log_every=10)
    assert out["exposed_comm_s"] == pytest.approx((6e-3 - 2e-3) + 82e-3, rel=1e-9)
    assert out["predicted_s"] == pytest.approx(3e-3 + 86e-3 + 0.3 * (a + b * 32), rel=1e-9)


def test_predict_step_from_a_fit_of_exact_times():
    """fit_alpha_beta of times made from t = a + b S, then predict_step: the same step as the
    hand computation above (the fit loses nothing)."""
    a, b, n = 1.5e-3, 1 / 110e6, 3
    sizes = [65536, 262144, 1 << 20, 4 << 20, 16 << 20]
    f = fit_alpha_beta(sizes, [a + b * s for s in sizes], n)
    out = predict_step(40e-3, PARAMS, f, n, control_every=10, log_every=10)
    expected = 40e-3 + (a + b * 4_000_000) + 0.3 * (a + b * 32)
    assert out["predicted_s"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_alpha_from_the_latency_beta_fitted_to_the_rest(n):
    """With the intercept fixed at a measured 32-byte allreduce (6 ms) the fit recovers the slope
    of times made from t = 6 ms + S / (50 MB/s) and reads 6 ms as 2(n-1) alpha, even where a free
    line's intercept would differ (times 2% off at 2 sizes); predict_step then charges each
    fused allreduce 6 ms + b S and each of the loop's small allreduces 6 ms + 32 b, and a window
    of 10% of a 10 ms step hides 1 ms of the decoder's."""
    lat, b = 6e-3, 1 / 50e6
    sizes = [1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23]
    exact = [lat + b * s for s in sizes]
    f = fit_alpha_beta(sizes, exact, n, intercept_s=lat)
    assert f["intercept_s"] == lat and f["slope_s_per_byte"] == pytest.approx(b, rel=1e-9)
    assert f["alpha_s"] == pytest.approx(lat / (2 * (n - 1)))
    # off the line, the slope is the relative-error least squares of t - a = b S (numpy's)
    noisy = [t * (1.02 if i in (0, 3) else 1) for i, t in enumerate(exact)]
    s_, t_ = np.array(sizes, float), np.array(noisy)
    (want,), *_ = np.linalg.lstsq((s_ / t_)[:, None], (t_ - lat) / t_, rcond=None)
    got = fit_alpha_beta(sizes, noisy, n, intercept_s=lat)
    assert got["intercept_s"] == lat and got["slope_s_per_byte"] == pytest.approx(want, rel=1e-9)
    assert fit_alpha_beta(sizes, noisy, n)["intercept_s"] != pytest.approx(lat, rel=0.01)
    out = predict_step(10e-3, PARAMS, f, n, control_every=10, log_every=10,
                       backward_fraction=0.1)
    t_dec, t_rnn = lat + b * 200_000, lat + b * 4_000_000
    assert out["hidden_comm_s"] == pytest.approx(1e-3, rel=1e-6)
    assert out["exposed_comm_s"] == pytest.approx(t_dec - 1e-3 + t_rnn, rel=1e-6)
    assert out["loop_s"] == pytest.approx(0.3 * (lat + b * LATENCY_BYTES), rel=1e-6)
    with pytest.raises(ValueError, match="intercept"):
        fit_alpha_beta(sizes, exact, n, intercept_s=0.0)


@pytest.mark.serial  # times the parts of a step
@pytest.mark.parametrize("where", ["forward", "after-decoder-grads"])
def test_backward_window_measures_the_backward_after_the_decoder(monkeypatch, where):
    """The step's parts of one process (H=64), with 40 ms of work planted at a known place: in
    the forward pass it shows in forward_s and not in the window; in the backward after the
    decoder's gradients are ready (the embedding's gradient, computed last) it shows in the
    window, which then holds at least those 40 ms of the step."""
    import time

    import torch

    from hvd_lm.model.lm import LanguageModel

    real_init = LanguageModel.__init__

    def planted(self, *a, **kw):
        real_init(self, *a, **kw)
        if where == "forward":
            self.decoder.register_forward_hook(lambda *_: time.sleep(0.04))
        else:
            self.embed.weight.register_hook(lambda g: time.sleep(0.04))

    monkeypatch.setattr(LanguageModel, "__init__", planted)
    torch.manual_seed(0)
    cfg = MultinodeConfig(hosts="n1:1,n2:1", network_interface="eth0", shards="/s",
                          hidden_size=64, embed_dim=16, seq_len=8)
    w = measure_backward_window(cfg, steps=3, skip=1)
    assert all(w[k] > 0 for k in ("forward_s", "backward_s", "window_s", "update_s", "step_s"))
    if where == "forward":
        assert w["forward_s"] >= 0.04 and w["window_s"] < 0.04
    else:
        assert w["window_s"] >= 0.04 and w["forward_s"] < 0.04
        assert w["fraction"] >= 0.04 / w["step_s"]


def test_rounds_are_estimated_alone_and_together(monkeypatch):
    """run_multinode_bench with its launches replaced by known figures (2 rounds at 2 ranks):
    the row's fit uses the median time per size over both rounds and the rounds' median 32-byte
    time as its intercept; ratio_rounds has each round's own estimate, None for a round whose
    times do not grow with size (too noisy to fit) instead of ending the run; the JSON's
    records are every round's."""
    import benchmarks.bench_multinode as bm

    lat, b = 2e-3, 1 / 100e6
    sizes = [1 << 20, 1 << 21]
    rounds = iter([[lat + b * s for s in sizes], [5e-3, 4e-3]])  # round 2: below its alpha
    latencies = iter([lat, 3 * lat])
    steps = iter([(0.06, 0.01), (0.08, 0.01)])

    def allreduce(cfg):
        if cfg.sizes == str(bm.LATENCY_BYTES):
            return {"records": [{"case": "single", "size_bytes": 32, "time_s": next(latencies)}]}
        return {"records": [{"case": "single", "size_bytes": s, "time_s": t}
                            for s, t in zip(sizes, next(rounds))]}

    monkeypatch.setattr(bm, "run_allreduce_bench", allreduce)
    monkeypatch.setattr(bm, "measure_training", lambda cfg, hosts, work: next(steps))
    parts = {"forward_s": 3e-3, "backward_s": 3e-3, "window_s": 2e-3, "update_s": 2e-3,
             "step_s": 5e-3, "fraction": 0.4}
    monkeypatch.setattr(bm, "measure_backward_window", lambda cfg: parts)
    cfg = MultinodeConfig(hosts="n1:1,n2:1", network_interface="eth0", shards="/s", nodes=[2],
                          repeats=2, colocated=True, sizes="1M,2M")
    data = bm.run_multinode_bench(cfg)
    row, = data["rows"]
    med = [statistics.median([lat + b * s, t]) for s, t in zip(sizes, [5e-3, 4e-3])]
    assert [a["time_s"] for a in row["allreduce"]] == pytest.approx(med)
    assert row["fit"]["intercept_s"] == pytest.approx(2 * lat)  # median of lat and 3 lat
    assert row["latency_s_runs"] == [lat, 3 * lat] and row["measured_s"] == pytest.approx(0.07)
    # round 1 by hand: its exact times fit t = lat + b S; of the decoder's allreduce 40% of the
    # 10 ms step hides; the loop's 0.3 small allreduces per step; measured 60 ms
    params = mlstm_parameters(512)
    dec = 4 * sum(m for name, m in params if name.startswith("decoder."))
    rest = 4 * sum(m for _, m in params) - dec
    step = 0.01 + (lat + b * dec - 0.4 * 0.01) + (lat + b * rest) + 0.3 * (lat + b * 32)
    assert row["ratio_rounds"] == [pytest.approx(step / 0.06, rel=1e-6), None]
    assert len(data["records"]["2"]) == 4
    print_report(data)  # a round without a ratio is left out of the spread


def test_train_argv_is_a_valid_training_command():
    """Every run's flags parse with ``hvd-lm train``'s own parser."""
    import argparse

    from hvd_lm.train.loop import TRAIN

    cfg = MultinodeConfig(hosts="n1:1,n2:1", network_interface="eth0", shards="/s")
    argv = train_argv(cfg, "/out")
    assert argv[:3] == ["-m", "hvd_lm", "train"]
    parser = argparse.ArgumentParser()
    TRAIN.add_arguments(parser)
    tc = TRAIN.settings(parser.parse_args(argv[3:]))
    assert tc.model.hidden_size == cfg.hidden_size and tc.data.batch_size == cfg.batch_size


def test_report_prints_every_row(capsys):
    row = {"nodes": 2, "fit": {"alpha_s": 1e-3, "beta_GBps": 0.118, "max_rel_error": 0.05},
           "latency_s": 4e-3,
           "compute_s": 0.03, "comm_s": 0.05, "loop_s": 0.001, "predicted_s": 0.081,
           "measured_s": 0.09, "ratio": 0.9, "ratio_rounds": [0.85, None, 0.95]}
    parts = {"forward_s": 3e-3, "backward_s": 3e-3, "window_s": 2e-3, "update_s": 2e-3,
             "step_s": 8e-3, "fraction": 0.25}
    print_report({"label": "1gbit", "gradient_bytes": 6.5e6, "rows": [row],
                  "step_parts": parts})
    out = capsys.readouterr().out
    assert "links 1gbit" in out and "0.900" in out and "81.0" in out and "90.0" in out
    assert " 1000 " in out and "0.118" in out  # alpha and beta of the fit
    assert "4.0 ms at 2 ranks" in out and "behind 25% of the step" in out
    assert "0.85-0.95 at 2 nodes" in out  # a round without a ratio left out


def test_fit_sizes_bracket_the_gradient():
    """The default fit sizes are the powers of two from the one at or below an eighth of the
    gradient bytes to the one at or above them."""
    K, M = 1 << 10, 1 << 20
    assert fit_sizes(6_497_280) == [512 * K, M, 2 * M, 4 * M, 8 * M]  # H=512: 6.50 MB
    assert fit_sizes(8 * M) == [M, 2 * M, 4 * M, 8 * M]  # a power of two is its own top
    assert fit_sizes(3 * M) == [256 * K, 512 * K, M, 2 * M, 4 * M]
    assert all(s % 4 == 0 for s in fit_sizes(100))  # whole float32 elements
