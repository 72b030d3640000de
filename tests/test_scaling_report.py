"""``python -m benchmarks scaling-report``: s/iter, speedup and efficiency of a sweep's runs from
their metrics.jsonl, checked against the reference talk's table (Puri et al. 2018)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import main as bench_main
from benchmarks import scaling_report as S


def fake_run(root: Path, gpus: int, s_iter: float, per_gpu: int = 32, warmup: float = 9.0,
             records: int = 5) -> Path:
    """A metrics.jsonl as rank 0 of `hvd-lm train` writes it: one slow warm-up record, then
    ``records`` records at ``s_iter``."""
    d = root / f"g{gpus:03d}"
    d.mkdir(parents=True)
    recs = [{"kind": "start", "step": 0, "world_size": gpus, "global_batch": gpus * per_gpu}]
    recs += [{"kind": "train", "step": 10 * (i + 1), "loss": 1.0,
              "step_time": warmup if i == 0 else s_iter,
              "chars_per_s": gpus * per_gpu * 256 / s_iter} for i in range(records + 1)]
    recs.append({"kind": "end", "step": 10 * (records + 1), "stop": "done", "world_size": gpus})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def talk_runs(root: Path, column: str) -> list[Path]:
    return [fake_run(root, g, t) for g, (t, _) in S.REFERENCE[column].items()]


# Entries of the talk's table that N x t1 / tN (from its own rounded s/iter column) does not
# reproduce to within 0.1x; see docs/launch.md.
TALK_MISMATCHES = {("no-ib", 16): 11.89, ("no-ib", 64): 45.88, ("ib", 16): 14.24,
                   ("ib", 32): 28.48, ("ib", 128): 113.93}


@pytest.mark.parametrize("column", list(S.REFERENCE))
def test_report_reproduces_the_talks_speedup_column(column, tmp_path, capsys):
    runs = talk_runs(tmp_path, column)
    png, js = tmp_path / "scaling.png", tmp_path / "scaling.json"
    assert bench_main(["scaling-report", *map(str, runs), "--reference", column, "--plot",
                       str(png), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(js.read_text())["rows"]
    t1 = S.REFERENCE[column][1][0]
    for row in rows:
        g, (t, talk_speed) = row["gpus"], S.REFERENCE[column][row["gpus"]]
        assert row["step_time"] == pytest.approx(t)  # the warm-up record was skipped
        assert row["speedup"] == pytest.approx(g * t1 / t)
        assert row["efficiency"] == pytest.approx(t1 / t)
        if (column, g) in TALK_MISMATCHES:
            assert row["speedup"] == pytest.approx(TALK_MISMATCHES[(column, g)], abs=0.01)
            assert abs(row["speedup"] - talk_speed) > 0.5
        else:
            assert row["speedup"] == pytest.approx(talk_speed, abs=0.07)
    assert "baseline: 1 GPU" in printed and "talk speed" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_ib_128_gpus_is_113_9x_not_109x(tmp_path):
    rows, _ = S.scaling_rows([S.read_run(p) for p in talk_runs(tmp_path, "ib")])
    assert f"{rows[-1].speedup:.1f}" == "113.9" and rows[-1].gpus == 128


def test_missing_one_gpu_baseline(tmp_path, capsys):
    runs = [str(fake_run(tmp_path, g, t)) for g, t in ((8, 0.85), (16, 0.91))]
    assert bench_main(["scaling-report", *runs, "--no-plot"]) == 2
    assert "no 1-GPU baseline run among world sizes [8, 16]" in capsys.readouterr().err
    assert bench_main(["scaling-report", *runs, "--no-plot", "--baseline", "smallest"]) == 0
    out = capsys.readouterr().out
    assert "speedup is relative to 8 GPUs" in out
    row16 = [line for line in out.splitlines() if line.split()[:1] == ["16"]][0].split()
    assert float(row16[2].rstrip("x")) == pytest.approx(round(2 * 0.85 / 0.91, 1))


def test_report_input_errors(tmp_path, capsys):
    a, b = fake_run(tmp_path / "a", 1, 0.8), fake_run(tmp_path / "b", 1, 0.9)
    assert bench_main(["scaling-report", str(a), str(b), "--no-plot"]) == 2
    assert "two runs with world size 1" in capsys.readouterr().err
    assert bench_main(["scaling-report", str(tmp_path / "nope"), "--no-plot"]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    short = fake_run(tmp_path / "c", 1, 0.8, records=0)
    assert bench_main(["scaling-report", str(short), "--no-plot"]) == 2
    assert "no 'train' record" in capsys.readouterr().err


def test_resumed_run_skips_warmup_after_each_start(tmp_path):
    d = fake_run(tmp_path, 2, 0.5)
    with open(d / "metrics.jsonl", "a") as f:  # a requeued attempt: new start, slow first record
        start = {"kind": "start", "step": 60, "world_size": 2, "global_batch": 64}
        f.write(json.dumps(start) + "\n")
        for st in (7.0, 0.5, 0.5):
            f.write(json.dumps({"kind": "train", "step": 70, "step_time": st}) + "\n")
    timing = S.read_run(d)
    assert timing.step_time == 0.5 and timing.records == 7


def test_json_to_stdout(tmp_path, capsys):
    runs = [str(fake_run(tmp_path, g, t)) for g, t in ((1, 0.81), (8, 0.85))]
    assert bench_main(["scaling-report", *runs, "--json", "-", "--no-plot"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [r["gpus"] for r in payload["rows"]] == [1, 8]
    assert payload["rows"][1]["speedup"] == pytest.approx(8 * 0.81 / 0.85)
