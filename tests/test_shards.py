"""The shard format (hvd_lm.formats.shards): write/read/verify, manifests, and an independent
reader."""
import hashlib
import json
import re
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from hvd_lm.formats import shards
from hvd_lm.formats.manifest import (
    MANIFEST_NAME,
    ShardInfo,
    build_manifest,
    load_manifest,
    manifest_entry,
    write_manifest,
)
from hvd_lm.formats.shards import (
    FORMAT_VERSION,
    ShardChecksumError,
    ShardFormatError,
    check_shard,
    open_shard,
    read_tokens,
    verify_shard,
    write_shard,
)
from hvd_lm.formats.tokenizer import TOKENIZER_NAME, encode_document

DOCS = ["first review", "second, longer review \u00e9\u00e8", "x", "last one \U0001f3b8"]
ATTRS = {"tokenizer": TOKENIZER_NAME, "source_files": ["a.json.gz", "b/c.csv"]}


def _stream(docs=DOCS):
    arrays = [encode_document(t) for t in docs]
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    return np.concatenate(arrays), offsets


@pytest.fixture
def shard(tmp_path):
    tokens, offsets = _stream()
    path = tmp_path / "train-00000.h5"
    sha = write_shard(path, tokens, offsets, ATTRS)
    return path, tokens, offsets, sha


def test_write_and_open_round_trip(shard):
    path, tokens, offsets, sha = shard
    assert sha == hashlib.sha256(tokens.tobytes()).hexdigest()
    s = open_shard(path)
    np.testing.assert_array_equal(s.tokens, tokens)
    np.testing.assert_array_equal(s.doc_offsets, offsets)
    assert s.tokens.dtype == np.uint8 and s.doc_offsets.dtype == np.int64
    assert s.attrs["format_version"] == FORMAT_VERSION
    assert s.attrs["tokenizer"] == TOKENIZER_NAME
    assert s.attrs["source_files"] == ATTRS["source_files"]
    assert s.attrs["documents"] == len(DOCS) and s.attrs["bytes"] == len(tokens)
    assert s.attrs["sha256"] == sha
    assert s.document(1)[:-1].tobytes().decode() == DOCS[1]
    np.testing.assert_array_equal(read_tokens(path, 3, 10), tokens[3:10])
    assert check_shard(path)["sha256"] == sha
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_same_content_gives_a_byte_identical_file(tmp_path):
    tokens, offsets = _stream()
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_shard(a, tokens, offsets, ATTRS)
    write_shard(b, tokens, offsets, ATTRS)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("compression", ["gzip", "lzf", "none"])
def test_chunking_and_compression(tmp_path, compression):
    tokens, offsets = _stream(DOCS * 2000)
    path = tmp_path / "s.h5"
    write_shard(path, tokens, offsets, ATTRS, compression=compression)
    with h5py.File(path, "r") as f:
        ds = f["tokens"]
        assert ds.chunks == (min(shards.TOKEN_CHUNK, len(tokens)),)
        assert ds.compression == (None if compression == "none" else compression)
    np.testing.assert_array_equal(open_shard(path).tokens, tokens)


def test_empty_shard(tmp_path):
    path = tmp_path / "e.h5"
    write_shard(path, np.zeros(0, np.uint8), np.zeros(1, np.int64), ATTRS)
    assert check_shard(path)["documents"] == 0


@pytest.mark.parametrize("tokens,offsets,attrs,compression,match", [
    (np.zeros(3, np.int32), np.array([0, 3]), ATTRS, None, "uint8"),
    (np.array([1, 0], np.uint8), np.array([0, 2], np.int32), ATTRS, None, "int64"),
    (np.array([1, 0], np.uint8), np.array([0, 1], np.int64), ATTRS, None, "end at len"),
    (np.array([1, 0], np.uint8), np.array([0, 2], np.int64), {"tokenizer": "t"}, None,
     "source_files"),
    (np.array([1, 0], np.uint8), np.array([0, 2], np.int64), dict(ATTRS, sha256="x"), None,
     "computed"),
    (np.array([1, 0], np.uint8), np.array([0, 2], np.int64), ATTRS, "zstd", "compression"),
])
def test_write_shard_rejects_bad_arguments(tmp_path, tokens, offsets, attrs, compression, match):
    path = tmp_path / "bad.h5"
    with pytest.raises(ValueError, match=match):
        write_shard(path, tokens, offsets, attrs, compression=compression)
    assert not list(tmp_path.iterdir())


def test_failed_write_leaves_no_file(tmp_path):
    tokens, offsets = _stream()
    with pytest.raises(TypeError):
        write_shard(tmp_path / "x.h5", tokens, offsets, dict(ATTRS, extra=object()))
    assert not list(tmp_path.iterdir())


def _info(path, tokens, offsets, sha, split="train"):
    return ShardInfo(path=path, split=split, tokens=len(tokens), documents=len(offsets) - 1,
                     sha256=sha)


def test_verify_catches_a_flipped_byte(shard):
    path, tokens, offsets, sha = shard
    verify_shard(_info(path, tokens, offsets, sha))
    with h5py.File(path, "r+") as f:  # flip one byte of the stream, attributes untouched
        f["tokens"][5] ^= 0x20
    with pytest.raises(ShardChecksumError) as e:
        verify_shard(_info(path, tokens, offsets, sha))
    assert str(path) in str(e.value) and sha in str(e.value) and e.value.actual != sha
    with pytest.raises(ShardChecksumError):
        open_shard(path)
    open_shard(path, verify=False)  # reading without verification still works


