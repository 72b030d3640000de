"""``hvd-lm transfer``: sentiment transfer from a trained byte-level LM.

The method of Radford et al. 2017 ("Learning to Generate Reviews and Discovering Sentiment") as
rebuilt by NVIDIA/sentiment-discovery (``transfer.py`` + ``logreg_utils.py``):

1. **Featurize** (:func:`hvd_lm.transfer.features.featurize`): the LM's final cell state (or
   final hidden state, or mean / max over time of h_t) of each text, batched, padding-invariant,
   split over ranks under ``horovodrun``/``mpirun``, cached.
2. **Classify** (:func:`hvd_lm.transfer.fit.fit_logreg`): L1 logistic regression on
   standardised features (scikit-learn), C chosen by stratified k-fold cross-validation on the
   training split and the model refit on all of it; validation and test accuracy are measured
   once, on splits no choice looked at. The classifier is saved (:mod:`hvd_lm.transfer.saved`)
   for ``hvd-lm classify`` / ``visualize`` / ``generate``.
3. **Sentiment neuron** (:func:`hvd_lm.transfer.fit.sentiment_neuron`): the largest-|weight|
   unit alone, with a histogram by class.
4. **Baseline** (:func:`hvd_lm.transfer.fit.tfidf_baseline`): TF-IDF n-grams + L2 logistic
   regression on the same splits, C chosen by the same cross-validation.

Settings: :class:`TransferConfig` (flags, or the ``transfer:`` section of a YAML file).
Outputs (rank 0): ``OUT/transfer.json``, ``OUT/transfer.md``, ``OUT/neuron_hist.png`` and
``OUT/classifier.safetensors``; the markdown table is also printed. See
``docs/transfer.md``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hvd_lm.comm import engine
from hvd_lm.formats import tokenizer
from hvd_lm.model import device as devices
from hvd_lm.model.config import KERNELS
from hvd_lm.model.load import weights_sha256
from hvd_lm.options import Command, option
from hvd_lm.transfer import datasets, fit
from hvd_lm.transfer import features as lm_features
from hvd_lm.transfer.saved import FILE_NAME, save_classifier
from hvd_lm.util.atomic import write_text
from hvd_lm.util.digest import file_sha256
from hvd_lm.util.units import parse_split


@dataclass
class TransferConfig(lm_features.RankOptions):
    """Settings of ``hvd-lm transfer`` (flags; or a YAML file's keys, e.g. the demo's
    ``transfer:`` section); the checkpoint, device, threads, batch size, time chunk, backend and
    progress are :class:`~hvd_lm.transfer.features.RankOptions`'."""

    out: str = option("", "output folder for transfer.json/.md, the PNG and "
                      "classifier.safetensors", required=True)
    # data
    dataset: str | None = option(None, "named dataset read from --data-dir (sst2: "
                                 "train/val[/test].csv; imdb: aclImdb folder or tar.gz)",
                                 choices=("sst2", "imdb"))
    data_dir: str | None = option(None, "folder (or IMDB tarball) of --dataset")
    train: str | None = option(None, "training data: a CSV/TSV/JSON-lines or Blitzer .review file "
                               "(.gz ok), several comma-separated, or a folder of .review files "
                               "(labelled by their names: positive.review, negative.review)")
    val: str | None = option(None, "validation data, as --train (absent: carved from train)")
    test: str | None = option(None, "test data, as --train (optional)")
    split: tuple[float, ...] | None = option(None, "TRAIN,VAL,TEST ratios that carve --train into "
                                             "stratified, seeded splits (e.g. 80,10,10, read as "
                                             "prepare's --split)", parse=parse_split)
    text_field: str = option("text", "text column/key of --train/--val/--test")
    label_field: str = option("label", "label column/key (values 0/1, neg/pos, "
                              "negative/positive, false/true)")
    val_fraction: float = option(0.1, "fraction of train carved off as val when no val split "
                                 "exists", gt=0, le=0.9)
    max_examples: int = option(0, "use at most N examples per split (seeded, stratified; 0 = "
                               "all)", ge=0)
    seed: int = option(0, "seed for carving, subsampling, liblinear/saga", ge=0)
    # features
    features: str = option("cell", "final cell state (reference), final hidden state, mean/max "
                           "of h_t", choices=lm_features.FEATURE_KINDS)
    max_chars: int = option(lm_features.DEFAULT_MAX_CHARS, "keep the first N bytes of each "
                            "text (0 = no limit)", ge=0)
    normalize: bool = option(False, "collapse whitespace before encoding "
                             "(tokenizer.normalize_text)", switch=True)
    precision: str = option("fp32", "autocast precision", choices=devices.PRECISIONS)
    rnn_kernels: str = option("auto", "fused mLSTM cell kernels on this device (auto: triton "
                              "on CUDA when installed, else torch)", choices=KERNELS)
    threads: int = option(0, "torch CPU threads per rank (0 = the usable cores / the ranks "
                          "on this machine; a warning when ranks x threads exceed them), and "
                          "the classifier's parallel fits (0 = one per usable core)", ge=0)
    cache_dir: str = option(lm_features.DEFAULT_CACHE_DIR, "feature cache folder")
    cache: bool = option(True, "read and write the feature cache (--no-cache: neither)",
                         switch=False, flag="--no-cache")
    # classifier
    penalty: str = option("l1", "logistic-regression penalty", choices=("l1", "l2"))
    c_grid: tuple[float, ...] = option(fit.DEFAULT_C_GRID, "comma-separated C values, one "
                                       "chosen by k-fold cross-validation on train (default "
                                       "2^-8..2^2)", gt=0)
    cv_folds: int = option(fit.DEFAULT_FOLDS, "folds of the stratified cross-validation on train "
                           "that chooses C (fewer when a label has fewer examples)", ge=2)
    standardize: bool = option(True, "z-score features with train statistics, kept with the "
                               "classifier (--no-standardize: raw features, as the reference)",
                               switch=False, flag="--no-standardize")
    solver: str = option("auto", "scikit-learn's LogisticRegression solver (auto: liblinear, the "
                         "reference's); the folds' fits run in parallel worker processes",
                         choices=fit.SOLVERS)
    tol: float = option(0.0, "stopping tolerance (0 = scikit-learn's default, 1e-4)", ge=0)
    max_iter: int = option(0, "iterations per fit at most (0 = scikit-learn's default, 1000)", ge=0)
    baseline: bool = option(True, "TF-IDF baseline (--no-baseline: skip it)", switch=False,
                            flag="--no-baseline")
    baseline_c_grid: tuple[float, ...] = option(fit.DEFAULT_BASELINE_C_GRID, "C values for the "
                                                "TF-IDF baseline (default 2^-3..2^5)", gt=0)

    def check(self) -> None:
        """Each C grid holds at least one value (an empty one failed only after the
        featurization, or after the whole LM fit for the baseline's); ``--out`` is not a file
        (found before the featurization, not after)."""
        for name in ("c_grid", "baseline_c_grid"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty: give at least one C value")
        if self.out and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"--out {self.out}: is a file; transfer writes a folder there")


