"""A trained sentiment classifier on disk, tied to the LM checkpoint whose features it reads.

``hvd-lm transfer`` writes two files to its output folder (:func:`save_classifier`):

* ``classifier.npz``: float64 arrays ``coef`` [H] (standardised units), ``intercept`` [1],
  ``mean`` [H] and ``scale`` [H] (the training split's statistics; zeros and ones when the fit
  was on raw features): :class:`LinearClassifier` (numpy only, so the
  commands that apply a saved classifier start without scikit-learn);
* ``classifier.json``: everything needed to apply it again and to say what it is: the format
  version, the npz file's sha256, the features (kind, max chars, whitespace normalisation,
  precision), the fit (penalty, solver, C, standardised or not, accuracies), the sentiment unit,
  and the LM checkpoint's path, step, **sha256**, its weights' sha256 and config.

:func:`load_classifier` reads the pair back (either file or their folder) and checks it is whole
(the npz's sha256 is the one recorded, the arrays have the recorded width);
:func:`check_checkpoint` refuses a model whose weights are not the recorded ones (a checkpoint
and its export are the same weights; a classifier of an older version is checked by the
checkpoint file's sha256): features of another LM (even another step of the same run) mean
nothing to these weights. Both files are
written atomically, the npz first, so the JSON never points at a missing or older npz.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hvd_lm.transfer.texts import DatasetError
from hvd_lm.util.atomic import atomic_path, write_text
from hvd_lm.util.digest import file_sha256
from hvd_lm.util.files import FileRefused, check_npz, check_regular, read_json, shown

CLASSIFIER_FORMAT = 1
NPZ_NAME = "classifier.npz"
JSON_NAME = "classifier.json"
#: The largest classifier.json read (one is about 2 kB: settings, accuracies, the unit).
MAX_JSON_BYTES = 1 << 20
#: The largest array of a classifier.npz (each is [H] float64: 128 kB at H=16384, hvd_lm's
#: widest; 16 MiB leaves room for features wider than H).
MAX_ARRAY_BYTES = 16 << 20


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


class ClassifierError(ValueError):
    """A classifier file is missing, incomplete or inconsistent, or belongs to another
    checkpoint; the message names the file."""


#: Errors that mean bad input to the commands reading a saved classifier (classify, generate,
#: visualize): exit status 2 with one ``ERROR:`` line.
USAGE_ERRORS = (ClassifierError, DatasetError, FileNotFoundError, ValueError)


@dataclass
class SavedClassifier:
    """A classifier read back from disk.

    Attributes:
        model: the :class:`LinearClassifier`.
        meta: the JSON description (see the module docstring).
        path: the JSON file it was read from.
    """

    model: LinearClassifier
    meta: dict
    path: Path

    @property
    def features(self) -> dict:
        """Feature options the classifier was fit on: ``kind``, ``max_chars``, ``normalize``,
        ``precision``."""
        return self.meta["features"]

    @property
    def files(self) -> list[Path]:
        """The JSON file and its npz."""
        return [self.path, self.path.with_name(NPZ_NAME)]

    @property
    def neuron(self) -> dict:
        """The sentiment unit: ``index`` (None when every weight is 0), ``weight``, ``sign``,
        ``threshold``, and (classifiers written since 2026-11-27) ``accuracy``: the unit alone
        thresholded, as a fraction per split (``train``, ``val``, ``test``)."""
        return self.meta.get("neuron") or {"index": None}


def _paths(path: str | Path) -> tuple[Path, Path]:
    """(npz, json) for a folder or either file of the pair."""
    p = Path(path) / JSON_NAME if Path(path).is_dir() else Path(path)
    if p.suffix in (".npz", ".json"):
        return p.with_suffix(".npz"), p.with_suffix(".json")
    raise ClassifierError(f"{p}: not a classifier (give its folder, {NPZ_NAME} or {JSON_NAME})")


def save_classifier(out_dir: str | Path, model: LinearClassifier, meta: dict) -> Path:
    """Write ``OUT/classifier.npz`` then ``OUT/classifier.json`` (``meta`` plus the format
    version, the npz's sha256, the width and the time), both atomically.

    Args:
        model: the classifier to store.
        meta: JSON-able description, holding ``checkpoint_sha256`` and ``features`` (what
            :func:`load_classifier` requires; transfer's one call gives them).
    Returns:
        The JSON file's path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    npz, js = out / NPZ_NAME, out / JSON_NAME
    with atomic_path(npz, suffix=".npz") as tmp:
        np.savez(tmp, coef=np.asarray(model.coef, np.float64),
                 intercept=np.array([model.intercept], np.float64),
                 mean=np.asarray(model.mean, np.float64), scale=np.asarray(model.scale, np.float64))
    full = {"format": CLASSIFIER_FORMAT, "npz": NPZ_NAME, "npz_sha256": file_sha256(npz),
            "inputs": int(len(model.coef)), "created": time.time(), **meta}
    write_text(js, json.dumps(full, indent=2, default=str) + "\n")
    return js


def load_classifier(path: str | Path) -> SavedClassifier:
    """Read a classifier written by :func:`save_classifier`.

    Args:
        path: its folder, ``classifier.json`` or ``classifier.npz``.
    Raises:
        ClassifierError: a file is missing or unreadable (a FIFO or device, a JSON over
            :data:`MAX_JSON_BYTES`, an npz member whose header declares more than
            :data:`MAX_ARRAY_BYTES`: refused before it is read or inflated), the JSON is not a
            classifier of this format, the npz is not the one the JSON describes (sha256) or
            its arrays disagree in shape; the message names the file.
    """
    npz, js = _paths(path)
    for p in (js, npz):
        if not p.exists():
            raise ClassifierError(f"{shown(p)}: no such file (a classifier is {JSON_NAME} + "
                                  f"{NPZ_NAME}, written by hvd-lm transfer)")
    try:  # within its budget: a 3 GB classifier.json is refused, not read whole
        meta = read_json(js, MAX_JSON_BYTES, f"a {JSON_NAME} is a few kB")
        check_regular(npz, f"a {NPZ_NAME} is a file")
    except (OSError, FileRefused) as e:
        raise ClassifierError(f"unreadable classifier description: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CLASSIFIER_FORMAT:
        raise ClassifierError(f"{js}: not a classifier description of format "
                              f"{CLASSIFIER_FORMAT}")
    for key in ("npz_sha256", "checkpoint_sha256", "features", "inputs"):
        if key not in meta:
            raise ClassifierError(f"{js}: field '{key}' missing")
    digest = file_sha256(npz)
    if digest != meta["npz_sha256"]:
        raise ClassifierError(f"{npz}: sha256 {digest[:12]}... is not the {meta['npz_sha256'][:12]}"
                              f"... recorded in {js} (the pair was mixed or the npz changed)")
    try:  # every member's header first: an array inflating 8 MB to 7 GiB is never inflated
        check_npz(npz, MAX_ARRAY_BYTES, f"a {NPZ_NAME} holds four arrays of the LM's width")
        with np.load(npz, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k], np.float64) for k in ("coef", "intercept", "mean",
                                                               "scale")}
    except FileRefused as e:
        raise ClassifierError(str(e)) from None
    except (OSError, ValueError, KeyError) as e:
        raise ClassifierError(f"{npz}: unreadable classifier arrays ({e})") from None
    H = int(meta["inputs"])
    if any(arrays[k].shape != (H,) for k in ("coef", "mean", "scale")) \
            or arrays["intercept"].shape != (1,):
        raise ClassifierError(f"{npz}: arrays {({k: v.shape for k, v in arrays.items()})} do not "
                              f"match the {H} inputs of {js}")
    model = LinearClassifier(arrays["coef"], float(arrays["intercept"][0]), arrays["mean"],
                             arrays["scale"])
    return SavedClassifier(model, meta, js)


def check_checkpoint(saved: SavedClassifier, checkpoint: str | Path, weights: str) -> None:
    """Refuse a model other than the one the classifier was fit on: by its weights
    (:func:`hvd_lm.model.load.weights_sha256`, recorded since classifiers hold
    ``weights_sha256``: a checkpoint and its export are the same weights, so either serves), else
    (an older classifier) by the checkpoint file's sha256.

    Args:
        checkpoint: the checkpoint file or exported weights about to featurize texts.
        weights: the loaded model's :func:`~hvd_lm.model.load.weights_sha256`.
    Raises:
        ClassifierError: the digest differs (naming both files and both digests' prefixes).
    """
    if want := saved.meta.get("weights_sha256"):
        if weights != want:
            raise ClassifierError(
                f"{saved.path} was fit on features of the weights of "
                f"{saved.meta.get('checkpoint')} (weights sha256 {want[:12]}...), not those of "
                f"{checkpoint} ({weights[:12]}...): refit it with hvd-lm transfer on this model")
        return
    digest, want = file_sha256(checkpoint), saved.meta["checkpoint_sha256"]
    if digest != want:
        raise ClassifierError(
            f"{saved.path} was fit on features of checkpoint {saved.meta.get('checkpoint')} "
            f"(sha256 {want[:12]}...), not {checkpoint} (sha256 {digest[:12]}...): refit it "
            "with hvd-lm transfer on this checkpoint")
