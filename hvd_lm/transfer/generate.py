"""``hvd-lm generate CHECKPOINT``: sample text from the byte-level LM, optionally steering it by
holding one unit fixed, and draw that unit's per-character value (sentiment-discovery's
``generate.py``; Radford et al. 2017, "Learning to Generate Reviews and Discovering Sentiment",
section 4: fixing the sentiment unit's value makes the model write positive or negative reviews).
``hvd-lm visualize CHECKPOINT --input FILE --out OUT.html|OUT.png`` draws that value over given
texts instead (sentiment-discovery's ``visualize.py``; the sentiment-neuron pictures of the same
paper).

Only the model's public API is used (:meth:`~hvd_lm.model.lm.LanguageModel.init_state`,
``forward``/``encode`` on [B, T] byte ids with an explicit state), one byte per call while a unit
is read or pinned.

* **Priming.** The prime's UTF-8 bytes (:func:`hvd_lm.formats.tokenizer.encode`) are read from the
  zero state, as ``hvd-lm transfer`` reads a text; an empty prime starts from one end-of-document
  byte (0), which precedes every document in training, i.e. "a new review".
* **Sampling** (:func:`sample_next`): softmax of logits / temperature over the 256 bytes,
  restricted to the ``top_k`` most likely when ``top_k > 0``, drawn with a CPU
  ``torch.Generator`` seeded by ``seed`` (so a seed gives the same samples on a given device);
  temperature 0 is greedy (argmax). ``samples`` rows are drawn as one batch. A sampled
  end-of-document byte ends that sample's text.
* **Steering** (``neuron``, ``overwrite``): after every byte read, prime included, the unit's
  value in the cell state c_t (or the hidden state h_t, ``state="hidden"``) is set to
  ``overwrite`` before the next step, as sentiment-discovery's ``--overwrite`` does (it wrote h_t
  times the sign of the classifier weight; here the value is given as is).
* **Trace** (:func:`trace_unit` for given texts): the unit's value after each byte, read before
  any pinning (what the model computed), for the heatmap (:mod:`hvd_lm.transfer.heatmap`).
* **Visualize** (:func:`visualize`): the unit is ``--neuron N``, or by default the sentiment unit
  that ``hvd-lm transfer`` found, read from its classifier (``--classifier OUT``; the checkpoint
  must be the classifier's, by sha256), whose feature options (max chars, whitespace
  normalisation) then apply too. Each text is read from the zero state, as transfer featurizes
  it (:func:`trace_unit`); with a classifier the colours are oriented so that green is the
  positive side of the unit.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hvd_lm.formats import tokenizer
from hvd_lm.options import Command, option
from hvd_lm.train.log import Progress
from hvd_lm.transfer import features as lm_features
from hvd_lm.transfer import texts as text_input
from hvd_lm.transfer.features import ModelOptions, featurize, open_classified, pad_batch
from hvd_lm.transfer.heatmap import HeatRow, char_values, check_chars, check_suffix, render
from hvd_lm.transfer.saved import USAGE_ERRORS, ClassifierError
from hvd_lm.util.atomic import write_text

#: Which state a unit is read from / pinned in.
STATES = ("cell", "hidden")
#: Bounds of what one ``generate`` holds in memory: bytes per sample, samples (one batch: the
#: model's state is [samples, H] per step), and bytes in all (each keeps its tensor and unit
#: value until the end).
MAX_LENGTH = 1 << 20
MAX_SAMPLES = 4096
MAX_GENERATED = 1 << 24
#: Below this accuracy of the unit alone (on val, else train), generate warns that pinning it is
#: unlikely to steer (a fraction; docs/transfer.md gives the run it comes from).
WEAK_UNIT_ACCURACY = 0.6


@dataclass
class Generation:
    """Output of :func:`generate`.

    Attributes:
        prime: uint8 [P] the prime's bytes.
        tokens: int64 [S, length] the sampled bytes of each sample.
        texts: S strings: prime + sample, decoded (UTF-8, errors replaced), cut at a sampled
            end-of-document byte.
        first_logits: float32 [S, 256] (CPU) the logits the first byte was sampled from.
        unit: float32 [S, P + length] the unit's value after each prime and sampled byte (before
            pinning), or None without ``neuron``.
        state: the final (h, c), each [S, H] (after pinning).
    """

    prime: np.ndarray
    tokens: np.ndarray
    texts: list[str]
    first_logits: torch.Tensor
    unit: np.ndarray | None
    state: tuple[torch.Tensor, torch.Tensor]

    def sample_bytes(self, i: int) -> np.ndarray:
        """uint8: prime + sample ``i`` up to (without) a sampled end-of-document byte."""
        gen = self.tokens[i]
        stop = np.flatnonzero(gen == tokenizer.EOD)
        gen = gen[:stop[0]] if stop.size else gen
        return np.concatenate([self.prime, gen.astype(np.uint8)])


def sample_next(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator) -> torch.Tensor:
    """One byte per row of ``logits`` [S, V]: argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the ``top_k`` largest (all when 0), in float64 on the CPU.

    Returns:
        int64 [S] (CPU).
    """
    lg = logits.detach().to("cpu", torch.float64)
    if temperature == 0:
        return lg.argmax(-1)
    lg = lg / temperature
    if 0 < top_k < lg.shape[-1]:
        kth = torch.topk(lg, top_k, dim=-1).values[..., -1:]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    return torch.multinomial(torch.softmax(lg, -1), 1, generator=generator).squeeze(-1)


def _check_unit(model, neuron: int | None, state: str) -> None:
    """Raise ValueError for a ``state`` not in :data:`STATES` or a unit outside 0..H-1 (None:
    no unit)."""
    H = model.config.hidden_size
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    if neuron is not None and not 0 <= neuron < H:
        raise ValueError(f"neuron {neuron} is outside 0..{H - 1} (the model has H={H})")


def _pin(state, neuron: int | None, value: float | None, which: str):
    """Record the unit's value [B] (before pinning) and pin it; returns (state, value or None)."""
    if neuron is None:
        return state, None
    state, idx = list(state), 1 if which == "cell" else 0  # state is (h, c)
    seen = state[idx][:, neuron].float().cpu()
    if value is not None:
        state[idx] = state[idx].clone()
        state[idx][:, neuron] = value
    return tuple(state), seen