_KIND_LABEL = {"cell": "final cell state", "hidden": "final hidden state",
               "mean": "mean of h_t", "max": "max of h_t"}


def format_markdown(report: dict) -> str:
    """The report as a markdown table (LM classifier, sentiment unit, TF-IDF baseline rows) with
    a header of checkpoint, dataset and featurization details."""
    f, clf, neu, ds = report["features"], report["classifier"], report["neuron"], report["dataset"]
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
        "| method | features | C | train acc % | CV acc % | val acc % | test acc % | "
        "non-zero weights |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    def row(method, features, C, acc: dict, nonzero) -> str:  # acc: split -> fraction or None
        cells = [method, features, C, *("-" if acc.get(k) is None else f"{100 * acc[k]:.2f}"
                                         for k in ("train", "cv", "val", "test")), nonzero]
        return "| " + " | ".join(map(str, cells)) + " |"

    lines.append(row(f"LM + {clf['penalty'].upper()} logistic regression",
                     f"{_KIND_LABEL[f['kind']]}, {f['dim']}", f"{clf['C']:g}", clf["accuracy"],
                     clf["nonzero"]))
    if neu["index"] is None:
        lines.append(row("sentiment unit: none (all weights 0)", "-", "-", {}, "-"))
    else:  # (no cv accuracy: "-")
        lines.append(row(f"sentiment unit #{neu['index']} alone (threshold on train)", 1, "-",
                         neu["accuracy"], 1))
    if b := report.get("baseline"):
        lines.append(row("TF-IDF word 1-2 + char_wb 2-5, L2 LR", f"n-grams, {b['features']:,}",
                         f"{b['C']:g}", b["accuracy"], f"{b['nonzero']:,}"))
    lines += ["", f"C is chosen by {clf['cv']['folds']}-fold cross-validation on the train split "
              "(CV acc: the chosen C's mean over the folds); val and test accuracy are measured "
              "once, on splits no choice looked at.",
              *(f"Note: {note}" for note in report.get("notes", []))]
    return "\n".join(lines) + "\n"