def test_verify_catches_count_version_and_missing_file(shard):
    path, tokens, offsets, sha = shard
    with pytest.raises(ShardFormatError, match="documents"):
        verify_shard(ShardInfo(path, "train", len(tokens), len(offsets), sha))
    with pytest.raises(ShardFormatError, match="tokens"):
        verify_shard(ShardInfo(path, "train", len(tokens) + 1, len(offsets) - 1, sha))
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 99
    with pytest.raises(ShardFormatError, match="format_version"):
        verify_shard(_info(path, tokens, offsets, sha))
    with pytest.raises(FileNotFoundError):
        verify_shard(_info(path.with_name("gone.h5"), tokens, offsets, sha))
    path.write_bytes(b"not hdf5")
    with pytest.raises(ShardFormatError, match="HDF5"):
        verify_shard(_info(path, tokens, offsets, sha))


def test_verify_catches_a_document_without_eod(tmp_path):
    tokens, offsets = _stream()
    path = tmp_path / "s.h5"
    write_shard(path, tokens, offsets, ATTRS)
    with h5py.File(path, "r+") as f:  # make the offsets lie, keep the tokens and checksum
        f["doc_offsets"][1] = offsets[1] - 1
    with pytest.raises(ShardFormatError, match="EOD"):
        check_shard(path)


def _manifest(tmp_path):
    entries = {}
    for split, docs_list in {"train": [DOCS, DOCS[:2]], "val": [DOCS[2:]]}.items():
        entries[split] = []
        for i, docs in enumerate(docs_list):
            tokens, offsets = _stream(docs)
            name = f"{split}-{i:05d}.h5"
            sha = write_shard(tmp_path / name, tokens, offsets, ATTRS)
            entries[split].append(manifest_entry(name, len(tokens), len(docs), sha))
    write_manifest(tmp_path, build_manifest(entries, TOKENIZER_NAME, seed=7))
    return entries


def test_manifest_round_trip_and_split(tmp_path):
    entries = _manifest(tmp_path)
    m = load_manifest(tmp_path)
    assert m.directory == tmp_path.resolve()
    assert [s.path.name for s in m.split("train")] == ["train-00000.h5", "train-00001.h5"]
    assert all(s.path.is_absolute() for s in m.shards)
    assert m.meta["seed"] == 7 and m.meta["totals"]["shards"] == 3
    assert m.meta["totals"]["documents"] == len(DOCS) * 2 - 2 + 2
    assert m.split("val")[0].sha256 == entries["val"][0]["sha256"]
    for info in m.shards:
        verify_shard(info)
    with pytest.raises(KeyError) as e:
        m.split("test")
    assert "test" in str(e.value) and MANIFEST_NAME in str(e.value)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: d.pop("splits"), "splits"),
    (lambda d: d["splits"]["train"]["shards"][1].update(sha256="abc"),
     r"splits\.train\.shards\[1\]\.sha256"),
    (lambda d: d["splits"]["val"]["shards"][0].pop("tokens"), r"splits\.val\.shards\[0\]\.tokens"),
    (lambda d: d["splits"]["train"]["shards"][0].update(file="../x.h5"), "file"),
    (lambda d: d["splits"]["train"]["shards"][0].update(documents=-1), "documents"),
    (lambda d: d.update(vocab_size=300), r"field vocab_size is 300, expected 256"),
    (lambda d: d.update(tokenizer="sentencepiece"), r"field tokenizer is 'sentencepiece'"),
])
def test_load_manifest_names_the_bad_field(tmp_path, edit, match):
    _manifest(tmp_path)
    path = tmp_path / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match) as e:
        load_manifest(tmp_path)
    assert str(path) in str(e.value)


def test_load_manifest_missing_or_invalid(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_manifest(tmp_path)


def test_write_manifest_is_atomic(tmp_path):
    write_manifest(tmp_path, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_NAME]
    with pytest.raises(TypeError):
        write_manifest(tmp_path, {"a": object()})
    assert json.loads((tmp_path / MANIFEST_NAME).read_text()) == {"a": 1}  # old one intact
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_NAME]


@pytest.mark.skipif(shutil.which("h5dump") is None or shutil.which("h5ls") is None,
                    reason="h5dump/h5ls (Debian hdf5-tools) not installed")
def test_hdf5_tools_read_the_shard(shard):
    """An independent HDF5 client (the C tools) sees the documented layout."""
    path, tokens, offsets, sha = shard
    ls = subprocess.run(["h5ls", str(path)], capture_output=True, text=True, check=True).stdout
    shapes = dict(re.findall(r"^(\w+)\s+Dataset \{(\d+)", ls, re.M))
    assert shapes == {"tokens": str(len(tokens)), "doc_offsets": str(len(offsets))}
    dump = subprocess.run(["h5dump", "-d", "/tokens", "-s", "0", "-c", "5", str(path)],
                          capture_output=True, text=True, check=True).stdout
    assert "H5T_STD_U8LE" in dump
    values = dump.split("DATA {")[1].split("}")[0].split(":")[1]
    assert [int(v) for v in values.replace(",", " ").split()] == tokens[:5].tolist()
    dump = subprocess.run(["h5dump", "-a", "/sha256", str(path)], capture_output=True,
                          text=True, check=True).stdout
    assert sha in dump
    dump = subprocess.run(["h5dump", "-d", "/doc_offsets", str(path)], capture_output=True,
                          text=True, check=True).stdout
    assert "H5T_STD_I64LE" in dump