@torch.no_grad()
def generate(model, prime: str = "", length: int = 200, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, samples: int = 1, neuron: int | None = None,
             overwrite: float | None = None, state: str = "cell",
             device: torch.device | str = "cpu", progress: bool = False) -> Generation:
    """Sample ``samples`` continuations of ``prime`` of ``length`` bytes (see the module
    docstring).

    Args:
        model: a :class:`~hvd_lm.model.lm.LanguageModel` in eval mode on ``device``.
        prime: text to continue ("" = a new document).
        temperature: >= 0 (0 = greedy); top_k: 0 (all) or the k most likely bytes.
        neuron: unit to trace (and with ``overwrite`` pin) in ``state``; None = neither.
        overwrite: value the unit is held at after every byte read.
        progress: the sampled chars on stderr (:class:`hvd_lm.train.log.Progress`: a bar on a
            terminal, a line every 10 s in a log).
    Returns:
        :class:`Generation`.
    Raises:
        ValueError: length/samples < 1, temperature < 0, top_k < 0, unit outside 0..H-1,
            ``overwrite`` without ``neuron``, unknown state.
    """
    if length < 1 or samples < 1:
        raise ValueError(f"length and samples must be >= 1, got {length} and {samples}")
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature and top_k must be >= 0, got {temperature}, {top_k}")
    _check_unit(model, neuron, state)
    if overwrite is not None and neuron is None:
        raise ValueError("overwrite needs a neuron to pin")
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = tokenizer.encode(prime)
    feed = ids.astype(np.int64) if len(ids) else np.array([tokenizer.EOD], np.int64)
    tokens = torch.from_numpy(feed).to(device).unsqueeze(0).repeat(samples, 1)  # [S, P']
    st = model.init_state(samples, device)
    trace: list[torch.Tensor | None] = []  # (None without a neuron: not kept)
    for chunk in [tokens] if neuron is None else tokens.split(1, dim=1):  # a unit: byte by byte
        logits, st = model(chunk, st)
        st, seen = _pin(st, neuron, overwrite, state)
        trace.append(seen)
    trace = trace if len(ids) else []  # the start byte is not part of the text
    first = logits[:, -1].float().cpu().clone()
    out = []
    with Progress("hvd-lm generate", length * samples, "char", enabled=progress) as bar:
        for _ in range(length):
            bar.update(samples)
            out.append(sample_next(logits[:, -1], temperature, top_k, gen))
            logits, st = model(out[-1].to(device).unsqueeze(1), st)
            st, seen = _pin(st, neuron, overwrite, state)
            trace.append(seen)
    result = Generation(ids.copy(), torch.stack(out, 1).numpy(), [], first,
                        torch.stack(trace, 1).numpy() if neuron is not None else None,
                        (st[0].detach(), st[1].detach()))
    result.texts = [tokenizer.decode(result.sample_bytes(i)) for i in range(samples)]
    return result


