"""A trained model from a checkpoint or an exported folder: what every command that uses a model
(eval, transfer, generate, visualize, classify) loads it with, below both training and transfer;
and ``hvd-lm export``, which writes a checkpoint's model as an exported folder
(:mod:`hvd_lm.formats.export`: safetensors + config.json, read without unpickling).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import torch

from hvd_lm.formats import export
from hvd_lm.formats.checkpoint import CheckpointError, checkpoint_dir, load, resolve
from hvd_lm.formats.export import ARCHITECTURE, CONFIG, WEIGHTS, export_folder
from hvd_lm.formats.tokenizer import TOKENIZER_NAME
from hvd_lm.model.lm import LanguageModel, ModelConfig, parameter_shapes
from hvd_lm.options import Command, option, validate
from hvd_lm.util.digest import file_sha256
from hvd_lm.util.files import shown


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 of a model's weights: every ``state_dict`` entry's name, shape and values (floating
    point as float32, as checkpoints and exports store them), in order. The same for a
    checkpoint and its export (:func:`hvd_lm.formats.export.write_export`), which differ as
    files: what a classifier fit on features of these weights is bound to
    (:func:`hvd_lm.transfer.saved.check_checkpoint`)."""
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        a = t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype)
        digest.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
        digest.update(a.contiguous().numpy().tobytes())
    return digest.hexdigest()


def load_state(model: torch.nn.Module, state: dict, path: str | Path, copy: bool = True) -> None:
    """``model.load_state_dict(state)``, with a mismatch reported as one line; with ``copy``
    False the names and shapes alone are checked (no tensor data read: a rank whose weights
    rank 0 broadcasts next).

    Raises:
        CheckpointError: the checkpoint was written for a model of another shape (names the
            first differing tensor and both shapes).
    """
    own = model.state_dict()
    for name, t in own.items():
        if name not in state:
            raise CheckpointError(f"{path}: written for another model (no {name}); check "
                                  "--cell/--hidden-size/--embed-dim/--weight-norm")
        if tuple(state[name].shape) != tuple(t.shape):
            raise CheckpointError(
                f"{path}: written for a model of another shape: {name} is "
                f"{list(state[name].shape)} there, {list(t.shape)} here (check --hidden-size, "
                "--embed-dim, --cell)")
    extra = sorted(set(state) - set(own))
    if extra:
        raise CheckpointError(f"{path}: written for another model (it has {extra[0]})")
    if copy:
        model.load_state_dict(state)


def model_config(fields: dict, source: str | Path, **override) -> ModelConfig:
    """The :class:`~hvd_lm.model.lm.ModelConfig` a file's model config describes, validated
    (choices, bounds) with the file named: ``F: model.cell must be one of ['mlstm', 'lstm'],
    got 'bogus'``.

    Raises:
        CheckpointError: an unknown field, a wrong type or a value out of its range.
    """
    try:
        cfg = ModelConfig(**{**fields, **override})
        validate(cfg, shown(source), ("model",))
    except TypeError as e:
        raise CheckpointError(f"{shown(source)}: model config: {shown(str(e))}") from None
    except ValueError as e:  # ConfigError: already names the file and the field
        raise CheckpointError(str(e)) from None
    return cfg


def check_state(state, model_cfg: dict, path: str | Path) -> None:
    """Before a model is built from a file's config: its weights are floating-point, finite
    tensors, and the config asks for no more parameters than the file holds (a 1 kB file whose
    config says ``embed_dim: 1000000`` would otherwise allocate gigabytes before its first
    weight is compared).

    Raises:
        CheckpointError: naming the file and the tensor or the config field.
    """
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor)
                                              for t in state.values()):
        raise CheckpointError(f"{path}: field model is not a dict of tensors")
    for name, t in state.items():
        if not t.is_floating_point():
            raise CheckpointError(f"{path}: tensor {name} is {t.dtype}, expected floating point")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path}: tensor {name} holds NaN or infinite values")
    for key in ("embed_dim", "hidden_size", "vocab_size"):
        if key in model_cfg and (type(model_cfg[key]) is not int or model_cfg[key] < 1):
            raise CheckpointError(f"{path}: model config field {key} is {model_cfg[key]!r}, "
                                  "expected an int >= 1")
    want = sum(math.prod(shape) for _, shape in parameter_shapes(model_config({
        k: v for k, v in model_cfg.items() if k in ARCHITECTURE}, path)))
    have = sum(t.numel() for t in state.values())
    if want > have:
        raise CheckpointError(f"{path}: the model config asks for {want:,} parameters, the file "
                              f"holds {have:,} (check its model config: {model_cfg})")


def resolve_model(path: str | Path) -> Path:
    """The file a model is loaded from: an exported folder's weights file
    (:func:`hvd_lm.formats.export.export_folder`), else the checkpoint
    :func:`hvd_lm.formats.checkpoint.resolve` finds (a file, or a run directory's latest). Its
    sha256 is the model's identity (a saved classifier records it).

    Raises:
        FileNotFoundError: neither, naming what was looked for.
    """
    folder = export_folder(path)
    return folder / WEIGHTS if folder is not None else resolve(path)


def model_files(path: str | Path) -> list[Path]:
    """Every file loading a model from ``path`` reads: an exported folder's weights and
    config.json, or the checkpoint file (and a run directory's ``checkpoints/latest``); what an
    output flag may not name (:func:`hvd_lm.util.files.check_output`). Empty when ``path`` names
    no model (loading then says so).
    """
    folder = export_folder(path)
    if folder is not None:
        return [folder / WEIGHTS, folder / CONFIG]
    try:
        found = [resolve(path)]
    except (OSError, CheckpointError):
        found = []
    latest = checkpoint_dir(path) / "latest"
    return found + ([latest] if Path(path).is_dir() and latest.is_file() else [])


