"""``hvd-lm bench multinode``'s pure parts against hand computations; the bench itself runs for
real on the cluster in a box in tests/test_multinode.py
(``test_bench_multinode_predicts_the_step_on_a_shaped_link``)."""
from __future__ import annotations

import pytest

from hvd_lm.perf.bench_multinode import (MultinodeConfig, fit_sizes, predict_step, print_report,
                                         train_argv)
from hvd_lm.perf.results import fit_alpha_beta

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
    5 (each of 32 bytes) cost 0.5 of a 2 ms allreduce per step. The fit is read back as the ring's alpha and
    beta and must give the same times at every n."""
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
           "compute_s": 0.03, "comm_s": 0.05, "loop_s": 0.001, "predicted_s": 0.081,
           "measured_s": 0.09}
    print_report({"label": "1gbit", "gradient_bytes": 6.5e6, "rows": [row]})
    out = capsys.readouterr().out
    assert "links 1gbit" in out and "0.900" in out and "81.0" in out and "90.0" in out


def test_fit_sizes_bracket_the_gradient():
    """The default fit sizes are the powers of two from the one at or below an eighth of the
    gradient bytes to the one at or above them."""
    K, M = 1 << 10, 1 << 20
    assert fit_sizes(6_497_280) == [512 * K, M, 2 * M, 4 * M, 8 * M]  # H=512: 6.50 MB
    assert fit_sizes(8 * M) == [M, 2 * M, 4 * M, 8 * M]  # a power of two is its own top
    assert fit_sizes(3 * M) == [256 * K, 512 * K, M, 2 * M, 4 * M]
    assert all(s % 4 == 0 for s in fit_sizes(100))  # whole float32 elements
