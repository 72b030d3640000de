"""Sentiment transfer from a trained byte-level LM: ``hvd-lm transfer``.

The method of Radford et al. 2017 ("Learning to Generate Reviews and Discovering Sentiment") as
rebuilt by NVIDIA/sentiment-discovery (``transfer.py`` + ``logreg_utils.py``):

1. **Featurize** (:func:`featurize`): run the LM over each text's UTF-8 bytes (the project's
   tokenizer) from a zero state; the feature vector is the final cell state c_T (the reference's
   choice), or optionally the final hidden state h_T, or the mean / max over time of h_t.
   Texts are sorted by length, cut into batches, right-padded and masked; padding never changes a
   feature (the model holds/packs the state on masked steps, and each batch is run in time chunks
   over only its still-active rows). Under ``horovodrun``/``mpirun`` the length-sorted batches are
   dealt round-robin to the ranks and the features are gathered back in input order with
   :func:`hvd_lm.distributed.allgather`. Features are cached as ``.npy`` (:class:`FeatureCache`).
2. **Classify** (:func:`fit_logreg`): scikit-learn ``LogisticRegression`` with an L1 penalty
   (``liblinear``), C chosen by validation accuracy on a log2 grid (the reference's grid is
   2^-8..2^0), on the raw, unstandardised features as in the reference.
3. **Sentiment neuron** (:func:`sentiment_neuron`): the unit with the largest |weight|, its
   accuracy alone with a threshold fit on train (:func:`fit_threshold`), the number of non-zero
   weights, and a histogram of the unit's value by class (:func:`plot_neuron_histogram`).
4. **Baseline** (:func:`tfidf_baseline`): TF-IDF word 1-2-grams + char_wb 2-5-grams and an L2
   ``LogisticRegression``, C chosen on validation, on the same splits.

Outputs (rank 0): ``OUT/transfer.json``, ``OUT/transfer.md`` and ``OUT/neuron_hist.png``; the
markdown table is also printed. See ``docs/transfer.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hvd_lm import tokenizer
from hvd_lm.atomic import atomic_path, write_text

#: Feature types: final cell state, final hidden state, mean / max over time of the hidden states.
FEATURE_KINDS = ("cell", "hidden", "mean", "max")
#: Default truncation, in bytes (UTF-8 chars). On the IMDB train split it keeps 83% of reviews whole
#: and 85% of all bytes (median 979, p99 5,213 bytes); SST-2 sentences are at most 255 bytes.
DEFAULT_MAX_CHARS = 2000
#: Default C grid for the L1 logistic regression on LM features: 2^-8..2^2 (reference: 2^-8..2^0).
DEFAULT_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-8, 3))
#: Default C grid for the L2 TF-IDF baseline: 2^-3..2^5.
DEFAULT_BASELINE_C_GRID = tuple(float(c) for c in 2.0 ** np.arange(-3, 6))
DEFAULT_CACHE_DIR = "~/.cache/hvd_lm/features"
#: Bumped whenever featurization changes meaning, so old cache entries are not reused.
CACHE_VERSION = 1
_LAUNCHER_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


# --------------------------------------------------------------------------------------------
# Featurization
# --------------------------------------------------------------------------------------------

def encode_texts(texts: Sequence[str], max_chars: int = DEFAULT_MAX_CHARS,
                 normalize: bool = False) -> list[np.ndarray]:
    """Byte ids of each text (:func:`hvd_lm.tokenizer.encode`), cut to the first ``max_chars``
    bytes (``max_chars <= 0``: no cut).

    Returns:
        N uint8 arrays, each of length <= max_chars.
    """
    out = []
    for t in texts:
        ids = tokenizer.encode(t, normalize=normalize)
        out.append(ids[:max_chars] if max_chars > 0 else ids)
    return out


def plan_batches(lengths: Sequence[int], batch_size: int, rank: int = 0, size: int = 1
                 ) -> list[np.ndarray]:
    """This rank's batches: indices into ``lengths``, longest first.

    All texts are sorted by length (descending, stable), the order is cut into batches of
    ``batch_size`` and batch ``b`` goes to rank ``b % size`` (round-robin, so every rank gets
    long and short batches). A batch is the same on any world size, so features do not depend on
    the number of ranks.

    Returns:
        list of int64 index arrays, each sorted by descending length.
    Raises:
        ValueError: batch_size < 1 or rank outside 0..size-1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return batches[rank::size]


