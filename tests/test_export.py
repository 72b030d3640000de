"""An exported model (hvd_lm.formats.export, ``hvd-lm export``) and OpenAI's released weights
(``hvd-lm import-openai``): the folder's files, loading without unpickling, every command that
takes a checkpoint taking the folder, atomic writes, and the import against an independent numpy
implementation of the reference's recurrence on random arrays of the released layout."""
from __future__ import annotations

import errno
import json
import pickle
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hvd_lm.cli import main as cli_main
from hvd_lm.formats import checkpoint as ck
from hvd_lm.formats import export as ex
from hvd_lm.formats.tokenizer import TOKENIZER_NAME
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.model.load import load_model, resolve_model
from hvd_lm.util.atomic import DiskFullError
from hvd_lm.util.digest import file_sha256
from tests.shardutil import default_shards
from tests.test_transfer import synthetic_reviews


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A weight-normed tiny model's checkpoint (step 7, trained on 2 ranks evaluating 8 rows in
    all: eval's default is 8 rows, not 32) and ``hvd-lm export`` of it."""
    d = tmp_path_factory.mktemp("export")
    torch.manual_seed(3)
    cfg = ModelConfig(embed_dim=8, hidden_size=32, weight_norm=True)
    model = LanguageModel(cfg)
    path = ck.save({"model": model.state_dict(), "step": 7, "world_size": 2,
                    "config": {"model": asdict(cfg), "data": {"seq_len": 16},
                               "run": {"eval_batch_size": 8}}}, d / "run", 7)
    assert cli_main(["export", str(d / "run"), str(d / "exp")]) == 0
    return {"dir": d, "ckpt": path, "exp": d / "exp", "model": model}


def test_the_folder_holds_the_weights_and_what_they_are(exported):
    exp, src = exported["exp"], exported["ckpt"]
    assert sorted(p.name for p in exp.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((exp / "config.json").read_text())
    assert cfg["format"] == "hvd_lm-export" and cfg["format_version"] == 1
    assert cfg["model"] == {"cell": "mlstm", "embed_dim": 8, "hidden_size": 32,
                            "weight_norm": True, "vocab_size": 256}
    assert (cfg["vocab_size"], cfg["tokenizer"], cfg["step"], cfg["seq_len"]) == (
        256, TOKENIZER_NAME, 7, 16)
    assert cfg["source"] == {"kind": "hvd_lm checkpoint", "path": str(src),
                             "sha256": file_sha256(src)}
    assert cfg["weights_sha256"] == file_sha256(exp / "model.safetensors")
    weights = load_file(str(exp / "model.safetensors"))
    saved = ck.load(src)["model"]
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[k], v) for k, v in saved.items())
    assert not list(exported["dir"].glob(".*tmp*"))


def test_loading_never_unpickles_and_computes_what_the_checkpoint_does(exported, monkeypatch):
    ref, _ = load_model(exported["ckpt"])

    def refuse(*a, **k):
        raise AssertionError("unpickling while loading an exported folder")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    exp = exported["exp"]
    assert resolve_model(exp) == exp / "model.safetensors"
    for where in (exp, exp / "model.safetensors"):
        model, meta = load_model(where)
        assert meta["step"] == 7 and meta["config"]["data"]["seq_len"] == 16
        tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model(tokens)[0], ref(tokens)[0])


def test_a_damaged_folder_is_one_line(exported, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((exported["exp"] / "config.json").read_text())
    data = (exported["exp"] / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-5] + b"xxxxx")
    with pytest.raises(ex.ExportError, match=r"bad/model.safetensors: sha256 .* is not the"):
        load_model(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ex.ExportError, match=r"bad/config.json: not JSON"):
        load_model(bad)
    # config.json names its weights file: only its own model.safetensors is ever read (a path
    # out of the folder, whose sha256 config.json would give too, is refused unread)
    (tmp_path / "elsewhere.safetensors").write_bytes(data)
    cfg = json.loads((exported["exp"] / "config.json").read_text())
    for weights in ("../elsewhere.safetensors", str(tmp_path / "elsewhere.safetensors")):
        (bad / "config.json").write_text(json.dumps({**cfg, "weights": weights}))
        with pytest.raises(ex.ExportError, match=r"\"weights\" is .* model.safetensors"):
            load_model(bad)
    (bad / "config.json").write_text("{" + " " * (ex.MAX_CONFIG_BYTES + 1) + "}")
    with pytest.raises(ex.ExportError, match=r"more than 1,048,576 bytes"):
        load_model(bad)