@dataclass
class SplitFeatures(lm_features.FeatureResult):
    """LM features of every split (:func:`featurize_splits`; rank 0 only): a
    :class:`~hvd_lm.transfer.features.FeatureResult` of all of them.

    Attributes:
        features: split -> float32 [N, H]; chars, seconds: bytes featurized and wall time (cache
            hits excluded); truncated: texts cut to ``max_chars``; cache: split ->
            hit/path/seconds.
    """

    features: dict[str, np.ndarray]
    cache: dict[str, dict] = field(default_factory=dict)


def feature_options(cfg: TransferConfig) -> dict:
    """The options that define a feature vector (and a feature-cache key): kind, max_chars,
    normalize, precision."""
    return {"kind": cfg.features, "max_chars": cfg.max_chars, "normalize": cfg.normalize,
            "precision": cfg.precision}


def featurize_splits(lm: lm_features.LMSession, splits: dict[str, datasets.LabelledSplit],
                     cfg: TransferConfig, checkpoint_sha256: str) -> SplitFeatures | None:
    """Features of each split with the LM of ``lm``, from the cache where it has them (rank 0
    looks, the answer is broadcast), else featurized over all ranks and cached by rank 0.

    Returns:
        :class:`SplitFeatures` on rank 0, None on the other ranks.
    """
    ctx, is_root = lm.ctx, lm.ctx is None or lm.ctx.rank == 0
    cache = None if not cfg.cache else lm_features.FeatureCache(cfg.cache_dir)
    options = feature_options(cfg)
    out = SplitFeatures({}, 0, 0.0, 0)
    for name, split in splits.items():
        key = hit = None
        if cache is not None and is_root:
            key = lm_features.cache_key(checkpoint_sha256, name, split.texts, options)
            hit = cache.load(key, len(split))
        cached = hit is not None
        if ctx is not None and cache is not None:
            cached = engine.broadcast_object(cached, name=f"transfer_hit_{name}")
        if cached:
            if is_root:
                out.features[name] = hit
                out.cache[name] = {"hit": True, "path": str(cache.path(key))}
                out.truncated += sum(len(tokenizer.encode_bytes(t, cfg.normalize))
                                     > cfg.max_chars > 0 for t in split.texts)
            continue
        res = lm_features.featurize(lm.model, split.texts, cfg.features, cfg.max_chars,
                                    cfg.batch_size, lm.device, ctx, is_root and cfg.progress,
                                    name, cfg.time_chunk, cfg.precision, cfg.normalize)
        out.chars += res.chars
        out.seconds += res.seconds
        out.truncated += res.truncated
        if is_root:
            out.features[name] = res.features
            info = {"hit": False, "seconds": res.seconds, "chars": res.chars,
                    "chars_per_s": res.chars_per_s}
            if cache is not None:
                meta = {"checkpoint": str(lm.path), "checkpoint_sha256": checkpoint_sha256,
                        "split": name, "source": split.source, "n": len(split),
                        "options": options, "created": time.time()}
                info["path"] = str(cache.save(key, res.features, meta))
            out.cache[name] = info
    return out if is_root else None


