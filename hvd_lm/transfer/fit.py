"""The classifier on LM features, the sentiment neuron, and the TF-IDF baseline.

From Radford et al. 2017 as rebuilt by NVIDIA/sentiment-discovery (``logreg_utils.py``), with C
chosen without looking at the split it is scored on:

* :func:`fit_logreg`: L1 (or L2) logistic regression (scikit-learn's ``LogisticRegression``,
  liblinear as the reference, or saga) on features standardised with the training split's mean
  and standard deviation (``StandardScaler``, fit inside each fold; :class:`LinearClassifier`
  keeps the full training split's, so a saved classifier applies them itself). C is chosen from
  a log2 grid (the reference's 2^-8..2^0; ours 2^-8..2^2) by stratified k-fold cross-validation
  on the training split (:func:`cross_validate`: ``GridSearchCV``, the folds' fits in parallel
  worker processes), the model refit on the whole training split at that C; validation and test
  accuracy are then measured once. (The reference, and this project before, scored every C on
  validation and reported the best, an optimistic figure.)
* :func:`sentiment_neuron`: the unit with the largest |weight| of that model, its accuracy alone
  with a threshold fit on train (:func:`fit_threshold`), and a histogram of the unit's value by
  class (:func:`plot_neuron_histogram`).
* :func:`tfidf_baseline`: TF-IDF word 1-2-grams + char_wb 2-5-grams and an L2
  ``LogisticRegression`` on the same splits, C chosen by the same cross-validation.
"""

from __future__ import annotations

import inspect
import time
import warnings
from pathlib import Path
from typing import Sequence

import matplotlib
import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, StratifiedKFold
from sklearn.pipeline import FeatureUnion, Pipeline
from sklearn.preprocessing import StandardScaler

from hvd_lm.comm.threads import usable_cores
from hvd_lm.transfer.saved import LinearClassifier
from hvd_lm.util.atomic import atomic_path

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

#: Default C grid for the L1 logistic regression on LM features: 2^-8..2^2 (reference: 2^-8..2^0).
DEFAULT_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-8, 3))


#: Default C grid for the L2 TF-IDF baseline: 2^-3..2^5.
DEFAULT_BASELINE_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-3, 6))


#: ``--solver`` values: scikit-learn's ``LogisticRegression`` solvers (``auto``: liblinear, the
#: reference's).
SOLVERS = ("auto", "liblinear", "saga")


#: Folds of the cross-validation that chooses C (``--cv-folds``).
DEFAULT_FOLDS = 5


#: Problems of at most this many values (N x D) are cross-validated in this process, one fit
#: after another: starting worker processes costs more than such fits.
IN_PROCESS_FIT = 1000 * 256


def _sk_penalty(penalty: str) -> dict:
    """``LogisticRegression`` keyword for the penalty: scikit-learn >= 1.8 deprecates
    ``penalty`` for ``l1_ratio`` (1 = l1, 0 = l2); older versions only know ``penalty``."""
    if inspect.signature(LogisticRegression).parameters["penalty"].default == "deprecated":
        return {"l1_ratio": 1.0 if penalty == "l1" else 0.0}
    return {"penalty": penalty}


def logistic_regression(penalty: str = "l1", solver: str = "auto", max_iter: int = 0,
                        tol: float = 0.0, seed: int = 42) -> LogisticRegression:
    """scikit-learn's ``LogisticRegression`` as transfer fits it (C set by the search).

    Args:
        penalty: ``l1`` or ``l2``.
        solver: one of :data:`SOLVERS` (``auto``: liblinear).
        max_iter / tol: scikit-learn's (0: its defaults, 1000 and 1e-4).
        seed: ``random_state``.

    Raises:
        ValueError: unknown penalty or solver.
    """
    if penalty not in ("l1", "l2"):
        raise ValueError(f"penalty must be 'l1' or 'l2', got {penalty!r}")
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    return LogisticRegression(solver="liblinear" if solver == "auto" else solver,
                              max_iter=max_iter or 1000, tol=tol or 1e-4, random_state=seed,
                              **_sk_penalty(penalty))