@torch.no_grad()
def trace_unit(model, seqs: Sequence[np.ndarray], neuron: int, state: str = "cell",
               device: torch.device | str = "cpu", progress: bool = False) -> list[np.ndarray]:
    """The unit's value after each byte of each sequence, read from the zero state as
    ``hvd-lm transfer`` reads a text (one batch, right-padded, masked: a row's values equal
    those of the text alone).

    Args:
        seqs: B byte-id arrays; neuron: unit index; state: ``cell`` or ``hidden``.
        progress: the chars read on stderr (a bar on a terminal, a line every 10 s in a log).
    Returns:
        B float32 arrays, each as long as its sequence.
    Raises:
        ValueError: unit outside 0..H-1 or unknown state.
    """
    _check_unit(model, neuron, state)
    device = torch.device(device)
    tokens, mask, lengths = pad_batch(seqs, device)
    T = max((len(s) for s in seqs), default=0)
    st = model.init_state(len(seqs), device)
    vals = torch.zeros(len(seqs), T)
    with Progress("hvd-lm visualize", int(lengths.sum()), "char", enabled=progress) as bar:
        for t in range(T):
            _, st = model.encode(tokens[:, t:t + 1], st, mask[:, t:t + 1])
            vals[:, t] = st[1 if state == "cell" else 0][:, neuron].float().cpu()
            bar.update(int((lengths > t).sum()))
    return [vals[i, :len(s)].numpy().copy() for i, s in enumerate(seqs)]


