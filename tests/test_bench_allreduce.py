"""``python -m benchmarks allreduce`` / ``fusion``: helpers, JSON parsing, and one real 2-rank run.
(benchmarks.bench_allreduce, benchmarks.bench_train, benchmarks.results)"""

import json
import sys

import pytest

from benchmarks import allreduce_worker as aw
from benchmarks import bench_allreduce as ba
from benchmarks import bench_fusion as bf
from benchmarks import build_parser
from benchmarks import results as R
from benchmarks.allreduce_report import human_bytes, print_report
from tests._mp import REPO, launch_env, run


def test_sizes_and_factors():
    assert aw.parse_sizes("64K,4096,1M,4k") == [4096, 65536, 1048576]
    assert aw.parse_size("256MB") == 256 * 1024 * 1024
    assert aw.DEFAULT_SIZES[0] == 4096 and aw.DEFAULT_SIZES[-1] == 256 * 1024 * 1024
    for bad in ("", "abc", "0", "6"):
        with pytest.raises(ValueError):
            aw.parse_size(bad)
    assert R.busbw_factor(2) == 1.0 and R.busbw_factor(8) == pytest.approx(1.75)
    assert aw.iters_for(4096, 20) == 20 and aw.iters_for(256 * 2 ** 20, 20) == 4
    assert human_bytes(4096) == "4K" and human_bytes(256 * 2 ** 20) == "256M"


def test_groups():
    assert aw.group_tensor_numels("synthetic200x64k") == [16384] * 200
    m = aw.group_tensor_numels("mlstm1024")
    assert len(m) == 8 and sum(m) * 4 == 5_853_440 * 4  # 23.4 MB
    with pytest.raises(ValueError):
        aw.group_tensor_numels("resnet50")


def test_configurations():
    confs = ba.configurations(ba.AllreduceConfig())
    labels = [c["label"] for c in confs]
    assert labels[:4] == ["mpi4py", "torch-gloo", "hvd-mpi", "hvd-gloo"]
    assert "hvd-mpi fusion=0MB" in labels and "hvd-mpi cycle=5ms" in labels
    assert all(c["env"].get("HOROVOD_CONTROLLER") == "mpi" for c in confs
               if c["label"].startswith("hvd-mpi"))


def _records():
    recs = []
    for s in (4096, 65536, 1048576):
        recs.append({"label": "mpi4py", "backend": "mpi", "case": "single", "size_bytes": s,
                     "time_s": 20e-6 + s / 4e9, "ranks": 2, "compression": "none"})
        recs.append({"label": "hvd-mpi", "backend": "horovod", "case": "single",
                     "size_bytes": s, "time_s": 600e-6 + s / 3e9, "ranks": 2,
                     "compression": "none", "cycle_time_ms": 1.0})
    recs.append({"label": "hvd-mpi", "case": "grouped", "group": "synthetic200x64k",
                 "mode": "async", "tensors": 200, "size_bytes": 200 * 65536, "time_s": 0.01,
                 "ranks": 2, "compression": "none"})
    return recs


def test_derived_fields_ratios_and_json_roundtrip(tmp_path, capsys):
    recs = _records()
    R.derive(recs)
    r = recs[0]
    assert r["algbw_GBps"] == pytest.approx(4096 / r["time_s"] / 1e9)
    assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(n-1)/n = 1 at n = 2
    ratios = R.ratios_to_mpi(recs)
    assert {x["size_bytes"] for x in ratios} == {4096, 65536, 1048576}
    assert all(x["label"] == "hvd-mpi" and x["time_ratio"] > 1 for x in ratios)
    fits = R.fit_records(recs)
    assert fits["mpi4py"]["beta_GBps"] == pytest.approx(4.0, rel=1e-6)
    data = {"ranks": 2, "records": recs, "fits": fits}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    loaded = R.load_bench_json(path)
    print_report(loaded)
    out = capsys.readouterr().out
    assert "time / raw MPI" in out and "synthetic200x64k" in out
    from benchmarks.calibration import calibrate_from_bench

    cal = calibrate_from_bench(loaded)  # no sizes >= 16 MiB here: ratio of fitted slopes
    assert cal.bandwidth_factor == pytest.approx(4 / 3, rel=1e-6)
    # median over the sizes <= 64 KiB (4 KiB and 64 KiB) of the Horovod - MPI difference
    extra = (4096 + 65536) / 2 * (1 / 3e9 - 1 / 4e9)
    assert cal.per_cycle_overhead_s == pytest.approx(580e-6 + extra, rel=1e-6)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ranks": 2, "records": [{"label": "x", "case": "single",
                                                        "size_bytes": 4, "time_s": 0,
                                                        "ranks": 2}]}))
    with pytest.raises(ValueError):
        R.load_bench_json(bad)
    bad.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError):
        R.load_bench_json(bad)