def cv_folds(y: np.ndarray, folds: int) -> int:
    """The folds a stratified k-fold split of labels ``y`` can have: ``folds``, or fewer when a
    class has fewer examples (at least 2).

    Raises:
        ValueError: a class with fewer than 2 examples (naming the count).
    """
    counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=2)
    if counts.min() < 2:
        raise ValueError(f"cross-validation needs at least 2 examples of each label in the "
                         f"training split, got {counts[0]} negative and {counts[1]} positive")
    return int(min(folds, counts.min()))


def cross_validate(estimator, X, y, grid: Sequence[float], folds: int = DEFAULT_FOLDS,
                   seed: int = 42, jobs: int = 0, param: str = "C") -> GridSearchCV:
    """C (``param``) chosen by stratified k-fold cross-validation accuracy on (X, y), refit on
    all of it: scikit-learn's ``GridSearchCV`` over ``grid`` in ascending order (ties: the
    smallest C, the sparsest model), ``StratifiedKFold(shuffle=True, random_state=seed)``.

    Args:
        estimator: the scikit-learn estimator (or pipeline) whose ``param`` is searched.
        X: [N, D] features (dense or sparse); y: int [N] labels 0/1.
        folds: k (fewer when a class has fewer examples: :func:`cv_folds`).
        jobs: fits at once, in worker processes (joblib's loky: liblinear draws from C's
            process-wide ``rand()``, so fits in threads of one process would interleave their
            draws); 0: one per usable core. Problems of at most :data:`IN_PROCESS_FIT` values
            (stored values when sparse) are fit one after another in this process whatever
            ``jobs`` says: starting workers costs more than such fits.

    Returns:
        the fitted ``GridSearchCV`` (``best_params_``, ``best_estimator_``, ``cv_results_``).
    Raises:
        ValueError: as :func:`cv_folds`.
    """
    k = cv_folds(y, folds)
    size = X.nnz if hasattr(X, "nnz") else X.shape[0] * X.shape[1]  # sparse: its values
    jobs = 1 if size <= IN_PROCESS_FIT else (jobs or usable_cores())
    search = GridSearchCV(estimator, {param: sorted(float(c) for c in grid)},
                          scoring="accuracy", n_jobs=jobs, refit=True, error_score="raise",
                          cv=StratifiedKFold(n_splits=k, shuffle=True, random_state=seed))
    with warnings.catch_warnings():  # the refit's convergence is reported from its n_iter_
        warnings.simplefilter("ignore", ConvergenceWarning)
        search.fit(X, y)
    return search


def _search_result(search: GridSearchCV, param: str, train: float, val: float | None,
                   test: float | None, coef: np.ndarray, n_iter: int, max_iter: int) -> dict:
    """What a fitted search reports: the chosen ``C``, ``cv`` (folds, per-C mean and standard
    deviation of fold accuracy), ``grid`` (the means), ``accuracy`` {train, cv, val, test},
    ``nonzero`` weights of ``coef`` and whether the refit ``converged`` (``n_iter`` below
    ``max_iter``)."""
    res = search.cv_results_
    Cs = [f"{float(c):g}" for c in res[f"param_{param}"]]
    cv = {"folds": search.n_splits_, "scoring": "accuracy",
          "mean": {c: float(m) for c, m in zip(Cs, res["mean_test_score"])},
          "std": {c: float(s) for c, s in zip(Cs, res["std_test_score"])}}
    return {"C": float(search.best_params_[param]), "cv": cv, "grid": cv["mean"],
            "accuracy": {"train": train, "cv": float(search.best_score_), "val": val,
                         "test": test},
            "nonzero": int(np.count_nonzero(coef)), "converged": n_iter < max_iter}