def unit_alone_accuracy(neuron: dict) -> tuple[str, float] | None:
    """(split, accuracy as a fraction) of a classifier's sentiment unit alone (its ``neuron``
    record), thresholded: ``val`` when recorded, else ``train``; None when the record holds no
    number in [0, 1] there."""
    acc = neuron.get("accuracy") or {}
    for split in ("val", "train"):
        v = acc.get(split) if isinstance(acc, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0:
            return split, float(v)
    return None


def pinned_value(overwrite: float | None, steer: str, polarity: int) -> float | None:
    """The value the unit is held at: ``--overwrite`` as given, or with ``--steer`` its
    magnitude (default 3, the value sentiment-discovery's examples use) with the sign that moves
    the classifier toward that sentiment (``polarity``: the sign of the unit's weight)."""
    if not steer:
        return overwrite
    magnitude = abs(overwrite) if overwrite is not None else 3.0
    return magnitude * polarity * (1 if steer == "positive" else -1)


def open_model(command: str, cfg, outputs: dict[str, str], reads: Sequence = ()) -> tuple:
    """The model, classifier and unit of ``generate``/``visualize`` (one process; ``cfg``: a
    :class:`UnitOptions`): the checkpoint's model and the classifier at ``cfg.classifier``
    (None for ""), each output (``{flag: path}``, "" = none) refused where it names a file this
    run reads (:func:`hvd_lm.transfer.features.open_classified`), and the unit.

    Returns:
        (checkpoint path, model, device, classifier or None, unit, polarity, state): the unit is
        ``cfg.neuron`` when given, else the classifier's sentiment unit; polarity the sign of
        the classifier's weight on it (+1 without a classifier or weight); the state the unit
        is read from and pinned in is ``cfg.state`` unless ``"auto"``, which is the state the
        classifier's features were computed from (``cell``: the final cell state c_t;
        ``hidden``, ``mean``, ``max``: the hidden state h_t), or ``cell`` without a classifier
        (the reference's feature, Radford et al. 2017).
    Raises:
        FileNotFoundError: no checkpoint; ClassifierError: bad classifier files or another
        model's, or no unit given and none in the classifier; ValueError: a device that cannot
        be used, an output that is read.
    """
    lm, saved = open_classified(cfg, cfg.classifier, command, outputs, reads)
    neuron, polarity, state = cfg.neuron, 1, cfg.state
    if saved is not None:
        neuron = saved.neuron.get("index") if neuron is None else neuron
        if neuron is None:
            raise ClassifierError(f"{saved.path}: the classifier has no sentiment unit (every "
                                  "weight is 0); give --neuron")
        polarity = -1 if neuron < len(saved.model.coef) and saved.model.coef[neuron] < 0 else 1
    if state == "auto":
        state = "hidden" if saved is not None and saved.features.get("kind") != "cell" else "cell"
    return lm.path, lm.model, lm.device, saved, neuron, polarity, state


@dataclass
class UnitOptions(ModelOptions):
    """The settings of the commands that read one unit (``generate``, ``visualize`` inherit
    them; :func:`open_model` reads them)."""

    neuron: int | None = option(None, "unit to draw (generate: and pin; default with "
                                "--classifier: its sentiment unit)", ge=0)
    state: str = option("auto", "state the unit is read from (generate: and pinned in; auto: the "
                        "one the classifier's features come from, h_t for mean/max/hidden, else "
                        "the cell state)", choices=("auto", *STATES))
    classifier: str = option("", "classifier from hvd-lm transfer (its folder or file): the "
                             "default --neuron (generate: and each sample's P(positive)); "
                             "refused if fit on another checkpoint")


@dataclass
class GenerateConfig(UnitOptions):
    """Settings of ``hvd-lm generate`` (the shared ones: :class:`UnitOptions`)."""

    prime: str = option("", "text the samples continue (empty: a new review)")
    length: int = option(200, "bytes to generate per sample (at most 1,048,576)", ge=1,
                         le=MAX_LENGTH)
    temperature: float = option(1.0, "softmax temperature (0 = greedy, else 0.001..100)", ge=0,
                                le=100)
    top_k: int = option(0, "sample among the k most likely bytes (0 = all 256)", ge=0, le=256)
    seed: int = option(0, "sampling seed (same seed, same samples on a device)", ge=0, le=2**32 - 1)
    samples: int = option(1, "samples drawn (one batch; at most 4,096)", ge=1, le=MAX_SAMPLES)
    overwrite: float | None = option(None, "hold the unit at this value while sampling "
                                     "(sentiment-discovery --overwrite)", ge=-1e4, le=1e4)
    steer: str = option("", "with --classifier: pin the sentiment unit toward this sentiment, at "
                        "|--overwrite| (default 3) with the sign the classifier's weight gives "
                        "it (a unit whose weight is < 0 is held negative to steer positive)",
                        choices=("", "positive", "negative"))
    heatmap: str = option("", "write the unit's value per character of prime + sample: "
                          "OUT.html or OUT.png")
    output: str = option("", "also write the samples as JSON lines to this file")

    def check(self) -> None:
        """Cross-field rules (raised as ConfigError naming the settings' source)."""
        if self.length * self.samples > MAX_GENERATED:
            raise ValueError(f"--length {self.length:,} x --samples {self.samples:,} = "
                             f"{self.length * self.samples:,} bytes, more than the "
                             f"{MAX_GENERATED:,} one run generates (each byte's state and unit "
                             "value are kept); lower either")
        if 0 < self.temperature < 1e-3:  # logits / 1e-320 overflow: 0 is the greedy choice
            raise ValueError(f"--temperature {self.temperature:.3g} is below 0.001; give 0 for "
                             "greedy sampling")
        if (self.overwrite is not None or self.heatmap) and self.neuron is None \
                and not self.classifier:
            raise ValueError("--overwrite and --heatmap need a unit: --neuron N or --classifier")
        if self.steer and not self.classifier:
            raise ValueError("--steer needs --classifier: its weight says which sign of the unit "
                             "is which sentiment")
        check_suffix(self.heatmap)
        if self.heatmap:  # before sampling: each sample's prime and bytes are drawn
            check_chars(self.heatmap, (len(self.prime.encode("utf-8", "replace")) + self.length)
                        * self.samples, "lower --length or --samples")


def generate_command(cfg: GenerateConfig) -> int:
    """``hvd-lm generate``: sample, print each sample (and the classifier's P(positive) of it),
    write the heatmap / JSON lines."""
    path, model, device, saved, neuron, polarity, state = open_model(
        "generate", cfg, {"--output": cfg.output, "--heatmap": cfg.heatmap})
    value = pinned_value(cfg.overwrite, cfg.steer, polarity)
    res = generate(model, cfg.prime, cfg.length, cfg.temperature, cfg.top_k, cfg.seed,
                   cfg.samples, neuron, value, state, device, progress=True)
    prob = None
    if saved is not None:  # the classifier's view of each text, read afresh (no pinning)
        f = saved.features
        feats = featurize(model, res.texts, f["kind"], f["max_chars"], device=device,
                          precision=f["precision"], normalize=f["normalize"]).features
        prob = saved.model.predict_proba(feats)
    if neuron is not None:
        pin = f", held at {value:g}" if value is not None else ""
        orient = f" (classifier weight {'<' if polarity < 0 else '>'} 0)" if saved else ""
        if saved is not None and value:  # which way the pin steers, in the classifier's words
            pin += (f": steering toward {'positive' if value * polarity > 0 else 'negative'} "
                    "sentiment")
        print(f"unit {neuron} of the {state} state{orient}{pin}")
        alone = unit_alone_accuracy(saved.neuron) if saved and value is not None else None
        if alone and alone[1] < WEAK_UNIT_ACCURACY and neuron == saved.neuron.get("index"):
            print(f"warning: unit {neuron} alone classifies the {alone[0]} split of "
                  f"{saved.meta.get('dataset') or 'its dataset'} at {alone[1]:.1%} (chance is "
                  "50%): pinning it is unlikely to steer sentiment; a sentiment unit emerges "
                  "with longer training (Radford et al. 2017)", file=sys.stderr)
    records = []
    for i, text in enumerate(res.texts):
        rec, extra = {"sample": i, "seed": cfg.seed, "prime": cfg.prime, "text": text}, ""
        if prob is not None:
            rec["p_positive"] = float(prob[i])
            extra += f", classifier P(positive) = {prob[i]:.3f}"
        if res.unit is not None:
            rec.update(unit=neuron, unit_values=[round(float(v), 5) for v in res.unit[i]])
            extra += f", unit mean over the sample {res.unit[i, len(res.prime):].mean():.3f}"
        print(f"=== sample {i} (seed {cfg.seed}{extra}) ===\n{text}")
        records.append(rec)
    if cfg.output:
        write_text(cfg.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    if cfg.heatmap:
        rows = [HeatRow(f"sample {i}", *char_values(ids, res.unit[i, :len(ids)]))
                for i, ids in enumerate(map(res.sample_bytes, range(len(res.texts))))]
        pin = f", held at {value:g} while sampling" if value is not None else ""
        render(rows, cfg.heatmap, f"unit {neuron} ({state}) of {path.name}{pin}: value "
               "after each character (before pinning)", polarity)
        print(f"wrote {cfg.heatmap}", file=sys.stderr)
    return 0


GENERATE = Command(
    GenerateConfig, generate_command, usage_errors=USAGE_ERRORS,
    description="Sample text from the LM (prime, temperature, top-k, seed), optionally holding "
    "one unit at a value to steer it (the sentiment neuron: --classifier or --neuron N "
    "--overwrite V), and draw the unit's per-character value as HTML or PNG "
    "(NVIDIA/sentiment-discovery generate.py).")


@dataclass
class VisualizeConfig(text_input.TextOptions, UnitOptions):
    """Settings of ``hvd-lm visualize`` (the shared ones: :class:`UnitOptions`,
    :class:`~hvd_lm.transfer.texts.TextOptions`)."""

    out: str = option("", "heatmap file: OUT.html (one span per character) or OUT.png",
                      required=True)
    max_texts: int = option(20, "draw at most the first N texts", ge=1)
    max_chars: int | None = option(None, "keep the first N bytes of each text (default: the "
                                   "classifier's, else "
                                   f"{lm_features.DEFAULT_MAX_CHARS}; 0 = all)", ge=0)

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
    feat = saved.features if saved else {"max_chars": lm_features.DEFAULT_MAX_CHARS,
                                         "normalize": False}
    max_chars = feat["max_chars"] if cfg.max_chars is None else cfg.max_chars
    seqs = lm_features.encode_texts([t for _, t, _ in first], max_chars, bool(feat["normalize"]))
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
    VisualizeConfig, visualize, usage_errors=USAGE_ERRORS,
    description="Per-character heatmap (HTML or PNG) of one LM unit over given texts: by "
    "default the sentiment unit of a classifier saved by hvd-lm transfer "
    "(NVIDIA/sentiment-discovery visualize.py).")
