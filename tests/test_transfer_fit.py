"""The classifier fit (hvd_lm.transfer.fit): C chosen by stratified k-fold cross-validation
on the training split alone (a numpy/scikit-learn computation fold by fold gives the same C and
fold accuracies; validation labels change nothing), the model refit on all of train at that C,
the stored standardisation, every solver picking the planted units, and liblinear's fits in
worker processes equal to the same fits in this process."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold
from sklearn.preprocessing import StandardScaler

from hvd_lm.transfer import fit as C


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


def folds_by_hand(X, y, grid, k, seed, penalty="l1"):
    """Mean fold accuracy per C, fold by fold: scikit-learn's split, the training fold's own mean
    and standard deviation in numpy, one liblinear fit per fold and C."""
    means = []
    for c in grid:
        accs = []
        for tr, te in StratifiedKFold(k, shuffle=True, random_state=seed).split(X, y):
            mu, sd = X[tr].mean(0), X[tr].std(0)
            m = LogisticRegression(C=c, solver="liblinear", random_state=seed,
                                   **C._sk_penalty(penalty))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                m.fit((X[tr] - mu) / sd, y[tr])
            accs.append(float((m.predict((X[te] - mu) / sd) == y[te]).mean()))
        means.append(float(np.mean(accs)))
    return means


def test_c_is_chosen_by_cross_validation_on_train_alone():
    """The fold accuracies and the chosen C equal a fold-by-fold computation (ties: the smaller
    C); the validation labels, shuffled, change neither the C nor the weights; val and test are
    scored once, by the model refit on all of train."""
    (Xtr, ytr), (Xva, yva) = problem(400, 24, 11)
    X = Xtr.astype(np.float64)
    grid = (0.01, 0.03, 0.1, 0.3, 1.0)
    fit = C.fit_logreg(Xtr, ytr, Xva, yva, Xva[:500], yva[:500], grid=grid, seed=3, folds=4)
    by_hand = folds_by_hand(X, ytr, grid, 4, 3)
    assert list(fit["cv"]["mean"].values()) == pytest.approx(by_hand, abs=1e-12)
    assert fit["C"] == grid[int(np.argmax(by_hand))] and fit["cv"]["folds"] == 4
    assert fit["accuracy"]["cv"] == pytest.approx(max(by_hand))
    rng = np.random.default_rng(0)
    other = C.fit_logreg(Xtr, ytr, Xva, rng.permutation(yva), grid=grid, seed=3, folds=4)
    assert other["C"] == fit["C"]
    np.testing.assert_array_equal(other["coef"], fit["coef"])
    mu, sd = X.mean(0), X.std(0)
    ref = LogisticRegression(C=fit["C"], solver="liblinear", random_state=3,
                             **C._sk_penalty("l1")).fit((X - mu) / sd, ytr)
    np.testing.assert_allclose(fit["coef"], ref.coef_.ravel(), rtol=1e-6, atol=1e-9)
    assert fit["accuracy"]["val"] == float((ref.predict((Xva - mu) / sd) == yva).mean())
    assert fit["accuracy"]["test"] == float((ref.predict((Xva[:500] - mu) / sd)
                                             == yva[:500]).mean())


@pytest.mark.parametrize("solver", ["liblinear", "saga"])
def test_every_solver_picks_the_planted_units(solver):
    """fit_logreg with each solver on the same problem at the same C: near-identical validation
    accuracy, the same sentiment unit, and the stored standardisation equals StandardScaler's;
    over the default grid, a fold accuracy per C."""
    (Xtr, ytr), (Xva, yva) = problem(600, 40, 5, snr=4.0)
    clf = C.fit_logreg(Xtr, ytr, Xva, yva, solver=solver, grid=(0.1,))
    ref = C.fit_logreg(Xtr, ytr, Xva, yva, solver="liblinear", grid=(0.1,))
    assert clf["solver"] == solver and clf["converged"]
    assert abs(clf["accuracy"]["val"] - ref["accuracy"]["val"]) <= 0.01
    assert np.argmax(np.abs(clf["coef"])) == np.argmax(np.abs(ref["coef"]))
    sc = StandardScaler().fit(Xtr.astype(np.float64))
    m = clf["model"]
    np.testing.assert_allclose(m.mean, sc.mean_, rtol=1e-9)
    np.testing.assert_allclose(m.scale, sc.scale_, rtol=1e-9)
    margins = sc.transform(Xva.astype(np.float64)) @ m.coef + m.intercept
    np.testing.assert_allclose(m.decision_function(Xva), margins, rtol=1e-6, atol=1e-8)
    assert clf["accuracy"]["val"] == float(((margins > 0) == yva).mean())
    full = C.fit_logreg(Xtr, ytr, solver=solver)
    assert list(full["grid"]) == [f"{c:g}" for c in C.DEFAULT_C_GRID]


def test_bad_options_and_too_few_examples_for_the_folds():
    (X, y), _ = problem(100, 5, 6)
    with pytest.raises(ValueError, match="solver must be one of"):
        C.fit_logreg(X, y, solver="newton")
    with pytest.raises(ValueError, match="penalty must be"):
        C.fit_logreg(X, y, penalty="l0")
    y1 = np.zeros(len(y), dtype=np.int64)
    y1[0] = 1
    with pytest.raises(ValueError, match="at least 2 examples of each label.*99 negative and 1 "
                       "positive"):
        C.fit_logreg(X, y1)
    y3 = y1.copy()
    y3[:3] = 1
    assert C.cv_folds(y3, 5) == 3  # fewer folds than asked when a label has fewer examples


def test_liblinear_in_worker_processes_equals_one_fit_after_another():
    """The cross-validation's fits in 2 worker processes give the weights, fold accuracies and
    iteration counts of the same fits one after another in this process, run after run
    (liblinear's rand() is process-wide: in threads of one process they did not)."""
    (Xtr, ytr), _ = problem(2800, 96, 3)  # over IN_PROCESS_FIT: workers when asked for
    assert Xtr.size > C.IN_PROCESS_FIT
    grid = np.geomspace(0.01, 10.0, 6)
    one = C.fit_logreg(Xtr, ytr, grid=grid, jobs=1)
    for _ in range(2):
        two = C.fit_logreg(Xtr, ytr, grid=grid, jobs=2)
        np.testing.assert_array_equal(two["coef"], one["coef"])
        assert two["grid"] == one["grid"] and two["n_iter"] == one["n_iter"]
