"""``hvd-lm visualize CHECKPOINT --input FILE --out OUT.html|OUT.png``: the per-character value of
one unit over given texts (sentiment-discovery ``visualize.py``; the sentiment-neuron pictures of
Radford et al. 2017).

The unit is ``--neuron N``, or by default the sentiment unit that ``hvd-lm transfer`` found,
read from its classifier (``--classifier OUT``; the checkpoint must be the classifier's, by
sha256), whose feature options (max chars, whitespace normalisation) then apply too. Each text is
read from the zero state, as transfer featurizes it (:func:`hvd_lm.transfer.generate.trace_unit`),
and drawn by :mod:`hvd_lm.transfer.heatmap`; with a classifier the colours are oriented so that
green is the positive side of the unit.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

from hvd_lm.formats import tokenizer
from hvd_lm.options import Command, option
from hvd_lm.transfer import texts as text_input
from hvd_lm.transfer.features import DEFAULT_MAX_CHARS, encode_texts
from hvd_lm.transfer.generate import UnitOptions, open_model, trace_unit
from hvd_lm.transfer.heatmap import HeatRow, char_values, check_chars, check_suffix, render
from hvd_lm.transfer.saved import USAGE_ERRORS


@dataclass
class VisualizeConfig(text_input.TextOptions, UnitOptions):
    """Settings of ``hvd-lm visualize`` (the shared ones: :class:`UnitOptions`,
    :class:`~hvd_lm.transfer.texts.TextOptions`)."""

    out: str = option("", "heatmap file: OUT.html (one span per character) or OUT.png",
                      required=True)
    max_texts: int = option(20, "draw at most the first N texts", ge=1)
    max_chars: int | None = option(None, "keep the first N bytes of each text (default: the "
                                   f"classifier's, else {DEFAULT_MAX_CHARS}; 0 = all)", ge=0)

    def check(self) -> None:
        """Cross-field rules."""
        if self.neuron is None and not self.classifier:
            raise ValueError("give the unit: --neuron N or --classifier (its sentiment unit)")
        check_suffix(self.out)


def visualize(cfg: VisualizeConfig) -> int:
    """``hvd-lm visualize``: draw the heatmap (see the module docstring) and say what was
    written.

    Raises:
        ClassifierError / DatasetError / FileNotFoundError / ValueError: bad classifier, input,
            checkpoint or unit.
    """
    path, model, device, saved, neuron, polarity, state = open_model(
        "visualize", cfg, {"--out": cfg.out}, [cfg.input] if cfg.input != "-" else [])
    stream = text_input.iter_texts(cfg.input, cfg.format, cfg.text_field)
    first = list(itertools.islice(stream.records, cfg.max_texts))  # the rest is never read
    stream.records.close()
    if not first:
        raise text_input.DatasetError(f"{stream.name}: no texts")
    feat = saved.features if saved else {"max_chars": DEFAULT_MAX_CHARS, "normalize": False}
    max_chars = feat["max_chars"] if cfg.max_chars is None else cfg.max_chars
    seqs = encode_texts([text for _, text, _ in first], max_chars, bool(feat["normalize"]))
    # before one model step per byte: the heatmap's size bound (HTML as PNG), the flags named
    check_chars(cfg.out, sum(len(tokenizer.decode(s)) for s in seqs),
                f"lower --max-chars ({max_chars:,}{': all' if max_chars == 0 else ''}) or "
                f"--max-texts ({cfg.max_texts})")
    values = trace_unit(model, seqs, neuron, state, device, progress=True)
    rows = [HeatRow(f"line {line}", *char_values(s, v))
            for (line, _, _), s, v in zip(first, seqs, values)]
    orient = "" if saved is None else \
        f"; classifier weight {'< 0: colours flipped' if polarity < 0 else '> 0'}"
    render(rows, cfg.out, f"unit {neuron} ({state}) of {path.name} after each character"
           f"{orient}", polarity)
    print(f"wrote {cfg.out}: unit {neuron} over {len(rows)} text(s), "
          f"{sum(len(r.chars) for r in rows):,} characters", file=sys.stderr)
    return 0


VISUALIZE = Command(
    VisualizeConfig, visualize,
    usage_errors=USAGE_ERRORS,
    description="Per-character heatmap (HTML or PNG) of one LM unit over given texts: by "
    "default the sentiment unit of a classifier saved by hvd-lm transfer "
    "(NVIDIA/sentiment-discovery visualize.py).")
