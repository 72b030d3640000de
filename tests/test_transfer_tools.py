"""The tools on top of transfer: the saved classifier (hvd_lm.transfer.saved), ``hvd-lm
classify`` (hvd_lm.transfer.classify), ``hvd-lm generate`` (hvd_lm.transfer.generate) and
``hvd-lm visualize`` with its heatmaps (hvd_lm.transfer.generate, hvd_lm.transfer.heatmap)."""
from __future__ import annotations

import csv
import gzip
import json
import re
import sys
from html.parser import HTMLParser

import matplotlib.image
import numpy as np
import pytest
import torch

from hvd_lm.cli import main as cli_main
from hvd_lm.formats import tokenizer
from hvd_lm.transfer import datasets as D
from hvd_lm.transfer import features as F
from hvd_lm.transfer import generate as G
from hvd_lm.transfer import heatmap as HM
from hvd_lm.transfer import saved as S
from hvd_lm.util.digest import file_sha256
from tests._mp import REPO, horovodrun_cmd, run
from tests.test_transfer import SST2, need_sst2, synthetic_reviews, tiny_model, write_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny checkpoint, and ``hvd-lm transfer`` on synthetic reviews with a test split (its
    classifier is what the classify tests apply)."""
    d = tmp_path_factory.mktemp("trained")
    ckpt = write_checkpoint(d / "run")
    train = synthetic_reviews(d / "train.jsonl", 160, 0)
    test = synthetic_reviews(d / "test.jsonl", 80, 1)
    rc = cli_main(["transfer", str(d / "run"), "--train", str(train), "--test", str(test),
                   "--text-field", "review", "--label-field", "sentiment", "--out",
                   str(d / "out"), "--no-cache", "--no-progress", "--no-baseline",
                   "--batch-size", "16"])
    assert rc == 0
    report = json.loads((d / "out/transfer.json").read_text())
    return {"dir": d, "ckpt": ckpt, "test": test, "report": report}


# ---- The saved classifier ------------------------------------------------------------------------

def test_saved_classifier_reproduces_transfer_test_accuracy(trained):
    """Reloaded from classifier.safetensors and applied to freshly computed test features (the
    options read from the JSON), the classifier's accuracy is transfer's test accuracy exactly."""
    rep = trained["report"]
    saved = S.load_classifier(trained["dir"] / "out")
    assert saved.meta["checkpoint_sha256"] == file_sha256(trained["ckpt"])
    assert saved.meta["C"] == rep["classifier"]["C"] and saved.meta["standardize"] is True
    assert saved.neuron["index"] == rep["neuron"]["index"]
    split = D.load_table(trained["test"], "test", "review", "sentiment")
    f = saved.features
    model = tiny_model()
    X = F.featurize(model, split.texts, f["kind"], f["max_chars"], batch_size=16,
                    precision=f["precision"], normalize=f["normalize"]).features
    acc = saved.model.accuracy(X, split.labels)
    assert acc == rep["classifier"]["accuracy"]["test"]
    assert 0 < np.count_nonzero(saved.model.coef) == rep["classifier"]["nonzero"]
    # Standardisation is part of the classifier: raw features in, the stored statistics applied.
    assert np.all(saved.model.scale > 0) and np.abs(saved.model.mean).max() > 0


def test_classifier_files_are_checked(tmp_path, trained):
    """One classifier.safetensors, read by file or folder; a bit flipped in an array, a truncated
    file, an older hvd_lm's classifier.npz + .json, a missing file or another name: one
    ClassifierError naming it."""
    data = (trained["dir"] / "out" / S.FILE_NAME).read_bytes()
    (tmp_path / S.FILE_NAME).write_bytes(data)
    want = trained["report"]["classifier"]["C"]
    assert S.load_classifier(tmp_path / S.FILE_NAME).meta["C"] == want
    (tmp_path / S.FILE_NAME).write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    with pytest.raises(S.ClassifierError, match=r"safetensors: its arrays' sha256 .* not the rec"):
        S.load_classifier(tmp_path)
    (tmp_path / S.FILE_NAME).write_bytes(data[:-5])
    with pytest.raises(S.ClassifierError, match=r"classifier\.safetensors: not a classifier file"):
        S.load_classifier(tmp_path)
    (tmp_path / S.FILE_NAME).unlink()
    with pytest.raises(S.ClassifierError, match=r"classifier\.safetensors: no such file"):
        S.load_classifier(tmp_path)
    for name in ("classifier.npz", "classifier.json"):
        (tmp_path / name).write_bytes(b"{}")
    for where in (tmp_path, tmp_path / "classifier.json"):
        with pytest.raises(S.ClassifierError, match="older hvd_lm .* run hvd-lm transfer again"):
            S.load_classifier(where)
    with pytest.raises(S.ClassifierError, match="not a classifier"):
        S.load_classifier(tmp_path / "model.txt")


def test_classifier_from_another_checkpoint_is_refused(tmp_path, trained, capsys):
    """Another checkpoint (same shape, other weights): classify, generate and visualize stop
    with exit 2 naming both sha256s; nothing is written."""
    other = write_checkpoint(tmp_path / "other", seed=1)
    clf = str(trained["dir"] / "out")
    for argv in (["classify", str(other), clf, "--input", str(trained["test"]), "--text-field",
                  "review", "--output", str(tmp_path / "p.csv")],
                 ["generate", str(other), "--classifier", clf, "--length", "5"],
                 ["visualize", str(other), "--classifier", clf, "--input", str(trained["test"]),
                  "--text-field", "review", "--out", str(tmp_path / "v.html")]):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(r"ERROR: .*classifier\.safetensors was fit on features of the weights "
                         r"of .* \(weights sha256 [0-9a-f]{12}\.\.\.\), not those of .* "
                         r"\([0-9a-f]{12}", err), err
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "v.html").exists()


def test_a_classifier_serves_the_export_of_its_checkpoint(tmp_path, trained, capsys):
    """The same weights exported (another file: safetensors) are the classifier's model: classify
    through the export gives the checkpoint's predictions (before: refused, a 5-minute refit);
    the export's files are readable by others as the run's are (model.safetensors was 0600)."""
    import stat

    export = tmp_path / "export"
    assert cli_main(["export", str(trained["ckpt"]), str(export)]) == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in export.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] and modes["config.json"] & 0o044
    clf = str(trained["dir"] / "out")
    rows = {}
    for name, model in (("ckpt", trained["ckpt"]), ("export", export)):
        assert cli_main(["classify", str(model), clf, "--input", str(trained["test"]),
                         "--text-field", "review", "--output", str(tmp_path / f"{name}.csv")]) == 0
        rows[name] = _read_csv(tmp_path / f"{name}.csv")
    assert rows["export"] == rows["ckpt"] and len(rows["ckpt"]) == 80


# ---- hvd-lm classify -----------------------------------------------------------------------------

def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_classify_matches_the_classifier_and_formats(tmp_path, trained, capsys):
    """Probabilities equal the saved classifier on the features of each text alone; the label
    is probability > 0.5; CSV, JSON lines (gzip) and TSV carry the same rows; plain-line input
    (gzip) and standard output work; line numbers point into the input."""
    ckpt, clf = str(trained["ckpt"]), str(trained["dir"] / "out")
    base = ["classify", ckpt, clf, "--no-progress"]
    assert cli_main(base + ["--input", str(trained["test"]), "--text-field", "review",
                            "--label-field", "sentiment", "--output",
                            str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    acc = trained["report"]["classifier"]["accuracy"]["test"]
    assert f"accuracy {100 * acc:.2f}% against --label-field" in out
    rows = _read_csv(tmp_path / "p.csv")
    split = D.load_table(trained["test"], "test", "review", "sentiment")
    assert [r["text"] for r in rows] == split.texts
    assert [int(r["line"]) for r in rows] == list(range(1, len(split) + 1))
    saved = S.load_classifier(clf)
    model = tiny_model()
    for i in (0, 7, 33):
        x = F.featurize(model, [split.texts[i]], "cell").features
        assert float(rows[i]["probability"]) == pytest.approx(saved.model.predict_proba(x)[0],
                                                              abs=2e-6)
    assert all(int(r["label"]) == int(float(r["probability"]) > 0.5) for r in rows)
    assert np.mean([int(r["label"]) == int(r["true_label"]) for r in rows]) == acc
    # JSON lines, gzip-compressed, without the text
    assert cli_main(base + ["--input", str(trained["test"]), "--text-field", "review",
                            "--output", str(tmp_path / "p.jsonl.gz"), "--no-text"]) == 0
    with gzip.open(tmp_path / "p.jsonl.gz", "rt") as f:
        js = [json.loads(line) for line in f]
    assert [j["probability"] for j in js] == [float(r["probability"]) for r in rows]
    assert set(js[0]) == {"line", "probability", "label"}
    # Plain lines (gzip) with blank lines skipped, TSV out
    with gzip.open(tmp_path / "t.txt.gz", "wt") as f:
        f.write(split.texts[0] + "\n\n" + split.texts[1] + "\n")
    assert cli_main(base + ["--input", str(tmp_path / "t.txt.gz"), "--output",
                            str(tmp_path / "p.tsv")]) == 0
    with open(tmp_path / "p.tsv", newline="") as f:
        tsv = list(csv.DictReader(f, delimiter="\t"))
    assert [(r["line"], r["probability"]) for r in tsv] == [("1", rows[0]["probability"]),
                                                             ("3", rows[1]["probability"])]
    capsys.readouterr()
    # Standard output (the summary goes to standard error)
    assert cli_main(base + ["--input", str(tmp_path / "t.txt.gz")]) == 0
    cap = capsys.readouterr()
    assert cap.out.splitlines()[0] == "line,probability,label,text"
    assert "classified 2 texts" in cap.err


def test_classify_bad_input_names_file_line_and_field(tmp_path, trained, capsys):
    (tmp_path / "bad.csv").write_text("text,label\nfine,1\nodd,maybe\n")
    argv = ["classify", str(trained["ckpt"]), str(trained["dir"] / "out"), "--input",
            str(tmp_path / "bad.csv"), "--label-field", "label", "--output",
            str(tmp_path / "o.csv")]
    assert cli_main(argv) == 2
    assert "bad.csv:3: field 'label': unknown label 'maybe'" in capsys.readouterr().err
    assert not (tmp_path / "o.csv").exists()
    assert cli_main(argv[:4] + [str(tmp_path / "none.csv")]) == 2
    assert "none.csv: no such file" in capsys.readouterr().err


@need_sst2
def test_classify_on_sst2_val_gives_transfer_val_accuracy(tmp_path, capsys):
    """transfer (train: 400 SST-2 sentences, val: the whole shared val.csv), then classify on
    val.csv with its labels: the same accuracy, to the last digit."""
    write_checkpoint(tmp_path / "run", hidden=16)
    train = D.load_sst2(SST2)["train"]
    with open(tmp_path / "train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "sentence"])
        w.writerows(zip(train.labels[:400].tolist(), train.texts[:400]))
    assert cli_main(["transfer", str(tmp_path / "run"), "--train", str(tmp_path / "train.csv"),
                     "--val", str(SST2 / "val.csv"), "--text-field", "sentence", "--out",
                     str(tmp_path / "out"), "--no-cache", "--no-progress", "--no-baseline",
                     "--threads", "1"]) == 0
    report = json.loads((tmp_path / "out/transfer.json").read_text())
    val_acc = report["classifier"]["accuracy"]["val"]
    capsys.readouterr()
    assert cli_main(["classify", str(tmp_path / "run"), str(tmp_path / "out"), "--input",
                     str(SST2 / "val.csv"), "--text-field", "sentence", "--label-field", "label",
                     "--output", str(tmp_path / "val_pred.jsonl"), "--no-progress",
                     "--threads", "1"]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "val_pred.jsonl")]
    assert len(rows) == 872
    assert np.mean([r["label"] == r["true_label"] for r in rows]) == val_acc
    assert f"accuracy {100 * val_acc:.2f}%" in capsys.readouterr().out


@pytest.mark.slow
def test_classify_under_horovodrun_matches_one_process(tmp_path, trained):
    """``horovodrun -np 2 --gloo python -m hvd_lm classify``: texts split over 2 ranks, rank 0
    writes the same predictions as one process (to 1e-6)."""
    ckpt, clf = trained["ckpt"], trained["dir"] / "out"
    args = [ckpt, clf, "--input", trained["test"], "--text-field", "review", "--batch-size", "8",
            "--no-progress", "--device", "cpu"]  # 2 ranks cannot share one GPU
    run(horovodrun_cmd(2, ["-m", "hvd_lm", "classify", *args, "--output", tmp_path / "two.csv"],
                       "gloo"), timeout=240)
    assert cli_main(["classify", *map(str, args), "--output", str(tmp_path / "one.csv")]) == 0
    two, one = _read_csv(tmp_path / "two.csv"), _read_csv(tmp_path / "one.csv")
    assert [r["text"] for r in two] == [r["text"] for r in one] and len(one) == 80
    np.testing.assert_allclose([float(r["probability"]) for r in two],
                               [float(r["probability"]) for r in one], atol=1e-6)


# ---- Generation ----------------------------------------------------------------------------------

def test_generation_is_reproducible_and_starts_from_the_forward_pass():
    model = tiny_model()
    prime = "The food was"
    a = G.generate(model, prime, 30, temperature=1.0, seed=3, samples=3)
    b = G.generate(model, prime, 30, temperature=1.0, seed=3, samples=3)
    c = G.generate(model, prime, 30, temperature=1.0, seed=4, samples=3)
    assert np.array_equal(a.tokens, b.tokens) and a.texts == b.texts
    assert not np.array_equal(a.tokens, c.tokens)
    assert len({tuple(r) for r in a.tokens}) == 3  # the batch rows are different draws
    ids = torch.from_numpy(tokenizer.encode(prime).astype(np.int64)).unsqueeze(0)
    with torch.no_grad():
        logits, _ = model(ids)
    for g in (a, G.generate(model, prime, 5, seed=0, neuron=2)):  # one call, then byte by byte
        torch.testing.assert_close(g.first_logits, logits[0, -1].expand(len(g.texts), -1),
                                   rtol=0, atol=1e-5)
    assert a.texts[0].startswith(prime) and a.tokens.shape == (3, 30)
    assert a.texts[0] == tokenizer.decode(a.sample_bytes(0))
    # An empty prime starts a new document: the first logits follow one end-of-document byte.
    with torch.no_grad():
        eod_logits, _ = model(torch.zeros(1, 1, dtype=torch.long))
    e = G.generate(model, "", 4, seed=0)
    torch.testing.assert_close(e.first_logits[0], eod_logits[0, -1], rtol=0, atol=1e-6)


def test_temperature_to_zero_and_top_k_one_are_greedy():
    """Greedy decoding written out with model.forward, against temperature 1e-6, temperature 0
    and top-k 1 (any seed)."""
    model = tiny_model(hidden=24, seed=5)
    prime = "It was"
    ids = torch.from_numpy(tokenizer.encode(prime).astype(np.int64)).unsqueeze(0)
    greedy = []
    with torch.no_grad():
        logits, st = model(ids)
        for _ in range(25):
            nxt = int(logits[0, -1].argmax())
            greedy.append(nxt)
            logits, st = model(torch.tensor([[nxt]]), st)
    for kw in ({"temperature": 1e-6, "seed": 1}, {"temperature": 0.0, "seed": 9},
               {"temperature": 1.0, "top_k": 1, "seed": 2}):
        g = G.generate(model, prime, 25, **kw)
        assert g.tokens[0].tolist() == greedy, kw
    assert G.generate(model, prime, 25, temperature=1.5, seed=1).tokens[0].tolist() != greedy


def test_overwrite_pins_the_unit():
    """After generation with --neuron N --overwrite V the state read back holds V at N (cell or
    hidden), the trace shows what the model computed before each pin, and pinning changes what
    is generated; the trace over the prime equals trace_unit's (no pin) for the hidden state,
    itself equal to encode()'s hidden states."""
    model = tiny_model(hidden=32, seed=2)
    prime = "Not what I expected."
    free = G.generate(model, prime, 40, temperature=0.0, neuron=5)
    for which, idx in (("cell", 1), ("hidden", 0)):
        g = G.generate(model, prime, 40, temperature=0.0, neuron=5, overwrite=4.0, state=which,
                       samples=2)
        assert torch.all(g.state[idx][:, 5] == 4.0)
        assert not torch.all(g.state[1 - idx][:, 5] == 4.0)
        assert g.unit.shape == (2, len(tokenizer.encode(prime)) + 40)
        assert np.abs(g.unit - 4.0).min() > 1e-3  # pre-pin values, not the pin
    pinned = G.generate(model, prime, 40, temperature=0.0, neuron=5, overwrite=4.0)
    assert pinned.tokens[0].tolist() != free.tokens[0].tolist()
    assert free.state[1][0, 5] != 4.0
    seq = tokenizer.encode(prime)
    traced = G.trace_unit(model, [seq], 5, "hidden")[0]
    hid = G.generate(model, prime, 3, temperature=0.0, neuron=5, state="hidden")
    np.testing.assert_allclose(hid.unit[0, :len(seq)], traced, atol=1e-6)
    with torch.no_grad():
        hs, _ = model.encode(torch.from_numpy(seq.astype(np.int64)).unsqueeze(0))
    np.testing.assert_allclose(traced, hs[0, :, 5].numpy(), atol=1e-6)
    cell = G.trace_unit(model, [seq], 5, "cell")[0]
    np.testing.assert_allclose(cell, free.unit[0, :len(seq)], atol=1e-6)
    with pytest.raises(ValueError, match="outside 0..31"):
        G.generate(model, prime, 3, neuron=32)


