"""Per-character heatmaps of one LM unit over texts, as HTML or PNG (the pictures of Radford et
al. 2017 and sentiment-discovery's ``visualize.py``/``generate.py --visualize``).

A unit's value is recorded after the model reads each byte (:func:`hvd_lm.transfer.generate.
trace_unit`); :func:`char_values` turns bytes into characters (UTF-8, undecodable bytes as U+FFFD,
the same text as :func:`hvd_lm.formats.tokenizer.decode`) and gives each character the value after
its last byte. Colours come from matplotlib's diverging ``RdYlGn`` map, symmetric about 0 with
the largest |value| shown at the ends (red low, green high); ``polarity`` -1 flips them, so that
green means positive sentiment for a unit whose classifier weight is negative.

* :func:`render_html`: one ``<span>`` per character (background colour, the value as its
  ``title`` tooltip), whitespace kept; one block per text.
* :func:`render_png`: the characters on a grid of coloured cells (``width`` per line, a new line at
  each newline), one block per text, with a colour bar; matplotlib's Agg backend.

Both write atomically (:mod:`hvd_lm.util.atomic`); :func:`render` picks by suffix.
"""

from __future__ import annotations

import codecs
import html
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import matplotlib
import numpy as np
from matplotlib.colors import to_hex

from hvd_lm.util.atomic import atomic_path, write_text
from hvd_lm.util.files import shown

matplotlib.use("Agg")  # files only, never a window

#: Suffixes :func:`render` understands.
HEATMAP_SUFFIXES = (".html", ".htm", ".png")
CMAP = "RdYlGn"


@dataclass
class HeatRow:
    """One text of a heatmap: ``title``, its characters and one value per character."""

    title: str
    chars: list[str]
    values: np.ndarray


def char_values(ids: Sequence[int], values: Sequence[float]) -> tuple[list[str], np.ndarray]:
    """Characters of the byte sequence ``ids`` (UTF-8, errors replaced, as
    :func:`hvd_lm.formats.tokenizer.decode`) and, for each, the value at its last byte.

    Args:
        ids: B byte values; values: B numbers (the unit after each byte).
    Returns:
        (C characters, float64 [C]).
    Raises:
        ValueError: lengths differ.
    """
    if len(ids) != len(values):
        raise ValueError(f"{len(ids)} bytes but {len(values)} values")
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pairs = [(ch, float(v)) for b, v in zip(ids, values) for ch in dec.decode(bytes([int(b)]))]
    pairs += [(ch, float(values[-1])) for ch in dec.decode(b"", final=True)]  # a cut sequence
    return [c for c, _ in pairs], np.asarray([v for _, v in pairs], dtype=np.float64)


def render_html(rows: Sequence[HeatRow], path: str | Path, heading: str, polarity: int,
                vmax: float) -> None:
    """Write an HTML page with one block per row and one ``<span>`` per character, coloured by
    value / ``vmax`` (:func:`render` bounds the characters first: :data:`MAX_HTML_CHARS`)."""
    parts = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">",
             f"<title>{html.escape(heading)}</title>",
             "<style>body{font-family:sans-serif;margin:1.5em}"
             ".text{font-family:monospace;white-space:pre-wrap;line-height:1.7;"
             "border:1px solid #ccc;padding:.6em;margin-bottom:1.2em}</style>",
             "</head><body>", f"<h3>{html.escape(heading)}</h3>",
             f"<p>colour: value / {vmax:.4g} ({CMAP}, red = "
             f"{'high' if polarity < 0 else 'low'}, green = "
             f"{'low' if polarity < 0 else 'high'}); hover a character for its value</p>"]
    for r in rows:  # the colour scale, symmetric about 0: value / vmax from -1 (red) to 1 (green)
        rgba = matplotlib.colormaps[CMAP](np.clip(polarity * r.values / vmax, -1, 1) * 0.5 + 0.5)
        spans = "".join(f"<span style=\"background:{to_hex(c)}\" title=\"{v:.4f}\">"
                        f"{html.escape(ch)}</span>" for ch, v, c in zip(r.chars, r.values, rgba))
        parts += [f"<h4>{html.escape(r.title)}</h4>", f"<div class=\"text\">{spans}</div>"]
    parts.append("</body></html>")
    write_text(path, "\n".join(parts) + "\n")


