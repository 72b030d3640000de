"""LM features of texts, and their cache.

The method of Radford et al. 2017 ("Learning to Generate Reviews and Discovering Sentiment") as
rebuilt by NVIDIA/sentiment-discovery (``transfer.py``): run the LM over each text's UTF-8 bytes
(the project's tokenizer) from a zero state; the feature vector is the final cell state c_T (the
reference's choice), or optionally the final hidden state h_T, or the mean / max over time of h_t.
Texts are sorted by length, cut into batches, right-padded and masked; padding never changes a
feature (the model holds/packs the state on masked steps, and each batch is run in time chunks
over only its still-active rows). Under ``horovodrun``/``mpirun`` the length-sorted batches are
dealt round-robin to the ranks and the features are gathered back in input order with
:func:`hvd_lm.comm.engine.allgather`. Features are cached as ``.npy`` (:class:`FeatureCache`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hvd_lm.comm import engine
from hvd_lm.comm.threads import set_rank_threads
from hvd_lm.comm.world import RankContext, world_size
from hvd_lm.formats import tokenizer
from hvd_lm.model import device as devices
from hvd_lm.model.lm import ModelConfig
from hvd_lm.model.load import load_model, model_files, resolve_model, weights_sha256
from hvd_lm.options import error_text, option
from hvd_lm.train.log import Progress
from hvd_lm.transfer.saved import ClassifierError, check_checkpoint, load_classifier
from hvd_lm.util.atomic import atomic_path, write_text
from hvd_lm.util.digest import json_sha256
from hvd_lm.util.files import FileRefused, check_output, load_npy, shown

#: Feature types: final cell state, final hidden state, mean / max over time of the hidden states.
FEATURE_KINDS = ("cell", "hidden", "mean", "max")


#: Default truncation, in bytes (UTF-8 chars); docs/transfer.md gives how much of IMDB and SST-2
#: it keeps.
DEFAULT_MAX_CHARS = 2000


DEFAULT_CACHE_DIR = "~/.cache/hvd_lm/features"


#: Bumped whenever featurization changes meaning, so old cache entries are not reused.
CACHE_VERSION = 1


@dataclass
class ModelOptions:
    """The settings every transfer command shares (:class:`~hvd_lm.transfer.run.TransferConfig`,
    ``ClassifyConfig``, ``GenerateConfig`` and ``VisualizeConfig`` inherit them): the checkpoint,
    the device and the torch CPU threads."""

    checkpoint: str = option("", "checkpoint file, run directory (its latest) or exported folder",
                             positional=True, required=True)
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    threads: int = option(0, "torch CPU threads (0 = the usable cores; a warning when more are "
                          "asked for)", ge=0)


@dataclass
class RankOptions(ModelOptions):
    """The settings of the commands that featurize texts over ranks (``transfer``,
    ``classify``)."""

    batch_size: int = option(64, "texts per batch per rank", ge=1)
    time_chunk: int = option(256, "steps per model call (bounds memory for mean/max)", ge=1)
    backend: str = option("horovod", engine.BACKEND_HELP, choices=engine.BACKENDS)
    progress: bool = option(True, "progress on stderr: a bar on a terminal, a line every 10 s "
                            "in a log (--no-progress: none)", switch=False, flag="--no-progress")


@dataclass
class LMSession:
    """A checkpoint's LM ready to featurize on this rank.

    Attributes:
        ctx: the Horovod :class:`~hvd_lm.comm.world.RankContext` when launched on several
            ranks, else None (one process; Horovod is not initialised).
        path: the checkpoint file; model: its LanguageModel (eval mode, on ``device``);
        ckpt: the checkpoint dict; device: one GPU per local rank, or the CPU.
    """

    ctx: RankContext | None
    path: Path
    model: torch.nn.Module
    ckpt: dict
    device: torch.device


def open_lm(checkpoint: str | Path, device: str = "auto", precision: str = "fp32",
            threads: int = 0, rnn_kernels: str = "auto", command: str = "transfer",
            backend: str = "horovod") -> LMSession:
    """Start Horovod when a launcher started several ranks (they split the texts, see
    :func:`featurize`), pick this rank's device (:func:`hvd_lm.model.device.resolve_device`),
    check the precision there and load the checkpoint's model onto it.

    Args:
        checkpoint: file or run directory (its latest).
        threads: torch CPU threads (0: the usable cores / the ranks on this machine, the rule
            of :mod:`hvd_lm.comm.threads`, whose warning names ``hvd-lm COMMAND``).
        rnn_kernels: the fused mLSTM's cell kernels (:func:`hvd_lm.model.load.load_model`).
        backend: the collective engine of several ranks (:data:`hvd_lm.comm.world.BACKENDS`);
            "": one process, however many a launcher started.
    Raises:
        FileNotFoundError: no checkpoint; ValueError: a device/precision that cannot be used.
    """
    # collective: the ranks split the texts
    ctx = engine.init(backend=backend) if backend and world_size() > 1 else None
    set_rank_threads(threads, ctx, command)  # collective: an allgather of machine ids
    path = resolve_model(checkpoint)
    dev = devices.resolve_device(device, ctx.local_rank if ctx else 0, ctx.local_size if ctx else 1)
    devices.check(dev, precision)
    model, ckpt = load_model(path, map_location=dev, rnn_kernels=rnn_kernels)
    if ctx is not None:
        engine.begin_steps()  # the torch engine's collectives: its timeout from here
    return LMSession(ctx, path, model, ckpt, dev)


def open_classified(cfg: ModelOptions, classifier: str, command: str, outputs: dict[str, str],
                    reads: Sequence = (), precision: str = "fp32", backend: str = "") -> tuple:
    """The LM and the classifier of ``classify``, ``generate`` and ``visualize``: the classifier
    at ``classifier`` ("" = none) is read and each output (``{flag: path}``, "" or "-" = none)
    refused where it names a file this run reads (the model's, the classifier's, ``reads``),
    before any work; then the LM is opened (:func:`open_lm`: ``cfg``'s checkpoint, device and
    threads; ``precision`` "" = the classifier's; over ranks with a ``backend``) and refused
    unless the classifier was fit on its weights (a checkpoint's export has the same:
    :func:`~hvd_lm.transfer.saved.check_checkpoint`).

    Returns:
        (:class:`LMSession`, :class:`~hvd_lm.transfer.saved.SavedClassifier` or None).
    Raises:
        ClassifierError: bad classifier files, or another model's; FileNotFoundError: no
        checkpoint; ValueError: a device/precision that cannot be used, an output that is read.
    """
    saved = load_classifier(classifier) if classifier else None
    for flag, out in outputs.items():
        if out not in ("", "-"):  # never replace what this run reads
            check_output(out, flag, *model_files(cfg.checkpoint),
                         *([saved.path] if saved else []), *reads)
    lm = open_lm(cfg.checkpoint, cfg.device, precision or saved.features["precision"],
                 cfg.threads, command=command, backend=backend)
    if saved is not None:
        digest = weights_sha256(lm.model) if lm.ctx is None or lm.ctx.rank == 0 else None
        if lm.ctx is not None:  # collective: rank 0 hashed the weights
            digest = engine.broadcast_object(digest, name=f"{command}_weights_sha256")
        check_checkpoint(saved, lm.path, digest)
        if lm.model.config.hidden_size != len(saved.model.coef):
            raise ClassifierError(f"{saved.path}: {len(saved.model.coef)} inputs, but the model "
                                  f"has H={lm.model.config.hidden_size}")
    return lm, saved


def encode_texts(texts: Sequence[str], max_chars: int = DEFAULT_MAX_CHARS,
                 normalize: bool = False) -> list[np.ndarray]:
    """Byte ids of each text (:func:`hvd_lm.formats.tokenizer.encode`), cut to the first
    ``max_chars`` bytes (``max_chars <= 0``: no cut).

    Returns:
        N uint8 arrays, each of length <= max_chars.
    """
    ids = [tokenizer.encode(t, normalize=normalize) for t in texts]
    return [s[:max_chars] for s in ids] if max_chars > 0 else ids


def plan_batches(lengths: Sequence[int], batch_size: int, rank: int = 0, size: int = 1
                 ) -> list[np.ndarray]:
    """This rank's batches: indices into ``lengths``, longest first.

    All texts are sorted by length (descending, stable), the order is cut into batches of
    ``batch_size`` and batch ``b`` goes to rank ``b % size`` (round-robin, so every rank gets
    long and short batches). A batch is the same on any world size, so features do not depend on
    the number of ranks.

    Args:
        batch_size: >= 1 (every command's ``--batch-size`` is bounded so); rank: 0..size-1.
    Returns:
        list of int64 index arrays, each sorted by descending length.
    """
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return batches[rank::size]


def pad_batch(seqs: Sequence[np.ndarray], device: torch.device | str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``seqs`` right-padded with 0 to the longest (at least 1 step) on ``device``.

    Returns:
        (tokens int64 [B, T], mask bool [B, T]: True on each row's own bytes, lengths int64 [B]).
    """
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    T = max(int(lengths.max()) if len(seqs) else 0, 1)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return tokens.to(device), mask.to(device), lengths.to(device)


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
        model: a :class:`hvd_lm.model.lm.LanguageModel` (eval mode).
        seqs: B uint8/int arrays of byte ids.
        kind: one of :data:`FEATURE_KINDS`.
        time_chunk: steps per ``model.encode`` call (bounds the [B, chunk, H] hidden states kept).
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast, :mod:`hvd_lm.model.device`).
    Returns:
        float32 tensor [B, H] on CPU.
    Raises:
        ValueError: unknown kind.
    """
    if kind not in FEATURE_KINDS:
        raise ValueError(f"features must be one of {FEATURE_KINDS}, got {kind!r}")
    device = torch.device(device)
    tokens, mask, lengths_d = pad_batch(seqs, device)
    T = max((len(s) for s in seqs), default=0)
    h, c = model.init_state(len(seqs), device, torch.float32)
    acc = torch.full(h.shape, float("-inf") if kind == "max" else 0.0, device=device)
    for t0 in range(0, T, time_chunk):
        t1 = min(T, t0 + time_chunk)
        active = torch.nonzero(lengths_d > t0).flatten()
        m = mask[active, t0:t1]
        with devices.autocast(device, precision):
            hs, (ha, ca) = model.encode(tokens[active, t0:t1], (h[active], c[active]), m)
        h = h.index_copy(0, active, ha.float())
        c = c.index_copy(0, active, ca.float())
        if kind == "mean":
            acc = acc.index_add(0, active, (hs.float() * m.unsqueeze(-1)).sum(1))
        elif kind == "max":
            part = hs.float().masked_fill(~m.unsqueeze(-1), float("-inf")).amax(1)
            acc = acc.index_copy(0, active, torch.maximum(acc[active], part))
    if kind == "mean":
        acc = acc / lengths_d.clamp(min=1).unsqueeze(1).to(acc.dtype)
    elif kind == "max":
        acc = torch.where(lengths_d.unsqueeze(1) > 0, acc, torch.zeros_like(acc))
    return {"cell": c, "hidden": h}.get(kind, acc).float().cpu()


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
              desc: str = "texts", time_chunk: int = 256, precision: str = "fp32",
              normalize: bool = False) -> FeatureResult:
    """Features of every text, in input order (Radford et al. 2017: final cell state).

    Args:
        model: a :class:`hvd_lm.model.lm.LanguageModel` in eval mode, on ``device``.
        texts: N strings.
        kind: ``cell`` (final c_T), ``hidden`` (final h_T), ``mean`` / ``max`` (over t of h_t).
        max_chars: keep the first ``max_chars`` bytes of each text (<= 0: all).
        batch_size: texts per batch (per rank), >= 1.
        ctx: a :class:`hvd_lm.comm.world.RankContext` to split the work over ranks (each rank
            gets every ``size``-th batch of the length-sorted order, see :func:`plan_batches`;
            results are gathered with :func:`hvd_lm.comm.engine.allgather` onto every rank);
            None = this process does everything.
        progress: this rank's share in chars on stderr (:class:`hvd_lm.train.log.Progress`: a bar
            on a terminal, a line every 10 s in a log); pass True on rank 0 only.
        time_chunk, precision: see :func:`encode_batch`.
        normalize: collapse whitespace first (:func:`hvd_lm.formats.tokenizer.normalize_text`).
    Returns:
        :class:`FeatureResult` with features float32 [N, H].
    Raises:
        ValueError: unknown kind.
    """
    t0 = time.perf_counter()
    rank, size = (ctx.rank, ctx.size) if ctx is not None else (0, 1)
    seqs = encode_texts(texts, 0, normalize)
    truncated = sum(len(s) > max_chars for s in seqs) if max_chars > 0 else 0
    seqs = [s[:max_chars] for s in seqs] if max_chars > 0 else seqs
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    mine = plan_batches(lengths, batch_size, rank, size)
    H = model.config.hidden_size
    # a sentinel row (index -1) first, so that no rank ever sends an empty tensor
    local_idx, local_feats = [torch.tensor([-1])], [torch.zeros(1, H)]
    with Progress(f"hvd-lm features of {desc}", int(sum(lengths[b].sum() for b in mine)), "char",
                  enabled=progress) as bar:  # a bar on a terminal, a line every 10 s in a log
        for b in mine:
            local_feats.append(encode_batch(model, [seqs[i] for i in b], kind, device,
                                            time_chunk, precision))
            local_idx.append(torch.from_numpy(b.astype(np.int64)))
            bar.update(int(lengths[b].sum()))
    feats, idx = torch.cat(local_feats), torch.cat(local_idx)
    if size > 1:
        feats = engine.allgather(feats, name=f"transfer_feats_{desc}")
        idx = engine.allgather(idx, name=f"transfer_idx_{desc}")
    feats, idx = feats[idx >= 0], idx[idx >= 0]
    out = np.zeros((len(texts), H), dtype=np.float32)
    out[idx.numpy()] = feats.numpy()
    if len(np.unique(idx.numpy())) != len(texts):
        raise RuntimeError(f"featurize: gathered {len(idx)} rows for {len(texts)} texts")
    return FeatureResult(out, int(lengths.sum()), time.perf_counter() - t0, truncated)


def cache_key(checkpoint_sha256: str, split: str, texts: Sequence[str], options: dict) -> str:
    """Cache key: sha256 of (the checkpoint file's sha256, the split name, the sha256 of the
    split's texts in order (each UTF-8 encoded and length-prefixed, so boundaries count: the
    dataset's identity after loading, carving and subsampling, independent of where the file
    lies), the feature options (kind, max_chars, normalize, precision) and
    :data:`CACHE_VERSION`). Batch size, device and world size are left out: they do not change
    the features (beyond float rounding)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    return json_sha256({"version": CACHE_VERSION, "checkpoint_sha256": checkpoint_sha256,
                        "split": split, "texts_sha256": h.hexdigest(), "options": options})


