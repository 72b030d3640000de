"""Bits per character (BPC): total -log2 p(next byte) over all predicted bytes / their count.

Summed across ranks with an allreduce, so N ranks over disjoint streams give the same number as one
process over the whole split (up to float rounding).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hvd_lm import precision as prec
from hvd_lm.data import IGNORE, RankStreams


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
        with prec.autocast(device, precision):
            logits, state = model(x, state, reset=batch.reset.to(device))
        # float64 log-softmax: the sum over millions of chars stays exact (uniform -> 8.0 bits).
        nats = F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), y.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")
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
        from hvd_lm.distributed import allreduce_sum

        bits, chars = allreduce_sum([bits, float(chars)], name="eval_bpc")
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
    import gzip
    import lzma

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
