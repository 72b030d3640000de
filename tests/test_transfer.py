"""Sentiment transfer (hvd_lm.transfer.run, hvd_lm.transfer.datasets): padding-invariant features,
distributed featurization == one process, classifier/neuron on separable and shuffled data, dataset
loaders and their errors, the feature cache, and the command end to end."""
from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import tarfile
from dataclasses import asdict

import numpy as np
import pytest
import torch

from hvd_lm.formats.checkpoint import save
from hvd_lm.model.lm import LanguageModel, ModelConfig
from hvd_lm.transfer import datasets as D
from hvd_lm.transfer import features as F
from hvd_lm.transfer import fit as C
from hvd_lm.transfer import run as R
from tests._mp import SHARED, horovodrun_cmd, run

SST2 = SHARED / "data/sst2"
IMDB_TAR = SHARED / "data/imdb/aclImdb_train.tar.gz"
need_sst2 = pytest.mark.skipif(not (SST2 / "train.csv").is_file(),
                               reason=f"shared SST-2 not found at {SST2}")
need_imdb = pytest.mark.skipif(not IMDB_TAR.is_file(),
                               reason=f"shared IMDB tarball not found at {IMDB_TAR}")

# Lengths 0..~700 bytes, multi-byte UTF-8 and repeated text, so a batch has real padding.
TEXTS = ["great", "", "This was a terrible, terrible film and I hated it. " * 6, "ok",
         "héllo wörld, très bien " * 3, "x" * 700, "Loved every minute of it!", "meh"]