def test_autotune_log_parsing(tmp_path):
    head = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
            "cycle_time_ms,tensor_fusion_threshold,score\n")
    rows = "0,0,0, 1,5,4,10.5\n0,0,0, 1,50,32,30.25\n0,0,0, 1,25,16,20\n"
    log = tmp_path / "a.csv"
    log.write_text(head + rows + "0,0,0, 1,50,32,30.25\n")  # finished: best row last
    r = bf.parse_autotune_log(log)
    assert r["finished"] and len(r["samples"]) == 3
    assert r["best"]["cycle_time_ms"] == 50 and r["best"]["tensor_fusion_threshold"] == 32
    log.write_text(head + rows)  # not finished: best sample so far
    r = bf.parse_autotune_log(log)
    assert not r["finished"] and r["best"]["score"] == 30.25
    log.write_text("nothing\n")
    with pytest.raises(ValueError):
        bf.parse_autotune_log(log)


def test_summarize_fusion():
    runs = [{"label": "fusion=0MB cycle=1ms", "fusion_threshold_mb": 0.0, "cycle_time_ms": 1.0,
             "step_time_s": 0.3, "allreduce_wait_share": 0.1},
            {"label": "fusion=128MB cycle=1ms", "fusion_threshold_mb": 128.0,
             "cycle_time_ms": 1.0, "step_time_s": 0.2, "allreduce_wait_share": 0.1},
            {"label": "fusion=128MB cycle=1ms", "fusion_threshold_mb": 128.0,
             "cycle_time_ms": 1.0, "step_time_s": 0.4, "allreduce_wait_share": 0.2}]
    s = {x["label"]: x for x in bf.summarize_fusion(runs)}
    assert s["fusion=128MB cycle=1ms"]["step_time_s"] == pytest.approx(0.3)
    assert s["fusion=128MB cycle=1ms"]["step_time_min_s"] == pytest.approx(0.2)
    assert s["fusion=0MB cycle=1ms"]["relative_to_default"] == pytest.approx(1.0)


def test_registers_bench_subcommands():
    argv = ["allreduce", "--sizes", "4K,64K", "--np", "2"]
    a = build_parser(argv).parse_args(argv)
    assert a.command_obj is ba.BENCH_ALLREDUCE and a.command_obj.settings(a).np == 2
    argv = ["fusion", "--fusion-mb", "0,64"]
    f = build_parser(argv).parse_args(argv)
    cfg = f.command_obj.settings(f)
    assert f.command_obj is bf.BENCH_FUSION and cfg.hidden_size == 256 and cfg.fusion_mb == [0, 64]


@pytest.mark.slow
def test_real_allreduce_bench_two_ranks(tmp_path):
    out = tmp_path / "ar.json"
    run([sys.executable, "-m", "benchmarks", "allreduce", "--np", "2",
         "--sizes", "4096,65536", "--iters", "3", "--warmup", "1", "--fusion-mb", "",
         "--cycle-ms", "", "--groups", "synthetic8x16k", "--json", str(out)],
        timeout=240, env=launch_env(), cwd=REPO)
    data = R.load_bench_json(out)
    labels = {r["label"] for r in data["records"]}
    assert {"mpi4py", "torch-gloo", "hvd-mpi", "hvd-mpi+fp16", "hvd-gloo",
            "hvd-gloo+fp16"} == labels
    for r in data["records"]:
        assert r["time_s"] > 0 and r["algbw_GBps"] > 0 and r["busbw_GBps"] > 0
        assert r["ranks"] == 2
    single = {(r["label"], r["size_bytes"]) for r in data["records"] if r["case"] == "single"}
    assert ("mpi4py", 4096) in single and ("hvd-gloo", 65536) in single
    grouped = [r for r in data["records"] if r["case"] == "grouped"]
    assert {r["mode"] for r in grouped} == {"async", "flat"}
    assert all(f["beta_GBps"] > 0 for f in data["fits"].values())  # 2 noisy sizes may not fit
    assert all(x["time_ratio"] > 0 for x in data["ratios_to_mpi"])


def test_median_over_repeats():
    recs = [{"label": "a", "case": "single", "size_bytes": 4, "time_s": t} for t in (3, 1, 2)]
    recs.append({"label": "a", "case": "grouped", "size_bytes": 4, "group": "g", "mode": "async",
                 "time_s": 5})
    out = R.median_over_repeats(recs)
    single = [r for r in out if r["case"] == "single"][0]
    assert single["time_s"] == 2 and single["time_s_repeats"] == [3, 1, 2]
    assert len(out) == 2
