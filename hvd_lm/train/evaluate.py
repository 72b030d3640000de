"""Bits per character (BPC) of a model on a split: total -log2 p(next byte) over all predicted
bytes / their count (the training loss, the same quantity in nats, is
:func:`hvd_lm.train.step.window_nll`), and ``hvd-lm eval``.

Summed across ranks with an allreduce, so N ranks over disjoint streams give the same number as one
process over the whole split (up to float rounding).
"""
from __future__ import annotations

import gzip
import itertools
import json
import lzma
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hvd_lm.comm import engine
from hvd_lm.comm.threads import set_rank_threads
from hvd_lm.formats.checkpoint import CheckpointError
from hvd_lm.formats.export import MAX_SEQ_LEN
from hvd_lm.formats.manifest import MANIFEST_NAME, load_manifest
from hvd_lm.formats.shards import read_tokens
from hvd_lm.model import device as devices
from hvd_lm.model.config import KERNELS
from hvd_lm.model.load import load_model, model_files
from hvd_lm.options import Command, ConfigError, option
from hvd_lm.train.data import RankStreams, stream_bounds
from hvd_lm.train.log import Progress
from hvd_lm.train.memory import free_memory
from hvd_lm.train.preflight import check_vocab
from hvd_lm.train.settings import EVAL_BATCH_SIZE
from hvd_lm.train.step import window_nll
from hvd_lm.util.atomic import human, write_text
from hvd_lm.util.files import check_output


@torch.no_grad()
def bpc(model, streams: RankStreams, device: torch.device, precision: str = "fp32",
        distributed: bool = True, progress: bool = False) -> tuple[float, int]:
    """(BPC over all ranks, characters evaluated over all ranks): each rank's sum of -log2 p over
    its targets and their number, the state carried through, summed over the ranks.

    Args:
        streams: this rank's eval streams (epoch 0 is used).
        distributed: sum over the ranks (an allreduce: every rank calls it).
        progress: this rank's progress on stderr (:class:`hvd_lm.train.log.Progress`: a bar on a
            terminal, a line every 10 s in a log).

    Raises:
        ValueError: no characters to evaluate.
    """
    model.eval()
    bits, chars = 0.0, 0
    if streams.batch_size > 0:  # none when there are more ranks than validation rows
        state = None
        bar = Progress("hvd-lm eval (rank 0)", streams.chars_per_epoch, "char", enabled=progress)
        for batch in streams:
            # float64 log-softmax: the sum over millions of chars stays exact (uniform -> 8.0
            # bits)
            nats, state = window_nll(model, batch, state, device, precision, torch.float64)
            bits += float(nats) / math.log(2)
            chars += batch.chars
            bar.update(batch.chars)
        bar.close()
    if distributed:
        bits, chars = engine.allreduce_sum([bits, float(chars)], name="eval_bpc")
    if chars <= 0:
        raise ValueError("no characters to evaluate (empty split?)")
    return bits / chars, int(chars)


@torch.no_grad()
def estimate_seconds(model, streams: RankStreams, device: torch.device,
                     precision: str = "fp32") -> float:
    """Seconds :func:`bpc` would take over ``streams``: two of its windows (forward and loss)
    timed (after one untimed: kernels compiled for these shapes) and scaled to its windows per
    row; the model is left in training mode. What a run planned to a deadline
    (:mod:`hvd_lm.train.deadline`) reserves for its final validation before it has run one."""
    if streams.batch_size == 0:  # more ranks than validation rows: nothing here
        return 0.0
    model.eval()
    state, times = None, []
    try:
        for batch in itertools.islice(streams, 3):
            t0 = time.perf_counter()
            nats, state = window_nll(model, batch, state, device, precision, torch.float64)
            float(nats)  # the device done
            times.append(time.perf_counter() - t0)
    finally:
        model.train()
    if not times:
        return 0.0
    per_window = min(times[1:] or times)
    return per_window * max(1, streams.windows_per_epoch)