def _grid(chars: list[str], width: int) -> list[list[int]]:
    """Line layout: lists of character indices, at most ``width`` per line, a new line after
    each newline character."""
    lines: list[list[int]] = [[]]
    for i, ch in enumerate(chars):
        if len(lines[-1]) >= width:
            lines.append([])
        lines[-1].append(i)
        if ch == "\n":
            lines.append([])
    return [ln for ln in lines if ln] or [[]]


#: The most characters a PNG heatmap draws (250 lines of 80; one matplotlib text object each).
MAX_PNG_CHARS = 20_000
#: The most characters an HTML heatmap holds (about 55 bytes of HTML each, and one model step
#: per byte to compute; docs/transfer.md gives what more cost): 5x visualize's default (20 texts
#: of 2,000).
MAX_HTML_CHARS = 200_000


def check_chars(path: str | Path, n: int, lower: str) -> None:
    """Refuse a heatmap of more characters than its kind draws (:data:`MAX_PNG_CHARS`,
    :data:`MAX_HTML_CHARS`), before the values are computed where the caller can.

    Args:
        n: characters to draw; lower: what to lower, with the flags (for the message).
    Raises:
        ValueError: naming the file, the count, the bound and ``lower``.
    """
    png = Path(path).suffix.lower() == ".png"
    limit = MAX_PNG_CHARS if png else MAX_HTML_CHARS
    if n > limit:
        raise ValueError(f"{shown(path)}: {n:,} characters are too many for "
                         f"{'a PNG' if png else 'an HTML'} heatmap (at most {limit:,}"
                         + (", one drawn glyph each): write .html, or " if png else "): ")
                         + lower)


def render_png(rows: Sequence[HeatRow], path: str | Path, heading: str, polarity: int,
               vmax: float, width: int = 80) -> None:
    """Write a PNG: each row's characters on cells coloured by value / ``vmax``, ``width`` per
    line (:func:`render` bounds the characters first: :data:`MAX_PNG_CHARS`, as matplotlib draws
    one text object per character)."""
    layout = [(r, _grid(r.chars, width)) for r in rows]
    grid = np.full((sum(len(g) + 1 for _, g in layout), width), np.nan)  # + a title line each
    import matplotlib.pyplot as plt  # here: pyplot's import only for a PNG

    fig, ax = plt.subplots(figsize=(max(4.0, 0.13 * width + 1.2), 0.25 * len(grid) + 0.9))
    y = 0
    for r, g in layout:
        ax.text(-0.5, y, r.title, ha="left", va="center", fontsize=8, weight="bold")
        for y, line in enumerate(g, y + 1):
            for x, i in enumerate(line):
                grid[y, x] = np.clip(polarity * r.values[i] / vmax, -1, 1)
                ch = "\u21b5" if r.chars[i] == "\n" else r.chars[i]
                if ch.isprintable() and ch.strip():  # (a space, a control character: a cell)
                    ax.text(x, y, ch, ha="center", va="center", fontsize=8, family="monospace")
        y += 1
    im = ax.imshow(grid, cmap=CMAP, vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set(xticks=[], yticks=[])
    ax.set_title(heading, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01).set_ticks(
        [-1, 0, 1], labels=[f"{-polarity * vmax:.3g}", "0", f"{polarity * vmax:.3g}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # glyphs the monospace font lacks (emoji)
        fig.tight_layout()
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def render(rows: Sequence[HeatRow], path: str | Path, heading: str, polarity: int = 1) -> None:
    """:func:`render_html` or :func:`render_png` by the suffix of ``path``, the colours symmetric
    about 0 with the largest |value| of ``rows`` at the ends.

    Raises:
        ValueError: another suffix (:func:`check_suffix`), or more characters than that kind
            draws (:func:`check_chars`).
    """
    check_suffix(str(path))
    check_chars(path, sum(len(r.chars) for r in rows), "lower --max-chars")
    vmax = max((float(np.abs(r.values).max()) for r in rows if len(r.values)), default=0.0)
    draw = render_png if Path(path).suffix.lower() == ".png" else render_html
    draw(rows, path, heading, polarity, vmax if vmax > 0 else 1.0)


def check_suffix(path: str) -> None:
    """For settings' ``check()``: ``path`` is empty or ends in a heatmap suffix.

    Raises:
        ValueError: naming the path.
    """
    if path and Path(path).suffix.lower() not in HEATMAP_SUFFIXES:
        raise ValueError(f"heatmap {path!r} must end in .html or .png")
