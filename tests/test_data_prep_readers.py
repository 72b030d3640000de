"""Readers (data_prep.readers) against independent parses of the real shared files, striping,
and each bad-input behaviour at the reader level."""
import csv
import gzip
import io
import json
import re

import pytest

from data_prep import gzip_blocks, inputs, readers
from data_prep.inputs import BadRecord, CorruptInput, InputError, ReadStats
from data_prep.readers import read_documents
from data_prep.sniff import resolve_input

AMAZON = "amazon"
MUSIC = f"{AMAZON}/mcauley2014_5core/reviews_Digital_Music_5.json.gz"
TSV = f"{AMAZON}/amazon_customer_reviews_us/amazon_reviews_us_Gift_Card_v1_00.tsv.gz"
KAGGLE = f"{AMAZON}/kaggle_musical_instruments/Musical_instruments_reviews.csv.gz"
FOOD = f"{AMAZON}/amazon_fine_food/Reviews.csv.gz"
BLITZER = f"{AMAZON}/blitzer_mdsd/sorted_data_acl"


def _text(path, encoding="utf-8"):
    return gzip.decompress(path.read_bytes()).decode(encoding)


def independent(shared_data, rel):
    """Texts of a real file parsed without data_prep (json / csv / regex), in file order."""
    path = shared_data / rel
    if rel == MUSIC:
        return [json.loads(line)["reviewText"] for line in _text(path).splitlines()]
    if rel == TSV:
        rows = csv.DictReader(io.StringIO(_text(path), newline=""), delimiter="\t",
                              quoting=csv.QUOTE_NONE)
        return [r["review_body"] for r in rows]
    if rel in (KAGGLE, FOOD):
        rows = csv.DictReader(io.StringIO(_text(path, "utf-8-sig"), newline=""))
        return [r["reviewText" if rel == KAGGLE else "Text"] for r in rows]
    return re.findall(r"<review_text>\n(.*?)\n</review_text>", _text(path), re.S)


REAL = [MUSIC, TSV, KAGGLE, FOOD, f"{BLITZER}/books/positive.review.gz",
        f"{BLITZER}/dvd/negative.review.gz", f"{BLITZER}/electronics/positive.review.gz"]
COUNTS = {MUSIC: 6908, TSV: 1452, KAGGLE: 499, FOOD: 1000}


@pytest.mark.parametrize("rel", REAL)
def test_every_record_of_the_real_files_byte_exact(shared_data, rel):
    spec = resolve_input(shared_data / rel)
    stats = ReadStats()
    got = list(read_documents(spec, stats=stats))
    want = independent(shared_data, rel)
    assert len(got) == COUNTS.get(rel, 1000) == len(want) == stats.records
    assert [t for _, t in got] == want  # all records, byte-exact
    assert stats.bytes_in == len(gzip.decompress((shared_data / rel).read_bytes()))
    assert stats.bad_records == stats.utf8_replaced == 0
    # line numbers point at the start of each record
    lines = _text(shared_data / rel, "utf-8-sig").split("\n")
    for line_no, text in got[:200]:
        first = lines[line_no - 1]
        if spec.format == "review":
            assert first == "<review>"
        elif spec.format == "json":
            assert json.loads(first)["reviewText"] == text
        else:
            assert first.split("\t" if spec.format == "tsv" else ",")[0] != ""


def test_inferred_formats_and_fields(shared_data):
    cases = {MUSIC: ("json", "reviewText", "first record"), TSV: ("tsv", "review_body", "header"),
             KAGGLE: ("csv", "reviewText", "header"), FOOD: ("csv", "Text", "header"),
             f"{BLITZER}/books/negative.review.gz": ("review", "review_text", "default")}
    for rel, (fmt, field, how) in cases.items():
        spec = resolve_input(shared_data / rel)
        assert (spec.format, spec.text_field, spec.field_source) == (fmt, field, how)
        assert spec.format_source == "file name" and spec.compressed
    assert resolve_input(shared_data / FOOD).columns[0] == "Id"  # BOM dropped


def _write(path, data: bytes, compress=True):
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    return path