def test_export_writes_atomically_and_refuses_a_used_folder(exported, tmp_path, monkeypatch,
                                                            capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("keep")
    assert cli_main(["export", str(exported["ckpt"]), str(tmp_path / "used")]) == 1
    assert "used: exists and is not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "used" / "x").read_text() == "keep"
    import safetensors.torch as st

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"12345")  # a partial file, then the device is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "save_file", full)
    with pytest.raises(DiskFullError, match=r"new: no space left on the device \(.* needed"):
        ex.write_export(tmp_path / "new", {"w": torch.ones(10)}, {"model": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used"]  # no folder, no temporary


@pytest.mark.slow
def test_every_model_command_takes_an_exported_folder(exported, tmp_path, capsys):
    """eval, generate, visualize, transfer and classify on the exported folder: the same
    figures as on the checkpoint; a classifier fit on the folder's model serves the checkpoint
    too (the same weights in another file: before, a refit), another model's is refused."""
    ckpt, exp = str(exported["ckpt"]), str(exported["exp"])
    shards = default_shards(tmp_path / "shards")
    for src, name in ((ckpt, "c"), (exp, "e")):
        assert cli_main(["eval", src, str(shards), "--max-bytes", "3000", "--device", "cpu",
                         "--output", str(tmp_path / f"eval_{name}.json")]) == 0
        assert cli_main(["generate", src, "--prime", "Great", "--length", "20", "--seed", "1",
                         "--output", str(tmp_path / f"gen_{name}.jsonl")]) == 0
    e_c, e_e = (json.loads((tmp_path / f"eval_{n}.json").read_text()) for n in "ce")
    # default flags: the rows the training evaluated with, on the folder as on the checkpoint
    assert e_c["rows"] == e_e["rows"] == 8, (e_c, e_e)
    assert e_e["bpc"] == e_c["bpc"] and e_e["step"] == 7 and e_e["chars"] == e_c["chars"]
    assert (tmp_path / "gen_e.jsonl").read_text() == (tmp_path / "gen_c.jsonl").read_text()
    train = synthetic_reviews(tmp_path / "train.jsonl", 120, 0)
    test = synthetic_reviews(tmp_path / "test.jsonl", 40, 1)
    common = ["--train", str(train), "--test", str(test), "--text-field", "review",
              "--label-field", "sentiment", "--no-cache", "--no-progress", "--no-baseline",
              "--batch-size", "16"]
    for src, name in ((ckpt, "c"), (exp, "e")):
        assert cli_main(["transfer", src, *common, "--out", str(tmp_path / f"t_{name}")]) == 0
    r_c, r_e = (json.loads((tmp_path / f"t_{n}/transfer.json").read_text()) for n in "ce")
    assert r_e["classifier"]["accuracy"] == r_c["classifier"]["accuracy"]
    assert r_e["checkpoint_step"] == 7 and r_e["model"]["hidden_size"] == 32
    capsys.readouterr()
    assert cli_main(["classify", exp, str(tmp_path / "t_e"), "--input", str(test),
                     "--text-field", "review", "--label-field", "sentiment", "--no-progress",
                     "--output", str(tmp_path / "p.csv")]) == 0
    acc = r_e["classifier"]["accuracy"]["test"]
    assert f"accuracy {100 * acc:.2f}%" in capsys.readouterr().out
    assert cli_main(["classify", ckpt, str(tmp_path / "t_e"), "--input", str(test),
                     "--text-field", "review", "--label-field", "sentiment", "--no-progress"]
                    ) == 0
    assert f"accuracy {100 * acc:.2f}%" in capsys.readouterr().err  # predictions on stdout
    (tmp_path / "in.txt").write_text("I loved it\nawful\n")
    assert cli_main(["visualize", exp, "--neuron", "3", "--input", str(tmp_path / "in.txt"),
                     "--out", str(tmp_path / "v.html")]) == 0


# ---- OpenAI's released weights ----------------------------------------------------------------

def openai_arrays(E: int = 64, H: int = 64, seed: int = 0) -> list[np.ndarray]:
    """Random arrays in the released layout (0 embedding, 1 wx, 2-5 wh's column blocks, 6 wmx,
    7 wmh, 8 b, 9-12 gains gx gh gmx gmh, 13-14 output w and b)."""
    rng = np.random.default_rng(seed)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return [r(256, E), r(E, 4 * H), *[r(H, H) for _ in range(4)], r(E, H), r(H, H),
            r(4 * H, scale=0.5), r(4 * H), r(4 * H), r(H), r(H), r(H, 256, scale=0.3),
            r(256, scale=0.1)]


def openai_reference(arrays: list[np.ndarray], data: bytes):
    """The reference's recurrence as its encoder.py defines it, in float64: weights l2-normalised
    per column times their gains, m = (x wmx) * (h wmh), z = x wx + m wh + b, gates split i, f,
    o, u; returns hs [T, H], the final c [H] and logits [T, 256]."""
    a = [x.astype(np.float64) for x in arrays]
    emb, wx, wh, wmx, wmh, b = a[0], a[1], np.concatenate(a[2:6], axis=1), a[6], a[7], a[8]
    gx, gh, gmx, gmh, w, bo = a[9:15]

    def l2n(v, g):
        return v / np.sqrt(np.maximum((v * v).sum(axis=0, keepdims=True), 1e-12)) * g

    wx, wh, wmx, wmh = l2n(wx, gx), l2n(wh, gh), l2n(wmx, gmx), l2n(wmh, gmh)
    H = wmh.shape[0]
    c, h = np.zeros(H), np.zeros(H)

    def sig(v):
        return 1 / (1 + np.exp(-v))

    hs, logits = [], []
    for byte in data:
        x = emb[byte]
        m = (x @ wmx) * (h @ wmh)
        z = x @ wx + m @ wh + b
        i, f, o, u = np.split(z, 4)
        c = sig(f) * c + sig(i) * np.tanh(u)
        h = sig(o) * np.tanh(c)
        hs.append(h)
        logits.append(h @ w + bo)
    return np.array(hs), c, np.array(logits)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    d = tmp_path_factory.mktemp("openai")
    arrays = openai_arrays()
    (d / "model").mkdir()
    for i, a in enumerate(arrays):
        np.save(d / "model" / f"{i}.npy", a)
    assert cli_main(["import-openai", str(d / "model"), str(d / "out")]) == 0
    return {"dir": d, "arrays": arrays, "out": d / "out"}


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_imported_model_computes_the_references_recurrence(imported, impl):
    """Hidden states, the final cell state and next-byte logits of hvd_lm's model loaded from the
    imported folder agree with the numpy reference within 1e-5 (both mLSTM paths)."""
    data = "Great food, slow service. Très bien! 😀 Would go again.".encode()
    hs, c, logits = openai_reference(imported["arrays"], data)
    model, meta = load_model(imported["out"])
    assert meta["export"]["model"] == {"cell": "mlstm", "embed_dim": 64, "hidden_size": 64,
                                       "weight_norm": True, "vocab_size": 256}
    if impl == "reference":
        model = LanguageModel(ModelConfig(**meta["export"]["model"], rnn_impl="reference"))
        model.load_state_dict(meta["model"])
    tokens = torch.tensor([list(data)])
    with torch.no_grad():
        h_t, (_, c_t) = model.encode(tokens)
        out, _ = model(tokens)
    np.testing.assert_allclose(h_t[0].numpy(), hs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(c_t[0].numpy(), c, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[0].numpy(), logits, atol=1e-5, rtol=0)
    assert np.abs(hs).max() > 0.1 and np.abs(logits).std() > 0.1  # not a trivially small case


def test_imported_folder_records_its_source_and_generates(imported, tmp_path):
    cfg = json.loads((imported["out"] / "config.json").read_text())
    assert cfg["step"] is None and cfg["seq_len"] == 256 and cfg["training"] is None
    digests = [file_sha256(imported["dir"] / "model" / f"{i}.npy") for i in range(15)]
    assert cfg["source"]["files_sha256"] == digests
    assert cli_main(["generate", str(imported["out"]), "--prime", "This", "--length", "10",
                     "--output", str(tmp_path / "g.jsonl")]) == 0


def test_import_errors_name_the_file_and_exit_2(tmp_path, capsys):
    arrays = openai_arrays(E=8, H=4)
    (tmp_path / "m").mkdir()
    for i, a in enumerate(arrays):
        if i != 7:
            np.save(tmp_path / "m" / f"{i}.npy", a)
    assert cli_main(["import-openai", str(tmp_path / "m"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "ERROR:" in err and "m/7.npy: missing" in err and "0.npy .. 14.npy" in err
    np.save(tmp_path / "m" / "7.npy", arrays[7])
    np.save(tmp_path / "m" / "13.npy", arrays[13][:, :255])
    assert cli_main(["import-openai", str(tmp_path / "m"), str(tmp_path / "o")]) == 2
    assert "m/13.npy: shape [4, 255], expected [4, 256]" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