def fit_logreg(Xtr: np.ndarray, ytr: np.ndarray, Xva: np.ndarray | None = None,
               yva: np.ndarray | None = None, Xte: np.ndarray | None = None,
               yte: np.ndarray | None = None, penalty: str = "l1",
               grid: Sequence[float] = DEFAULT_C_GRID, seed: int = 42, max_iter: int = 0,
               standardize: bool = True, solver: str = "auto", tol: float = 0.0,
               folds: int = DEFAULT_FOLDS, jobs: int = 0) -> dict:
    """Logistic regression on LM features with C chosen by k-fold cross-validation on the
    training split (:func:`cross_validate`), refit on all of it; validation and test accuracy
    measured once (Radford et al. 2017; sentiment-discovery ``logreg_utils.train_logreg``
    chose C on validation instead).

    Args:
        X*: float [N, H] features; y*: int [N] labels 0/1 (val and test optional).
        penalty: ``l1`` (sparse, the reference) or ``l2``.
        standardize: z-score with train statistics, inside each fold (False: raw features, as
            the reference).
        solver / max_iter / tol / seed: :func:`logistic_regression`.
        folds / jobs: :func:`cross_validate`.
    Returns:
        dict: ``model`` (:class:`LinearClassifier` at the chosen C), ``coef`` float64 [H] (its
        weights, in standardised units when standardised), ``C``, ``cv`` (folds, per-C mean and
        std of fold accuracy), ``grid`` {C: mean fold accuracy}, ``accuracy`` {train, cv, val,
        test} (None where absent), ``nonzero`` (non-zero weights), ``converged`` (the refit),
        ``n_iter``, ``solver``, ``device`` ("cpu"), ``fit_seconds`` (the search) and
        ``seconds`` (with the scoring).
    Raises:
        ValueError: unknown penalty or solver; a label with fewer than 2 training examples.
    """
    t0 = time.perf_counter()
    lr = logistic_regression(penalty, solver, max_iter, tol, seed)
    pipe = Pipeline([("scale", StandardScaler() if standardize else "passthrough"), ("lr", lr)])
    X = np.asarray(Xtr, dtype=np.float64)
    search = cross_validate(pipe, X, ytr, grid, folds, seed, jobs, param="lr__C")
    fit_s = time.perf_counter() - t0
    fitted, scaler = (search.best_estimator_.named_steps[k] for k in ("lr", "scale"))
    d = X.shape[1]
    mean, scale = (scaler.mean_, scaler.scale_) if standardize else (np.zeros(d), np.ones(d))
    model = LinearClassifier(fitted.coef_.ravel().astype(np.float64), float(fitted.intercept_[0]),
                             np.asarray(mean, np.float64), np.asarray(scale, np.float64))
    n_iter = int(np.max(fitted.n_iter_))
    return {"model": model, "coef": model.coef,
            **_search_result(search, "lr__C", model.accuracy(Xtr, ytr), model.accuracy(Xva, yva),
                             model.accuracy(Xte, yte), model.coef, n_iter, lr.max_iter),
            "n_iter": n_iter, "solver": lr.solver, "device": "cpu", "fit_seconds": fit_s,
            "seconds": time.perf_counter() - t0}


def fit_threshold(x: np.ndarray, y: np.ndarray) -> tuple[float, int, float]:
    """Best single split of a 1-D feature for binary labels: the threshold and sign that maximise
    accuracy of ``predict = 1 if sign * (x - threshold) > 0 else 0`` on (x, y).

    Exhaustive over the midpoints between consecutive distinct values (and beyond both ends), for
    both signs, in O(N log N). (A decision stump from scikit-learn would split by Gini impurity,
    not accuracy.)

    Returns:
        (threshold, sign in {+1, -1}, accuracy on (x, y)).
    Raises:
        ValueError: empty input or length mismatch.
    """
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y).ravel().astype(np.int64)
    if len(x) == 0 or len(x) != len(y):
        raise ValueError(f"fit_threshold needs equal, non-empty x and y ({len(x)}, {len(y)})")
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    n = len(xs)
    cum = np.concatenate([[0], np.cumsum(ys)])  # positives among the k smallest, k = 0..n
    correct_plus = np.arange(n + 1) - 2 * cum + cum[-1]  # the k smallest -> 0, the rest -> 1
    valid = np.concatenate([[True], xs[1:] > xs[:-1], [True]])  # cuts between distinct values
    cand = np.where(valid, np.maximum(correct_plus, n - correct_plus), -1)
    kb = int(np.argmax(cand))
    sign = 1 if correct_plus[kb] >= n - correct_plus[kb] else -1
    cuts = np.concatenate([[xs[0] - 1.0], (xs[:-1] + xs[1:]) / 2, [xs[-1] + 1.0]])
    return float(cuts[kb]), sign, float(cand[kb] / n)


def threshold_accuracy(x: np.ndarray, y: np.ndarray, threshold: float, sign: int) -> float:
    """Accuracy of ``1 if sign * (x - threshold) > 0`` against y."""
    return float(((sign * (np.asarray(x, np.float64) - threshold) > 0) == np.asarray(y)).mean())


