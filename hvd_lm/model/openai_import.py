"""OpenAI's released sentiment-neuron model (Radford et al. 2017, "Learning to Generate Reviews and
Discovering Sentiment") as an hvd_lm exported folder: ``hvd-lm import-openai MODEL_DIR OUT_DIR``.

It lives in the model layer because what it knows is hvd_lm's model: which array becomes which
parameter of :class:`hvd_lm.model.lm.LanguageModel`, in which gate order and under which weight
norm convention; the folder it writes is :mod:`hvd_lm.formats.export`'s. Written from the
documented layout and math below, not from OpenAI's code.

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

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hvd_lm.formats.export import write_export
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.model.load import load_state
from hvd_lm.options import Command, option
from hvd_lm.util.digest import file_sha256, json_sha256
from hvd_lm.util.files import load_npy, shown

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
                             "hvd_lm/model/openai_import.py)")
    want = [(256, E), (E, 4 * H)] + [(H, H)] * 4 + [(E, H), (H, H), (4 * H,), (4 * H,),
                                                    (4 * H,), (H,), (H,), (H, 256), (256,)]
    for i, (a, shape) in enumerate(zip(arrays, want)):
        if a.shape != shape:
            raise ValueError(f"{shown(d / f'{i}.npy')}: shape {list(a.shape)}, expected "
                             f"{list(shape)} (E={E} from 0.npy, H={H} from 7.npy; layout: "
                             "hvd_lm/model/openai_import.py)")
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


@dataclass
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
    out = write_export(cfg.out_dir, state, {
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
