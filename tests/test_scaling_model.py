"""The scaling model's arithmetic against hand-computed values (no timing)."""

import json
import math

import numpy as np
import pytest

from benchmarks import calibration as cal_mod
from benchmarks import main
from benchmarks import scaling_model as sm
from benchmarks import scaling_study as ss
from benchmarks.results import fit_alpha_beta
from benchmarks.scaling_model import Link, ScalingConfig
from hvd_lm.model.lm import mlstm_parameters

MB = 1e6


def test_ring_allreduce_by_hand():
    a, bw, S = 1e-5, 10.0, 1e8  # 10 us, 10 GB/s, 100 MB
    # 2(n-1) alpha + 2(n-1)/n S/beta
    assert sm.ring_allreduce_time(S, 2, a, bw) == pytest.approx(2e-5 + 0.01)
    assert sm.ring_allreduce_time(S, 8, a, bw) == pytest.approx(1.4e-4 + 0.0175)
    assert sm.ring_allreduce_time(S, 128, a, bw) == pytest.approx(2.54e-3 + 0.01984375)
    assert sm.ring_allreduce_time(S, 1, a, bw) == 0.0
    for bad in [(S, 0, a, bw), (-1, 2, a, bw), (S, 2, -1, bw), (S, 2, a, 0)]:
        with pytest.raises(ValueError):
            sm.ring_allreduce_time(*bad)


def test_hierarchical_by_hand():
    intra, inter = Link(100.0, 2e-6), Link(10.0, 1e-5)
    S = 8e8
    half = 7 * 2e-6 + 7 / 8 * S / 100e9          # reduce-scatter (= allgather) in the node
    cross = 2 * 1 * 1e-5 + 2 * 1 / 2 * (S / 8) / (10e9 / 8)  # 2 nodes, 8 shards share the NICs
    t = sm.hierarchical_allreduce_time(S, 16, 8, intra, inter)
    assert t == pytest.approx(2 * half + cross)
    assert t == pytest.approx(0.094048)
    staged = sm.hierarchical_allreduce_time(S, 16, 8, intra, inter, staging_GBps=5.0)
    assert staged - t == pytest.approx(2 * (S / 8) / 5e9)
    # within a node it is the plain ring; partial nodes are refused
    assert sm.hierarchical_allreduce_time(S, 8, 8, intra, inter) == pytest.approx(
        sm.ring_allreduce_time(S, 8, 2e-6, 100.0))
    with pytest.raises(ValueError):
        sm.hierarchical_allreduce_time(S, 12, 8, intra, inter)


def test_flat_ring_uses_slowest_link_across_nodes():
    intra, inter = Link(100.0, 2e-6), Link(10.0, 1e-5)
    S = 8e8
    assert sm.flat_ring_time(S, 16, 8, intra, inter) == pytest.approx(
        2 * 15 * 1e-5 + 2 * 15 / 16 * S / 10e9)
    assert sm.flat_ring_time(S, 4, 8, intra, inter) == pytest.approx(
        sm.ring_allreduce_time(S, 4, 2e-6, 100.0))
    # hierarchical sends 2(m-1)/m S per node instead of 2(n-1)/n S: less for few nodes
    assert sm.hierarchical_allreduce_time(S, 16, 8, intra, inter) < sm.flat_ring_time(
        S, 16, 8, intra, inter)


def test_fusion_buffer_counts():
    small = [65536] * 200
    assert len(sm.fused_buffers(small, 1024 * 1024)) == 13 == math.ceil(200 * 65536 / 2 ** 20)
    assert len(sm.fused_buffers(small, 0)) == 200
    assert len(sm.fused_buffers(small, 64 * 2 ** 20)) == 1
    assert [sum(b) for b in sm.fused_buffers([100, 50, 200, 10], 150)] == [150, 200, 10]
    with pytest.raises(ValueError):
        sm.fused_buffers(small, -1)


def test_mlstm_parameter_list_and_overlap_fraction():
    H, E = 4096, 64
    params = dict(mlstm_parameters(H, E))
    assert params == {"embed.weight": 256 * E, "rnn.w_x.weight": 4 * H * E,
                      "rnn.w_x.bias": 4 * H, "rnn.w_mx.weight": H * E,
                      "rnn.w_mh.weight": H * H, "rnn.w_h.weight": 4 * H * H,
                      "decoder.weight": 256 * H, "decoder.bias": 256}
    total = sum(params.values())
    assert total == 86_278_400
    frac = sm.overlappable_fraction(list(params.items()))
    assert frac == pytest.approx((256 * H + 256) / total)
    assert frac == pytest.approx(0.012156, abs=1e-6)
    early, late = sm.split_by_readiness(list(params.items()))
    assert [n for n, _ in early] == ["decoder.bias", "decoder.weight"]
    assert late[-1][0] == "embed.weight"  # differentiated last
    with pytest.raises(ValueError):
        sm.overlappable_fraction([])


