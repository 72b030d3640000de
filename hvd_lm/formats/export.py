"""An exported model: the folder a trained model leaves hvd_lm in (``hvd-lm export``), and the
one ``hvd-lm import-openai`` writes OpenAI's released weights as.

``<folder>/model.safetensors`` holds the weights, named as ``LanguageModel.state_dict()`` names
them (``embed.weight`` [256, E]; mLSTM ``rnn.w_x.weight`` [4H, E] with gates in the order i, f,
u, o, ``rnn.w_x.bias`` [4H], ``rnn.w_mx.weight`` [H, E], ``rnn.w_mh.weight`` [H, H],
``rnn.w_h.weight`` [4H, H], or with weight norm each ``rnn.<name>.parametrizations.weight.
original0`` (the gain g [rows, 1]) and ``original1`` (the direction v), the weight being
``g * v / ||v||`` per row; ``decoder.weight`` [256, H], ``decoder.bias`` [256]; float32).
``<folder>/config.json`` says what they are::

    {"format": "hvd_lm-export", "format_version": 1, "weights": "model.safetensors",
     "weights_sha256": "...", "model": {"cell": "mlstm", "embed_dim": 64, "hidden_size": 4096,
     "weight_norm": true, "vocab_size": 256}, "vocab_size": 256,
     "tokenizer": "bytes-utf8-eod0", "step": 1234, "seq_len": 256, "world_size": 8,
     "source": {"kind": "...", "path": "...", "sha256": "..."}, "training": {...} or null}

``model`` is the architecture (:class:`hvd_lm.model.lm.ModelConfig`'s fields that change the
function; the kernels are the loading machine's), ``tokenizer`` the byte mapping of
:mod:`hvd_lm.formats.tokenizer`, ``step`` the optimizer step trained (null when unknown),
``seq_len`` the training window (what ``hvd-lm eval`` uses by default), ``world_size`` the
training's ranks (with ``training.run.eval_batch_size``, the rows eval uses by default, so an
export evaluates as its checkpoint does), ``source`` the file the weights came from and its
sha256, ``training`` the whole training config when there was one.

Reading never unpickles: safetensors is a JSON header and raw little-endian tensor bytes
(huggingface/safetensors, "Format"), read by ``safetensors.torch.load_file``; config.json is JSON;
the weights file is checked against ``weights_sha256`` first. Writing is atomic for the folder:
both files go into a temporary folder beside it (``.<name>.<pid>.<random>.tmp``), are fsync'd,
and the folder is renamed into place (onto a missing or empty folder only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hvd_lm.formats.checkpoint import CheckpointError
from hvd_lm.util.atomic import atomic_path
from hvd_lm.util.digest import file_sha256
from hvd_lm.util.files import FileRefused, read_json

FORMAT = "hvd_lm-export"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
#: A config.json larger than this is refused unread (an export's is a few kB).
MAX_CONFIG_BYTES = 1 << 20
#: The :class:`~hvd_lm.model.lm.ModelConfig` fields config.json's ``model`` holds.
ARCHITECTURE = ("cell", "embed_dim", "hidden_size", "weight_norm", "vocab_size")


#: The longest TBPTT window an export may name (bytes; a default for eval's --seq-len).
MAX_SEQ_LEN = 1 << 20


class ExportError(CheckpointError):
    """An exported folder that cannot be loaded (missing, damaged or foreign files); the
    message names the file and what is wrong."""


def export_folder(path: str | Path) -> Path | None:
    """The exported folder ``path`` names (the folder itself, or its weights file), or None
    when ``path`` is not one (a checkpoint file, a run directory, nothing)."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent if p.suffix == ".safetensors" else None
    if folder is None or not (folder / CONFIG).is_file():
        return None
    if p.is_dir() and not (p / WEIGHTS).exists() and (p / "checkpoints").is_dir():
        return None  # a run directory that happens to hold a config.json
    return folder


def write_export(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write an exported folder atomically (module docstring).

    Args:
        tensors: name -> tensor (copied to contiguous CPU tensors).
        config: the config.json fields besides ``format``, ``format_version``, ``weights`` and
            ``weights_sha256`` (which this adds).

    Returns:
        ``out_dir``.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty folder (nothing is replaced).
        hvd_lm.util.atomic.DiskFullError: no space (naming the bytes needed and free); nothing
            is left behind.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty folder; export into a new "
                              "folder (or remove this one)")
    from safetensors.torch import save_file  # the one writer of the format

    out.parent.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype)
               .contiguous() for k, v in tensors.items()}
    need = sum(t.numel() * t.element_size() for t in weights.values())
    with atomic_path(out, needed=need, then="nothing was written") as tmp:
        tmp.mkdir()
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": WEIGHTS,
                "weights_sha256": file_sha256(tmp / WEIGHTS), **config}
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        # safetensors creates its file 0600: give it the mode the umask gave config.json (and
        # every other file of the run), so others on a shared cluster can read it
        os.chmod(tmp / WEIGHTS, os.stat(tmp / CONFIG).st_mode & 0o777)
    return out


def read_export(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights (CPU tensors) and config.json of an exported folder (or its weights file).

    Raises:
        FileNotFoundError: no exported folder at ``path``.
        ExportError: config.json not JSON or not this format, the weights file missing, not
            matching its sha256, or not a safetensors file; naming the file.
    """
    folder = export_folder(path)
    if folder is None:
        raise FileNotFoundError(f"{path}: no exported model (a folder with {CONFIG} and {WEIGHTS})")
    cfg_path = folder / CONFIG
    try:  # within its budget; a FIFO, a device or JSON nested 100,000 deep refused, one line
        cfg = read_json(cfg_path, MAX_CONFIG_BYTES, "an export's config.json is a few kB")
    except FileRefused as e:
        raise ExportError(str(e)) from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise ExportError(f"{cfg_path}: not an hvd_lm export (\"format\": \"{FORMAT}\")")
    if cfg.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{cfg_path}: format_version {cfg.get('format_version')!r}, this "
                          f"hvd_lm reads {FORMAT_VERSION}")
    for key, kind, what in (("weights", str, "a file name"), ("weights_sha256", str, "a hex "
                            "digest"), ("model", dict, "an object"), ("seq_len", int, "an int")):
        if key not in cfg and key != "seq_len":  # (seq_len is optional: 256 when absent)
            raise ExportError(f"{cfg_path}: no {key!r} field")
        value = cfg.get(key, 256)
        if type(value) is not kind or (kind is int and not 1 <= value <= MAX_SEQ_LEN):
            raise ExportError(f"{cfg_path}: field {key!r} is {str(value)[:60]!r}, expected {what}"
                              + (f" in 1..{MAX_SEQ_LEN:,}" if kind is int else ""))
    if cfg["weights"] != WEIGHTS:  # a name only: never a path to follow out of the folder
        raise ExportError(f"{cfg_path}: \"weights\" is {str(cfg['weights'])[:80]!r}, an export's "
                          f"weights are its {WEIGHTS}")
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise ExportError(f"{weights}: missing (named by {cfg_path})")
    digest = file_sha256(weights)
    if digest != cfg["weights_sha256"]:
        raise ExportError(f"{weights}: sha256 {digest[:12]}... is not the {cfg_path}'s "
                          f"{cfg['weights_sha256'][:12]}... (damaged or replaced)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"{weights}: not a loadable safetensors file ({e})") from None
    return state, cfg