def test_trace_unit_is_padding_invariant():
    model = tiny_model()
    seqs = [tokenizer.encode(t) for t in ("short", "a rather longer text, with more bytes", "")]
    together = G.trace_unit(model, seqs, 3)
    for s, t in zip(seqs, together):
        alone = G.trace_unit(model, [s], 3)[0]
        assert len(t) == len(s)
        np.testing.assert_allclose(t, alone, atol=1e-6)


# ---- Heatmaps ------------------------------------------------------------------------------------

class _Spans(HTMLParser):
    def __init__(self):
        super().__init__()
        self.blocks, self.depth, self.text = [], 0, None

    def handle_starttag(self, tag, attrs):
        if tag == "div" and ("class", "text") in attrs:
            self.blocks.append([])
        elif tag == "span":
            self.text = ""

    def handle_data(self, data):
        if self.text is not None:
            self.text += data

    def handle_endtag(self, tag):
        if tag == "span":
            self.blocks[-1].append(self.text)
            self.text = None


def test_char_values_follow_utf8():
    ids = np.frombuffer("aé€😀".encode() + b"\xff" + "z".encode() + "é".encode()[:1],
                        dtype=np.uint8)
    vals = np.arange(len(ids), dtype=float)
    chars, v = HM.char_values(ids, vals)
    assert "".join(chars) == tokenizer.decode(ids)
    assert chars[:4] == ["a", "é", "€", "😀"] and v[:4].tolist() == [0, 2, 5, 9]
    assert len(chars) == len(v) == 7  # the bad byte and the cut é each become U+FFFD