def run(cfg: TransferConfig) -> int:
    """``hvd-lm transfer``: everything of the module docstring; rank 0 writes the outputs and
    prints the markdown table and where the outputs went. Bad data or options: exit 2 with one
    ``ERROR:`` line (:data:`TRANSFER`).

    Raises:
        hvd_lm.transfer.datasets.DatasetError: bad dataset input.
        FileNotFoundError: no checkpoint.
        ValueError: bad option.
    """
    splits = datasets.load_splits(
        cfg.dataset, cfg.data_dir, cfg.train, cfg.val, cfg.test, cfg.text_field,
        cfg.label_field, cfg.val_fraction, cfg.max_examples, cfg.seed, cfg.split)
    lm = lm_features.open_lm(cfg.checkpoint, cfg.device, cfg.precision, cfg.threads,
                             cfg.rnn_kernels, backend=cfg.backend)
    is_root = lm.ctx is None or lm.ctx.rank == 0
    say = (lambda text: print(f"hvd-lm transfer: {text}", file=sys.stderr, flush=True)) \
        if cfg.progress and is_root else (lambda text: None)  # the fit and baseline take minutes
    notes = sorted({n for s in splits.values() for n in s.notes})
    for note in notes:  # what was carved and dropped, said before the featurization
        say(note)
    ck_sha = file_sha256(lm.path) if is_root else ""
    sf = featurize_splits(lm, splits, cfg, ck_sha)
    if not is_root:
        return 0
    feats, ckpt = sf.features, lm.ckpt
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    y = {k: s.labels for k, s in splits.items()}
    n, d = feats["train"].shape
    say(f"fitting {cfg.penalty.upper()} logistic regression: {len(cfg.c_grid)} C values x "
        f"{cfg.cv_folds}-fold cross-validation on {n:,} x {d:,} train features ({cfg.solver} "
        "solver)")
    clf = fit.fit_logreg(feats["train"], y["train"], feats.get("val"), y.get("val"),
                     feats.get("test"), y.get("test"), penalty=cfg.penalty, grid=cfg.c_grid,
                     seed=cfg.seed, max_iter=cfg.max_iter, standardize=cfg.standardize,
                     solver=cfg.solver, tol=cfg.tol, folds=cfg.cv_folds, jobs=cfg.threads)
    say(f"fit in {clf['seconds']:.1f} s ({clf['solver']}): C={clf['C']:g} (CV "
        f"{clf['accuracy']['cv']:.1%}), val {clf['accuracy']['val']:.1%}")
    neuron = fit.sentiment_neuron(clf["coef"], {k: (feats[k], y[k]) for k in splits})
    neuron["histogram"] = None
    (out / "neuron_hist.png").unlink(missing_ok=True)  # never leave an older run's plot
    if neuron["index"] is not None:
        neuron["histogram"] = str(fit.plot_neuron_histogram(
            feats["train"][:, neuron["index"]], y["train"], neuron["index"], neuron["threshold"],
            out / "neuron_hist.png", f"unit {neuron['index']} on {cfg.dataset or 'train'} train"))
    baseline = None
    if cfg.baseline:
        say(f"TF-IDF baseline at {len(cfg.baseline_c_grid)} C values")
        baseline = fit.tfidf_baseline(splits["train"], splits.get("val"), splits.get("test"),
                                      cfg.baseline_c_grid, cfg.seed, cfg.cv_folds, cfg.threads)
    if "test" not in splits:
        notes.append("no test split: only train/val accuracies are reported")
    for what, res, grid, flag in (("LM classifier", clf, cfg.c_grid, "--c-grid"),
                                  ("baseline", baseline, cfg.baseline_c_grid,
                                   "--baseline-c-grid")):
        if res is not None and len(grid) > 1 and res["C"] in (min(grid), max(grid)):
            end = "largest" if res["C"] == max(grid) else "smallest"
            notes.append(f"{what}: the chosen C={res['C']:g} is the {end} of the grid; "
                         f"consider widening {flag}")
    if neuron["index"] is None:
        notes.append("the chosen L1 model has no non-zero weight (it predicts one class), so "
                     "there is no sentiment unit and no histogram")
    if not clf["converged"]:
        notes.append(f"the {clf['solver']} fit at the chosen C stopped at its iteration limit "
                     f"({clf['n_iter']}) before its tolerance: raise --max-iter")
    report = {
        "checkpoint": str(lm.path), "checkpoint_step": int(ckpt.get("step", -1)),
        "model": dict(ckpt["config"]["model"]),
        "dataset": {"name": cfg.dataset or ", ".join(
                        Path(p.strip()).name for f in (cfg.train, cfg.val, cfg.test) if f
                        for p in f.split(",") if p.strip()),
                    "splits": {k: s.summary() for k, s in splits.items()},
                    "val_carved": any("carved" in s.source for s in splits.values())
                    or cfg.split is not None, "split": cfg.split,
                    "max_examples": cfg.max_examples, "seed": cfg.seed},
        "features": {"kind": cfg.features, "dim": int(feats["train"].shape[1]),
                     "max_chars": cfg.max_chars, "normalize": cfg.normalize,
                     "truncated": sf.truncated, "batch_size": cfg.batch_size,
                     "precision": cfg.precision, "device": str(lm.device),
                     "world_size": lm.ctx.size if lm.ctx else 1,
                     "chars": sf.chars, "seconds": sf.seconds,
                     "chars_per_s": sf.chars / sf.seconds if sf.seconds > 0 else None,
                     "cache": sf.cache},
        "classifier": {"penalty": cfg.penalty, "standardize": cfg.standardize,
                       "file": str(out / FILE_NAME),
                       **{k: v for k, v in clf.items() if k not in ("model", "coef")}},
        "neuron": neuron, "baseline": baseline, "notes": notes}
    save_classifier(out, clf["model"], {
        "checkpoint": str(lm.path), "checkpoint_sha256": ck_sha,
        "weights_sha256": weights_sha256(lm.model),
        "checkpoint_step": report["checkpoint_step"], "checkpoint_config": ckpt["config"],
        "features": feature_options(cfg), "dataset": report["dataset"]["name"],
        "penalty": cfg.penalty, "solver": clf["solver"], "C": clf["C"],
        "standardize": cfg.standardize, "accuracy": clf["accuracy"],
        "neuron": {k: neuron[k] for k in ("index", "weight", "sign", "threshold", "accuracy")}})
    write_text(out / "transfer.json", json.dumps(report, indent=2) + "\n")
    write_text(out / "transfer.md", format_markdown(report))
    print(format_markdown(report), end="")
    png = ", neuron_hist.png" if neuron["histogram"] else ""
    print(f"wrote {out / 'transfer.json'}, transfer.md{png}, {FILE_NAME} (fit: {clf['solver']} "
          f"on {clf['device']}, {clf['fit_seconds']:.1f} s)")
    return 0


TRANSFER = Command(
    TransferConfig, run, usage_errors=(datasets.DatasetError, FileNotFoundError, ValueError),
    description="Featurize labelled texts with a trained LM (final cell state by default), fit "
    "an L1 logistic regression with C chosen by k-fold cross-validation on train, find the "
    "sentiment neuron, and compare with a TF-IDF baseline (Radford et al. 2017; "
    "NVIDIA/sentiment-discovery transfer.py).")
