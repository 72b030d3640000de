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