def architecture(model: dict, source: str | Path) -> dict:
    """The architecture fields (:data:`hvd_lm.formats.export.ARCHITECTURE`) of a ``model``
    config dict, with ModelConfig's defaults for those it lacks.

    Raises:
        CheckpointError: a field ModelConfig does not have, naming ``source``.
    """
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(model) - fields)
    if unknown:
        raise CheckpointError(f"{source}: model config field {unknown[0]!r} is not one of "
                              f"hvd_lm's ({', '.join(ARCHITECTURE)})")
    full = dataclasses.asdict(model_config(model, source))
    return {k: full[k] for k in ARCHITECTURE}


def load_model(path: str | Path, map_location: str | torch.device = "cpu",
               rnn_kernels: str = "auto"):
    """The :class:`~hvd_lm.model.lm.LanguageModel` stored in a checkpoint or an exported folder,
    on ``map_location``, in eval mode, and the checkpoint dict (for an exported folder: its
    weights as ``model``, ``config`` = ``{"model", "data": {"seq_len"}}``, ``step`` (-1 when
    unknown) and config.json as ``export``).

    Args:
        path: a checkpoint file, a run directory (its latest), an exported folder or its
            weights file (:func:`resolve_model`).
        rnn_kernels: the fused mLSTM's cell kernels for this device
            (:data:`hvd_lm.model.config.KERNELS`; ``auto``: the device's default). Not
            the checkpoint's own: kernels are a property of the machine, not of the model, and
            a model trained with ``triton`` on a GPU must still load on a CPU.

    Raises:
        FileNotFoundError / CheckpointError: as :func:`resolve` / :func:`load`;
            hvd_lm.formats.export.ExportError (a CheckpointError): a damaged exported folder.
        ValueError: an unknown ``rnn_kernels``.
    """
    folder = export_folder(path)
    if folder is not None:
        state, meta = export.read_export(folder)
        path = folder / WEIGHTS
        model_cfg = architecture(meta["model"], folder / "config.json")
        step = meta.get("step")
        training = meta.get("training") if isinstance(meta.get("training"), dict) else {}
        ckpt = {"model": state, "step": -1 if step is None else step, "export": meta,
                "world_size": meta.get("world_size"),  # with run: eval's rows as the training's
                "config": {"model": model_cfg, "data": {"seq_len": meta.get("seq_len") or 256},
                           "run": training.get("run") if isinstance(training.get("run"), dict)
                           else {}}}
    else:
        path = resolve(path)
        ckpt = load(path, map_location)
        model_cfg = ckpt.get("config", {}).get("model")
        if model_cfg is None or "model" not in ckpt:
            raise CheckpointError(f"{path}: no field {'model' if model_cfg else 'config.model'}"
                                  " (not written by hvd-lm train?)")
    check_state(ckpt["model"], model_cfg, path)
    model = LanguageModel(model_config(model_cfg, path, rnn_kernels=rnn_kernels))
    load_state(model, ckpt["model"], path)
    model.to(map_location)
    model.eval()
    return model, ckpt


# ---- hvd-lm export ------------------------------------------------------------------------------

@dataclasses.dataclass
class ExportConfig:
    """``hvd-lm export CHECKPOINT OUT_DIR``."""

    checkpoint: str = option("", "checkpoint file or run directory (its latest)",
                             positional=True, required=True)
    out_dir: str = option("", "the exported folder to write (must not exist, or be empty)",
                          positional=True, required=True)


def export_command(cfg: ExportConfig) -> int:
    """``hvd-lm export``: the checkpoint's model as an exported folder (model.safetensors +
    config.json: architecture, vocabulary and tokenizer, step, window, the checkpoint's path and
    sha256, its training config), written atomically.

    Raises:
        FileNotFoundError / CheckpointError: no checkpoint, or not a loadable one.
        FileExistsError: OUT_DIR exists and is not empty. DiskFullError: no room.
    """
    src = resolve(cfg.checkpoint)
    ckpt = load(src)
    model_cfg = architecture(ckpt["config"]["model"], src)
    check_state(ckpt["model"], model_cfg, src)
    model = LanguageModel(ModelConfig(**model_cfg))
    load_state(model, ckpt["model"], src)  # a checkpoint of another shape: one line
    out = export.write_export(cfg.out_dir, model.state_dict(), {
        "model": model_cfg, "vocab_size": model_cfg["vocab_size"], "tokenizer": TOKENIZER_NAME,
        "step": ckpt.get("step"), "seq_len": ckpt["config"].get("data", {}).get("seq_len"),
        "world_size": ckpt.get("world_size"),
        "source": {"kind": "hvd_lm checkpoint", "path": str(src), "sha256": file_sha256(src)},
        "training": ckpt["config"]})
    params = sum(p.numel() for p in model.parameters())
    print(f"exported {src} (step {ckpt.get('step')}, {params:,} parameters) to {out}: "
          f"{WEIGHTS} + config.json")
    return 0


EXPORT = Command(ExportConfig, export_command,
                 description="Write a checkpoint's model as an exported folder: the weights as "
                 "safetensors and a config.json (architecture, vocabulary and tokenizer, training "
                 "step, the checkpoint's sha256), which eval, transfer, classify, generate and "
                 "visualize load in place of a checkpoint, without unpickling.")