def compressor_bpc(data: bytes, which: tuple[str, ...] = ("xz", "gzip")) -> dict[str, float]:
    """Bits per character of general-purpose compressors on ``data``: 8 x compressed / original
    bytes. ``xz`` is ``lzma.compress(preset=9)`` (the .xz format of ``xz -9``), ``gzip`` is
    ``gzip.compress(compresslevel=9, mtime=0)`` (``gzip -9``). A trained LM should beat both.

    Raises:
        ValueError: empty ``data`` or an unknown compressor name.
    """
    if not data:
        raise ValueError("no bytes to compress")
    funcs = {"xz": lambda b: lzma.compress(b, preset=9),
             "gzip": lambda b: gzip.compress(b, compresslevel=9, mtime=0)}
    unknown = [name for name in which if name not in funcs]
    if unknown:
        raise ValueError(f"unknown compressor {unknown[0]!r} (known: {list(funcs)})")
    return {name: 8.0 * len(funcs[name](data)) / len(data) for name in which}


def split_bytes(manifest, split: str, max_bytes: int = 0) -> bytes:
    """The byte stream ``hvd-lm eval`` reads from ``split``: its shards' tokens in manifest order
    (documents separated by the EOD byte), the first ``max_bytes`` when > 0."""
    parts = [read_tokens(s.path, 0, s.tokens) for s in manifest.split(split)]
    return np.concatenate(parts).tobytes()[:max_bytes or None]


