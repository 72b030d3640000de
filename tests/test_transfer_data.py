"""A user's own labelled set for `hvd-lm transfer` (hvd_lm.transfer.datasets): Blitzer `.review`
pairs labelled by file or folder name (read by prepare's own reader), comma-separated files, and
`--split TRAIN,VAL,TEST` carving one labelled set into stratified splits; the CLI end to end with
test accuracy beside TF-IDF's."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from data_prep import readers, sniff
from hvd_lm.cli import main as cli_main
from hvd_lm.transfer import datasets as D
from tests._mp import SHARED
from tests.test_transfer import write_checkpoint

BLITZER_BOOKS = SHARED / "data/amazon/blitzer_mdsd/sorted_data_acl/books"


def write_review(path, texts, gz=False):
    """Blitzer's layout: <review> blocks, each field an opening tag line, value lines, a closing
    tag line (a text may span lines)."""
    blocks = "".join(f"<review>\n<rating>\n4.0\n</rating>\n<review_text>\n{t}\n</review_text>\n"
                     "</review>\n" for t in texts)
    (gzip.open if gz else open)(path, "wt").write(blocks)
    return path


def reviews(n, seed, good):
    rng = np.random.default_rng(seed)
    words = "the a book plot author chapter story it was and then we read".split()
    end = " Great, I loved it." if good else " Awful, I hated it."
    return [" ".join(rng.choice(words, int(rng.integers(3, 20)))) + end for _ in range(n)]


def test_review_pairs_are_labelled_by_file_or_folder_name(tmp_path):
    d = tmp_path / "books"
    d.mkdir()
    write_review(d / "positive.review", ["Loved it.\nEvery page.", "Fine book."])
    write_review(d / "negative.review.gz", ["Dull.", "Awful.", "Boring."], gz=True)
    write_review(d / "unlabeled.review", ["who knows"])
    split = D.load_files(str(d), "train")  # the folder: its labelled .review files, by name
    assert split.texts == ["Dull.", "Awful.", "Boring.", "Loved it.\nEvery page.", "Fine book."]
    assert split.labels.tolist() == [0, 0, 0, 1, 1]
    # the same texts prepare reads from those files (one reader of the format)
    want = [t for f in ("negative.review.gz", "positive.review")
            for _, t in readers.read_documents(sniff.resolve_input(d / f, "review"))]
    assert split.texts == want
    pair = D.load_files(f"{d / 'positive.review'},{d / 'negative.review.gz'}", "val")
    assert pair.labels.tolist() == [1, 1, 0, 0, 0] and pair.name == "val"
    (tmp_path / "pos").mkdir()
    write_review(tmp_path / "pos/electronics.review", ["Works."])  # the folder names the label
    assert D.load_files(str(tmp_path / "pos/electronics.review"), "test").labels.tolist() == [1]
    with pytest.raises(D.DatasetError, match="unlabeled.review.*names neither"):
        D.load_files(str(d / "unlabeled.review"), "train")
    (tmp_path / "none").mkdir()
    with pytest.raises(D.DatasetError, match=r"none: a folder of train data holds \.review"):
        D.load_files(str(tmp_path / "none"), "train")
    (tmp_path / "neg").mkdir()  # <review_text> never closed: prepare's own error, file and line
    (tmp_path / "neg/broken.review").write_text("<review>\n<review_text>\nx\n</review>\n")
    with pytest.raises(D.DatasetError, match="broken.review:4: </review> inside <review_text>"):
        D.load_files(f"{tmp_path / 'pos'},{tmp_path / 'neg'}", "train")


def test_split_carves_stratified_disjoint_seeded_splits(tmp_path):
    labels = np.array([0] * 70 + [1] * 30)
    data = D.LabelledSplit("train", [f"t{i}" for i in range(100)], labels, "f.csv")
    got = D.carve_splits(data, (80, 10, 10), seed=3)
    assert {k: len(v) for k, v in got.items()} == {"train": 80, "val": 10, "test": 10}
    assert {k: int(v.labels.sum()) for k, v in got.items()} == {"train": 24, "val": 3, "test": 3}
    seen = [t for v in got.values() for t in v.texts]
    assert sorted(seen) == sorted(data.texts)  # disjoint, and nothing lost
    assert all(v.texts == sorted(v.texts, key=lambda t: int(t[1:])) for v in got.values())
    again = D.carve_splits(data, (80, 10, 10), seed=3)
    assert all(again[k].texts == got[k].texts for k in got)
    assert D.carve_splits(data, (80, 10, 10), seed=4)["test"].texts != got["test"].texts
    assert set(D.carve_splits(data, (9, 1, 0))) == {"train", "val"}
    with pytest.raises(D.DatasetError, match="give val a share"):
        D.carve_splits(data, (9, 0, 1))
    (tmp_path / "f.csv").write_text("label,text\n" + "".join(
        f"{y},{t}\n" for t, y in zip(data.texts, data.labels)))
    got = D.load_splits(train=str(tmp_path / "f.csv"), split=(8, 1, 1))
    assert {k: len(v) for k, v in got.items()} == {"train": 80, "val": 10, "test": 10}
    with pytest.raises(D.DatasetError, match="--split carves the training set.*val"):
        D.load_splits(train=str(tmp_path / "f.csv"), val=str(tmp_path / "f.csv"), split=(8, 1, 1))


@pytest.mark.parametrize("kind", ["review", "csv"])
def test_transfer_on_a_users_own_set_reports_test_beside_tfidf(tmp_path, capsys, kind):
    """`hvd-lm transfer RUN --train books/ --split 80,10,10` (Blitzer pairs) and on one labelled
    CSV: train/val/test carved stratified, the test accuracy of the LM and of TF-IDF reported."""
    write_checkpoint(tmp_path / "run")
    good, bad = reviews(60, 0, True), reviews(60, 1, False)
    if kind == "review":
        (tmp_path / "books").mkdir()
        write_review(tmp_path / "books/positive.review", good)
        write_review(tmp_path / "books/negative.review", bad)
        train, fields = tmp_path / "books", []
    else:
        train = tmp_path / "mine.csv"
        rows = [(t, "pos") for t in good] + [(t, "neg") for t in bad]
        train.write_text("review,stars\n" + "".join(f'"{t}",{y}\n' for t, y in rows))
        fields = ["--text-field", "review", "--label-field", "stars"]
    assert cli_main(["transfer", str(tmp_path / "run"), "--train", str(train), "--split",
                     "80,10,10", *fields, "--out", str(tmp_path / "out"), "--no-cache",
                     "--no-progress", "--batch-size", "32"]) == 0
    table = capsys.readouterr().out
    rep = json.loads((tmp_path / "out/transfer.json").read_text())
    splits = rep["dataset"]["splits"]
    assert {k: (s["n"], s["positive"]) for k, s in splits.items()} == {
        "train": (96, 48), "val": (12, 6), "test": (12, 6)}
    assert rep["dataset"]["split"] == [80.0, 10.0, 10.0] and rep["dataset"]["val_carved"]
    assert rep["classifier"]["accuracy"]["test"] >= 0.9  # the closing sentence decides
    assert rep["baseline"]["accuracy"]["test"] >= 0.9
    row = [x for x in table.splitlines() if x.startswith("| TF-IDF")]
    assert len(row) == 1 and row[0].split("|")[-3].strip() != "-", table


@pytest.mark.skipif(not BLITZER_BOOKS.is_dir(), reason=f"no {BLITZER_BOOKS}")
def test_the_real_blitzer_books_pair():
    """The shared Blitzer books domain: 1,000 positive and 1,000 negative reviews."""
    data = D.load_files(str(BLITZER_BOOKS), "train")
    assert len(data) == 2000 and int(data.labels.sum()) == 1000
    got = D.carve_splits(data, (80, 10, 10))
    assert {k: (len(v), int(v.labels.sum())) for k, v in got.items()} == {
        "train": (1600, 800), "val": (200, 100), "test": (200, 100)}
