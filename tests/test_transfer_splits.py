"""What `hvd-lm transfer` reads and how it splits it (issue #63): every path into the dataset
readers named as what it is (a FIFO as SST-2's train.csv was "no such file"), and no text on
both sides of a split (a file listed twice with --split put copies of train rows in val and
test: an inflated accuracy, with no word)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hvd_lm.transfer import datasets as D
from tests.hostile_common import hvd_lm, one_error_line
from tests.test_transfer import write_checkpoint

QUICK = ["--no-cache", "--no-baseline", "--c-grid", "1", "--cv-folds", "2", "--batch-size", "32"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "run")


def texts(n: int, seed: int) -> list[str]:
    """``n`` distinct texts of random words."""
    words = np.random.default_rng(seed).choice("the a plot film it was and then".split(), (n, 6))
    return [f"text {seed}-{i}: {' '.join(w)}" for i, w in enumerate(words)]


def write_csv(path, rows, text="text"):
    path.write_text(f"label,{text}\n" + "".join(f'{y},"{t}"\n' for t, y in rows))
    return path


def notes(proc) -> list[str]:
    return [x for x in proc.stdout.splitlines() if x.startswith("Note: ")]


def test_every_dataset_path_is_named_as_what_it_is(ckpt, tmp_path):
    """Before: a FIFO as SST-2's train.csv was "no such file (SST-2 needs train.csv and
    val.csv)", a FIFO as --data-dir "SST-2 folder not found" (IMDB's "IMDB not found"), while
    the same FIFO as --train was named right. Now each through the one check: one ERROR line,
    exit 2, nothing written."""
    sst = tmp_path / "sst2"
    sst.mkdir()
    os.mkfifo(sst / "train.csv")
    write_csv(sst / "val.csv", [("fine", 1), ("awful", 0)], "sentence")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "only_val").mkdir()
    write_csv(tmp_path / "only_val/val.csv", [("fine", 1)], "sentence")
    out = tmp_path / "out"
    for args, needle in (
            (["--dataset", "sst2", "--data-dir", sst],
             f"{sst / 'train.csv'}: a FIFO (named pipe), not a regular file"),
            (["--train", sst / "train.csv"],
             f"{sst / 'train.csv'}: a FIFO (named pipe), not a regular file"),
            (["--dataset", "sst2", "--data-dir", fifo],
             f"{fifo}: a FIFO (named pipe), not a folder"),
            (["--dataset", "sst2", "--data-dir", sst / "val.csv"],
             f"{sst / 'val.csv'}: a regular file, not a folder"),
            (["--dataset", "sst2", "--data-dir", tmp_path / "only_val"],
             f"{tmp_path / 'only_val/train.csv'}: no such file (SST-2 is read from --data-dir: "
             "train.csv and val.csv"),
            (["--dataset", "imdb", "--data-dir", fifo],
             f"{fifo}: a FIFO (named pipe), not a regular file"),
            (["--dataset", "imdb", "--data-dir", "/dev/zero"], "/dev/zero: a character device")):
        proc = hvd_lm("transfer", ckpt, *args, "--out", out, "--no-progress", timeout=120)
        assert proc.returncode == 2
        one_error_line(proc, needle)
        assert not out.exists()
    (sst / "train.csv").unlink()  # test.csv is optional, but a FIFO there is named too
    write_csv(sst / "train.csv", [("fine", 1), ("awful", 0)] * 2, "sentence")
    os.mkfifo(sst / "test.csv")
    proc = hvd_lm("transfer", ckpt, "--dataset", "sst2", "--data-dir", sst, "--out", out,
                  timeout=120)
    one_error_line(proc, f"{sst / 'test.csv'}: a FIFO (named pipe), not a regular file")
    assert not out.exists()


def test_a_file_listed_twice_is_carved_without_copies_across_splits(ckpt, tmp_path):
    """``--train a.csv,b.csv --split 80,10,10`` where b.csv repeats a.csv's 60 texts (7 of them
    with the other label): the 60 copies are dropped before the carving, in one line, the first
    copy's label kept, and no val or test text is in train (before: all 120 rows were carved,
    and copies of train rows were scored as val and test)."""
    rng = np.random.default_rng(5)
    rows = list(zip(texts(60, 0), rng.integers(0, 2, 60).tolist()))  # random labels
    a = write_csv(tmp_path / "a.csv", rows)
    b = write_csv(tmp_path / "b.csv", [(t, 1 - y if i < 7 else y) for i, (t, y) in enumerate(rows)])
    line = ("60 duplicate texts dropped from train before val/test were carved from it (the first "
            "copy kept; 7 of them labelled otherwise)")
    proc = hvd_lm("transfer", ckpt, "--train", f"{a},{b}", "--split", "80,10,10", "--out",
                  tmp_path / "out", *QUICK, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert f"Note: {line}" in notes(proc) and f"hvd-lm transfer: {line}" in proc.stderr
    got = D.load_splits(train=f"{a},{b}", split=(80, 10, 10))  # what the command carved
    rep = json.loads((tmp_path / "out/transfer.json").read_text())["dataset"]["splits"]
    assert {k: v["n"] for k, v in rep.items()} == {k: len(v) for k, v in got.items()}
    assert sum(len(v) for v in got.values()) == 60
    train = set(got["train"].texts)
    assert not train & set(got["val"].texts) and not train & set(got["test"].texts)
    assert sorted((t, y) for s in got.values() for t, y in zip(s.texts, s.labels)) == sorted(rows)
    proc = hvd_lm("transfer", ckpt, "--train", a, "--split", "80,10,10", "--out",
                  tmp_path / "out2", *QUICK, timeout=240)  # no copies: no line
    assert proc.returncode == 0 and not [x for x in notes(proc) if "duplicate" in x]


def test_val_and_test_texts_also_in_train(ckpt, tmp_path):
    """A given val/test file sharing texts with train: dropped from it, counted in one line;
    SST-2's own splits (the standard benchmark) only counted and left as published."""
    rng = np.random.default_rng(1)
    rows = list(zip(texts(40, 0), rng.integers(0, 2, 40).tolist()))
    sst = tmp_path / "sst2"
    sst.mkdir()
    write_csv(sst / "train.csv", rows, "sentence")
    val = rows[:2] + list(zip(texts(10, 1), [0, 1] * 5))  # 2 sentences shared, as SST-2's
    write_csv(sst / "val.csv", val, "sentence")
    mine = write_csv(tmp_path / "mine.csv", rows[5:8] + list(zip(texts(10, 2), [1, 0] * 5)))
    proc = hvd_lm("transfer", ckpt, "--dataset", "sst2", "--data-dir", sst, "--test", mine,
                  "--out", tmp_path / "out", *QUICK, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert ("Note: 5 val/test texts also appear in train: 2 in val kept (--dataset sst2's own "
            "split, as published), 3 dropped from test") in notes(proc)
    rep = json.loads((tmp_path / "out/transfer.json").read_text())["dataset"]["splits"]
    assert {k: v["n"] for k, v in rep.items()} == {"train": 40, "val": 12, "test": 10}
