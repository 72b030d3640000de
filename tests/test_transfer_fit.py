"""The classifier fit (hvd_lm.transfer.classify, hvd_lm.transfer.fista): the batched torch
solver against scikit-learn on small problems (objective, validation accuracy, signs of the
largest weights), its duality-gap certificate, the zero models below l1_min_c, the stored
standardisation, and the CUDA path (marked ``cuda``: skipped without a GPU)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from sklearn.svm import l1_min_c

from hvd_lm.transfer import classify as C
from hvd_lm.transfer import fista

GRID = tuple(2.0 ** np.arange(-6, 3))


def problem(n: int, d: int, seed: int, rank: int = 6, nnz: int = 6, snr: float = 2.5):
    """Correlated features (``rank`` shared factors + noise, columns on different scales) and
    labels drawn from a sparse logistic model: like LM features, not separable."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(rank, d)) / np.sqrt(rank)

    def draw(m):
        X = rng.normal(size=(m, rank)) @ A + 0.7 * rng.normal(size=(m, d))
        return X

    w = np.zeros(d)
    nnz = min(nnz, d)
    w[rng.choice(d, nnz, replace=False)] = rng.normal(size=nnz)
    scales = np.exp(rng.normal(size=d))
    out = []
    for m in (n, 2000):
        X = draw(m)
        z = X @ w
        y = (rng.random(m) < 1 / (1 + np.exp(-snr * z / z.std()))).astype(np.int64)
        out.append(((X * scales).astype(np.float32), y))
    return out


def reference_path(X, y, grid, penalty):
    """scikit-learn with tight tolerances: saga (unpenalised intercept, the torch solver's
    problem) warm-started along the grid."""
    m = LogisticRegression(C=1.0, solver="saga", tol=1e-9, max_iter=20000, warm_start=True,
                           random_state=0, **C._sk_penalty(penalty))
    coef, icpt = [], []
    for c in grid:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            m.set_params(C=c).fit(X, y)
        coef.append(m.coef_.ravel().copy())
        icpt.append(float(m.intercept_[0]))
    return np.array(coef), np.array(icpt)


@pytest.mark.parametrize("penalty", ["l1", "l2"])
@pytest.mark.parametrize("n,d,seed", [(400, 30, 0), (800, 60, 1)])
def test_torch_solver_agrees_with_sklearn(penalty, n, d, seed):
    """Per C: objective within 1e-3 relative, validation accuracy within 0.5 points, and the
    same signs on scikit-learn's 5 largest weights (the issue's agreement criteria)."""
    (Xtr, ytr), (Xva, yva) = problem(n, d, seed)
    mean, scale = C.standardizer(Xtr)
    Xs, Xvs = (Xtr - mean) / scale, (Xva - mean) / scale
    path = C.fit_path(Xs, ytr, GRID, penalty, solver="torch", device="cpu")
    assert path.solver == "torch" and path.converged.all()
    ref_coef, ref_icpt = reference_path(Xs.astype(np.float64), ytr, GRID, penalty)
    ref_obj = fista.objective_values(Xs, ytr, ref_coef, ref_icpt, GRID, penalty)
    assert np.all(np.abs(path.objective - ref_obj) <= 1e-3 * ref_obj), (path.objective, ref_obj)
    for k in range(len(GRID)):
        acc_t = float((((Xvs @ path.coef[k]) + path.intercept[k] > 0) == yva).mean())
        acc_s = float((((Xvs @ ref_coef[k]) + ref_icpt[k] > 0) == yva).mean())
        assert abs(acc_t - acc_s) <= 0.005, (GRID[k], acc_t, acc_s)
        top = np.argsort(-np.abs(ref_coef[k]))[:5]
        top = top[np.abs(ref_coef[k][top]) > 1e-3 * max(np.abs(ref_coef[k]).max(), 1e-12)]
        assert np.array_equal(np.sign(path.coef[k][top]), np.sign(ref_coef[k][top])), GRID[k]
    if penalty == "l1":  # sparse at small C, as scikit-learn's
        assert np.count_nonzero(path.coef[0]) < d / 2
        assert np.count_nonzero(path.coef[0]) == pytest.approx(np.count_nonzero(ref_coef[0]),
                                                               abs=2)