def tiny_model(cell: str = "mlstm", hidden: int = 32, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(ModelConfig(cell=cell, embed_dim=8, hidden_size=hidden)).eval()


def write_checkpoint(run_dir, cell: str = "mlstm", hidden: int = 32, seed: int = 0):
    """A checkpoint in hvd_lm.train.loop's layout (model, config.model, config.data, step)."""
    m = tiny_model(cell, hidden, seed)
    return save({"model": m.state_dict(), "step": 0,
                 "config": {"model": asdict(m.config), "data": {"seq_len": 16}}}, run_dir, 0)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    R.TRANSFER.add_arguments(p)
    p.set_defaults(func=lambda a: R.TRANSFER.invoke(a, "hvd-lm transfer"))
    return p.parse_args(list(map(str, argv)))


# ---------------------------------------------------------------------------------------------
# Featurization
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", ["mlstm", "lstm"])
@pytest.mark.parametrize("kind", F.FEATURE_KINDS)
def test_features_alone_equal_padded_batch(cell, kind):
    """Each text alone (batch 1, no padding) == the same text inside one length-sorted, padded
    batch run in 64-step chunks; float rounding only (matmuls of different M)."""
    model = tiny_model(cell)
    alone = np.stack([F.featurize(model, [t], kind, batch_size=1).features[0] for t in TEXTS])
    batched = F.featurize(model, TEXTS, kind, batch_size=len(TEXTS), time_chunk=64).features
    assert batched.shape == (len(TEXTS), 32) and batched.dtype == np.float32
    np.testing.assert_allclose(batched, alone, rtol=0, atol=1e-5)
    # Rows really differ (order is kept) and the empty text is all zeros.
    assert np.abs(batched[0] - batched[3]).max() > 1e-3
    assert not batched[1].any()


def test_padding_without_mask_would_change_features():
    """Power check for the test above: had the padding been fed through the model, the short
    text's final cell state would change."""
    model = tiny_model()
    short, long_ = F.encode_texts(["ok", "a much longer text here"])
    tokens = torch.zeros(2, len(long_), dtype=torch.long)
    tokens[0, :len(short)] = torch.from_numpy(short.astype(np.int64))
    tokens[1] = torch.from_numpy(long_.astype(np.int64))
    with torch.no_grad():
        _, (_, c_unmasked) = model.encode(tokens)
    alone = F.featurize(model, ["ok"], "cell").features[0]
    assert np.abs(c_unmasked[0].numpy() - alone).max() > 1e-3


def test_max_chars_truncates_to_prefix():
    model = tiny_model()
    text = "abcdefghij" * 30
    res = F.featurize(model, [text, "short"], "cell", max_chars=25)
    prefix = F.featurize(model, [text[:25]], "cell", max_chars=0).features[0]
    np.testing.assert_allclose(res.features[0], prefix, atol=1e-6)
    assert res.truncated == 1 and res.chars == 25 + 5 and res.chars_per_s > 0


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_plan_batches_cover_every_text_once(size):
    lengths = np.array([5, 0, 9, 9, 3, 12, 1, 7, 7, 2, 4])
    got = [F.plan_batches(lengths, 3, r, size) for r in range(size)]
    flat = np.concatenate([b for bs in got for b in bs])
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for bs in got:
        for b in bs:
            assert (np.diff(lengths[b]) <= 0).all()  # longest first within a batch
    # Batches do not depend on the world size: the union is the 1-rank plan.
    one = {tuple(b) for b in F.plan_batches(lengths, 3)}
    assert {tuple(b) for bs in got for b in bs} == one


# ---------------------------------------------------------------------------------------------
# Classifier and sentiment neuron
# ---------------------------------------------------------------------------------------------

def synthetic_features(n: int, h: int = 48, unit: int = 7, seed: int = 0):
    """Gaussian features [n, h]; unit ``unit`` = 2 * label - 1 + N(0, 0.3^2): separable."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    X = rng.normal(size=(n, h)).astype(np.float32)
    X[:, unit] = (2 * y - 1) + 0.3 * rng.normal(size=n)
    return X, y


def test_l1_logreg_finds_the_planted_unit():
    (Xtr, ytr), (Xva, yva), (Xte, yte) = (synthetic_features(n, seed=s)
                                          for n, s in ((600, 0), (300, 1), (600, 2)))
    clf = C.fit_logreg(Xtr, ytr, Xva, yva, Xte, yte, penalty="l1")
    assert clf["accuracy"]["val"] >= 0.99 and clf["accuracy"]["test"] >= 0.99
    assert clf["C"] in C.DEFAULT_C_GRID and len(clf["grid"]) == len(C.DEFAULT_C_GRID)
    assert 1 <= clf["nonzero"] < 48  # L1 drops most of the noise units
    neuron = C.sentiment_neuron(clf["coef"], {"train": (Xtr, ytr), "test": (Xte, yte)})
    assert neuron["index"] == 7 and neuron["sign"] == 1
    assert neuron["accuracy"]["test"] >= 0.99  # P(|N(0, .3)| > 1) ~ 1e-3
    assert abs(neuron["threshold"]) < 0.3


def test_standardized_and_degenerate_models():
    (Xtr, ytr), (Xva, yva) = synthetic_features(400, seed=6), synthetic_features(200, seed=7)
    Xtr[:, 3] *= 100.0  # a large-scale noise unit must not matter after z-scoring
    clf = C.fit_logreg(Xtr, ytr, Xva, yva, standardize=True)
    assert clf["accuracy"]["val"] >= 0.99
    assert C.sentiment_neuron(clf["coef"], {"train": (Xtr, ytr)})["index"] == 7
    # C so small that L1 zeroes every weight: no sentiment unit rather than an arbitrary one.
    clf = C.fit_logreg(Xtr, ytr, Xva, yva, grid=[1e-6])
    assert clf["nonzero"] == 0
    assert C.sentiment_neuron(clf["coef"], {"train": (Xtr, ytr)})["index"] is None


def test_shuffled_labels_give_chance_accuracy():
    """Labels independent of the features: test accuracy is chance. With 1,000 test texts the
    standard error is 1.6 points, so the band 0.5 +- 0.06 is ~4 standard errors. (C >= 0.25, so
    the L1 model keeps some weights and there is a unit to test; at smaller C the all-zero model
    can win on validation, which is the honest answer but has no unit.)"""
    (Xtr, ytr), (Xva, yva), (Xte, yte) = (synthetic_features(n, seed=s)
                                          for n, s in ((600, 3), (300, 4), (1000, 5)))
    rng = np.random.default_rng(9)
    ytr, yva, yte = rng.permutation(ytr), rng.permutation(yva), rng.permutation(yte)
    for penalty in ("l1", "l2"):
        clf = C.fit_logreg(Xtr, ytr, Xva, yva, Xte, yte, penalty=penalty, grid=(0.25, 1.0, 4.0))
        assert clf["nonzero"] > 0
        assert 0.44 <= clf["accuracy"]["test"] <= 0.56, (penalty, clf["accuracy"])
        neuron = C.sentiment_neuron(clf["coef"], {"train": (Xtr, ytr), "test": (Xte, yte)})
        assert 0.44 <= neuron["accuracy"]["test"] <= 0.56


def test_fit_threshold_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n = int(rng.integers(1, 25))
        x = rng.integers(-4, 5, n).astype(float)  # many ties
        y = rng.integers(0, 2, n)
        thr, sign, acc = C.fit_threshold(x, y)
        assert acc == pytest.approx(C.threshold_accuracy(x, y, thr, sign))
        cands = np.concatenate([[x.min() - 1], np.unique(x) + 0.5])
        best = max(C.threshold_accuracy(x, y, t, s) for t in cands for s in (1, -1))
        assert acc == pytest.approx(best), (x, y)


def test_neuron_histogram_png(tmp_path):
    X, y = synthetic_features(200)
    p = C.plot_neuron_histogram(X[:, 7], y, 7, 0.0, tmp_path / "h.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [f.name for f in tmp_path.iterdir()] == ["h.png"]  # no temp file left


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------

@need_sst2
def test_sst2_counts():
    s = D.load_sst2(SST2)
    assert set(s) == {"train", "val"}
    assert (len(s["train"]), len(s["val"])) == (6920, 872)
    assert (int(s["train"].labels.sum()), int(s["val"].labels.sum())) == (3610, 444)
    assert all(isinstance(t, str) and t for t in s["train"].texts)


@need_imdb
def test_imdb_tarball_counts_and_carved_val():
    s = D.load_imdb(IMDB_TAR)
    assert set(s) == {"train"}
    tr = s["train"]
    assert len(tr) == 25000 and int(tr.labels.sum()) == 12500
    assert sum(len(t.encode()) for t in tr.texts) == 33_132_823  # data/README.md
    train, val = D.carve_validation(tr, 0.1, seed=0)
    assert (len(train), len(val)) == (22500, 2500)
    assert int(val.labels.sum()) == 1250  # stratified
    again = D.carve_validation(tr, 0.1, seed=0)[1]
    assert again.texts == val.texts  # seeded


def _imdb_files():
    return {"aclImdb/train/pos/0_9.txt": "A wonderful film.", "aclImdb/train/pos/1_8.txt": "Great!",
            "aclImdb/train/neg/0_2.txt": "Awful.", "aclImdb/train/neg/10_1.txt": "Dull.",
            "aclImdb/test/pos/3_10.txt": "Superb.", "aclImdb/test/neg/4_3.txt": "Boring.",
            "aclImdb/train/unsup/5_0.txt": "ignored", "aclImdb/README": "readme"}


def test_imdb_folder_and_tar_agree(tmp_path):
    for name, text in _imdb_files().items():
        (tmp_path / "dir" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dir" / name).write_text(text)
    tar_path = tmp_path / "imdb.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tf:
        for name, text in _imdb_files().items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    for src in (tmp_path / "dir", tmp_path / "dir/aclImdb", tar_path):
        s = D.load_imdb(src)
        assert {k: len(v) for k, v in s.items()} == {"train": 4, "test": 2}
        assert s["train"].texts == ["A wonderful film.", "Great!", "Awful.", "Dull."]
        assert s["train"].labels.tolist() == [1, 1, 0, 0]
    assert not (tmp_path / "aclImdb").exists()  # nothing extracted


def test_csv_jsonl_and_label_mapping(tmp_path):
    (tmp_path / "a.csv").write_text('id,review,y\n1,"Good, really",pos\n2,bad,Negative\n'
                                    '3,"multi\nline",1\n')
    s = D.load_table(tmp_path / "a.csv", "train", "review", "y")
    assert s.texts == ["Good, really", "bad", "multi\nline"] and s.labels.tolist() == [1, 0, 1]
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write('{"t": "fine", "l": true}\n\n{"t": "poor", "l": 0}\n{"t": "yes", "l": "1.0"}\n')
    s = D.load_table(tmp_path / "b.jsonl.gz", "val", "t", "l")
    assert s.texts == ["fine", "poor", "yes"] and s.labels.tolist() == [1, 0, 1]


@pytest.mark.parametrize("name,content,fields,match", [
    ("m.csv", "label,text\n1,a\n", ("sentence", "label"), r"m\.csv: line 1: no column 'sentence'"),
    ("u.csv", "label,text\n1,a\n0,b\n2,c\n", ("text", "label"),
     r"u\.csv:4: field 'label': unknown label '2'"),
    ("e.csv", "label,text\n", ("text", "label"), r"e\.csv: split 'train' has no examples"),
    ("s.csv", "label,text\n1,a\n0\n", ("text", "label"), r"s\.csv:3: field 'text' missing"),
    ("m.jsonl", '{"text": "a", "label": 1}\n{"text": "b"}\n', ("text", "label"),
     r"m\.jsonl:2: field 'label' missing"),
    ("u.jsonl", '{"text": "a", "label": "neutral"}\n', ("text", "label"),
     r"u\.jsonl:1: field 'label': unknown label 'neutral'"),
    ("b.jsonl", '{"text": "a", "label": 1}\n{oops\n', ("text", "label"),
     r"b\.jsonl:2: invalid JSON"),
    ("e.jsonl", "\n\n", ("text", "label"), r"e\.jsonl: split 'train' has no examples"),
    ("x.txt", "hello", ("text", "label"), r"x\.txt: unknown file type"),
])
def test_bad_inputs_name_file_line_and_field(tmp_path, name, content, fields, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(D.DatasetError, match=match):
        D.load_table(tmp_path / name, "train", *fields)


def test_missing_paths_and_empty_imdb(tmp_path):
    with pytest.raises(D.DatasetError, match="no such file"):
        D.load_table(tmp_path / "nope.csv", "train")
    with pytest.raises(D.DatasetError, match="train.csv and val.csv"):
        D.load_sst2(tmp_path)
    (tmp_path / "aclImdb/train/pos").mkdir(parents=True)
    with pytest.raises(D.DatasetError, match="split 'train' has no examples"):
        D.load_imdb(tmp_path)
    with pytest.raises(D.DatasetError, match="--data-dir"):
        D.load_splits("sst2")
    with pytest.raises(D.DatasetError, match="no training split"):
        D.load_splits()


def test_subsample_is_seeded_and_stratified():
    s = D.LabelledSplit("train", [str(i) for i in range(100)], [0] * 30 + [1] * 70, "mem")
    a, b = D.subsample(s, 20, seed=1), D.subsample(s, 20, seed=1)
    assert a.texts == b.texts and len(a) == 20 and int(a.labels.sum()) == 14
    assert a.texts == sorted(a.texts, key=int)  # original order kept
    assert D.subsample(s, 500) is s


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def synthetic_reviews(path, n: int, seed: int, shuffle_labels: bool = False):
    """JSON lines: random filler words, then a clearly positive or negative closing sentence."""
    rng = np.random.default_rng(seed)
    words = "the a film plot actor scene music story it was and then we saw".split()
    ends = {1: " Great, I loved it.", 0: " Awful, I hated it."}
    with open(path, "w") as f:
        for _ in range(n):
            y = int(rng.integers(0, 2))
            text = " ".join(rng.choice(words, int(rng.integers(3, 30)))) + ends[y]
            label = int(rng.integers(0, 2)) if shuffle_labels else y
            f.write(json.dumps({"review": text, "sentiment": ["neg", "pos"][label]}) + "\n")
    return path


def test_cli_end_to_end_and_cache(tmp_path, capsys):
    write_checkpoint(tmp_path / "run")
    train = synthetic_reviews(tmp_path / "train.jsonl", 160, 0)
    test = synthetic_reviews(tmp_path / "test.jsonl", 80, 1)
    argv = [tmp_path / "run", "--train", train, "--test", test, "--text-field", "review",
            "--label-field", "sentiment", "--out", tmp_path / "out", "--cache-dir",
            tmp_path / "cache", "--batch-size", "16", "--no-progress"]
    args = parse(argv)
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "| LM + L1 logistic regression |" in table and "TF-IDF" in table
    rep = json.loads((tmp_path / "out/transfer.json").read_text())
    assert (tmp_path / "out/transfer.md").read_text().startswith("**Checkpoint**")
    assert (tmp_path / "out/neuron_hist.png").read_bytes()[:4] == b"\x89PNG"
    assert rep["dataset"]["val_carved"] and rep["dataset"]["splits"]["val"]["n"] == 16
    assert rep["dataset"]["splits"]["train"]["n"] == 144
    assert rep["features"]["kind"] == "cell" and rep["features"]["dim"] == 32
    assert rep["features"]["chars_per_s"] > 0
    # The closing sentence decides the label: a random LM's final state separates it, and so do
    # n-grams.
    assert rep["classifier"]["accuracy"]["test"] >= 0.9
    assert rep["baseline"]["accuracy"]["test"] >= 0.9
    assert 0 <= rep["neuron"]["index"] < 32 and rep["classifier"]["nonzero"] >= 1
    assert all(not c["hit"] for c in rep["features"]["cache"].values())
    npys = sorted((tmp_path / "cache").glob("*.npy"))
    assert len(npys) == 3 and not list((tmp_path / "cache").glob(".*"))  # no temp files
    # Same inputs again: every split from the cache, same numbers.
    assert args.func(args) == 0
    rep2 = json.loads((tmp_path / "out/transfer.json").read_text())
    assert all(c["hit"] for c in rep2["features"]["cache"].values())
    assert rep2["classifier"]["accuracy"] == rep["classifier"]["accuracy"]
    # Another feature option is another key.
    args3 = parse(argv + ["--max-chars", "10", "--no-baseline"])
    assert args3.func(args3) == 0
    rep3 = json.loads((tmp_path / "out/transfer.json").read_text())
    assert not any(c["hit"] for c in rep3["features"]["cache"].values())
    assert rep3["features"]["truncated"] > 0 and rep3["baseline"] is None
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 6


@pytest.mark.slow
def test_cli_under_horovodrun_matches_one_process(tmp_path, capsys):
    """``horovodrun -np 2 --gloo python -m hvd_lm.transfer``: rank 0 writes the report and the
    cache; a second launch hits the cache on every split (the hit is broadcast from rank 0); the
    cached features equal a one-process run's (same cache keys: world size is not in the key)."""
    ckpt = write_checkpoint(tmp_path / "run")
    data = ["--train", synthetic_reviews(tmp_path / "tr.jsonl", 60, 0), "--test",
            synthetic_reviews(tmp_path / "te.jsonl", 30, 1), "--text-field", "review",
            "--label-field", "sentiment", "--batch-size", "8", "--no-baseline", "--device", "cpu"]
    dist_argv = ["-m", "hvd_lm.transfer", ckpt, *data, "--out", tmp_path / "o2",
                 "--cache-dir", tmp_path / "c2"]
    hits = []
    for _ in range(2):
        proc = run(horovodrun_cmd(2, dist_argv, "gloo"), timeout=240)
        assert "LM + L1 logistic regression" in proc.stdout
        rep = json.loads((tmp_path / "o2/transfer.json").read_text())
        assert rep["features"]["world_size"] == 2
        hits.append([c["hit"] for c in rep["features"]["cache"].values()])
    assert hits == [[False] * 3, [True] * 3]
    args = parse([ckpt, *data, "--out", tmp_path / "o1", "--cache-dir", tmp_path / "c1",
                  "--no-progress"])
    assert args.func(args) == 0
    one = json.loads((tmp_path / "o1/transfer.json").read_text())
    assert one["features"]["world_size"] == 1
    names = sorted(p.name for p in (tmp_path / "c1").glob("*.npy"))
    assert names == sorted(p.name for p in (tmp_path / "c2").glob("*.npy")) and len(names) == 3
    for name in names:
        np.testing.assert_allclose(np.load(tmp_path / "c2" / name), np.load(tmp_path / "c1" / name),
                                   rtol=0, atol=1e-6)
    assert one["classifier"]["accuracy"] == rep["classifier"]["accuracy"]


def test_cli_shuffled_labels_near_chance(tmp_path):
    """Same texts with labels drawn independently: LM and baseline fall to chance on 300 test
    texts (standard error 2.9 points; band 0.5 +- 0.15, ~5 standard errors)."""
    ckpt = write_checkpoint(tmp_path / "run")
    args = parse([ckpt, "--train", synthetic_reviews(tmp_path / "tr.jsonl", 200, 0, True),
                  "--test", synthetic_reviews(tmp_path / "te.jsonl", 300, 1, True),
                  "--text-field", "review", "--label-field", "sentiment", "--out", tmp_path / "o",
                  "--no-cache", "--no-progress", "--features", "mean"])
    assert args.func(args) == 0
    rep = json.loads((tmp_path / "o/transfer.json").read_text())
    assert 0.35 <= rep["classifier"]["accuracy"]["test"] <= 0.65
    assert 0.35 <= rep["baseline"]["accuracy"]["test"] <= 0.65


def test_cli_reports_bad_input(tmp_path, capsys):
    write_checkpoint(tmp_path / "run")
    (tmp_path / "bad.csv").write_text("label,text\n1,a\nmaybe,b\n")
    args = parse([tmp_path / "run", "--train", tmp_path / "bad.csv", "--out", tmp_path / "o",
                  "--no-cache"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "bad.csv:3: field 'label': unknown label 'maybe'" in err
    assert not (tmp_path / "o").exists()


@need_sst2
def test_cli_sst2_small_via_module_entry(tmp_path):
    """``python -m hvd_lm.transfer`` (the launchable entry) on 60 SST-2 sentences per split."""
    write_checkpoint(tmp_path / "run", hidden=16)
    proc = run([sys.executable, "-m", "hvd_lm.transfer", tmp_path / "run", "--dataset", "sst2",
                "--data-dir", SST2, "--max-examples", "60", "--out", tmp_path / "o",
                "--no-cache", "--features", "max", "--threads", "1"], timeout=120)
    assert "| sentiment unit" in proc.stdout and "| LM + L1 logistic regression |" in proc.stdout
    rep = json.loads((tmp_path / "o/transfer.json").read_text())
    assert {k: v["n"] for k, v in rep["dataset"]["splits"].items()} == {"train": 60, "val": 60}
    assert rep["dataset"]["splits"]["train"]["positive"] == 31  # stratified: 3610/6920 of 60
    assert rep["features"]["dim"] == 16 and rep["features"]["world_size"] == 1
    for acc in (rep["classifier"]["accuracy"], rep["baseline"]["accuracy"]):
        assert 0.0 <= acc["val"] <= 1.0 and acc["test"] is None


def test_imdb_tarball_damaged_truncated_or_bloated(tmp_path, monkeypatch):
    """A truncated tarball (an interrupted download), bytes that are no archive, a review over
    MAX_REVIEW_BYTES (patched down) and a link to /dev/zero in the folder layout: one
    DatasetError line naming the file (before: a bare EOFError, a 5-line message, unbounded
    reads)."""
    tar_path = tmp_path / "imdb.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tf:
        for i in range(300):
            data = f"review {i} ".encode() * 200
            info = tarfile.TarInfo(f"aclImdb/train/pos/{i}_9.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(tar_path.read_bytes()[:tar_path.stat().st_size // 2])
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"<html>404 not found</html>\n" * 50)
    for bad in (cut, junk):
        with pytest.raises(D.DatasetError, match=f"{bad.name}: not a readable tar") as e:
            D.load_imdb(bad)
        assert "\n" not in str(e.value)
    monkeypatch.setattr(D, "MAX_REVIEW_BYTES", 1000)
    with pytest.raises(D.DatasetError, match=r"imdb.tar.gz\['aclImdb/train/pos/0_9.txt'\]: "
                                             r"1,800 bytes, over the 1,000"):
        D.load_imdb(tar_path)
    (tmp_path / "dir/aclImdb/train/pos").mkdir(parents=True)
    (tmp_path / "dir/aclImdb/train/pos/0_9.txt").write_text("Fine film.")
    (tmp_path / "dir/aclImdb/train/pos/1_9.txt").symlink_to("/dev/zero")
    assert D.load_imdb(tmp_path / "dir")["train"].texts == ["Fine film."]