def eval_window(model_cfg, manifest, cfg: "EvalConfig", seq_len: int, rows: int, ranks: int,
                device: torch.device) -> int:
    """The window eval reads: ``seq_len``, or the longest row of the split when that is shorter
    (the state is carried across windows, so the BPC is the same; only padding is saved: a
    window far longer than the split would allocate its logits for nothing); refused when one
    window's
    logits and states would not fit in the memory free (:func:`hvd_lm.train.memory.free_memory`),
    naming --seq-len and --batch-size and the window that fits.

    Raises:
        ConfigError: the window's estimate (bytes), the memory free, the flags to lower.
    """
    total = min(sum(s.tokens for s in manifest.split(cfg.split)), cfg.max_bytes or math.inf)
    longest = int(np.max(np.diff(stream_bounds(max(total, 2), rows))))
    seq_len = max(1, min(seq_len, longest))
    # logits in fp32 and two fp64 copies (the loss's), 20 bytes per class; the window's states
    # and gates, about 32 bytes per unit
    per_position = 20 * model_cfg.vocab_size + 32 * model_cfg.hidden_size
    mine = -(-rows // ranks)  # this rank's share of the rows in all, at most
    need = mine * seq_len * per_position
    free, where = free_memory(device)
    if need > free:
        fits = max(1, free // (mine * per_position))
        raise ConfigError(f"one eval window of {mine} rows per rank x {seq_len:,} bytes needs "
                          f"about {human(need)} (logits and states of H={model_cfg.hidden_size}) "
                          f"and {human(free)} is {where}: give --seq-len {fits:,} or less, "
                          f"or a lower --batch-size ({rows})")
    return seq_len


@dataclass
class EvalConfig:
    """``hvd-lm eval CHECKPOINT SHARDS``: bits per character of a checkpoint on a split."""

    checkpoint: str = option("", "checkpoint file, run directory (its latest) or exported folder",
                             positional=True, required=True)
    shards: str = option("", "shard directory (with manifest.json)", positional=True, required=True)
    split: str = option("val", "manifest split")
    batch_size: int = option(0, "rows in all, split over the ranks (0 = the rows the training "
                             "evaluated with, its --eval-batch-size, so the BPC is the val BPC "
                             f"it logged; {EVAL_BATCH_SIZE} for an export without them)", ge=0)
    seq_len: int = option(0, "window, bytes (0 = the checkpoint's; at most 1,048,576)", ge=0,
                          le=MAX_SEQ_LEN)
    max_bytes: int = option(0, "evaluate only the first N bytes (0 = all)", ge=0)
    precision: str = option("fp32", "autocast precision", choices=devices.PRECISIONS)
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    rnn_kernels: str = option("auto", "fused mLSTM cell kernels on this device (auto: triton "
                              "on CUDA when installed, else torch)", choices=KERNELS)
    output: str = option("", "also write the result JSON to this file (rank 0)")
    threads: int = option(0, "torch CPU threads per rank (0 = the usable cores / the ranks on "
                          "this machine; a warning when ranks x threads exceed them)", ge=0)
    backend: str = option("horovod", engine.BACKEND_HELP, choices=engine.BACKENDS)
    baselines: list[str] = option(default_factory=list, help="also the bits per character of "
                                  "general-purpose compressors on the same bytes (rank 0, once): "
                                  "xz (xz -9), gzip (gzip -9), comma-separated",
                                  choices=("xz", "gzip"))


def eval_rows(asked: int, ck: dict) -> int:
    """Rows in all for ``hvd-lm eval`` (split over its ranks, whatever their number): ``asked``
    when > 0, else the training's ``run.eval_batch_size`` (the same cut, so the BPC it logged),
    else :data:`~hvd_lm.train.settings.EVAL_BATCH_SIZE`. Each row's recurrent state starts at
    zero, so a split cut into another number of rows scores a slightly different BPC."""
    run = ck.get("config", {}).get("run", {}) if isinstance(ck.get("config"), dict) else {}
    rows = run.get("eval_batch_size") if isinstance(run, dict) else None
    return asked or (rows if type(rows) is int and rows >= 1 else EVAL_BATCH_SIZE)


def eval_command(cfg: EvalConfig) -> int:
    """``hvd-lm eval``: print (and with ``--output`` write) ``{"bpc", "chars", ...}`` as JSON on
    rank 0 (with ``--baselines``: ``"baselines": {"xz": BPC, "gzip": BPC}`` of the same
    bytes); ranks split the streams and sum bits and chars (Horovod)."""
    ctx = engine.init(backend=cfg.backend)
    threads = set_rank_threads(cfg.threads, ctx, "eval")  # collective: an allgather of machine ids
    device = devices.resolve_device(cfg.device, ctx.local_rank, ctx.local_size)
    model, ck = load_model(cfg.checkpoint, map_location=device, rnn_kernels=cfg.rnn_kernels)
    manifest = load_manifest(cfg.shards)
    if cfg.output:  # before any work: never replace what this run reads
        check_output(cfg.output, "--output", *model_files(cfg.checkpoint),
                     Path(cfg.shards) / MANIFEST_NAME, *(s.path for s in manifest.shards))
    check_vocab(model.config.vocab_size, manifest, f"{cfg.checkpoint}: model.vocab_size",
                "evaluate it on shards of that vocabulary")
    seq_len = cfg.seq_len or ck["config"].get("data", {}).get("seq_len", 256)
    if not cfg.seq_len and (type(seq_len) is not int or not 1 <= seq_len <= MAX_SEQ_LEN):
        raise CheckpointError(f"{cfg.checkpoint}: field config.data.seq_len is "
                              f"{str(seq_len)[:40]!r}, expected an int in 1..{MAX_SEQ_LEN:,} "
                              "(or give --seq-len)")
    rows = eval_rows(cfg.batch_size, ck)
    seq_len = eval_window(model.config, manifest, cfg, seq_len, rows, ctx.size, device)
    streams = RankStreams(manifest, cfg.split, ctx.rank, ctx.size, rows, seq_len, verify=True,
                          shuffle_shards=False, max_bytes=cfg.max_bytes, global_rows=True)
    engine.begin_steps()  # the torch engine's collectives: its timeout from here
    value, chars = bpc(model, streams, device, cfg.precision, progress=ctx.is_root)
    if ctx.is_root:
        result = {"checkpoint": str(cfg.checkpoint), "split": cfg.split, "bpc": value,
                  "chars": chars, "step": ck["step"], "world_size": ctx.size,
                  "rows": rows, "threads": threads}
        if cfg.baselines:  # the same bytes through xz -9 / gzip -9: what the LM must beat
            result["baselines"] = compressor_bpc(
                split_bytes(manifest, cfg.split, cfg.max_bytes), tuple(cfg.baselines))
        sys.stdout.write(json.dumps(result) + "\n")  # one write: one line under launchers
        sys.stdout.flush()
        if cfg.output:
            write_text(cfg.output, json.dumps(result, indent=1) + "\n")
    return 0


EVAL = Command(EvalConfig, eval_command, description="Bits per character of a checkpoint on a "
               "shard split: the sum of -log2 p(next byte) over every predicted byte, divided by "
               "their number, summed across ranks when launched on several.")