def test_duality_gap_bounds_the_true_suboptimality():
    """The reported relative gap of a loose float32 solve is an upper bound on how far its
    objective is from a float64 solve to 1e-10: the certificate the stopping rule relies on."""
    (X, y), _ = problem(300, 40, 3)
    X = (X - X.mean(0)) / X.std(0)
    loose = fista.fit_path(X, y, GRID, "l1", tol=1e-2)
    tight = fista.fit_path(X, y, GRID, "l1", tol=1e-10, dtype=torch.float64, max_iter=100000)
    assert tight.converged.all() and np.all(tight.gap <= 1e-10)
    subopt = (loose.objective - tight.objective) / tight.objective
    assert np.all(subopt >= -1e-9)  # the tight solve is (up to rounding) the optimum
    assert np.all(subopt <= loose.gap + 1e-9), (subopt, loose.gap)
    assert np.any(loose.gap > 1e-5)  # the loose solve really stopped early


def test_small_C_gives_the_zero_model_without_a_fit():
    """C at or below the zero threshold: weights exactly 0, the intercept the log-odds of the
    labels (torch, saga), liblinear's all-zero model below l1_min_c; scikit-learn fits agree."""
    (X, y), _ = problem(300, 20, 4)
    X = ((X - X.mean(0)) / X.std(0)).astype(np.float64)
    c0 = 1.0 / np.abs((y - y.mean()) @ X).max()
    grid = (0.5 * c0, 0.99 * c0, 4 * c0)
    for solver in ("torch", "saga"):
        p = C.fit_path(X, y, grid, "l1", solver=solver)
        assert not p.coef[:2].any() and list(p.n_iter[:2]) == [0, 0]
        assert p.intercept[:2] == pytest.approx([np.log(y.mean() / (1 - y.mean()))] * 2)
        assert np.count_nonzero(p.coef[2]) > 0
    sk = LogisticRegression(C=0.99 * c0, solver="saga", tol=1e-8, max_iter=10000,
                            **C._sk_penalty("l1")).fit(X, y)
    assert not sk.coef_.any()
    lib = C.fit_path(X, y, (0.9 * l1_min_c(X, y, loss="log"),), "l1", solver="liblinear")
    assert not lib.coef.any() and lib.intercept[0] == 0 and lib.n_iter[0] == 0


@pytest.mark.parametrize("solver", ["liblinear", "saga", "torch"])
def test_every_solver_picks_the_planted_units(solver):
    """fit_logreg with each solver on the same standardised problem: near-identical validation
    accuracy, the same sentiment unit, and the stored standardisation equals StandardScaler's."""
    (Xtr, ytr), (Xva, yva) = problem(600, 40, 5, snr=4.0)
    clf = C.fit_logreg(Xtr, ytr, Xva, yva, solver=solver, device="cpu")
    ref = C.fit_logreg(Xtr, ytr, Xva, yva, solver="liblinear")
    assert clf["solver"] == solver and clf["converged"]
    assert abs(clf["accuracy"]["val"] - ref["accuracy"]["val"]) <= 0.01
    assert np.argmax(np.abs(clf["coef"])) == np.argmax(np.abs(ref["coef"]))
    sc = StandardScaler().fit(Xtr)
    m = clf["model"]
    np.testing.assert_allclose(m.mean, sc.mean_, rtol=1e-6)
    np.testing.assert_allclose(m.scale, sc.scale_, rtol=1e-5)
    margins = sc.transform(Xva.astype(np.float64)) @ m.coef + m.intercept
    np.testing.assert_allclose(m.decision_function(Xva), margins, rtol=1e-6, atol=1e-8)
    assert clf["accuracy"]["val"] == float(((margins > 0) == yva).mean())
    assert [p["C"] for p in clf["path"]] == list(C.DEFAULT_C_GRID)