@torch.no_grad()
def encode_batch(model, seqs: Sequence[np.ndarray], kind: str = "cell",
                 device: torch.device | str = "cpu", time_chunk: int = 256,
                 precision: str = "fp32") -> torch.Tensor:
    """Features of one batch of byte sequences.

    The batch is right-padded to its longest sequence and run ``time_chunk`` steps at a time;
    each chunk runs only the rows that still have bytes, with ``mask`` False on their padding, so
    a row's features equal those of the same text run alone. An empty sequence gets zeros (the
    initial state; mean/max of nothing defined as 0).

    Args:
        model: a :class:`hvd_lm.model.LanguageModel` (eval mode).
        seqs: B uint8/int arrays of byte ids.
        kind: one of :data:`FEATURE_KINDS`.
        time_chunk: steps per ``model.encode`` call (bounds the [B, chunk, H] hidden states kept).
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast, :mod:`hvd_lm.precision`).
    Returns:
        float32 tensor [B, H] on CPU.
    Raises:
        ValueError: unknown kind.
    """
    from hvd_lm import precision as prec

    if kind not in FEATURE_KINDS:
        raise ValueError(f"features must be one of {FEATURE_KINDS}, got {kind!r}")
    device = torch.device(device)
    B = len(seqs)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    T = int(lengths.max()) if B else 0
    tokens = torch.zeros(B, max(T, 1), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            tokens[i, :len(s)] = torch.from_numpy(np.asarray(s, dtype=np.int64))
    mask = torch.arange(max(T, 1)).unsqueeze(0) < lengths.unsqueeze(1)
    tokens, mask, lengths_d = tokens.to(device), mask.to(device), lengths.to(device)
    h, c = model.init_state(B, device, torch.float32)
    H = h.shape[1]
    acc = None
    if kind == "mean":
        acc = torch.zeros(B, H, device=device)
    elif kind == "max":
        acc = torch.full((B, H), float("-inf"), device=device)
    for t0 in range(0, T, time_chunk):
        t1 = min(T, t0 + time_chunk)
        active = torch.nonzero(lengths_d > t0).flatten()
        m = mask[active, t0:t1]
        with prec.autocast(device, precision):
            hs, (ha, ca) = model.encode(tokens[active, t0:t1], (h[active], c[active]), m)
        h = h.index_copy(0, active, ha.float())
        c = c.index_copy(0, active, ca.float())
        if kind == "mean":
            acc = acc.index_add(0, active, (hs.float() * m.unsqueeze(-1)).sum(1))
        elif kind == "max":
            part = hs.float().masked_fill(~m.unsqueeze(-1), float("-inf")).amax(1)
            acc = acc.index_copy(0, active, torch.maximum(acc[active], part))
    if kind == "cell":
        out = c
    elif kind == "hidden":
        out = h
    elif kind == "mean":
        out = acc / lengths_d.clamp(min=1).unsqueeze(1).to(acc.dtype)
    else:
        out = torch.where(lengths_d.unsqueeze(1) > 0, acc, torch.zeros_like(acc))
    return out.float().cpu()


@dataclass
class FeatureResult:
    """Output of :func:`featurize`.

    Attributes:
        features: float32 [N, H], row i = text i (input order); None on ranks other than 0 when
            ``gather_to_all`` is False.
        chars: bytes fed to the model over all ranks (after truncation).
        seconds: wall time of the featurization on this rank, including the gather.
        truncated: number of texts cut to ``max_chars``.
    """

    features: np.ndarray | None
    chars: int
    seconds: float
    truncated: int

    @property
    def chars_per_s(self) -> float:
        """Featurization throughput over all ranks, in chars (bytes) per second."""
        return self.chars / self.seconds if self.seconds > 0 else float("nan")


def featurize(model, texts: Sequence[str], kind: str = "cell",
              max_chars: int = DEFAULT_MAX_CHARS, batch_size: int = 64,
              device: torch.device | str = "cpu", ctx=None, progress: bool = False,
              desc: str = "featurize", time_chunk: int = 256, precision: str = "fp32",
              normalize: bool = False) -> FeatureResult:
    """Features of every text, in input order (Radford et al. 2017: final cell state).

    Args:
        model: a :class:`hvd_lm.model.LanguageModel` in eval mode, on ``device``.
        texts: N strings.
        kind: ``cell`` (final c_T), ``hidden`` (final h_T), ``mean`` / ``max`` (over t of h_t).
        max_chars: keep the first ``max_chars`` bytes of each text (<= 0: all).
        batch_size: texts per batch (per rank).
        ctx: a :class:`hvd_lm.distributed.DistContext` to split the work over ranks (each rank
            gets every ``size``-th batch of the length-sorted order, see :func:`plan_batches`;
            results are gathered with :func:`hvd_lm.distributed.allgather` onto every rank);
            None = this process does everything.
        progress: show a tqdm bar (in chars) of this rank's share; pass True on rank 0 only.
        time_chunk, precision: see :func:`encode_batch`.
        normalize: collapse whitespace first (:func:`hvd_lm.tokenizer.normalize_text`).
    Returns:
        :class:`FeatureResult` with features float32 [N, H].
    Raises:
        ValueError: unknown kind or bad batch size.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    rank, size = (ctx.rank, ctx.size) if ctx is not None else (0, 1)
    seqs = encode_texts(texts, 0, normalize)
    truncated = sum(len(s) > max_chars for s in seqs) if max_chars > 0 else 0
    if max_chars > 0:
        seqs = [s[:max_chars] for s in seqs]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    mine = plan_batches(lengths, batch_size, rank, size)
    H = model.config.hidden_size
    bar = tqdm(total=int(sum(lengths[b].sum() for b in mine)), unit="char", unit_scale=True,
               desc=desc, disable=not progress, file=sys.stderr, dynamic_ncols=True)
    local_idx, local_feats = [], []
    for b in mine:
        local_feats.append(encode_batch(model, [seqs[i] for i in b], kind, device, time_chunk,
                                        precision))
        local_idx.append(torch.from_numpy(b.astype(np.int64)))
        bar.update(int(lengths[b].sum()))
    bar.close()
    feats = torch.cat(local_feats) if local_feats else torch.zeros(0, H)
    idx = torch.cat(local_idx) if local_idx else torch.zeros(0, dtype=torch.long)
    if size > 1:
        from hvd_lm import distributed as dist

        # One sentinel row (index -1) per rank, so no rank ever sends an empty tensor.
        feats = torch.cat([torch.zeros(1, H), feats])
        idx = torch.cat([torch.tensor([-1]), idx])
        feats = dist.allgather(feats, name=f"transfer_feats_{desc}")
        idx = dist.allgather(idx, name=f"transfer_idx_{desc}")
        keep = idx >= 0
        feats, idx = feats[keep], idx[keep]
    out = np.zeros((len(texts), H), dtype=np.float32)
    out[idx.numpy()] = feats.numpy()
    if len(np.unique(idx.numpy())) != len(texts):
        raise RuntimeError(f"featurize: gathered {len(idx)} rows for {len(texts)} texts")
    return FeatureResult(out, int(lengths.sum()), time.perf_counter() - t0, truncated)


# --------------------------------------------------------------------------------------------
# Feature cache
# --------------------------------------------------------------------------------------------

def file_sha256(path: str | Path, block: int = 1 << 22) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def texts_sha256(texts: Sequence[str]) -> str:
    """sha256 of the texts (each UTF-8 encoded and length-prefixed, so boundaries count)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def cache_key(checkpoint_sha256: str, split: str, texts_digest: str, options: dict) -> str:
    """Cache key: sha256 of (the checkpoint file's sha256, the split name, the sha256 of the
    split's texts in order (:func:`texts_sha256`: the dataset's identity after loading, carving and
    subsampling, independent of where the file lies), the feature options (kind, max_chars,
    normalize, precision) and :data:`CACHE_VERSION`). Batch size, device and world size are left
    out: they do not change the features (beyond float rounding)."""
    blob = json.dumps({"version": CACHE_VERSION, "checkpoint_sha256": checkpoint_sha256,
                       "split": split, "texts_sha256": texts_digest, "options": options},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class FeatureCache:
    """Features as ``<dir>/<key>.npy`` (float32 [N, H]) with a ``<key>.json`` description.

    Writes go to a temporary file in the same folder and are renamed over (``os.replace``), so a
    reader never sees a partial file and concurrent writers of the same key are harmless.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory).expanduser()

    def path(self, key: str) -> Path:
        """``<dir>/<key>.npy``."""
        return self.dir / f"{key}.npy"

    def load(self, key: str, n: int) -> np.ndarray | None:
        """The cached array, or None if absent, unreadable or not ``n`` rows."""
        p = self.path(key)
        if not p.is_file():
            return None
        try:
            arr = np.load(p, allow_pickle=False)
        except (OSError, ValueError):
            return None
        return arr if arr.ndim == 2 and arr.shape[0] == n else None

    def save(self, key: str, features: np.ndarray, meta: dict) -> Path:
        """Write ``features`` and ``meta`` atomically; returns the .npy path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.path(key)
        with atomic_path(p, suffix=".npy") as tmp:
            np.save(tmp, np.ascontiguousarray(features, dtype=np.float32))
        write_text(self.dir / f"{key}.json", json.dumps(meta, indent=1, sort_keys=True))
        return p


# --------------------------------------------------------------------------------------------
# Classifier, sentiment neuron, baseline
# --------------------------------------------------------------------------------------------

def _accuracy(model, X, y) -> float | None:
    return None if X is None or y is None else float((model.predict(X) == y).mean())


def _grid_search(make, Xtr, ytr, Xva, yva, grid: Sequence[float]) -> tuple[int, list, list, bool]:
    from sklearn.exceptions import ConvergenceWarning

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
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        train/val/test: :class:`hvd_lm.datasets.LabelledSplit` (test optional).
    Returns:
        dict like :func:`fit_logreg` (without ``model``/``coef``) plus ``features`` (count).
    """
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import FeatureUnion

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


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

def _launched_size() -> int:
    """World size announced by a launcher (horovodrun, mpirun, srun/PMI), else 1."""
    for var in _LAUNCHER_SIZE_VARS:
        v = os.environ.get(var)
        if v and v.isdigit():
            return int(v)
    return 1


_KIND_LABEL = {"cell": "final cell state", "hidden": "final hidden state",
               "mean": "mean of h_t", "max": "max of h_t"}


def _fmt_acc(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def format_markdown(report: dict) -> str:
    """The report as a markdown table (LM classifier, sentiment unit, TF-IDF baseline rows) with
    a header of checkpoint, dataset and featurization details."""
    f, clf, neu = report["features"], report["classifier"], report["neuron"]
    ds = report["dataset"]
    sizes = ", ".join(f"{k} {v['n']:,}" for k, v in ds["splits"].items())
    cps = f"{f['chars_per_s']:,.0f} chars/s" if f.get("chars_per_s") else "cached"
    lines = [
        f"**Checkpoint** `{report['checkpoint']}` (step {report['checkpoint_step']}, "
        f"{report['model']['cell']} H={report['model']['hidden_size']})  ",
        f"**Dataset** {ds['name']} ({sizes})" + ("; val carved from train" if ds["val_carved"]
                                                 else "") + "  ",
        f"**Features** {f['kind']} [N, {f['dim']}], max {f['max_chars']} chars "
        f"({f['truncated']} texts truncated), {cps} on {f['world_size']} rank(s), {f['device']}",
        "",
        "| method | features | C | train acc % | val acc % | test acc % | non-zero weights |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    a = clf["accuracy"]
    lines.append(f"| LM + {clf['penalty'].upper()} logistic regression | {_KIND_LABEL[f['kind']]}, "
                 f"{f['dim']} | {clf['C']:g} | {_fmt_acc(a['train'])} | {_fmt_acc(a['val'])} | "
                 f"{_fmt_acc(a['test'])} | {clf['nonzero']} |")
    a = neu["accuracy"]
    if neu["index"] is None:
        lines.append("| sentiment unit: none (all weights 0) | - | - | - | - | - | - |")
    else:
        lines.append(f"| sentiment unit #{neu['index']} alone (threshold on train) | 1 | - | "
                     f"{_fmt_acc(a.get('train'))} | {_fmt_acc(a.get('val'))} | "
                     f"{_fmt_acc(a.get('test'))} | 1 |")
    b = report.get("baseline")
    if b:
        a = b["accuracy"]
        lines.append(f"| TF-IDF word 1-2 + char_wb 2-5, L2 LR | n-grams, {b['features']:,} | "
                     f"{b['C']:g} | {_fmt_acc(a['train'])} | {_fmt_acc(a['val'])} | "
                     f"{_fmt_acc(a['test'])} | {b['nonzero']:,} |")
    lines.append("")
    lines.append("Val accuracy is the split C was chosen on (optimistic); test accuracy, where "
                 "present, is not used for any choice.")
    for note in report.get("notes", []):
        lines.append(f"Note: {note}")
    return "\n".join(lines) + "\n"


def run_transfer(args: argparse.Namespace) -> dict | None:
    """Everything ``hvd-lm transfer`` does (see the module docstring); returns the report on
    rank 0 and None on other ranks.

    Raises:
        hvd_lm.datasets.DatasetError: bad dataset input.
        FileNotFoundError: no checkpoint.
        ValueError: bad option.
    """
    from hvd_lm import datasets
    from hvd_lm.checkpoint import load_model, resolve
    from hvd_lm.train import resolve_device

    if args.features not in FEATURE_KINDS:
        raise ValueError(f"--features must be one of {FEATURE_KINDS}")
    ctx = None
    if _launched_size() > 1:
        from hvd_lm import distributed as dist

        ctx = dist.init()
    rank, size = (ctx.rank, ctx.size) if ctx else (0, 1)
    is_root = rank == 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    splits = datasets.load_splits(
        args.dataset, args.data_dir, args.train, args.val, args.test, args.text_field,
        args.label_field, args.val_fraction, args.max_examples, args.seed)
    ckpt_path = resolve(args.checkpoint)
    device = resolve_device(args.device, ctx.local_rank if ctx else 0)
    from hvd_lm import precision as prec

    prec.check(device, args.precision)
    model, ckpt = load_model(ckpt_path, map_location=device)
    model.to(device)
    cache = None if args.no_cache else FeatureCache(args.cache_dir)
    ck_sha = file_sha256(ckpt_path) if (cache is not None and is_root) else ""
    options = {"kind": args.features, "max_chars": args.max_chars, "normalize": args.normalize,
               "precision": args.precision}

    feats: dict[str, np.ndarray] = {}
    cache_info: dict[str, dict] = {}
    chars = truncated = 0
    seconds = 0.0
    for name, split in splits.items():
        key, hit = None, None
        if cache is not None and is_root:
            key = cache_key(ck_sha, name, texts_sha256(split.texts), options)
            hit = cache.load(key, len(split))
        if ctx is not None and cache is not None:
            from hvd_lm import distributed as dist

            cached = dist.broadcast_object(hit is not None, name=f"transfer_hit_{name}")
        else:
            cached = hit is not None
        if cached:
            if is_root:
                feats[name] = hit
                cache_info[name] = {"hit": True, "path": str(cache.path(key))}
                if args.max_chars > 0:
                    truncated += sum(len(tokenizer.encode_bytes(t, args.normalize)) >
                                     args.max_chars for t in split.texts)
            continue
        res = featurize(model, split.texts, args.features, args.max_chars, args.batch_size,
                        device, ctx, progress=is_root and not args.no_progress, desc=name,
                        time_chunk=args.time_chunk, precision=args.precision,
                        normalize=args.normalize)
        chars += res.chars
        seconds += res.seconds
        truncated += res.truncated
        if is_root:
            feats[name] = res.features
            info = {"hit": False, "seconds": res.seconds, "chars": res.chars,
                    "chars_per_s": res.chars_per_s}
            if cache is not None:
                meta = {"checkpoint": str(ckpt_path), "checkpoint_sha256": ck_sha, "split": name,
                        "source": split.source, "n": len(split), "options": options,
                        "created": time.time()}
                info["path"] = str(cache.save(key, res.features, meta))
            cache_info[name] = info
    if not is_root:
        return None

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    y = {k: s.labels for k, s in splits.items()}
    clf = fit_logreg(feats["train"], y["train"], feats["val"], y["val"], feats.get("test"),
                     y.get("test"), penalty=args.penalty, grid=args.c_grid, seed=args.seed,
                     max_iter=args.max_iter, standardize=args.standardize)
    neuron = sentiment_neuron(clf["coef"], {k: (feats[k], y[k]) for k in splits})
    neuron["histogram"] = None
    (out / "neuron_hist.png").unlink(missing_ok=True)  # never leave an older run's plot
    if neuron["index"] is not None:
        neuron["histogram"] = str(plot_neuron_histogram(
            feats["train"][:, neuron["index"]], y["train"], neuron["index"], neuron["threshold"],
            out / "neuron_hist.png", f"unit {neuron['index']} on {args.dataset or 'train'} train"))
    baseline = None
    if not args.no_baseline:
        baseline = tfidf_baseline(splits["train"], splits["val"], splits.get("test"),
                                  args.baseline_c_grid, args.seed)
    notes = sorted({n for s in splits.values() for n in s.notes})
    if "test" not in splits:
        notes.append("no test split: only train/val accuracies are reported")
    for what, res, grid, flag in (("LM classifier", clf, args.c_grid, "--c-grid"),
                                  ("baseline", baseline, args.baseline_c_grid,
                                   "--baseline-c-grid")):
        if res is not None and len(grid) > 1 and res["C"] in (min(grid), max(grid)):
            end = "largest" if res["C"] == max(grid) else "smallest"
            notes.append(f"{what}: the chosen C={res['C']:g} is the {end} of the grid; "
                         f"consider widening {flag}")
    if neuron["index"] is None:
        notes.append("the chosen L1 model has no non-zero weight (it predicts one class), so "
                     "there is no sentiment unit and no histogram")
    if not clf["converged"]:
        notes.append("liblinear hit max_iter for some C (ConvergenceWarning); raise --max-iter")
    report = {
        "checkpoint": str(ckpt_path), "checkpoint_step": int(ckpt.get("step", -1)),
        "model": dict(ckpt["config"]["model"]),
        "dataset": {"name": args.dataset or "files",
                    "splits": {k: s.summary() for k, s in splits.items()},
                    "val_carved": any("carved" in s.source for s in splits.values()),
                    "max_examples": args.max_examples, "seed": args.seed},
        "features": {"kind": args.features, "dim": int(feats["train"].shape[1]),
                     "max_chars": args.max_chars, "normalize": args.normalize,
                     "truncated": truncated, "batch_size": args.batch_size,
                     "precision": args.precision, "device": str(device), "world_size": size,
                     "chars": chars, "seconds": seconds,
                     "chars_per_s": chars / seconds if seconds > 0 else None,
                     "cache": cache_info},
        "classifier": {"penalty": args.penalty, "solver": "liblinear",
                       "standardize": args.standardize,
                       **{k: v for k, v in clf.items() if k not in ("model", "coef")}},
        "neuron": neuron,
        "baseline": baseline,
        "notes": notes,
    }
    write_text(out / "transfer.json", json.dumps(report, indent=2) + "\n")
    md = format_markdown(report)
    write_text(out / "transfer.md", md)
    return report


def _cmd_transfer(args: argparse.Namespace) -> int:
    from hvd_lm.datasets import DatasetError

    try:
        report = run_transfer(args)
    except (DatasetError, FileNotFoundError, ValueError) as e:
        print(f"hvd-lm transfer: ERROR: {e}", file=sys.stderr)
        return 2
    if report is not None:
        print(format_markdown(report), end="")
        png = ", neuron_hist.png" if report["neuron"]["histogram"] else ""
        print(f"wrote {Path(args.out) / 'transfer.json'}, transfer.md{png}")
    return 0


def _c_grid(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"C values must be > 0, got {text!r}")
    return vals


def add_subcommands(subparsers) -> None:
    """Register ``transfer`` on an argparse sub-parsers object (``hvd_lm.cli`` calls this)."""
    p = subparsers.add_parser(
        "transfer", help="sentiment transfer: LM features + L1 logistic regression, "
                         "sentiment neuron, TF-IDF baseline",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Featurize labelled texts with a trained LM (final cell state by default), "
                    "fit an L1 logistic regression with C chosen on validation, find the "
                    "sentiment neuron, and compare with a TF-IDF baseline "
                    "(Radford et al. 2017; NVIDIA/sentiment-discovery transfer.py).")
    p.add_argument("checkpoint", help="checkpoint file or run directory (its latest)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=["sst2", "imdb"], default=None,
                   help="named dataset read from --data-dir (sst2: train/val[/test].csv; imdb: "
                        "aclImdb folder or tar.gz)")
    g.add_argument("--data-dir", default=None, help="folder (or IMDB tarball) of --dataset")
    g.add_argument("--train", default=None, help="CSV/TSV/JSON-lines training file (.gz ok)")
    g.add_argument("--val", default=None, help="validation file (absent: carved from train)")
    g.add_argument("--test", default=None, help="test file (optional)")
    g.add_argument("--text-field", default="text", help="text column/key of --train/--val/--test")
    g.add_argument("--label-field", default="label", help="label column/key (values 0/1, "
                   "neg/pos, negative/positive, false/true)")
    g.add_argument("--val-fraction", type=float, default=0.1,
                   help="fraction of train carved off as val when no val split exists")
    g.add_argument("--max-examples", type=int, default=0,
                   help="use at most N examples per split (seeded, stratified; 0 = all)")
    g.add_argument("--seed", type=int, default=0, help="seed for carving, subsampling, liblinear")
    g = p.add_argument_group("features")
    g.add_argument("--features", choices=FEATURE_KINDS, default="cell",
                   help="final cell state (reference), final hidden state, mean/max of h_t")
    g.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS,
                   help="keep the first N bytes of each text (0 = no limit)")
    g.add_argument("--normalize", action="store_true",
                   help="collapse whitespace before encoding (tokenizer.normalize_text)")
    g.add_argument("--batch-size", type=int, default=64, help="texts per batch per rank")
    g.add_argument("--time-chunk", type=int, default=256,
                   help="steps per model call (bounds memory for mean/max)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    g.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="feature cache folder")
    g.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    g = p.add_argument_group("classifier")
    g.add_argument("--penalty", choices=["l1", "l2"], default="l1")
    g.add_argument("--c-grid", type=_c_grid, default=DEFAULT_C_GRID,
                   help="comma-separated C values tried on val (default 2^-8..2^2)")
    g.add_argument("--standardize", action="store_true",
                   help="z-score features with train statistics (the reference did not)")
    g.add_argument("--max-iter", type=int, default=1000, help="liblinear iterations")
    g.add_argument("--no-baseline", action="store_true", help="skip the TF-IDF baseline")
    g.add_argument("--baseline-c-grid", type=_c_grid, default=DEFAULT_BASELINE_C_GRID,
                   help="C values for the TF-IDF baseline (default 2^-3..2^5)")
    p.add_argument("--out", required=True, help="output folder for transfer.json/.md and the PNG")
    p.set_defaults(func=_cmd_transfer)


def main(argv: list[str] | None = None) -> int:
    """``python -m hvd_lm.transfer CHECKPOINT ...`` (same flags as ``hvd-lm transfer``)."""
    parser = argparse.ArgumentParser(prog="python -m hvd_lm.transfer")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "transfer":
        argv = ["transfer", *argv]
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