#: Widest feature vector a cache entry may hold when the reader does not say
#: (:meth:`FeatureCache.load`): the largest ``model.hidden_size`` (its bound, 16,384).
MAX_FEATURE_WIDTH = next(f.metadata["le"] for f in dataclasses.fields(ModelConfig)
                         if f.name == "hidden_size")


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
        """The cached float32 [``n``, H] array, or None when absent, or when the entry is bad
        (one warning on stderr names it; it is featurized again and rewritten): not a regular
        file (a FIFO, a device: never opened), a header declaring more than ``n`` x
        :data:`MAX_FEATURE_WIDTH` float32 values or more than the file holds (refused from the
        header, before anything is allocated: :func:`hvd_lm.util.files.load_npy`), or another
        shape or dtype."""
        p = self.path(key)
        if not p.exists() and not p.is_symlink():
            return None
        try:
            arr = load_npy(p, n * MAX_FEATURE_WIDTH * 4, "a feature cache entry is a float32 "
                           "[N, H] .npy")
            if arr.dtype != np.float32 or arr.ndim != 2 or arr.shape[0] != n:
                raise FileRefused(f"{shown(p)}: {arr.dtype} {list(arr.shape)}, expected float32 "
                                  f"[{n}, H]")
        except (OSError, FileRefused) as e:
            print(f"warning: feature cache: {error_text(e)}; featurizing again (the entry is "
                  "rewritten)", file=sys.stderr)
            return None
        return arr

    def save(self, key: str, features: np.ndarray, meta: dict) -> Path:
        """Write ``features`` and ``meta`` atomically; returns the .npy path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.path(key)
        with atomic_path(p, suffix=".npy") as tmp:
            np.save(tmp, np.ascontiguousarray(features, dtype=np.float32))
        write_text(self.dir / f"{key}.json", json.dumps(meta, indent=1, sort_keys=True))
        return p
