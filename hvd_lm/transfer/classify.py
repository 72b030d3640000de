"""The classifier on LM features, the sentiment neuron, and the TF-IDF baseline.

From Radford et al. 2017 as rebuilt by NVIDIA/sentiment-discovery (``logreg_utils.py``):

* :func:`fit_logreg`: scikit-learn ``LogisticRegression`` with an L1 penalty (``liblinear``), C
  chosen by validation accuracy on a log2 grid (the reference's grid is 2^-8..2^0), on the raw,
  unstandardised features as in the reference.
* :func:`sentiment_neuron`: the unit with the largest |weight|, its accuracy alone with a threshold
  fit on train (:func:`fit_threshold`), and a histogram of the unit's value by class
  (:func:`plot_neuron_histogram`).
* :func:`tfidf_baseline`: TF-IDF word 1-2-grams + char_wb 2-5-grams and an L2
  ``LogisticRegression``, C chosen on validation, on the same splits.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Sequence

import matplotlib
import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import FeatureUnion, make_pipeline
from sklearn.preprocessing import StandardScaler

from hvd_lm.core.atomic import atomic_path

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


#: Default C grid for the L1 logistic regression on LM features: 2^-8..2^2 (reference: 2^-8..2^0).
DEFAULT_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-8, 3))


#: Default C grid for the L2 TF-IDF baseline: 2^-3..2^5.
DEFAULT_BASELINE_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-3, 6))


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
               max_iter: int = 1000, standardize: bool = False) -> dict:
    """Logistic regression on features with C chosen on validation (Radford et al. 2017;
    sentiment-discovery ``logreg_utils.train_logreg``).

    For each C in ``grid`` a ``LogisticRegression(penalty, C, solver="liblinear")`` is fit on
    train and scored by validation accuracy; the best C (ties: the smallest) is kept, i.e. the
    model fit on train at that C (no refit on train+val, as the reference). Validation accuracy is
    therefore the selection score; test accuracy is the unbiased one.

    Args:
        X*: float [N, H] features; y*: int [N] labels 0/1.
        penalty: ``l1`` (sparse, the reference) or ``l2``.
        standardize: z-score features with train statistics first (off: as the reference, so C
            and the weights keep their meaning in raw feature units).
    Returns:
        dict: ``model`` (the fitted estimator or pipeline), ``coef`` float [H] (in the units the
        model saw), ``C``, ``grid`` {C: val acc}, ``accuracy`` {train, val, test|None},
        ``nonzero`` (non-zero weights), ``converged``, ``seconds``.
    Raises:
        ValueError: unknown penalty.
    """
    if penalty not in ("l1", "l2"):
        raise ValueError(f"penalty must be 'l1' or 'l2', got {penalty!r}")
    t0 = time.perf_counter()

    def make(C):
        lr = LogisticRegression(penalty=penalty, C=C, solver="liblinear", max_iter=max_iter,
                                random_state=seed)
        return make_pipeline(StandardScaler(), lr) if standardize else lr

    best, models, scores, converged = _grid_search(make, Xtr, ytr, Xva, yva, grid)
    model = models[best]
    coef = (model[-1] if standardize else model).coef_.ravel()
    return {"model": model, "coef": coef, "C": float(grid[best]),
            "grid": {f"{c:g}": s for c, s in zip(grid, scores)},
            "accuracy": {"train": _accuracy(model, Xtr, ytr), "val": scores[best],
                         "test": _accuracy(model, Xte, yte)},
            "nonzero": int(np.count_nonzero(coef)), "converged": converged,
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
        return LogisticRegression(penalty="l2", C=C, solver="liblinear", max_iter=1000,
                                  random_state=seed)

    best, models, scores, converged = _grid_search(make, Xtr, train.labels, Xva, val.labels, grid)
    model = models[best]
    return {"method": "TF-IDF word 1-2 + char_wb 2-5, L2 logistic regression",
            "features": int(Xtr.shape[1]), "C": float(grid[best]),
            "grid": {f"{c:g}": s for c, s in zip(grid, scores)},
            "accuracy": {"train": _accuracy(model, Xtr, train.labels), "val": scores[best],
                         "test": _accuracy(model, Xte, test.labels if test is not None else None)},
            "nonzero": int(np.count_nonzero(model.coef_)), "converged": converged,
            "seconds": time.perf_counter() - t0}
