"""A trained model from a checkpoint or an exported folder: what every command that uses a model
(eval, transfer, generate, visualize, classify) loads it with, below both training and transfer;
and ``hvd-lm export``, which writes a checkpoint's model as an exported folder
(:mod:`hvd_lm.formats.export`: safetensors + config.json, read without unpickling); and
``hvd-lm import-openai MODEL_DIR OUT_DIR``, which writes OpenAI's released sentiment-neuron model
(Radford et al. 2017, "Learning to Generate Reviews and Discovering Sentiment") as one.

The import lives in the model layer because what it knows is hvd_lm's model: which array
becomes which parameter of :class:`hvd_lm.model.lm.LanguageModel`, in which gate order and under
which weight norm convention; the folder it writes is :mod:`hvd_lm.formats.export`'s. Written
from the documented layout and math below, not from OpenAI's code.

The files (repository openai/generating-reviews-discovering-sentiment, ``model/0.npy`` ..
``model/14.npy``; E = 64, H = 4096 there; TF convention ``y = x W``, W [in, out])::

    0  embedding [256, E]      6  wmx [E, H]      9  gx [4H]     13  w (output) [H, 256]
    1  wx [E, 4H]              7  wmh [H, H]     10  gh [4H]     14  b (output) [256]
    2-5 wh [H, 4H], as four    8  b [4H]         11  gmx [H]
        [H, H] column blocks                     12  gmh [H]
        (concatenated in order)

The reference's recurrence, for the byte embedding x_t and state (c, h)::

    W = l2_normalize(V, axis=0) * g      (each of wx, wh, wmx, wmh: a column per output unit)
    m = (x Wmx) * (h Wmh)
    z = x Wx + m Wh + b;   i, f, o, u = split(z, 4)
    c = sigmoid(f) * c + sigmoid(i) * tanh(u);   h = sigmoid(o) * tanh(c)
    logits = h w + b_out

hvd_lm's (:mod:`hvd_lm.model.lm`): ``nn.Linear`` weights are [out, in] (``y = x W^T``), the gates
are ordered i, f, u, o, and ``weight_norm=True`` is torch's ``weight_norm(dim=0)``: ``W = g * v /
||v||`` with the norm over each row, i.e. per output unit, the same normalisation as the
reference's per column. So the map is exact: ``v = V^T``, ``g = gain`` as a column [out, 1], and
the 4H gate rows of ``wx``, ``wh``, ``b``, ``gx``, ``gh`` permuted from (i, f, o, u) to
(i, f, u, o); the embedding as it is; the decoder ``w^T`` and ``b_out``. (TF's l2_normalize
divides by ``sqrt(max(sum v^2, 1e-12))``: different from torch only for a column of norm below
1e-6, which a trained model does not have.) The model reads UTF-8 bytes, as hvd_lm's tokenizer;
OpenAI's ``encoder.py`` also wraps each text as ``"\\n " + text + " "`` before encoding, which
hvd_lm's featurization does not (docs/transfer.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np
import torch

from hvd_lm.formats import export
from hvd_lm.formats.checkpoint import CheckpointError, checkpoint_dir, load, resolve
from hvd_lm.formats.export import ARCHITECTURE, CONFIG, WEIGHTS, export_folder
from hvd_lm.formats.tokenizer import TOKENIZER_NAME
from hvd_lm.model.lm import LanguageModel, ModelConfig, parameter_shapes
from hvd_lm.options import Command, option, validate
from hvd_lm.util.digest import file_sha256, json_sha256
from hvd_lm.util.files import load_npy, shown


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
    unknown = sorted(set(model) - {f.name for f in dataclasses.fields(ModelConfig)})
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
    model.to(map_location).eval()
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


# ---- hvd-lm import-openai -----------------------------------------------------------------------

#: Where the files come from (README, docs/transfer.md).
SOURCE = "openai/generating-reviews-discovering-sentiment, model/0.npy .. model/14.npy"
FILES = 15
#: The training window of the released model (Radford et al. 2017, section 3: 256 bytes).
SEQ_LEN = 256
#: The largest array read: 1 GiB (the released model's largest, wmh [4096, 4096] float32, is
#: 64 MiB; H = 16384, hvd_lm's widest, is 1 GiB).
MAX_ARRAY_BYTES = 1 << 30


def read_arrays(model_dir: str | Path) -> list[np.ndarray]:
    """The 15 arrays of ``model_dir`` (float32, ``np.load(allow_pickle=False)``), their shapes
    checked against the layout of the module docstring (E and H read from files 0 and 7).

    Each file is read by :func:`hvd_lm.util.files.load_npy`: a regular file whose header
    declares at most :data:`MAX_ARRAY_BYTES` and no more than the file holds (a 2 TiB header or
    an .npz named ``1.npy`` is refused before anything is allocated); its values must be real,
    finite floating point (a NaN, an infinity or a complex array is refused, not written into an
    export every command would then refuse or misread).

    Raises:
        FileNotFoundError: a file missing, naming it and the layout.
        ValueError: (hvd_lm.util.files.FileRefused included) a file that is not such an array,
            of another dtype, with NaN/inf, or of another shape, naming it, its shape and the
            expected one.
    """
    d = Path(model_dir)
    arrays = []
    for i in range(FILES):
        path = d / f"{i}.npy"
        if not path.exists():
            raise FileNotFoundError(f"{shown(path)}: missing; {shown(d)} must hold OpenAI's 15 "
                                    f"arrays 0.npy .. 14.npy ({SOURCE})")
        # the header first: a regular file, a .npy (not an .npz), no more data than it holds
        a = load_npy(path, MAX_ARRAY_BYTES, "OpenAI's arrays are .npy files")
        if a.dtype.kind != "f":  # complex, int, bool, text: not weights
            raise ValueError(f"{shown(path)}: dtype {a.dtype}, expected floating point "
                             "(OpenAI's arrays are float32)")
        a = a.astype(np.float32)  # a float64 beyond float32's range becomes inf: refused too
        if not np.isfinite(a).all():
            raise ValueError(f"{shown(path)}: holds {int((~np.isfinite(a)).sum()):,} NaN or "
                             "infinite values (as float32); a trained model's weights are "
                             "finite")
        arrays.append(a)
    E = arrays[0].shape[1] if arrays[0].ndim == 2 else -1
    H = arrays[7].shape[0] if arrays[7].ndim == 2 else -1
    for i, name, value in ((0, "E (its columns)", E), (7, "H (its rows)", H)):
        if value < 1:
            raise ValueError(f"{shown(d / f'{i}.npy')}: shape {list(arrays[i].shape)} gives no "
                             f"{name}: expected a 2-d array with {name.split()[0]} >= 1 (layout: "
                             "hvd_lm/model/load.py)")
    want = [(256, E), (E, 4 * H)] + [(H, H)] * 4 + [(E, H), (H, H), (4 * H,), (4 * H,),
                                                    (4 * H,), (H,), (H,), (H, 256), (256,)]
    for i, (a, shape) in enumerate(zip(arrays, want)):
        if a.shape != shape:
            raise ValueError(f"{shown(d / f'{i}.npy')}: shape {list(a.shape)}, expected "
                             f"{list(shape)} (E={E} from 0.npy, H={H} from 7.npy; layout: "
                             "hvd_lm/model/load.py)")
    return arrays


def to_state_dict(arrays: list[np.ndarray]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the architecture: ModelConfig fields, the ``LanguageModel`` state dict with weight norm)
    of the 15 arrays (module docstring: transposed, gates reordered i, f, o, u -> i, f, u, o)."""
    emb, wx, *wh_blocks = arrays[:6]
    wmx, wmh, b, gx, gh, gmx, gmh, w_out, b_out = arrays[6:]
    wh = np.concatenate(wh_blocks, axis=1)
    E, H = emb.shape[1], wmh.shape[0]
    ifuo = np.concatenate([np.arange(k * H, (k + 1) * H) for k in (0, 1, 3, 2)])

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    def normed(name: str, v_out_in: np.ndarray, g: np.ndarray) -> dict:
        p = f"rnn.{name}.parametrizations.weight"
        return {f"{p}.original0": t(g[:, None]), f"{p}.original1": t(v_out_in)}

    state = {"embed.weight": t(emb), "rnn.w_x.bias": t(b[ifuo]),
             **normed("w_x", wx.T[ifuo], gx[ifuo]), **normed("w_mx", wmx.T, gmx),
             **normed("w_mh", wmh.T, gmh), **normed("w_h", wh.T[ifuo], gh[ifuo]),
             "decoder.weight": t(w_out.T), "decoder.bias": t(b_out)}
    arch = {"cell": "mlstm", "embed_dim": E, "hidden_size": H, "weight_norm": True,
            "vocab_size": 256}
    return arch, state


