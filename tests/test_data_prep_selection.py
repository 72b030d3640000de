"""Which text ``prepare`` takes from its inputs, through the command line: ``--text-field
A,B,...`` (each file reads the first listed field it has; ``#N`` for a CSV without a header row)
against the texts read with the csv and json modules, and the members of IMDB's tarball as it
ships (its reviews, not its URL lists or held-out test reviews)."""
from __future__ import annotations

import csv
import gzip
import io
import json
import subprocess
import sys

from hvd_lm.formats.manifest import load_manifest
from hvd_lm.formats.shards import open_shard
from tests._mp import REPO


def prepare(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvd_lm", "prepare", *map(str, args),
                           "--no-progress", *([] if "--split" in args else ["--split", "1"])],
                          capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def documents(out) -> list[str]:
    """Every document of the shards (the bytes before each end-of-document token)."""
    docs = []
    for info in load_manifest(out).shards:
        s = open_shard(info.path)
        docs += [s.tokens[a:b - 1].tobytes().decode()
                 for a, b in zip(s.doc_offsets[:-1], s.doc_offsets[1:])]
    return docs


def test_each_file_reads_the_first_listed_field_it_has(tmp_path):
    earphones = tmp_path / "AllProductReviews.csv"
    earphones.write_text('ReviewTitle,ReviewBody,ReviewStar\n"Nice","Good bass, clear '
                         'highs\nand a long cable",5\nMeh,Broke after a week,1\n')
    datafiniti = tmp_path / "reviews.csv.gz"
    with gzip.open(datafiniti, "wt") as f:
        f.write("\ufeffid,reviews.text,reviews.title\n1,The kindle reads well in sun,Great\n")
    jsonl = tmp_path / "movies.json"
    jsonl.write_text(json.dumps({"summary": "x", "reviewText": "A film to see twice"}) + "\n")
    headerless = tmp_path / "musical.csv"
    headerless.write_text("A1,B1,Bob,\"[0, 0]\",The capo holds tight,5\n"
                          "A2,B2,Ann,\"[1, 2]\",\"Strings buzz, sadly\",2\n")
    review = tmp_path / "books.review"
    review.write_text("<review>\n<title>\nt\n</title>\n<review_text>\nA gripping plot\n"
                      "</review_text>\n</review>\n")
    fields = "reviewText,ReviewBody,reviews.text,review_text,#5"
    p = prepare(earphones, datafiniti, jsonl, headerless, review, "--text-field", fields,
                "--out", tmp_path / "out")
    assert p.returncode == 0, p.stderr
    for line in ("text field 'ReviewBody' (given, first in the header)",
                 "text field 'reviews.text' (given, first in the header)",
                 "text field 'reviewText' (first record)",
                 "text field '#5' (given, no header row)",
                 "text field 'review_text' (given, first in the blocks)"):
        assert line in p.stdout, (line, p.stdout)
    expected = [r["ReviewBody"] for r in csv.DictReader(io.StringIO(earphones.read_text()))]
    expected += ["The kindle reads well in sun", "A film to see twice"]
    expected += [row[4] for row in csv.reader(io.StringIO(headerless.read_text()))]
    expected += ["A gripping plot"]
    assert sorted(documents(tmp_path / "out")) == sorted(expected)


def test_a_list_that_names_no_field_of_a_file_says_which(tmp_path):
    f = tmp_path / "mobile.csv"
    f.write_text("Product Name,Reviews\nphone,fine\n")
    p = prepare(f, "--text-field", "reviewText,Text", "--out", tmp_path / "out")
    assert p.returncode == 1
    assert "no text column among reviewText, Text in the CSV header (columns: Product Name, " \
        "Reviews)" in p.stderr, p.stderr
    p = prepare(f, "--text-field", "Text,#9", "--out", tmp_path / "out")
    assert p.returncode == 1 and "--text-field #9: the first row has 2 columns" in p.stderr
    # a name lost between two commas is refused, not skipped; a column number out of #1-#9999
    # is not "a column of the CSV header" (the first row of a headerless file is data)
    for fields, needle in (("Reviews,,Text", "--text-field 'Reviews,,Text': an empty name"),
                           ("#0", "--text-field '#0': a column number of a CSV/TSV without a "
                            "header row is #1 to #9999")):
        p = prepare(f, "--text-field", fields, "--out", tmp_path / "out2")
        assert p.returncode == 1 and p.stderr.count("ERROR") == 1 and needle in p.stderr, \
            p.stderr
        assert not list((tmp_path / "out2").glob("*.h5"))


def test_imdbs_tarball_as_it_ships_gives_reviews_only_and_a_small_split_is_said(tmp_path):
    """The default members of aclImdb's layout: its train reviews, not its URL lists, its
    expected-rating table or its held-out test reviews (counted in the summary); --tar-members
    reads exactly what it names. A val split of a few hundred bytes is warned about."""
    import tarfile

    members = {"aclImdb/train/pos/1_10.txt": "A wonderful film, see it.",
               "aclImdb/train/neg/2_1.txt": "Dull from start to end.",
               "aclImdb/train/urls_pos.txt": "http://www.imdb.com/title/tt0453418/usercomments",
               "aclImdb/imdbEr.txt": "0.0490972013402\n0.201363575849",
               "aclImdb/test/pos/3_9.txt": "A held-out review."}
    archive = tmp_path / "aclImdb_v1.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    p = prepare(archive, "--out", tmp_path / "default", "--split", "1,1")
    assert p.returncode == 0, p.stderr
    assert sorted(documents(tmp_path / "default")) == sorted(
        [members["aclImdb/train/neg/2_1.txt"], members["aclImdb/train/pos/1_10.txt"]])
    assert "tar members left out: 3 (aclImdb's URL lists" in p.stdout, p.stdout
    assert "warning: split val holds 1 document(s)" in p.stdout
    p = prepare(archive, "--out", tmp_path / "named", "--tar-members", "*.txt")
    # what the glob names, the held-out test/ review too; the URL list and imdbEr.txt never
    assert p.returncode == 0 and len(documents(tmp_path / "named")) == 3, p.stdout
    assert "tar members left out: 2 " in p.stdout, p.stdout


def test_the_small_split_warning_names_a_split_that_fixes_it(tmp_path):
    """A val split under 64 KiB: the warning computes the --split that reaches it from the bytes
    the splits hold (before: "--split 100,1,1" whatever was used, repeated after it was), and
    preparing with that split gives a val split the warning no longer names."""
    import random
    import re

    rng = random.Random(0)
    words = "great sound album bad love song track voice band music cheap broke fine".split()
    f = tmp_path / "reviews.jsonl"
    f.write_text("".join(json.dumps({"reviewText": " ".join(
        rng.choice(words) for _ in range(rng.randint(20, 80)))}) + "\n" for _ in range(3000)))
    p = prepare(f, "--split", "100,1,0", "--out", tmp_path / "a")
    assert p.returncode == 0, p.stderr
    fix = re.search(r"warning: split val holds .* prepare it with --split (\S+) \(about", p.stdout)
    assert fix, p.stdout
    p = prepare(f, "--split", fix.group(1), "--out", tmp_path / "b")
    assert p.returncode == 0 and "too few to measure" not in p.stdout, p.stdout
    val = sum(s.tokens for s in load_manifest(tmp_path / "b").split("val"))
    assert 64 * 1024 <= val < 3 * 64 * 1024, (fix.group(1), val)