def test_loose_json_is_sniffed_and_read(shared_data, tmp_path):
    records = [json.loads(line) for line in _text(shared_data / MUSIC).splitlines()[:200]]
    path = _write(tmp_path / "reviews_Books.json.gz",
                  "".join(f"{r!r}\n" for r in records).encode())
    spec = resolve_input(path)
    assert spec.format == "loose-json" and spec.format_source == "file name + content"
    assert [t for _, t in read_documents(spec)] == [r["reviewText"] for r in records]


def test_plain_text_one_document_per_line(shared_data, tmp_path):
    texts = [t for t in independent(shared_data, MUSIC)[:200] if "\n" not in t and "\r" not in t]
    path = _write(tmp_path / "docs.txt", ("\r\n".join(texts) + "\n\n").encode(), compress=False)
    stats = ReadStats()
    got = list(read_documents(resolve_input(path), stats=stats))
    assert [t for _, t in got] == [t for t in texts if t.strip()]
    assert [n for n, _ in got][:3] == [1, 2, 3] and stats.blank_lines >= 1


@pytest.mark.parametrize("rel", [MUSIC, TSV])
def test_stripes_partition_the_records(shared_data, rel):
    spec = resolve_input(shared_data / rel)
    full = list(read_documents(spec))
    parts, bytes_in = [], []
    for s in range(3):
        stats = ReadStats()
        parts.append(list(read_documents(spec, s, 3, stats=stats, block_size=4096)))
        bytes_in.append(stats.bytes_in)
    assert all(parts)
    assert sorted(r for p in parts for r in p) == sorted(full)  # each record exactly once
    assert bytes_in[1] == bytes_in[2] == 0 and bytes_in[0] == sum(len(t) for t in [
        gzip.decompress((shared_data / rel).read_bytes())])
    with pytest.raises(ValueError, match="stripes"):
        list(read_documents(resolve_input(shared_data / KAGGLE), 0, 2))


# ---- bad input -----------------------------------------------------------------------------

GOOD = [{"reviewText": "one"}, {"reviewText": "two"}, {"reviewText": "three"}]


def _jsonl(tmp_path, lines, name="x.json.gz"):
    return _write(tmp_path / name, b"".join(line + b"\n" for line in lines))


def _lines(records):
    return [json.dumps(r).encode() for r in records]


@pytest.mark.parametrize("bad,reason", [
    (b'{"reviewText": "unterminated', "invalid JSON"),
    (b'["a list"]', "expected an object"),
    (b'{"summary": "no text"}', "no field 'reviewText'"),
    (b'{"reviewText": null}', "is NoneType"),
])
def test_malformed_record_names_file_and_line(tmp_path, bad, reason):
    lines = _lines(GOOD)
    lines.insert(1, bad)
    spec = resolve_input(_jsonl(tmp_path, lines), text_field="reviewText")
    with pytest.raises(BadRecord) as e:
        list(read_documents(spec))
    assert e.value.line == 2 and e.value.path == spec.path and reason in str(e.value)
    assert str(e.value).startswith(f"{spec.path}:2: ")
    stats = ReadStats()
    got = list(read_documents(spec, stats=stats, skip_bad=True))
    assert got == [(1, "one"), (3, "two"), (4, "three")]
    assert stats.bad_records == 1 and stats.bad_samples[0][:2] == (spec.path, 2)


def test_bad_samples_keep_the_first_few(tmp_path):
    lines = [b"{bad"] * 12 + _lines(GOOD)
    spec = resolve_input(_jsonl(tmp_path, lines), text_field="reviewText")
    stats = ReadStats()
    assert len(list(read_documents(spec, stats=stats, skip_bad=True))) == 3
    assert stats.bad_records == 12
    assert [s[1] for s in stats.bad_samples] == list(range(1, inputs.MAX_BAD_SAMPLES + 1))


def test_invalid_utf8_replaced_or_strict(tmp_path):
    lines = _lines(GOOD)
    lines[1] = b'{"reviewText": "caf\xe9 \xff"}'  # Latin-1 bytes, invalid UTF-8
    spec = resolve_input(_jsonl(tmp_path, lines))
    stats = ReadStats()
    got = list(read_documents(spec, stats=stats))
    assert got[1] == (2, "caf\ufffd \ufffd") and stats.utf8_replaced == 1
    with pytest.raises(BadRecord, match="invalid UTF-8") as e:
        list(read_documents(spec, utf8_errors="strict"))
    assert e.value.line == 2