def test_resolve_solver_and_bad_options():
    assert C.resolve_solver("auto", "cpu") == (C.CPU_AUTO_SOLVER, "cpu")
    assert C.resolve_solver("auto", "cpu", C.CPU_SMALL_FIT) == ("liblinear", "cpu")
    assert C.resolve_solver("auto", "cpu", C.CPU_SMALL_FIT + 1) == (C.CPU_AUTO_SOLVER, "cpu")
    assert C.resolve_solver("saga", "cuda" if torch.cuda.is_available() else "cpu")[1] == "cpu"
    with pytest.raises(ValueError, match="solver must be one of"):
        C.resolve_solver("newton", "cpu")
    (X, y), _ = problem(100, 5, 6)
    with pytest.raises(ValueError, match="C values must be finite and > 0"):
        fista.fit_path(X, y, [1.0, -1.0])
    with pytest.raises(ValueError, match="both classes"):
        fista.fit_path(X, np.zeros(len(y)), [1.0])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            fista.fit_path(X, y, [1.0], device="cuda")


def test_auto_fits_a_small_cpu_problem_with_liblinear_in_one_process(monkeypatch):
    """``auto`` on the CPU below CPU_SMALL_FIT values: liblinear, one job (the C values fit
    one after another in this process), the same weights every time, the model liblinear itself
    fits at the chosen C."""
    (Xtr, ytr), (Xva, yva) = problem(200, 64, 8)
    jobs = []
    parallel = C.joblib.Parallel
    monkeypatch.setattr(C.joblib, "Parallel",
                        lambda n_jobs, backend: jobs.append(n_jobs) or parallel(n_jobs, backend))
    a, b = (C.fit_logreg(Xtr, ytr, Xva, yva, solver="auto", device="cpu") for _ in range(2))
    assert a["solver"] == "liblinear" and jobs == [1, 1]
    np.testing.assert_array_equal(a["coef"], b["coef"])
    m = a["model"]
    ref = LogisticRegression(C=a["C"], solver="liblinear", tol=1e-4, random_state=42,
                             **C._sk_penalty("l1")).fit((Xtr - m.mean) / m.scale, ytr)
    np.testing.assert_allclose(a["coef"], ref.coef_.ravel(), rtol=1e-3, atol=1e-4)


def test_liblinear_in_parallel_equals_one_fit_after_another():
    """liblinear's fits at several C values at once (2 worker processes) give the weights and
    iteration counts of the same fits one after another, run after run (in threads of one
    process they did not: liblinear's rand() is process-wide)."""
    (Xtr, ytr), _ = problem(400, 96, 3)
    grid = np.geomspace(0.01, 10.0, 8)
    one = C.fit_path(Xtr, ytr, grid, "l1", "liblinear", "cpu", jobs=1)
    for _ in range(2):
        two = C.fit_path(Xtr, ytr, grid, "l1", "liblinear", "cpu", jobs=2)
        np.testing.assert_array_equal(two.coef, one.coef)
        np.testing.assert_array_equal(two.n_iter, one.n_iter)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("penalty", ["l1", "l2"])
def test_torch_solver_on_cuda_matches_cpu(penalty):
    """The GPU path: same problem on cuda and cpu, objectives within 1e-3 and the same choice
    of C by fit_logreg (``auto`` picks torch on the GPU)."""
    (Xtr, ytr), (Xva, yva) = problem(2000, 256, 7)
    X = (Xtr - Xtr.mean(0)) / Xtr.std(0)
    gpu = fista.fit_path(X, ytr, GRID, penalty, device="cuda")
    cpu = fista.fit_path(X, ytr, GRID, penalty, device="cpu")
    assert gpu.device.startswith("cuda") and gpu.converged.all()
    np.testing.assert_allclose(gpu.objective, cpu.objective, rtol=1e-3)
    a = C.fit_logreg(Xtr, ytr, Xva, yva, penalty=penalty, solver="auto", device="cuda")
    b = C.fit_logreg(Xtr, ytr, Xva, yva, penalty=penalty, solver="torch", device="cpu")
    assert a["solver"] == "torch" and a["device"].startswith("cuda")
    assert abs(a["accuracy"]["val"] - b["accuracy"]["val"]) <= 0.005