def test_steering_says_and_picks_the_sentiment_direction(tmp_path, trained, capsys):
    """--overwrite V with a classifier says which sentiment V steers toward (3 steered negative
    silently when the unit's weight is < 0); --steer positive picks the sign the weight gives
    (the unit read back from the samples holds it)."""
    saved = S.load_classifier(trained["dir"] / "out")
    sign = 1 if saved.model.coef[saved.neuron["index"]] > 0 else -1
    ckpt, clf = str(trained["ckpt"]), str(trained["dir"] / "out")
    assert cli_main(["generate", ckpt, "--classifier", clf, "--overwrite", "3", "--length", "5",
                     "--state", "cell"]) == 0
    toward = "positive" if sign > 0 else "negative"
    assert f"held at 3: steering toward {toward} sentiment" in capsys.readouterr().out
    for steer, value in (("positive", 2.5 * sign), ("negative", -2.5 * sign)):
        assert cli_main(["generate", ckpt, "--classifier", clf, "--steer", steer,
                         "--overwrite", "2.5", "--length", "5"]) == 0
        assert f"held at {value:g}: steering toward {steer} sentiment" in \
            capsys.readouterr().out
    assert G.pinned_value(None, "positive", -1) == -3.0 and G.pinned_value(4.0, "", -1) == 4.0
    assert cli_main(["generate", ckpt, "--steer", "positive", "--neuron", "1"]) == 2
    assert "--steer needs --classifier" in capsys.readouterr().err


