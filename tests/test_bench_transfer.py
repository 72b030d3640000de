"""``python -m benchmarks transfer`` (benchmarks.bench_transfer): runs every solver on a small
problem in worker processes and reports them side by side; asserts behaviour (what is reported, that
the solvers solved the same problem), never speed."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import numpy as np
import pytest

from benchmarks import bench_transfer as B


def test_synthetic_problem_is_seeded_and_learnable():
    a = B.synthetic_problem(400, 30, n_val=200, seed=1)
    b = B.synthetic_problem(400, 30, n_val=200, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    Xtr, ytr, Xva, yva = a
    assert Xtr.shape == (400, 30) and Xva.shape == (200, 30) and Xtr.dtype == np.float32
    assert 0.3 < ytr.mean() < 0.7
    sd = Xtr.std(0)
    assert sd.max() / sd.min() > 5  # columns on different scales, as raw LM features
    corr = np.abs(np.corrcoef(Xtr.T)[np.triu_indices(30, 1)]).mean()
    noise = np.abs(np.corrcoef(np.random.default_rng(0).normal(size=(400, 30)).T)[
        np.triu_indices(30, 1)]).mean()
    assert corr > 2.5 * noise  # shared factors (independent columns: ~0.04 at n=400)


@pytest.mark.parametrize("text,ok", [("6920x4096", (6920, 4096)), ("25000X4096", (25000, 4096)),
                                     ("12", None), ("5x3", None), ("axb", None)])
def test_parse_size(text, ok):
    if ok:
        assert B.parse_size(text) == ok
    else:
        with pytest.raises(ValueError, match="NxD|N >= 10"):
            B.parse_size(text)


def test_bench_runs_every_solver_side_by_side(tmp_path, capsys, monkeypatch):
    """``python -m benchmarks transfer`` through the CLI's entry point in this process: the first
    problem's fits in real worker processes (``python -m benchmarks.bench_transfer
    --worker``), the second's through the same worker function in this process (a worker
    process costs ~4 s of imports; the second problem is there to show problems side by side).
    Each row is transfer's own fit: its chosen C and fold accuracy are fit_logreg's."""
    from benchmarks import main
    from hvd_lm.transfer.fit import fit_logreg

    real_run_fit, in_process = B._run_fit, []

    def run_fit(problem, solver, threads, cfg):
        with np.load(problem) as z:
            if z["Xtr"].shape[0] == 300:
                return real_run_fit(problem, solver, threads, cfg)
        in_process.append(solver)
        wc = B.WorkerConfig(**{f.name: getattr(cfg, f.name)
                               for f in dataclasses.fields(B.FitConfig)},
                            worker=str(problem), solver=solver, threads=threads)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert B.worker(wc) == 0
        (line,) = [ln for ln in buf.getvalue().splitlines() if ln.startswith("BENCH ")]
        return json.loads(line[6:])

    monkeypatch.setattr(B, "_run_fit", run_fit)
    out = tmp_path / "b.json"
    assert main(["transfer", "--sizes", "300x12,200x8", "--solvers",
                 "liblinear,saga", "--threads", "1", "--c-grid", "0.01,0.1,1", "--json",
                 str(out)]) == 0
    assert in_process == ["liblinear", "saga"]
    res = json.loads(out.read_text())
    assert [p["problem"] for p in res["problems"]] == ["synthetic 300 x 12", "synthetic 200 x 8"]
    Xtr, ytr, Xva, yva = B.synthetic_problem(300, 12, 872, 0)
    for p in res["problems"]:
        rows = p["solvers"]
        assert set(rows) == {"liblinear, 1 thread", "saga, 1 thread"}
        assert min(v["x_fastest"] for v in rows.values()) == 1.0
        for v in rows.values():
            assert v["seconds"] > 0 and v["threads"] == 1 and list(v["grid"]) == ["0.01", "0.1",
                                                                                  "1"]
    ref = fit_logreg(Xtr, ytr, Xva, yva, grid=(0.01, 0.1, 1), seed=0, jobs=1)
    row = res["problems"][0]["solvers"]["liblinear, 1 thread"]
    assert (row["C"], row["cv"], row["val"]) == (ref["C"], ref["accuracy"]["cv"],
                                                 ref["accuracy"]["val"])
    assert "| synthetic 300 x 12 | saga, 1 thread (1) |" in capsys.readouterr().out


def test_bench_reports_a_stopped_fit(tmp_path):
    """A fit over --time-limit is reported as stopped, the others as usual."""
    rows = B.summarize("p", (10, 2), {
        "a": [{"seconds": 2.0, "stopped": True}],
        "b": [{"seconds": 1.0, "threads": 1, "C": 2.0, "cv": 0.6, "val": 0.7, "nonzero": 2,
               "converged": True, "grid": {"1": 0.5, "2": 0.6}}]})["solvers"]
    assert rows["a"] == {"stopped": True, "seconds": 2.0}
    assert rows["b"]["C"] == 2.0 and rows["b"]["x_fastest"] == 1.0
    table = B.format_table({"config": {"time_limit": 1.5}, "problems": [
        {"problem": "p", "solvers": rows}]})
    assert "| p | a | > 2 (stopped) |" in table
    assert "| p | b (1) | 1.0 | 1.00 | 2 | 60.00 |" in table
