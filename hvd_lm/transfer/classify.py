"""The classifier on LM features, the sentiment neuron, and the TF-IDF baseline.

From Radford et al. 2017 as rebuilt by NVIDIA/sentiment-discovery (``logreg_utils.py``), made to
keep up with 4096-d features:

* :func:`fit_logreg`: L1 (or L2) logistic regression with C chosen by validation accuracy on a
  log2 grid (the reference's grid is 2^-8..2^0; ours 2^-8..2^2). Features are standardised with
  the training split's mean and standard deviation by default (:class:`LinearClassifier` keeps
  them, so a saved classifier applies them itself); the grid is walked as a regularisation path
  (:func:`fit_path`) by one of three solvers:

  - ``liblinear`` (scikit-learn; the reference's): one fit per C, intercept penalised as
    liblinear does; no warm start (liblinear has none), so the C values run in parallel, in
    worker processes (joblib's loky; one per core): liblinear draws from C's process-wide
    ``rand()``, and fits in threads of one process gave other weights run to run;
  - ``saga`` (scikit-learn): C ascending, each fit warm-started from the previous solution
    (``warm_start=True``);
  - ``torch`` (:mod:`hvd_lm.transfer.fista`): every C at once with batched GEMMs, on the GPU
    when the features were computed there;

  and ``auto`` picks ``torch`` on a CUDA device and :data:`CPU_AUTO_SOLVER` on the CPU (the
  fastest in ``hvd-lm bench transfer`` on the 2-core CI machine), except for problems of at most
  :data:`CPU_SMALL_FIT` values, where it picks ``liblinear`` in this process, one C after
  another (faster there than starting workers). For l1, every C at or below the all-zero
  threshold (:func:`sklearn.svm.l1_min_c`) gets the zero model without a fit.
* :func:`sentiment_neuron`: the unit with the largest |weight|, its accuracy alone with a threshold
  fit on train (:func:`fit_threshold`), and a histogram of the unit's value by class
  (:func:`plot_neuron_histogram`).
* :func:`tfidf_baseline`: TF-IDF word 1-2-grams + char_wb 2-5-grams and an L2
  ``LogisticRegression``, C chosen on validation, on the same splits.
"""

from __future__ import annotations

import inspect
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import joblib
import matplotlib
import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import FeatureUnion
from sklearn.svm import l1_min_c

from hvd_lm.transfer import fista
from hvd_lm.transfer.linear import LinearClassifier, standardizer
from hvd_lm.util.atomic import atomic_path

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

#: Default C grid for the L1 logistic regression on LM features: 2^-8..2^2 (reference: 2^-8..2^0).
DEFAULT_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-8, 3))


#: Default C grid for the L2 TF-IDF baseline: 2^-3..2^5.
DEFAULT_BASELINE_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-3, 6))


#: ``--solver`` values; ``auto`` resolves with :func:`resolve_solver`.
SOLVERS = ("auto", "liblinear", "saga", "torch")


#: What ``auto`` picks when the fit runs on the CPU (measured by ``hvd-lm bench transfer``).
CPU_AUTO_SOLVER = "torch"


#: Training sets of at most this many values (N x D) are fit by ``liblinear``, one C after
#: another in this process (worker processes cost more than such fits), when ``auto`` runs on
#: the CPU. Measured with ``hvd-lm bench transfer`` on the 2-core machine, 11 C values: on a
#: 4-step checkpoint's SST-2 cell features (badly conditioned) liblinear took 0.4 s at 200 x 256
#: and 6.2 s at 1,000 x 256 against torch's 3.3 s and 18.3 s (not converged), and 30.4 s at
#: 3,000 x 256 against torch's 25.2 s; on synthetic features both took 0.1-0.4 s up to 1,000 x 256.
CPU_SMALL_FIT = 1000 * 256


