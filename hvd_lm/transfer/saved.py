"""A trained sentiment classifier on disk, tied to the LM whose features it reads.

``hvd-lm transfer`` writes one file to its output folder (:func:`save_classifier`),
``classifier.safetensors``: the float64 arrays ``coef`` [H] (standardised units), ``intercept``
[1], ``mean`` [H] and ``scale`` [H] (the training split's statistics; zeros and ones when the fit
was on raw features) of a :class:`LinearClassifier` (numpy only, so the commands that apply a
saved classifier start without scikit-learn), and in the safetensors header's metadata (key
``classifier``, JSON) everything needed to apply it again and to say what it is: the format
version, the features (kind, max chars, whitespace normalisation, precision), the fit (penalty,
solver, C, standardised or not, accuracies), the sentiment unit, and the LM checkpoint's path,
step, sha256, its **weights' sha256** and config, and the arrays' own sha256 (checked on read).

:func:`load_classifier` reads it back (the file or its folder) within :data:`MAX_BYTES`;
safetensors checks the header, that every array lies inside the file and that the file holds
nothing else; the arrays must have the one width. :func:`check_checkpoint` refuses a model whose
weights are not the recorded ones (a checkpoint and its export are the same weights): features
of another LM (even another step of the same run) mean nothing to these weights. The file is
written atomically. A classifier of an older hvd_lm (``classifier.npz`` + ``classifier.json``)
is refused with one line saying to re-run ``hvd-lm transfer``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

from hvd_lm.transfer.texts import DatasetError
from hvd_lm.util.atomic import write_bytes
from hvd_lm.util.files import FileRefused, read_bounded, shown

CLASSIFIER_FORMAT = 2
FILE_NAME = "classifier.safetensors"
#: The largest classifier file read: four float64 [H] arrays (512 kB at H=16,384, hvd_lm's
#: widest) and a few kB of JSON; 16 MiB leaves room for features wider than H.
MAX_BYTES = 16 << 20
#: The arrays of a classifier file.
ARRAYS = ("coef", "intercept", "mean", "scale")


def arrays_sha256(arrays: dict[str, np.ndarray]) -> str:
    """sha256 hex digest of the float64 bytes of :data:`ARRAYS`, in that order."""
    return hashlib.sha256(b"".join(np.ascontiguousarray(arrays[k], np.float64).tobytes()
                                   for k in ARRAYS)).hexdigest()


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
        return None if X is None or y is None else float((self.predict(X) == np.asarray(y)).mean())


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
        path: the file it was read from.
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
    def neuron(self) -> dict:
        """The sentiment unit: ``index`` (None when every weight is 0), ``weight``, ``sign``,
        ``threshold``, and (classifiers written since 2026-11-27) ``accuracy``: the unit alone
        thresholded, as a fraction per split (``train``, ``val``, ``test``)."""
        return self.meta.get("neuron") or {"index": None}


def save_classifier(out_dir: str | Path, model: LinearClassifier, meta: dict) -> Path:
    """Write ``OUT/classifier.safetensors`` atomically: the arrays, and ``meta`` plus the format
    version and the time as its metadata.

    Args:
        model: the classifier to store.
        meta: JSON-able description, holding ``weights_sha256`` and ``features`` (what
            :func:`load_classifier` requires; transfer's one call gives them).
    Returns:
        The file's path.
    """
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(v, np.float64) for k, v in
              zip(ARRAYS, (model.coef, [model.intercept], model.mean, model.scale))}
    full = {"format": CLASSIFIER_FORMAT, "created": time.time(), **meta,
            "arrays_sha256": arrays_sha256(arrays)}
    return write_bytes(Path(out_dir) / FILE_NAME, safetensors.numpy.save(
        arrays, {"classifier": json.dumps(full, default=str)}))


def load_classifier(path: str | Path) -> SavedClassifier:
    """Read a classifier written by :func:`save_classifier`.

    Args:
        path: its folder or its ``classifier.safetensors``.
    Raises:
        ClassifierError: the file is missing, not a regular file or over :data:`MAX_BYTES`
            (refused before it is read), not a safetensors file (truncated, a header that
            overruns it), not a classifier of this format, its arrays disagree in shape or
            with their recorded sha256; a
            classifier of an older hvd_lm; the message names the file.
    """
    p = Path(path) / FILE_NAME if Path(path).is_dir() else Path(path)
    if p.suffix in (".npz", ".json") or (not p.exists() and p.with_suffix(".npz").exists()):
        raise ClassifierError(f"{shown(p)}: a classifier of an older hvd_lm (classifier.npz + "
                              f"classifier.json); run hvd-lm transfer again to write {FILE_NAME}")
    if p.suffix != ".safetensors":
        raise ClassifierError(f"{shown(p)}: not a classifier (give its folder or {FILE_NAME})")
    try:  # within its budget, then safetensors checks the header and every array's offsets
        raw = read_bounded(p, MAX_BYTES, f"a {FILE_NAME} holds four arrays of the LM's width")
        arrays = {k: v.astype(np.float64) for k, v in safetensors.numpy.load(raw).items()}
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])  # (checked by load)
        meta = json.loads(header.get("__metadata__", {}).get("classifier", "null"))
    except FileNotFoundError:
        raise ClassifierError(f"{shown(p)}: no such file (a classifier is the {FILE_NAME} "
                              "written by hvd-lm transfer)") from None
    except (OSError, FileRefused) as e:
        raise ClassifierError(f"unreadable classifier: {e}") from None
    except (SafetensorError, ValueError, RecursionError) as e:
        raise ClassifierError(f"{shown(p)}: not a classifier file ({shown(str(e))})") from None
    if not isinstance(meta, dict) or meta.get("format") != CLASSIFIER_FORMAT:
        raise ClassifierError(f"{shown(p)}: not a classifier of format {CLASSIFIER_FORMAT}")
    for key, kind in (("weights_sha256", str), ("features", dict), ("arrays_sha256", str)):
        if not isinstance(meta.get(key), kind):
            raise ClassifierError(f"{shown(p)}: field '{key}' missing or not a {kind.__name__}")
    H = len(arrays.get("coef", ()))
    if sorted(arrays) != sorted(ARRAYS) or any(arrays[k].shape != (n,) for k, n in
                                               zip(ARRAYS, (H, 1, H, H))):
        raise ClassifierError(f"{shown(p)}: arrays {({k: v.shape for k, v in arrays.items()})}, "
                              f"not {', '.join(ARRAYS)} of one width")
    if arrays_sha256(arrays) != meta["arrays_sha256"]:
        raise ClassifierError(f"{shown(p)}: its arrays' sha256 {arrays_sha256(arrays)[:12]}... is "
                              f"not the recorded {meta['arrays_sha256'][:12]}... (a damaged "
                              "file): run hvd-lm transfer again")
    return SavedClassifier(LinearClassifier(arrays["coef"], float(arrays["intercept"][0]),
                                            arrays["mean"], arrays["scale"]), meta, p)


def check_checkpoint(saved: SavedClassifier, checkpoint: str | Path, weights: str) -> None:
    """Refuse a model other than the one the classifier was fit on, by its weights
    (:func:`hvd_lm.model.load.weights_sha256`: a checkpoint and its export are the same weights,
    so either serves).

    Args:
        checkpoint: the checkpoint file or exported weights about to featurize texts.
        weights: the loaded model's :func:`~hvd_lm.model.load.weights_sha256`.
    Raises:
        ClassifierError: the digest differs (naming both files and both digests' prefixes).
    """
    want = saved.meta["weights_sha256"]
    if weights != want:
        raise ClassifierError(
            f"{saved.path} was fit on features of the weights of "
            f"{saved.meta.get('checkpoint')} (weights sha256 {want[:12]}...), not those of "
            f"{checkpoint} ({weights[:12]}...): refit it with hvd-lm transfer on this model")