def _cfg(**kw):
    base = dict(compute_time_s=1.0, params=[("rnn.w", 10_000_000), ("decoder.weight", 1000)],
                grad_bytes=4, compression="none", intra=Link(100.0, 0.0), inter=Link(10.0, 0.0),
                cycle_time_s=0.0, negotiation=False, backward_fraction=0.0)
    base.update(kw)
    return ScalingConfig(**base)


def test_fp16_halves_the_bandwidth_term():
    fp32, fp16 = _cfg(), _cfg(compression="fp16")
    for n in (2, 16, 128):
        assert sm.step_time(fp16, n)["comm_s"] == pytest.approx(
            sm.step_time(fp32, n)["comm_s"] / 2)
    assert fp16.gradient_bytes == fp32.gradient_bytes / 2


def test_step_time_by_hand_with_fusion_cycle_and_overlap():
    # one early tensor (decoder, 1e6 values) and two late ones; fp32, no latency
    params = [("rnn.a", 2_000_000), ("rnn.b", 2_000_000), ("decoder.weight", 1_000_000)]
    cfg = _cfg(params=params, fusion_threshold_bytes=10e6, cycle_time_s=2e-3,
               per_cycle_overhead_s=1e-4, backward_fraction=0.5, sync_overhead_s=0.01)
    n = 16  # flat ring over 2 nodes: beta = 10 GB/s
    ar = lambda b: 2 * 15 / 16 * b / 10e9  # noqa: E731
    early = 1e-3 + 1e-4 + ar(4e6)             # half a cycle + overhead + one buffer
    late = 1e-3 + 1e-4 + ar(8e6) + ar(8e6)    # 16 MB > 10 MB threshold: two buffers, one cycle
    r = sm.step_time(cfg, n)
    assert r["buffers"] == 3
    assert r["comm_s"] == pytest.approx(early + late)
    assert r["exposed_comm_s"] == pytest.approx(late)  # early hidden in the 0.5 s backward
    assert r["s_per_iter"] == pytest.approx(1.0 + late + 0.01)
    # no window: the early group's time is exposed too
    r0 = sm.step_time(_cfg(params=params, fusion_threshold_bytes=10e6, cycle_time_s=2e-3,
                           per_cycle_overhead_s=1e-4, backward_fraction=0.0), n)
    assert r0["exposed_comm_s"] == pytest.approx(early + late)


def test_fusion_copies_only_for_multi_tensor_buffers():
    cfg = _cfg(fusion_threshold_bytes=10e6, fusion_copy_GBps=20.0)
    ar = lambda b: 2 * 15 / 16 * b / 10e9  # noqa: E731
    # [3e6, 3e6, 3e6] fuse into one 9 MB buffer (copied in and out); 12 MB stays alone
    assert sm.group_comm_time(cfg, [3e6, 3e6, 3e6, 12e6], 16) == pytest.approx(
        ar(9e6) + 2 * 9e6 / 20e9 + ar(12e6))
    assert sm.fused_buffers([3e6, 3e6, 3e6, 12e6], 10e6) == [[3e6, 3e6, 3e6], [12e6]]
    assert sm.group_comm_time(cfg, [3e6], 1) == 0.0