@dataclasses.dataclass
class ImportOpenAIConfig:
    """``hvd-lm import-openai MODEL_DIR OUT_DIR``."""

    model_dir: str = option("", "folder of OpenAI's 0.npy .. 14.npy (the repository's model/)",
                            positional=True, required=True)
    out_dir: str = option("", "the exported folder to write (must not exist, or be empty)",
                          positional=True, required=True)


def import_openai(cfg: ImportOpenAIConfig) -> int:
    """``hvd-lm import-openai``: read, map (:func:`to_state_dict`), check that hvd_lm's model
    takes the weights, write the exported folder (config.json's ``source`` names the files and
    the sha256 of their sha256s).

    Raises:
        FileNotFoundError / ValueError: as :func:`read_arrays`. FileExistsError: OUT_DIR exists
            and is not empty.
    """
    arch, state = to_state_dict(read_arrays(cfg.model_dir))
    load_state(LanguageModel(ModelConfig(**arch)), state, cfg.model_dir)
    digests = [file_sha256(Path(cfg.model_dir) / f"{i}.npy") for i in range(FILES)]
    out = export.write_export(cfg.out_dir, state, {
        "model": arch, "vocab_size": 256,
        "tokenizer": "bytes-utf8 (no end-of-document byte; OpenAI's encoder.py wraps each text "
                     "as '\\n ' + text + ' ')",
        "step": None, "seq_len": SEQ_LEN,
        "source": {"kind": SOURCE, "path": str(cfg.model_dir), "sha256": json_sha256(digests),
                   "files_sha256": digests},
        "training": None,
        "reference": {"paper": "Radford, Jozefowicz, Sutskever 2017, Learning to Generate "
                      "Reviews and Discovering Sentiment (arXiv:1704.01444)",
                      "sst2_test_accuracy": 0.918,
                      "sentiment_unit": 2388,  # the unit OpenAI's sst_binary_demo.py plots
                      }})
    print(f"imported {cfg.model_dir} (mLSTM H={arch['hidden_size']} E={arch['embed_dim']}, "
          f"weight norm) to {out}")
    return 0


IMPORT_OPENAI = Command(ImportOpenAIConfig, import_openai,
                        # bad input (a missing or malformed array, a used OUT_DIR): exit 2, as
                        # every other command's
                        usage_errors=(ValueError, FileNotFoundError, FileExistsError),
                        description="Read OpenAI's released 4096-unit byte mLSTM (15 .npy "
                        f"arrays: {SOURCE}) and write it as an hvd_lm exported folder that "
                        "eval, transfer, classify, generate and visualize load.")