def sentiment_neuron(coef: np.ndarray, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
    """The "sentiment neuron" (Radford et al. 2017): the unit with the largest |weight| of the
    L1 model, and its accuracy alone with a threshold fit on train (:func:`fit_threshold`).

    Args:
        coef: float [H] logistic-regression weights.
        splits: name -> (features [N, H], labels [N]); must contain ``train``.
    Returns:
        dict: ``index``, ``weight``, ``threshold``, ``sign``, ``accuracy`` {split: acc}; when every
        weight is 0 (a too-small C won) there is no such unit and ``index`` etc. are None.
    """
    if not np.any(coef):
        return {"index": None, "weight": None, "threshold": None, "sign": None, "accuracy": {}}
    i = int(np.argmax(np.abs(coef)))
    xtr, ytr = splits["train"]
    thr, sign, _ = fit_threshold(xtr[:, i], ytr)
    acc = {name: threshold_accuracy(X[:, i], y, thr, sign) for name, (X, y) in splits.items()}
    return {"index": i, "weight": float(coef[i]), "threshold": thr, "sign": sign, "accuracy": acc}


def plot_neuron_histogram(values: np.ndarray, labels: np.ndarray, index: int, threshold: float,
                          path: str | Path, title: str = "") -> Path:
    """PNG histogram of one unit's value per class (matplotlib, Agg backend), with the threshold
    as a vertical line; written atomically. Returns ``path``."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.histogram_bin_edges(values, bins=50)
    for cls, name, color in ((0, "negative", "tab:red"), (1, "positive", "tab:blue")):
        ax.hist(values[labels == cls], bins=bins, alpha=0.55, color=color,
                label=f"{name} (n={int((labels == cls).sum())})")
    ax.axvline(threshold, color="k", ls="--", lw=1, label=f"threshold {threshold:.3g}")
    ax.set(xlabel=f"unit {index} value", ylabel="texts",
           title=title or f"Sentiment unit {index} by class")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path


def tfidf_baseline(train, val=None, test=None, grid: Sequence[float] = DEFAULT_BASELINE_C_GRID,
                   seed: int = 42, folds: int = DEFAULT_FOLDS, jobs: int = 0) -> dict:
    """TF-IDF n-gram baseline: word 1-2-grams + char_wb 2-5-grams (sublinear tf, each capped at
    300,000 features, min_df 2 when train has >= 100 texts) in a ``FeatureUnion`` fit on the
    training texts (no labels), then an L2 ``LogisticRegression`` (liblinear) with C chosen by
    the same k-fold cross-validation on train as :func:`fit_logreg` (:func:`cross_validate`),
    validation and test accuracy measured once.

    Args:
        train/val/test: :class:`hvd_lm.transfer.datasets.LabelledSplit` (val, test optional).
    Returns:
        dict like :func:`fit_logreg` (without ``model``/``coef``) plus ``features`` (count).
    Raises:
        ValueError: as :func:`cross_validate`.
    """
    t0 = time.perf_counter()
    min_df = 2 if len(train) >= 100 else 1
    union = FeatureUnion([
        (name, TfidfVectorizer(analyzer=analyzer, ngram_range=ngrams, sublinear_tf=True,
                               min_df=min_df, max_features=300_000, dtype=np.float32))
        for name, analyzer, ngrams in (("word", "word", (1, 2)), ("char", "char_wb", (2, 5)))])
    Xtr = union.fit_transform(train.texts)
    search = cross_validate(logistic_regression("l2", "liblinear", seed=seed), Xtr, train.labels,
                            grid, folds, seed, jobs)
    model = search.best_estimator_

    def accuracy(split, X=None):
        if split is None:
            return None
        X = union.transform(split.texts) if X is None else X
        return float((model.predict(X) == split.labels).mean())

    return {"method": "TF-IDF word 1-2 + char_wb 2-5, L2 logistic regression",
            "features": int(Xtr.shape[1]),
            **_search_result(search, "C", accuracy(train, Xtr), accuracy(val), accuracy(test),
                             model.coef_, int(np.max(model.n_iter_)), model.max_iter),
            "seconds": time.perf_counter() - t0}
