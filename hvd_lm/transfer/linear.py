"""The linear classifier a transfer fit yields, on standardised features: what
:func:`hvd_lm.transfer.fit.fit_logreg` returns and :mod:`hvd_lm.transfer.saved` writes and
reads back. numpy only, so the commands that apply a saved classifier (``classify``, ``generate``,
``visualize``) start without scikit-learn."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LinearClassifier:
    """A binary linear classifier on (optionally standardised) features:
    ``P(y=1 | x) = sigmoid(((x - mean) / scale) . coef + intercept)``.

    Attributes:
        coef: float64 [D] weights, in standardised units (raw units when ``mean`` is 0 and
            ``scale`` 1, i.e. not standardised).
        intercept: bias.
        mean / scale: float64 [D] training statistics (zeros / ones when not standardised).
    """

    coef: np.ndarray
    intercept: float
    mean: np.ndarray
    scale: np.ndarray

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        """Margins float64 [N] of features X [N, D] (float64 arithmetic, so the same features
        give bit-identical margins wherever the classifier is applied).

        Raises:
            ValueError: X is not [N, D] with D = ``len(coef)``.
        """
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[1] != self.coef.shape[0]:
            raise ValueError(f"features of shape {X.shape} for a classifier of "
                             f"{self.coef.shape[0]} inputs")
        return ((X.astype(np.float64) - self.mean) / self.scale) @ self.coef + self.intercept

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """P(y=1) float64 [N]."""
        return 1.0 / (1.0 + np.exp(-self.decision_function(X)))

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Labels int64 [N]: 1 where the margin is > 0 (scikit-learn's rule)."""
        return (self.decision_function(X) > 0).astype(np.int64)

    def accuracy(self, X: np.ndarray | None, y: np.ndarray | None) -> float | None:
        """Fraction of ``predict(X) == y``; None without data."""
        if X is None or y is None:
            return None
        return float((self.predict(X) == np.asarray(y)).mean())