def test_truncated_gzip_keeps_the_complete_lines(shared_data, tmp_path):
    data = (shared_data / MUSIC).read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(data[:len(data) // 3])
    spec = resolve_input(path)
    with pytest.raises(BadRecord, match="truncated") as e:
        list(read_documents(spec))
    stats = ReadStats()
    got = list(read_documents(spec, stats=stats, skip_bad=True))
    full = list(read_documents(resolve_input(shared_data / MUSIC)))
    assert 0 < len(got) < len(full) and got == full[:len(got)]
    assert e.value.line == len(got) + 1  # the cut line, dropped
    assert stats.truncated_files == 1 and stats.bad_records == 1


def test_corrupt_gzip_raises_corrupt_input(shared_data, tmp_path):
    data = bytearray((shared_data / TSV).read_bytes())
    data[len(data) // 2] ^= 0xFF
    path = tmp_path / "bad.tsv.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptInput, match="corrupt compressed stream") as e:
        list(read_documents(resolve_input(path), skip_bad=True))
    assert e.value.path == str(path)  # never skipped by the reader itself


def test_empty_files_yield_nothing(tmp_path):
    for name, data in [("e.json", b""), ("e.json.gz", gzip.compress(b"")), ("e.txt", b"\n\n"),
                       ("e.review", b""), ("e.csv", b"")]:
        path = tmp_path / name
        path.write_bytes(data)
        assert list(read_documents(resolve_input(path))) == []


def test_csv_bad_rows_and_missing_column(tmp_path):
    path = _write(tmp_path / "r.csv", b'id,Text\n1,"good, quoted\nover two lines"\n2\n3,fine\n',
                  compress=False)
    spec = resolve_input(path)
    assert spec.text_field == "Text" and spec.header_lines == 1
    with pytest.raises(BadRecord, match="1 fields, expected 2") as e:
        list(read_documents(spec))
    assert e.value.line == 4
    got = list(read_documents(spec, skip_bad=True))
    assert got == [(2, "good, quoted\nover two lines"), (5, "fine")]
    with pytest.raises(InputError, match="no column 'body'.*columns: id, Text"):
        resolve_input(path, text_field="body")
    path2 = _write(tmp_path / "n.csv", b"id,name\n1,x\n", compress=False)
    with pytest.raises(InputError, match="pass --text-field"):
        resolve_input(path2)


def test_review_blocks_broken(tmp_path):
    ok = ("<review>\n<title>\nT\n</title>\n<review_text>\nline 1\n\nline 3\n</review_text>\n"
          "</review>\n")
    no_text = "<review>\n<title>\nT\n</title>\n</review>\n"
    unclosed = "<review>\n<review_text>\ncut"
    path = _write(tmp_path / "x.review", (ok + no_text + ok + unclosed).encode(), compress=False)
    spec = resolve_input(path)
    with pytest.raises(BadRecord, match="no <review_text>") as e:
        list(read_documents(spec))
    assert e.value.line == 11
    stats = ReadStats()
    got = list(read_documents(spec, stats=stats, skip_bad=True))
    assert got == [(1, "line 1\n\nline 3"), (16, "line 1\n\nline 3")]
    assert stats.bad_records == 2 and "not closed" in stats.bad_samples[1][2]


def test_unknown_format_and_missing_file(tmp_path):
    path = _write(tmp_path / "data.bin", b"hello\n", compress=False)
    with pytest.raises(InputError, match="--format"):
        resolve_input(path)
    assert [t for _, t in read_documents(resolve_input(path, "text"))] == ["hello"]
    with pytest.raises(InputError, match="no such file"):
        resolve_input(tmp_path / "missing.json")
    with pytest.raises(InputError, match="unknown format"):
        resolve_input(path, "xml")



# ---- the bulk path of prepare: orjson batches and the zlib inflater ------------------------

_EDGE = [  # lines where orjson and json could disagree; every one must read as json reads it
    b'\xef\xbb\xbf{"reviewText": "BOM on line 1"}', b'{"reviewText": "a", "reviewText": "b"}',
    b'{"reviewText": "nan", "v": NaN}', b'{"reviewText": "big", "v": 1234567890123456789012}',
    b'{"reviewText": "lone \\ud800"}', b'{"reviewText": "pair \\ud83d\\ude00"}',
    b'{"reviewText": "nul \\u0000"}', b"", b"   ", b"\xe3\x80\x80", b'{"reviewText": "crlf"}\r',
    b'{"reviewText": 5}', b'{"other": 1}', b"[1]", b'{"reviewText": "x"} y',
    b'{"reviewText": "ctl \x01"}', b'{"reviewText": "inf", "f": 1e400}',
    b'{"reviewText": "bad \xff utf8"}', b'{"reviewText": "cut \xc3"}',
    b'{"reviewText": "deep", "n": ' + b"[" * 600 + b"]" * 600 + b"}", b"null",
    b'{"reviewText": "' + b"[{" * 400 + b'"}', b'{"reviewText": "last, no newline"}']


@pytest.mark.parametrize("skip_bad,utf8_errors", [(True, "replace"), (True, "strict"),
                                                  (False, "replace")])
@pytest.mark.parametrize("block_size,n_stripes", [(16, 3), (4096, 1), (1 << 20, 2)])
def test_batches_read_what_read_documents_reads(tmp_path, monkeypatch, skip_bad, utf8_errors,
                                                block_size, n_stripes):
    """read_document_batches (orjson's fast path, in lists) gives the texts, counters and errors
    of read_documents with orjson refusing every line (the json path alone: decoded lines,
    json.loads) for every stripe."""
    src = _write(tmp_path / "e.json.gz", b"\n".join(_EDGE * 3))
    spec = resolve_input(src)

    def outcome(fn, stripe):
        stats = ReadStats()
        try:
            got = list(fn(spec, stripe, n_stripes, stats=stats, skip_bad=skip_bad,
                          utf8_errors=utf8_errors, block_size=block_size))
        except BadRecord as e:
            return str(e), stats
        return got, stats

    def refuse(raw):
        raise readers.orjson.JSONDecodeError("refused", "", 0)

    for stripe in range(n_stripes):
        got, got_stats = outcome(readers.read_document_batches, stripe)
        with monkeypatch.context() as m:
            m.setattr(readers.orjson, "loads", refuse)
            want, want_stats = outcome(read_documents, stripe)
        if isinstance(want, list):
            want, got = [t for _, t in want], [t for batch in got for t in batch]
        assert got == want and got_stats == want_stats


def _reference_blocks(path, block_size):
    blocks, error = [], None
    try:
        for b in gzip_blocks._blocks_gzipfile(str(path), True, block_size, None):
            blocks.append(b)
    except Exception as e:  # noqa: BLE001 - compared below
        error = (type(e), str(e))
    return blocks, error


@pytest.mark.parametrize("block_size", [7, 1000, 1 << 16])
def test_inflater_matches_gzipfile(shared_data, tmp_path, block_size):
    """The zlib inflater yields GzipFile's blocks and, for damaged or truncated streams, the
    same blocks before the same exception (members, zero padding, cut header, garbage, CRC)."""
    one = gzip.compress(b'{"reviewText": "x"}\n' * 3000, mtime=0)
    music = (shared_data / MUSIC).read_bytes()
    flipped = bytearray(music)
    flipped[len(flipped) // 2] ^= 0xFF
    crc = bytearray(one)
    crc[-6] ^= 0xFF
    cases = {"members": one + b"\0" * 5 + one + b"\0", "cut_header": one + one[:6],
             "garbage": one + b"\0\0garbage", "truncated": music[: len(music) // 3],
             "flipped": bytes(flipped), "crc": bytes(crc)}
    for name, data in cases.items():
        if block_size == 7 and len(data) > 10**5:
            continue  # slow at 7-byte blocks; covered by the larger sizes
        path = tmp_path / f"{name}.gz"
        path.write_bytes(data)
        blocks, error = [], None
        try:
            for b in gzip_blocks._blocks(str(path), True, block_size, None):
                blocks.append(b)
        except Exception as e:  # noqa: BLE001 - compared below
            error = (type(e), str(e))
        assert (blocks, error) == _reference_blocks(path, block_size), name


# ---- tar archives of text files (IMDB's aclImdb layout) ----------------------------------------

def _tar(path, members, mode="w:gz"):
    """Write a tar archive of ``members``: name -> bytes (a file), None (a folder) or
    ("->", target) (a symbolic link)."""
    import tarfile
    import time

    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.mtime = int(time.time())
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, tuple):
                info.type, info.linkname = tarfile.SYMTYPE, data[1]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


_ACL = {"aclImdb/": None, "aclImdb/README": b"Large Movie Review Dataset v1.0\n",
        "aclImdb/train/pos/": None, "aclImdb/train/pos/0_9.txt": b"A gem.<br />Loved it.",
        "aclImdb/train/pos/1_8.txt": "\ufeffCaf\u00e9 scenes, great.".encode(),
        "aclImdb/train/pos/2_7.txt": b"  \n", "aclImdb/train/pos/3_10.txt": ("->", "0_9.txt"),
        "aclImdb/train/neg/": None, "aclImdb/train/neg/4_1.txt": b"Dull \xff plot.",
        "aclImdb/train/neg/5_2.txt": b"Boring.\nTwo lines.", "aclImdb/train/neg/6\n_3.txt": b"\xfe",
        "aclImdb/train/urls_pos.txt": b"http://www.imdb.com/title/tt0453418/usercomments\n"}


@pytest.mark.parametrize("suffix,mode", [(".tar.gz", "w:gz"), (".tar", "w"),
                                         (".tar.bz2", "w:bz2"), (".tar.xz", "w:xz")])
def test_tar_members_are_documents(tmp_path, suffix, mode):
    """Each regular member matching --tar-members is one document, in archive order, its
    position as its line; folders, links, other members are skipped; a BOM is dropped, a blank
    member counted, invalid UTF-8 replaced (or, strict, a bad record naming the member); the
    default globs (*.txt) leave IMDB's urls list out, counted as members_left_out; every
    compression reads the same."""
    path = _tar(tmp_path / f"acl{suffix}", _ACL, mode)
    spec = resolve_input(path, tar_members="*/pos/*.txt, */neg/*.txt")
    assert (spec.format, spec.format_source, spec.field_source) == ("tar", "file name", "given")
    assert spec.text_field == "*/pos/*.txt, */neg/*.txt"
    stats = ReadStats()
    got = list(read_documents(spec, stats=stats))
    assert got == [(4, "A gem.<br />Loved it."), (5, "Café scenes, great."),
                   (9, "Dull \ufffd plot."), (10, "Boring.\nTwo lines."), (11, "\ufffd")]
    assert (stats.records, stats.blank_lines, stats.utf8_replaced) == (5, 1, 2)
    assert stats.bytes_in == sum(len(_ACL[f"aclImdb/train/{m}"]) for m in
                                 ("pos/0_9.txt", "pos/1_8.txt", "pos/2_7.txt", "neg/4_1.txt",
                                  "neg/5_2.txt", "neg/6\n_3.txt"))
    with pytest.raises(BadRecord, match=r"\[aclImdb/train/neg/4_1.txt\]:1: invalid UTF-8"):
        list(read_documents(spec, utf8_errors="strict"))
    strict = ReadStats()
    list(read_documents(spec, stats=strict, skip_bad=True, utf8_errors="strict"))
    assert strict.bad_samples[1][0].endswith("acl%s['aclImdb/train/neg/6\\n_3.txt']" % suffix)
    default = resolve_input(path)
    assert (default.text_field, default.field_source) == ("*.txt", "default")
    left = ReadStats()
    assert [n for n, _ in read_documents(default, stats=left)] == [4, 5, 9, 10, 11]
    assert left.members_left_out == 1  # aclImdb/train/urls_pos.txt


def test_tar_damaged_oversized_and_not_a_tar(tmp_path):
    """A truncated archive is CorruptInput (the whole file, as a damaged gzip stream) after the
    members before the cut; a member over the per-document budget is a bad record naming it and
    its size; a file that is no tar archive is an InputError naming it; an empty one is empty."""
    members = {f"d/{i}.txt": f"review {i} ".encode() * 3000 for i in range(40)}
    path = _tar(tmp_path / "big.tgz", members)
    data = path.read_bytes()
    cut = _tar(tmp_path / "cut.tar.gz", {})
    cut.write_bytes(data[:len(data) // 2])
    got = []
    with pytest.raises(CorruptInput, match="damaged or truncated tar archive") as e:
        for item in read_documents(resolve_input(cut)):
            got.append(item)
    assert e.value.path == str(cut) and 0 < len(got) < 40 and e.value.line > len(got)
    spec = resolve_input(path)
    with pytest.raises(BadRecord, match=r"big.tgz\[d/0.txt\]:1: a member of 27,000 bytes"):
        list(read_documents(spec, max_line_bytes=10_000))
    stats = ReadStats()
    assert list(read_documents(spec, stats=stats, skip_bad=True, max_line_bytes=10_000)) == []
    assert stats.bad_records == 40
    junk = tmp_path / "notes.tar"
    junk.write_bytes(b"just some text, not an archive\n" * 40)
    with pytest.raises(InputError, match=r"notes.tar: not a readable tar archive"):
        list(read_documents(resolve_input(junk)))
    (tmp_path / "empty.tar").write_bytes(b"")
    assert list(read_documents(resolve_input(tmp_path / "empty.tar"))) == []
    with pytest.raises(InputError, match="holds no glob"):
        resolve_input(path, tar_members=" , ")


def _outcome(path):
    """The documents read from ``path``, or the type of the error reading it raised."""
    try:
        return [t for _, t in read_documents(resolve_input(path))]
    except (CorruptInput, InputError) as e:
        return type(e)


@pytest.mark.parametrize("suffix,mode", [(".tar.gz", "w:gz"), (".tar", "w")])
def test_a_cut_or_flipped_tar_never_reads_as_less_or_other_text(tmp_path, suffix, mode):
    """Every cut of the archive (a plain tar too, where tarfile itself ends quietly at a cut
    header) and every flipped byte of its compressed body either reads all the documents as
    they are or raises CorruptInput / InputError: never fewer documents, never other text
    (tarfile's own gzip reading checks no CRC: most flips read as other text there)."""
    members = {f"r/{i}.txt": f"review {i}: ".encode() + bytes(range(65, 91)) * (i + 1)
               for i in range(12)}
    path = _tar(tmp_path / f"a{suffix}", members, mode)
    data = path.read_bytes()
    full = [m.decode() for m in members.values()]
    assert _outcome(path) == full
    bad = tmp_path / f"bad{suffix}"
    cuts = range(1, len(data), max(1, len(data) // 150))
    flips = range(10, len(data) - 8, max(1, len(data) // 150)) if mode == "w:gz" else []
    for variant in [data[:n] for n in cuts] + [
            data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:] for i in flips]:
        bad.write_bytes(variant)
        got = _outcome(bad)
        assert got in (full, CorruptInput, InputError), (len(variant), got)


def test_tar_headers_that_lie_and_many_members(tmp_path):
    """A member whose header claims 10**14 bytes (a PAX size) ends in CorruptInput as soon as
    the file ends (tarfile's own skip would read empty blocks for ever); a GNU long-name header
    of 2 MiB is refused (tarfile reads one whole into memory, whatever its size); and reading
    20,000 members keeps no list of them (memory flat: tarfile's stream mode keeps every one)."""
    import tarfile
    import tracemalloc

    liar = tmp_path / "liar.tar"
    with tarfile.open(liar, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("a/ok.txt"), io.BytesIO(b""))
        info = tarfile.TarInfo("a/skip.bin")
        info.pax_headers = {"size": str(10**14)}
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(CorruptInput, match=r"liar.tar:2: damaged or truncated tar archive in"):
        list(read_documents(resolve_input(liar)))
    longname = tmp_path / "longname.tar"
    with tarfile.open(longname, "w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("ok.txt"), io.BytesIO(b""))
        tar.addfile(tarfile.TarInfo("x" * (2 << 20) + ".txt"), io.BytesIO(b""))
    with pytest.raises(CorruptInput, match="an extended header of 2,097,1"):
        list(read_documents(resolve_input(longname)))
    many = _tar(tmp_path / "many.tar.gz", {f"d/{i}.txt": b"x" for i in range(20_000)})
    tracemalloc.start()
    try:
        n = sum(1 for _ in read_documents(resolve_input(many)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 20_000 and peak < 2_000_000, peak  # tarfile's list of them: ~9 MB
