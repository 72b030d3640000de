"""Bits per character (BPC) of a model on a split: total -log2 p(next byte) over all predicted
bytes / their count (the training loss, the same quantity in nats, is
:func:`hvd_lm.train.step.window_nll`), and ``hvd-lm eval``.

Summed across ranks with an allreduce, so N ranks over disjoint streams give the same number as one
process over the whole split (up to float rounding).
"""
from __future__ import annotations

import gzip
import json
import lzma
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hvd_lm.comm import horovod as comm
from hvd_lm.formats.checkpoint import CheckpointError
from hvd_lm.formats.export import MAX_SEQ_LEN
from hvd_lm.formats.manifest import MANIFEST_NAME, load_manifest
from hvd_lm.model import device as devices
from hvd_lm.model.load import load_model, resolve_model
from hvd_lm.model.mlstm_kernels import KERNELS
from hvd_lm.options import Command, option
from hvd_lm.train.data import IGNORE, RankStreams
from hvd_lm.train.preflight import check_vocab
from hvd_lm.train.settings import EVAL_BATCH_SIZE
from hvd_lm.util.atomic import check_output, write_text


@torch.no_grad()
def nll_bits(model, streams: RankStreams, device: torch.device, precision: str = "fp32"
             ) -> tuple[float, int]:
    """This rank's (sum of -log2 p over its targets, number of targets), state carried through.

    Args:
        streams: this rank's eval streams (epoch 0 is used).
    """
    model.eval()
    state = None
    bits, chars = 0.0, 0
    for batch in streams:
        x, y = batch.inputs.to(device), batch.targets.to(device)
        with devices.autocast(device, precision):
            logits, state = model(x, state, reset=batch.reset.to(device), time_major=True)
        # float64 log-softmax: the sum over millions of chars stays exact (uniform -> 8.0 bits);
        # logits [T, B, 256] as the model makes them, the targets transposed to match
        nats = F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]),
                               y.t().reshape(-1), ignore_index=IGNORE, reduction="sum")
        bits += float(nats) / math.log(2)
        chars += batch.chars
    return bits, chars


def bpc(model, streams: RankStreams, device: torch.device, precision: str = "fp32",
        distributed: bool = True) -> tuple[float, int]:
    """(BPC over all ranks, characters evaluated over all ranks).

    Raises:
        ValueError: no characters to evaluate.
    """
    bits, chars = nll_bits(model, streams, device, precision)
    if distributed:
        bits, chars = comm.allreduce_sum([bits, float(chars)], name="eval_bpc")
    if chars <= 0:
        raise ValueError("no characters to evaluate (empty split?)")
    return bits / chars, int(chars)


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
    out = {}
    for name in which:
        if name not in funcs:
            raise ValueError(f"unknown compressor {name!r} (known: {list(funcs)})")
        out[name] = 8.0 * len(funcs[name](data)) / len(data)
    return out


@dataclass
class EvalConfig:
    """``hvd-lm eval CHECKPOINT SHARDS``: bits per character of a checkpoint on a split."""

    checkpoint: str = option("", "checkpoint file, run directory (its latest) or exported folder",
                             positional=True, required=True)
    shards: str = option("", "shard directory (with manifest.json)", positional=True,
                         required=True)
    split: str = option("val", "manifest split")
    batch_size: int = option(EVAL_BATCH_SIZE, "rows per rank", ge=1)
    seq_len: int = option(0, "window, bytes (0 = the checkpoint's)", ge=0)
    max_bytes: int = option(0, "evaluate only the first N bytes (0 = all)", ge=0)
    precision: str = option("fp32", "autocast precision", choices=devices.PRECISIONS)
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    rnn_kernels: str = option("auto", "fused mLSTM cell kernels on this device (auto: triton "
                              "on CUDA when installed, else torch)", choices=KERNELS)
    output: str = option("", "also write the result JSON to this file (rank 0)")


def eval_command(cfg: EvalConfig) -> int:
    """``hvd-lm eval``: print (and with ``--output`` write) ``{"bpc", "chars", ...}`` as JSON on
    rank 0; ranks split the streams and sum bits and chars (Horovod)."""
    ctx = comm.init()
    device = devices.resolve_device(cfg.device, ctx.local_rank, ctx.local_size)
    model, ck = load_model(cfg.checkpoint, map_location=device, rnn_kernels=cfg.rnn_kernels)
    manifest = load_manifest(cfg.shards)
    if cfg.output:  # before any work: never replace what this run reads
        check_output(cfg.output, "--output", resolve_model(cfg.checkpoint),
                     Path(cfg.shards) / MANIFEST_NAME, *(s.path for s in manifest.shards))
    check_vocab(model.config.vocab_size, manifest, f"{cfg.checkpoint}: model.vocab_size",
                "evaluate it on shards of that vocabulary")
    seq_len = cfg.seq_len or ck["config"].get("data", {}).get("seq_len", 256)
    if not cfg.seq_len and (type(seq_len) is not int or not 1 <= seq_len <= MAX_SEQ_LEN):
        raise CheckpointError(f"{cfg.checkpoint}: field config.data.seq_len is "
                              f"{str(seq_len)[:40]!r}, expected an int in 1..{MAX_SEQ_LEN:,} "
                              "(or give --seq-len)")
    streams = RankStreams(manifest, cfg.split, ctx.rank, ctx.size,
                          cfg.batch_size, seq_len, shuffle_shards=False, max_bytes=cfg.max_bytes,
                          verify=True)
    value, chars = bpc(model, streams, device, cfg.precision)
    if ctx.is_root:
        result = {"checkpoint": str(cfg.checkpoint), "split": cfg.split, "bpc": value,
                  "chars": chars, "step": ck["step"], "world_size": ctx.size}
        sys.stdout.write(json.dumps(result) + "\n")  # one write: one line under launchers
        sys.stdout.flush()
        if cfg.output:
            write_text(cfg.output, json.dumps(result, indent=1) + "\n")
    return 0


EVAL = Command(EvalConfig, eval_command,
               description="Bits per character of a checkpoint on a shard split: the sum of "
               "-log2 p(next byte) over every predicted byte, divided by their number, summed "
               "across ranks when launched on several.")