def test_heatmap_files_open(tmp_path, trained, capsys):
    """generate --heatmap .html: one span per character of prime + sample, in order; .png
    decodes; visualize on given texts: one block per text, one span per character."""
    ckpt = str(trained["ckpt"])
    assert cli_main(["generate", ckpt, "--prime", "Great food, slow service.\nWould go",
                     "--length", "30", "--samples", "2", "--neuron", "4", "--overwrite", "-2",
                     "--heatmap", str(tmp_path / "g.html"), "--output",
                     str(tmp_path / "g.jsonl"), "--seed", "1"]) == 0
    samples = [json.loads(line) for line in open(tmp_path / "g.jsonl")]
    p = _Spans()
    p.feed((tmp_path / "g.html").read_text())
    assert len(p.blocks) == 2
    for block, s in zip(p.blocks, samples):
        assert "".join(block) == s["text"] and len(block) == len(s["text"])
    assert capsys.readouterr().out.count("=== sample") == 2
    assert cli_main(["generate", ckpt, "--length", "20", "--neuron", "1", "--heatmap",
                     str(tmp_path / "g.png")]) == 0
    img = matplotlib.image.imread(tmp_path / "g.png")
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 200
    texts = ["I loved it", "Terrible, never again. 😞", "ok"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    for out in ("v.html", "v.png"):
        assert cli_main(["visualize", ckpt, "--classifier", str(trained["dir"] / "out"),
                         "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / out)]) == 0
    p = _Spans()
    p.feed((tmp_path / "v.html").read_text())
    assert ["".join(b) for b in p.blocks] == texts
    assert matplotlib.image.imread(tmp_path / "v.png").shape[2] in (3, 4)
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave nothing behind


@pytest.mark.parametrize("argv,match", [
    (["generate", "CK", "--overwrite", "1"], "need a unit: --neuron N or --classifier"),
    (["generate", "CK", "--neuron", "1", "--heatmap", "x.svg"], "must end in .html or .png"),
    (["generate", "CK", "--temperature", "-1"], "temperature must be >= 0"),
    (["visualize", "CK", "--out", "v.html"], "give the unit: --neuron N or --classifier"),
    (["classify", "CK", "CLF", "--format", "xml"], "invalid choice: 'xml'"),
])
def test_bad_options_are_usage_errors(argv, match, trained, capsys):
    argv = [str(trained["ckpt"]) if a == "CK" else str(trained["dir"] / "out") if a == "CLF"
            else a for a in argv]
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    assert match in capsys.readouterr().err


def test_commands_are_in_the_table():
    from benchmarks import BENCHMARKS
    from hvd_lm.cli import COMMANDS
    for name in ("classify", "generate", "visualize"):
        assert name in COMMANDS
    assert "transfer" in BENCHMARKS
    proc = run([sys.executable, "-m", "hvd_lm", "generate", "--help"], timeout=120)
    assert "--overwrite" in proc.stdout and "--heatmap" in proc.stdout
    assert (REPO / "hvd_lm/transfer/generate.py").is_file()


def test_a_png_heatmap_of_too_many_characters_is_refused_before_drawing(tmp_path, monkeypatch):
    """A PNG heatmap draws one matplotlib text per character (a 28k-character line peaked at
    964 MB): over MAX_PNG_CHARS (patched to 100 here) it is refused, naming the file and the
    way out (.html), before any figure exists; the HTML page of the same text is written."""
    import matplotlib.pyplot as plt

    monkeypatch.setattr(HM, "MAX_PNG_CHARS", 100)
    rows = [HM.HeatRow("long", list("x" * 101), np.zeros(101))]
    before = plt.get_fignums()
    with pytest.raises(ValueError, match=r"big.png: 101 characters are too many .*write .html"):
        HM.render(rows, tmp_path / "big.png", "h")
    assert plt.get_fignums() == before and not (tmp_path / "big.png").exists()
    HM.render(rows, tmp_path / "big.html", "h")
    assert (tmp_path / "big.html").stat().st_size > 101


def test_steering_warns_when_the_unit_alone_is_near_chance(tmp_path, trained, capsys):
    """What one H200 showed (docs/results/gpu_h200_2026-11-27/: a top unit at 50.9% on SST-2
    val, held at +1 and -1, moved the classifier the wrong way): the classifier records the
    unit's own accuracy as transfer.json reports it, and generate pinning a unit that alone is
    near chance says so on stderr; a strong unit, or a JSON without the record, is not warned."""
    import shutil
    rep = trained["report"]["neuron"]
    clf = tmp_path / "clf"
    shutil.copytree(trained["dir"] / "out", clf)
    meta = S.load_classifier(clf).meta

    def rewrite(meta):  # the same arrays, this metadata
        from safetensors.numpy import load_file, save_file
        path = str(clf / S.FILE_NAME)
        save_file(load_file(path), path, metadata={"classifier": json.dumps(meta)})

    assert meta["neuron"]["accuracy"] == rep["accuracy"]
    ckpt = str(trained["ckpt"])
    for acc, warned in ((0.509, True), (0.9, False), (None, False)):
        meta["neuron"]["accuracy"] = {"train": acc, "val": acc} if acc is not None else None
        rewrite(meta)
        assert cli_main(["generate", ckpt, "--classifier", str(clf), "--steer", "positive",
                         "--length", "3"]) == 0
        err = capsys.readouterr().err
        assert ("unlikely to steer" in err) == warned, err
        assert not warned or ("alone classifies the val split of train.jsonl, test.jsonl at "
                              "50.9% (chance is 50%): pinning it is unlikely") in err
    assert cli_main(["generate", ckpt, "--classifier", str(clf), "--length", "3"]) == 0
    assert "unlikely" not in capsys.readouterr().err  # nothing pinned: nothing to warn about
    # the unit is pinned in the state the classifier's features were computed from: h_t for a
    # classifier on the mean of h_t (before: the cell state unless --state hidden was given)
    meta["features"]["kind"] = "mean"
    rewrite(meta)
    assert cli_main(["generate", ckpt, "--classifier", str(clf), "--steer", "positive",
                     "--length", "3"]) == 0
    assert f"unit {rep['index']} of the hidden state" in capsys.readouterr().out
    assert cli_main(["generate", ckpt, "--classifier", str(clf), "--steer", "positive",
                     "--length", "3", "--state", "cell"]) == 0
    assert f"unit {rep['index']} of the cell state" in capsys.readouterr().out