#: Iteration limits per C when ``max_iter`` is 0: scikit-learn's (liblinear outer iterations,
#: saga epochs) and FISTA iterations for the batched torch solver.
DEFAULT_MAX_ITER = {"liblinear": 1000, "saga": 1000, "torch": 20000}


#: Tolerances when ``tol`` is 0: scikit-learn's default ``tol`` for liblinear/saga, the relative
#: duality gap for torch (a certified bound: see :mod:`hvd_lm.transfer.fista`).
DEFAULT_TOL = {"liblinear": 1e-4, "saga": 1e-4, "torch": 1e-3}


def _sk_penalty(penalty: str) -> dict:
    """``LogisticRegression`` keyword for the penalty: scikit-learn >= 1.8 deprecates
    ``penalty`` for ``l1_ratio`` (1 = l1, 0 = l2); older versions only know ``penalty``."""
    if inspect.signature(LogisticRegression).parameters["penalty"].default == "deprecated":
        return {"l1_ratio": 1.0 if penalty == "l1" else 0.0}
    return {"penalty": penalty}


def resolve_solver(solver: str, device: str | torch.device = "cpu",
                   size: int | None = None) -> tuple[str, str]:
    """(solver, device) for a fit: ``auto`` is ``torch`` on a CUDA ``device``, ``liblinear`` on
    the CPU for a training set of ``size`` <= :data:`CPU_SMALL_FIT` values (N x D; None: not
    known) and :data:`CPU_AUTO_SOLVER` otherwise; scikit-learn solvers always run on ``cpu``;
    ``torch`` on ``device``.

    Raises:
        ValueError: unknown solver, or torch on CUDA without CUDA.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    dev = fista.resolve_device(device)
    if solver == "auto":
        small = size is not None and size <= CPU_SMALL_FIT
        solver = "torch" if dev.type == "cuda" else "liblinear" if small else CPU_AUTO_SOLVER
    return solver, (str(dev) if solver == "torch" else "cpu")


@dataclass
class LogRegPath:
    """A regularisation path: one fitted model per C.

    Attributes:
        Cs: float64 [K] (as given); coef: float64 [K, D]; intercept: float64 [K];
        n_iter: int64 [K] iterations per C (0: closed-form zero model); converged: bool [K];
        objective: float64 [K] scikit-learn's objective ``C sum_i loss_i + R(w)`` (the
            intercept unpenalised, whatever the solver optimised);
        solver, device: what ran; seconds: wall time of the path.
    """

    Cs: np.ndarray
    coef: np.ndarray
    intercept: np.ndarray
    n_iter: np.ndarray
    converged: np.ndarray
    objective: np.ndarray
    solver: str
    device: str
    seconds: float


def fit_path(X: np.ndarray, y: np.ndarray, grid: Sequence[float], penalty: str = "l1",
             solver: str = "auto", device: str = "cpu", max_iter: int = 0, tol: float = 0.0,
             seed: int = 42, jobs: int = 0) -> LogRegPath:
    """Logistic regressions for every C of ``grid`` on (already standardised) features.

    Args:
        X: float [N, D]; y: int [N] labels 0/1 (both present).
        grid: K values of C > 0.
        penalty: ``l1`` or ``l2``.
        solver / device: see :func:`resolve_solver`.
        max_iter: per-C iteration limit (0: :data:`DEFAULT_MAX_ITER` of the solver).
        tol: scikit-learn's ``tol`` (liblinear, saga) or the relative duality gap (torch); 0:
            :data:`DEFAULT_TOL` of the solver.
        seed: ``random_state`` of liblinear/saga.
        jobs: liblinear fits run at once, in processes (0: ``torch.get_num_threads()``, i.e. one
            per core unless ``--threads`` says otherwise; 1 when ``auto`` chose liblinear for a
            small problem).
    Returns:
        :class:`LogRegPath` in the order of ``grid``.
    Raises:
        ValueError: bad penalty/solver/grid, labels not 0/1 with both classes.
    """
    if penalty not in fista.PENALTIES:
        raise ValueError(f"penalty must be 'l1' or 'l2', got {penalty!r}")
    auto = solver == "auto"
    solver, device = resolve_solver(solver, device, int(np.prod(np.shape(X))))
    if auto and solver == "liblinear":  # a small problem: workers would cost more than its fits
        jobs = 1
    max_iter = max_iter or DEFAULT_MAX_ITER[solver]
    tol = tol or DEFAULT_TOL[solver]
    Cs = np.asarray(list(grid), dtype=np.float64)
    t0 = time.perf_counter()
    if solver == "torch":
        p = fista.fit_path(X, y, Cs, penalty, tol=tol, max_iter=max_iter, device=device)
        return LogRegPath(Cs, p.coef, p.intercept, p.n_iter, p.converged, p.objective * Cs, solver,
                    p.device, time.perf_counter() - t0)
    X64 = np.asarray(X, dtype=np.float64)
    y = np.asarray(y)
    K, D = len(Cs), X64.shape[1]
    coef, intercept = np.zeros((K, D)), np.zeros(K)
    n_iter, converged = np.zeros(K, dtype=np.int64), np.ones(K, dtype=bool)
    if solver == "liblinear":
        # At C <= l1_min_c liblinear's solution (intercept penalised too) is all zeros.
        c_zero = l1_min_c(X64, y, loss="log") if penalty == "l1" else 0.0
    else:
        # Unpenalised intercept: w = 0, b = logit(mean y) below 1 / max|X^T (y - mean y)|.
        gmax = np.abs((y - y.mean()) @ X64).max()
        c_zero = 1.0 / gmax if (penalty == "l1" and gmax > 0) else 0.0
        intercept[:] = np.log(y.mean() / (1 - y.mean()))
    todo = [int(k) for k in np.argsort(Cs, kind="stable") if Cs[k] > c_zero]

    params = dict(solver=solver, max_iter=max_iter, tol=tol, random_state=seed,
                  warm_start=solver == "saga", **_sk_penalty(penalty))
    if solver == "saga":  # C ascending: each fit starts from the previous solution
        model = LogisticRegression(C=1.0, **params)
        fits = [_sk_fit(X64, y, float(Cs[k]), params, model) for k in todo]
    else:  # liblinear has no warm start: the largest C (the longest fits) first, in worker
        # processes (joblib's loky) when more than one runs at once: liblinear draws from C's
        # process-wide rand(), so fits in threads of one process interleave their draws and
        # give other weights run to run; a process per fit keeps each fit's draws its own
        n = max(1, min(jobs or torch.get_num_threads(), len(todo)))
        todo = todo[::-1]
        fits = joblib.Parallel(n_jobs=n, backend="loky" if n > 1 else "sequential")(
            joblib.delayed(_sk_fit)(X64, y, float(Cs[k]), params) for k in todo)
    for k, (w, b, it) in zip(todo, fits):
        coef[k], intercept[k], n_iter[k] = w, b, it
        converged[k] = it < max_iter  # scikit-learn warns exactly then
    objective = fista.objective_values(X64, y, coef, intercept, Cs, penalty)
    return LogRegPath(Cs, coef, intercept, n_iter, converged, objective, solver, "cpu",
                time.perf_counter() - t0)


def _sk_fit(X: np.ndarray, y: np.ndarray, C: float, params: dict,
            model: LogisticRegression | None = None) -> tuple[np.ndarray, float, int]:
    """One scikit-learn fit at ``C`` (``model`` reused for saga's warm start, else a new one
    from ``params``): (coef float64 [D], intercept, iterations), convergence warnings silenced
    (:func:`fit_path` records them from the iterations)."""
    model = model or LogisticRegression(C=C, **params)
    model.set_params(C=C)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(X, y)
    return model.coef_.ravel().copy(), float(model.intercept_[0]), int(np.max(model.n_iter_))


def _accuracy(model, X, y) -> float | None:
    return None if X is None or y is None else float((model.predict(X) == y).mean())


def _grid_search(make, Xtr, ytr, Xva, yva, grid: Sequence[float]) -> tuple[int, list, list, bool]:
    models, scores, converged = [], [], True
    for C in grid:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            m = make(C).fit(Xtr, ytr)
        converged &= not any(issubclass(w.category, ConvergenceWarning) for w in caught)
        models.append(m)
        scores.append(float((m.predict(Xva) == yva).mean()))
    return int(np.argmax(scores)), models, scores, converged  # ties: the smallest C


def fit_logreg(Xtr: np.ndarray, ytr: np.ndarray, Xva: np.ndarray, yva: np.ndarray,
               Xte: np.ndarray | None = None, yte: np.ndarray | None = None,
               penalty: str = "l1", grid: Sequence[float] = DEFAULT_C_GRID, seed: int = 42,
               max_iter: int = 0, standardize: bool = True, solver: str = "auto",
               device: str = "cpu", tol: float = 0.0) -> dict:
    """Logistic regression on features with C chosen on validation (Radford et al. 2017;
    sentiment-discovery ``logreg_utils.train_logreg``).

    Features are standardised with train statistics (:func:`standardizer`), the path over
    ``grid`` is fit on train (:func:`fit_path`), every model is scored by validation accuracy,
    and the best C (ties: the smallest, i.e. the sparsest model) is kept: the model fit on train
    at that C (no refit on train+val, as the reference). Validation accuracy is therefore the
    selection score; test accuracy is the unbiased one.

    Args:
        X*: float [N, H] features; y*: int [N] labels 0/1.
        penalty: ``l1`` (sparse, the reference) or ``l2``.
        standardize: z-score with train statistics (False: raw features, as the reference;
            ``auto`` then means liblinear).
        solver / device / max_iter / tol / seed: see :func:`fit_path`.
    Returns:
        dict: ``model`` (:class:`LinearClassifier` at the chosen C), ``coef`` float64 [H] (its
        weights, in standardised units when standardised), ``C``, ``grid`` {C: val acc},
        ``accuracy`` {train, val, test|None}, ``nonzero`` (non-zero weights), ``converged``
        (every C), ``solver``, ``device``, ``path`` (per C: val accuracy, non-zero weights,
        iterations, converged, objective), ``path_seconds`` (the fit alone) and ``seconds``
        (standardisation, fit and scoring).
    Raises:
        ValueError: unknown penalty or solver.
    """
    t0 = time.perf_counter()
    mean, scale = standardizer(Xtr, standardize)
    Xs = ((np.asarray(Xtr, dtype=np.float64) - mean) / scale).astype(np.float32)
    if solver == "auto" and not standardize:
        # Raw LM states are badly scaled: liblinear (the reference's solver for the reference's
        # raw features) took 9.9 s on the demo's, the torch solver 124 s without converging.
        solver = "liblinear"
    path = fit_path(Xs, ytr, grid, penalty, solver, device, max_iter, tol, seed)
    models = [LinearClassifier(path.coef[k], float(path.intercept[k]), mean, scale)
              for k in range(len(path.Cs))]
    scores = [m.accuracy(Xva, yva) for m in models]
    top = [k for k in range(len(scores)) if scores[k] == max(scores)]
    best = min(top, key=lambda k: path.Cs[k])  # ties: the smallest C (the sparsest model)
    model = models[best]
    nonzero = [int(np.count_nonzero(c)) for c in path.coef]
    return {"model": model, "coef": model.coef, "C": float(path.Cs[best]),
            "grid": {f"{c:g}": s for c, s in zip(path.Cs, scores)},
            "accuracy": {"train": model.accuracy(Xtr, ytr), "val": scores[best],
                         "test": model.accuracy(Xte, yte)},
            "nonzero": nonzero[best], "converged": bool(path.converged.all()),
            "solver": path.solver, "device": path.device,
            "path": [{"C": float(c), "val": s, "nonzero": nz, "n_iter": int(it),
                      "converged": bool(cv), "objective": float(obj)}
                     for c, s, nz, it, cv, obj in zip(path.Cs, scores, nonzero, path.n_iter,
                                                      path.converged, path.objective)],
            "path_seconds": path.seconds, "seconds": time.perf_counter() - t0}


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
    n, pos = len(xs), int(ys.sum())
    cum = np.concatenate([[0], np.cumsum(ys)])
    k = np.arange(n + 1)
    correct_plus = (k - cum[k]) + (pos - cum[k])  # left k -> 0, right -> 1
    valid = np.ones(n + 1, bool)
    valid[1:n] = xs[1:] > xs[:-1]
    cand = np.where(valid, np.maximum(correct_plus, n - correct_plus), -1)
    kb = int(np.argmax(cand))
    sign = 1 if correct_plus[kb] >= n - correct_plus[kb] else -1
    if kb == 0:
        thr = xs[0] - 1.0
    elif kb == n:
        thr = xs[-1] + 1.0
    else:
        thr = (xs[kb - 1] + xs[kb]) / 2
    return float(thr), sign, float(cand[kb] / n)


def threshold_accuracy(x: np.ndarray, y: np.ndarray, threshold: float, sign: int) -> float:
    """Accuracy of ``1 if sign * (x - threshold) > 0`` against y."""
    pred = (sign * (np.asarray(x, np.float64) - threshold) > 0).astype(np.int64)
    return float((pred == np.asarray(y)).mean())


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
    ax.set_xlabel(f"unit {index} value")
    ax.set_ylabel("texts")
    ax.set_title(title or f"Sentiment unit {index} by class")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path


def tfidf_baseline(train, val, test=None, grid: Sequence[float] = DEFAULT_BASELINE_C_GRID,
                   seed: int = 42, max_features: int = 300_000) -> dict:
    """TF-IDF n-gram baseline: word 1-2-grams + char_wb 2-5-grams (sublinear tf, each capped at
    ``max_features``, min_df 2 when train has >= 100 texts) in a ``FeatureUnion``, then an L2
    ``LogisticRegression`` (liblinear) with C chosen on validation accuracy.

    Args:
        train/val/test: :class:`hvd_lm.transfer.datasets.LabelledSplit` (test optional).
    Returns:
        dict like :func:`fit_logreg` (without ``model``/``coef``) plus ``features`` (count).
    """
    t0 = time.perf_counter()
    min_df = 2 if len(train) >= 100 else 1
    union = FeatureUnion([
        ("word", TfidfVectorizer(analyzer="word", ngram_range=(1, 2), sublinear_tf=True,
                                 min_df=min_df, max_features=max_features, dtype=np.float32)),
        ("char", TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True,
                                 min_df=min_df, max_features=max_features, dtype=np.float32)),
    ])
    Xtr = union.fit_transform(train.texts)
    Xva = union.transform(val.texts)
    Xte = union.transform(test.texts) if test is not None else None

    def make(C):
        return LogisticRegression(C=C, solver="liblinear", max_iter=1000, random_state=seed,
                                  **_sk_penalty("l2"))

    best, models, scores, converged = _grid_search(make, Xtr, train.labels, Xva, val.labels, grid)
    model = models[best]
    return {"method": "TF-IDF word 1-2 + char_wb 2-5, L2 logistic regression",
            "features": int(Xtr.shape[1]), "C": float(grid[best]),
            "grid": {f"{c:g}": s for c, s in zip(grid, scores)},
            "accuracy": {"train": _accuracy(model, Xtr, train.labels), "val": scores[best],
                         "test": _accuracy(model, Xte, test.labels if test is not None else None)},
            "nonzero": int(np.count_nonzero(model.coef_)), "converged": converged,
            "seconds": time.perf_counter() - t0}