def test_speedup_and_efficiency_definitions():
    cfg = _cfg(sync_overhead_s=0.02)
    one = sm.step_time(cfg, 1)
    assert one["s_per_iter"] == 1.0 and one["speedup"] == 1.0 and one["sync_s"] == 0.0
    for r in sm.predict(cfg, [8, 16, 128]):
        assert r["speedup"] == pytest.approx(r["n"] * one["s_per_iter"] / r["s_per_iter"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["n"])
        assert 0 < r["efficiency"] < 1


def test_monotonic_sanity():
    cfg = ss.reference_config(4096, "ib", 0.81)
    rows = sm.predict(cfg, [1, 2, 4, 8, 16, 32, 64, 128])
    times = [r["s_per_iter"] for r in rows]
    assert times == sorted(times)
    speed = [r["speedup"] for r in rows]
    assert speed == sorted(speed)
    # slower network -> slower step; bigger batch -> better efficiency; fp32 grads -> slower
    slow = ss.reference_config(4096, "10gbe", 0.81)
    assert sm.step_time(slow, 128)["s_per_iter"] > rows[-1]["s_per_iter"]
    big = ss.reference_config(4096, "ib", 0.81, batch_per_gpu=512)
    assert sm.step_time(big, 128)["efficiency"] > rows[-1]["efficiency"]
    fp32 = ss.reference_config(4096, "ib", 0.81, grad_bytes=4, compression="none")
    assert sm.step_time(fp32, 128)["s_per_iter"] > rows[-1]["s_per_iter"]


def test_config_errors():
    with pytest.raises(ValueError):
        _cfg(compression="int8")
    with pytest.raises(ValueError):
        _cfg(algorithm="tree")
    with pytest.raises(ValueError):
        _cfg(compute_time_s=0)
    with pytest.raises(ValueError):
        Link(0.0, 1e-6)
    with pytest.raises(ValueError):
        sm.step_time(_cfg(), 0)


def test_fit_alpha_beta_recovers_the_line():
    n, alpha, beta = 2, 20e-6, 5.0
    sizes = [4096 * 4 ** i for i in range(8)]
    times = [sm.ring_allreduce_time(s, n, alpha, beta) for s in sizes]
    f = fit_alpha_beta(sizes, times, n)
    assert f["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert f["beta_GBps"] == pytest.approx(beta, rel=1e-6)
    assert f["max_rel_error"] < 1e-9
    with pytest.raises(ValueError):
        fit_alpha_beta([4096], [1e-3], 2)
    with pytest.raises(ValueError):
        fit_alpha_beta([4096, 8192], [1e-3, 0.0], 2)


def _bench_data(overhead=300e-6, factor=1.25):
    recs = []
    for s in [4096 * 4 ** i for i in range(9)]:  # 4 KiB .. 256 MiB
        t = 30e-6 + s / 2e9
        recs.append({"label": "mpi4py", "case": "single", "size_bytes": s, "time_s": t,
                     "ranks": 2})
        # default cycle (1 ms): small messages hidden under the cycle; large ones slower
        recs.append({"label": "hvd-mpi", "case": "single", "size_bytes": s, "ranks": 2,
                     "cycle_time_ms": 1.0, "compression": "none",
                     "time_s": max(1e-3, t + overhead) if s < 2 ** 24 else factor * t})
        if s <= 65536:  # small cycle: the overhead shows
            recs.append({"label": "hvd-mpi cycle=0.2ms", "case": "single", "size_bytes": s,
                         "ranks": 2, "cycle_time_ms": 0.2, "compression": "none",
                         "time_s": t + overhead})
    return {"ranks": 2, "records": recs}


def test_calibrate_from_bench_json():
    cal = cal_mod.calibrate_from_bench(_bench_data())
    assert cal.latency_label == "hvd-mpi cycle=0.2ms"
    assert cal.per_cycle_overhead_s == pytest.approx(300e-6, rel=1e-6)
    assert cal.measured_bandwidth_ratio == pytest.approx(1.25, rel=1e-6)
    assert cal.bandwidth_factor == pytest.approx(1.25, rel=1e-6)
    faster = cal_mod.calibrate_from_bench(_bench_data(factor=0.9))
    assert faster.measured_bandwidth_ratio == pytest.approx(0.9) and faster.bandwidth_factor == 1
    with pytest.raises(ValueError):
        cal_mod.calibrate_from_bench(_bench_data(), horovod_label="hvd-gloo")


def test_calibration_spread_over_repeated_launches():
    """Each launch's time is kept (time_s_repeats): the calibration reports the interquartile
    range of the per-cycle overhead and bandwidth ratio over sizes x launches, compared here with
    numpy's percentiles of the same samples."""
    data = _bench_data()
    noise = {"mpi4py": [1.0, 1.0, 1.0], "hvd-mpi": [0.8, 1.0, 1.6],
             "hvd-mpi cycle=0.2ms": [1.0, 1.2, 3.0]}
    for r in data["records"]:
        r["time_s_repeats"] = [r["time_s"] * f for f in noise[r["label"]]]
    cal = cal_mod.calibrate_from_bench(data)
    small = [r for r in data["records"] if r["size_bytes"] <= 65536]
    by = {(r["label"], r["size_bytes"]): r["time_s_repeats"] for r in small}
    over = [max(0.0, a - b) for s in {r["size_bytes"] for r in small}
            for a, b in zip(by[("hvd-mpi cycle=0.2ms", s)], by[("mpi4py", s)])]
    assert cal.per_cycle_overhead_range_s == pytest.approx(tuple(np.percentile(over, [25, 75])))
    big = [r for r in data["records"] if r["size_bytes"] >= 2 ** 24]
    ratios = [h / m for s in {r["size_bytes"] for r in big}
              for h, m in zip(*(next(r["time_s_repeats"] for r in big
                                     if r["label"] == lb and r["size_bytes"] == s)
                                for lb in ("hvd-mpi", "mpi4py")))]
    assert cal.bandwidth_ratio_range == pytest.approx(tuple(np.percentile(ratios, [25, 75])))
    assert cal.bandwidth_ratio_range == pytest.approx((1.25 * 0.8, 1.25 * 1.6))  # 3 sizes x 3
    lo, hi = cal.bounds()
    assert lo.per_cycle_overhead_s <= cal.per_cycle_overhead_s < hi.per_cycle_overhead_s
    assert lo.bandwidth_factor <= cal.bandwidth_factor <= hi.bandwidth_factor
    # A single launch: no spread.
    one = cal_mod.calibrate_from_bench(_bench_data())
    assert one.per_cycle_overhead_range_s == pytest.approx((300e-6, 300e-6))


def test_validate_names_its_calibration_and_its_spread(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert main(["scaling-model", "validate", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"calibration {ss.SHIPPED_CALIBRATION} (vs mpi4py)" in text
    assert "with the calibration's interquartile range" in text
    v = json.loads(out.read_text())
    assert set(v["validation"]["calibration_range"]) == {"low", "high"}
    assert main(["scaling-model", "validate", "--bench-json", "none"]) == 0
    assert "calibration: none" in capsys.readouterr().out


def test_validation_rows_and_calibration():
    v = ss.validate()
    assert len(v["rows"]) == 18
    for r in v["rows"]:
        if r["gpus"] == 1:
            assert r["model_error"] == pytest.approx(0.0, abs=1e-12)
        assert r["model_s_per_iter"] >= r["pure_s_per_iter"]
    # t_sync is fitted on exactly one row: 4096-d with IB at 8 GPUs
    row8 = [r for r in v["rows"] if r["column"] == "4096-d w/ IB" and r["gpus"] == 8][0]
    assert row8["model_error"] == pytest.approx(0.0, abs=1e-9)
    assert 0 < v["sync_overhead_s"] < 0.05
    # the published s/iter implies n t1/tn, e.g. 128 x 0.81 / 1.12 = 92.6 (their column agrees)
    r128 = [r for r in v["rows"] if r["column"] == "4096-d w/o IB" and r["gpus"] == 128][0]
    assert r128["published_n_t1_over_tn"] == pytest.approx(92.57, abs=0.01)


def test_effective_bandwidth_is_the_root_an_independent_solver_finds():
    """effective_inter_bandwidth (bisection) against scipy's Brent root finder on the same
    equation: the bandwidth at which the model's s/iter at 128 GPUs is the talk's 0.91 s."""
    from dataclasses import replace

    from scipy.optimize import brentq

    base = ss.reference_config(4096, Link(1.0, 5e-6), 0.81, sync_overhead_s=0.037)

    def excess(log_bw: float) -> float:
        inter = replace(base.inter, bandwidth_GBps=math.exp(log_bw))
        return sm.step_time(replace(base, inter=inter), 128)["s_per_iter"] - 0.91

    want = math.exp(brentq(excess, math.log(1e-3), math.log(1e4), xtol=1e-12))
    assert ss.effective_inter_bandwidth(sync_overhead_s=0.037) == pytest.approx(want, rel=1e-6)


def test_recommend_and_plot(tmp_path):
    r = ss.recommend()
    names = {row["setting"] for row in r["rows"]}
    assert any("batch 512" in s for s in names) and any("hierarchical" in s for s in names)
    base = {row["scenario"]: row for row in r["rows"] if row["setting"].startswith("reference")}
    assert base["as-published"]["s_per_iter"] == pytest.approx(0.91, rel=1e-6)
    png = tmp_path / "v.png"
    ss.plot_validation(ss.validate(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_registers_and_runs(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["scaling-model", "predict", "--hidden-size", "1024", "--gpus", "1,2,16",
                 "--json", str(out)]) == 0
    assert "overlappable" in capsys.readouterr().out
    import json

    rows = json.loads(out.read_text())["predictions"]
    assert [r["n"] for r in rows] == [1, 2, 16]


def test_onebit_collectives_by_hand():
    """alltoall (pairwise exchange), ring allgather and the 1-bit allreduce's wire time."""
    intra, inter = Link(100.0, 2e-6), Link(10.0, 1e-5)
    S = 8e6
    # within a node: (n-1) alpha + (n-1)/n S / beta_intra
    assert sm.alltoall_time(S, 4, 8, intra, inter) == pytest.approx(3 * 2e-6 + 3 / 4 * S / 100e9)
    # 2 nodes x 8: each node sends g (n-g)/n S = 8 x 8/16 S = 4 S through its NICs
    assert sm.alltoall_time(S, 16, 8, intra, inter) == pytest.approx(15 * 1e-5 + 4 * S / 10e9)
    assert sm.alltoall_time(S, 1, 8, intra, inter) == 0.0
    assert sm.ring_allgather_time(1e6, 16, 8, intra, inter) == pytest.approx(
        15 * 1e-5 + 15 * 1e6 / 10e9)
    assert sm.ring_allgather_time(1e6, 4, 8, intra, inter) == pytest.approx(
        3 * 2e-6 + 3 * 1e6 / 100e9)
    numel, n = 1_000_000, 16
    part = 8 * math.ceil(math.ceil(numel / n) / 8)
    part_bytes = part // 8 + 4 * math.ceil(part / 2048)
    assert sm.onebit_allreduce_time(numel, n, 8, intra, inter) == pytest.approx(
        sm.alltoall_time(n * part_bytes, n, 8, intra, inter)
        + sm.ring_allgather_time(part_bytes, n, 8, intra, inter))


def test_onebit_step_time_by_hand():
    """Compressed phase: compute + 3 Horovod cycles + 8-byte allreduce + alltoall + allgather +
    the compression passes, nothing hidden; 1 GPU pays nothing."""
    params = [("rnn.w", 4_000_000), ("decoder.weight", 96_000)]
    cfg = _cfg(params=params, compression="onebit", cycle_time_s=2e-3,
               per_cycle_overhead_s=1e-4, fusion_copy_GBps=100.0, sync_overhead_s=0.01)
    n, numel = 16, 4_096_000
    want = (3 * (1e-3 + 1e-4) + sm.allreduce_time(cfg, 8, n)
            + sm.onebit_allreduce_time(numel, n, 8, cfg.intra, cfg.inter)
            + sm.ONEBIT_PASSES * 4 * numel / 100e9)
    r = sm.step_time(cfg, n)
    assert r["comm_s"] == pytest.approx(want) and r["exposed_comm_s"] == r["comm_s"]
    assert r["s_per_iter"] == pytest.approx(1.0 + want + 0.01)
    assert sm.step_time(cfg, 1)["s_per_iter"] == 1.0
    # on a slow network a 40M-value model communicates less than half as long as the fp16 ring
    # (8 ranks per node share the NICs in the alltoall: not the 16x of the bytes)
    big, slow = [("rnn.w", 40_000_000)], dict(inter=Link(1.25, 3e-5))
    assert (sm.step_time(_cfg(params=big, compression="onebit", **slow), 128)["comm_s"]
            < sm.step_time(_cfg(params=big, compression="fp16", **slow), 128)["comm_s"] / 2)
    with pytest.raises(ValueError):
        _cfg(compression="twobit")


def test_onebit_study_and_cli(capsys):
    r = ss.onebit_study(warmup_fraction=0.2, gpus=(1, 8, 128))
    rows = {(x["column"], x["gpus"]): x for x in r["rows"]}
    one = rows[("10 GbE", 128)]
    # the end-to-end speedup blends warmup (fp16) and compressed steps by time
    t = 0.2 * one["fp16_s_per_iter"] + 0.8 * one["onebit_s_per_iter"]
    assert one["onebit_end_to_end_speedup"] == pytest.approx(128 * 0.81 / t)
    assert one["fp16_speedup"] == pytest.approx(sm.step_time(
        ss.reference_config(4096, "10gbe", 0.81, sync_overhead_s=r["sync_overhead_s"]),
        128)["speedup"])
    assert rows[("10 GbE", 1)]["onebit_speedup"] == 1.0
    rec = r["recommended"]["10 GbE"]
    assert rec["batch_per_gpu"] == 256 and rec["speedup"] == max(
        x["speedup"] for x in r["settings"]
        if x["column"] == "10 GbE" and x["batch_per_gpu"] == 256)
    with pytest.raises(ValueError):
        ss.onebit_study(warmup_fraction=1.5)
    assert main(["scaling-model", "onebit", "--gpus", "1,128"]) == 0
    out = capsys.readouterr().out
    assert "recommended (10 GbE" in out and "IB as published" in out
