"""The shard format: the only module that knows a shard's dataset and attribute names (the
manifest's fields are :mod:`hvd_lm.formats.manifest`'s).

Shard file (HDF5, written with h5py; one file per shard, named ``{split}-{index:05d}.h5``)
------------------------------------------------------------------------------------------
datasets
    ``tokens``       uint8, shape ``(n_tokens,)``: the contiguous token stream of the shard.
                     Each document is its UTF-8 bytes followed by one ``EOD`` (0) byte
                     (:mod:`hvd_lm.formats.tokenizer`), so ``n_tokens`` = sum of (document bytes +
                     1).
    ``doc_offsets``  int64, shape ``(documents + 1,)``: start of each document in ``tokens``;
                     ``doc_offsets[0] == 0``, strictly increasing, ``doc_offsets[-1] == n_tokens``;
                     document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i+1]]`` (its EOD last).
    Both are chunked for sequential reads (``tokens`` in chunks of :data:`TOKEN_CHUNK` = 1 MiB,
    ``doc_offsets`` in chunks of 65,536 entries = 512 KiB) and optionally compressed
    (``gzip`` level 4 or ``lzf``, each with the shuffle filter off: bytes gain nothing from it).
attributes (on the file's root group)
    ``format_version``  int, :data:`FORMAT_VERSION` (1).
    ``tokenizer``       str, e.g. ``"bytes-utf8-eod0"`` (:mod:`hvd_lm.formats.tokenizer`).
    ``source_files``    list of str: names of the input files the corpus was built from.
    ``documents``       int, number of documents (= ``len(doc_offsets) - 1``).
    ``bytes``           int, number of tokens (= ``len(tokens)``; one token is one byte).
    ``sha256``          str, hex SHA-256 of the raw ``tokens`` bytes (not of the HDF5 file).
    optional: ``split`` (str), ``shard_index`` (int), ``config_sha256`` (str, fingerprint of the
    preparation settings, used by ``--resume``).

``format_version``, ``documents``, ``bytes`` and ``sha256`` are computed by :func:`write_shard`;
the caller supplies ``tokenizer``, ``source_files`` and the optional ones. The files carry no
timestamps (h5py's default ``track_times=False``), so the same tokens and attributes give a
byte-identical file.

The manifest that lists the shards of a corpus is :mod:`hvd_lm.formats.manifest`'s.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hvd_lm.util.atomic import atomic_path
from hvd_lm.util.files import FileRefused, check_regular, shown

#: Version of the shard file layout and manifest schema described above.
FORMAT_VERSION: int = 1
#: Chunk length of the ``tokens`` dataset (1 MiB of uint8).
TOKEN_CHUNK: int = 1 << 20
#: Chunk length of the ``doc_offsets`` dataset (65,536 int64 = 512 KiB).
OFFSET_CHUNK: int = 1 << 16
#: Compression names accepted by :func:`write_shard` (``None`` and ``"none"`` mean none).
COMPRESSIONS = ("none", "gzip", "lzf")
#: Split names, in the order their documents are taken from the shuffled stream.
SPLITS = ("train", "val", "test")
#: A val or test split with fewer bytes than this is too small to measure BPC on (the demo's
#: default 1000,1,1 split of a 4,000-review corpus gave 1,150 bytes): ``prepare`` and ``train``
#: warn.
SMALL_SPLIT_BYTES = 64 * 1024


def small_split_advice(split: str, split_bytes: dict[str, int],
                       ratios: dict[str, float] | None) -> str:
    """What gives ``split`` :data:`SMALL_SPLIT_BYTES`: the ``--split`` ratios that would, computed
    from the bytes each split holds now (documents are dealt by ratio, so bytes follow it; a
    quarter more than the threshold for documents' uneven lengths), or more text when even half
    of the corpus would not reach it.

    Args:
        split_bytes: bytes (tokens) per split now. ratios: the ``--split`` ratios used
            (``manifest.json``'s ``split_ratios``), None when unknown.
    """
    total = sum(split_bytes.values())
    want = 1.25 * SMALL_SPLIT_BYTES / max(total, 1)  # the share of the corpus it needs
    if want >= 0.5 or not ratios or not all(isinstance(ratios.get(k), (int, float))
                                            for k in SPLITS):
        return (f"prepare more text: the whole corpus is {total:,} bytes" if want >= 0.5 else
                f"give it a larger share of --split, about {want:.1%} of the text, or prepare "
                "more text")
    others = sum(float(ratios[k]) for k in SPLITS if k != split)
    x = want * others / (1 - want)  # x / (others + x) = want
    new = ",".join(f"{x:.3g}" if k == split else f"{float(ratios[k]):g}" for k in SPLITS)
    return f"prepare it with --split {new} (about {want:.1%} of the {total:,} bytes) or more text"

_TOKENS = "tokens"
_OFFSETS = "doc_offsets"
_REQUIRED_ATTRS = ("tokenizer", "source_files")
_COMPUTED_ATTRS = ("format_version", "documents", "bytes", "sha256")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_READ_CHUNK = 16 * TOKEN_CHUNK  # bytes per read when streaming a shard (16 MiB)


class ShardChecksumError(ValueError):
    """The SHA-256 of a shard's tokens differs from the expected one.

    Attributes: ``path`` (Path), ``expected`` and ``actual`` (hex str).
    """

    def __init__(self, path: Path, expected: str, actual: str):
        self.path, self.expected, self.actual = Path(path), expected, actual
        super().__init__(f"{path}: sha256 of tokens is {actual}, expected {expected}")

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (self.path, self.expected, self.actual))


class ShardFormatError(ValueError):
    """A shard file is unreadable or does not follow the format (or disagrees with the manifest):
    the message names the file and the field."""


@dataclass
class Shard:
    """A shard read into memory by :func:`open_shard`.

    Attributes:
        path: the shard file.
        tokens: uint8 array, shape ``(n_tokens,)``.
        doc_offsets: int64 array, shape ``(documents + 1,)``.
        attrs: the file's attributes as plain Python values.
    """

    path: Path
    tokens: np.ndarray
    doc_offsets: np.ndarray
    attrs: dict

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` including its trailing EOD (uint8 view)."""
        return self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1]]


def _plain(value: Any) -> Any:
    """HDF5 attribute value -> plain Python (str, int, list of str)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _check_stream(path: Path, tokens: np.ndarray, doc_offsets: np.ndarray) -> None:
    if tokens.dtype != np.uint8 or tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be a 1-D uint8 array, got {tokens.dtype} "
                         f"shape {tokens.shape}")
    if doc_offsets.dtype != np.int64 or doc_offsets.ndim != 1 or len(doc_offsets) < 1:
        raise ValueError(f"{path}: doc_offsets must be a 1-D int64 array of length documents+1, "
                         f"got {doc_offsets.dtype} shape {doc_offsets.shape}")
    if doc_offsets[0] != 0 or doc_offsets[-1] != len(tokens):
        raise ValueError(f"{path}: doc_offsets must start at 0 and end at len(tokens)="
                         f"{len(tokens)}, got {doc_offsets[0]}..{doc_offsets[-1]}")
    if len(doc_offsets) > 1 and not np.all(np.diff(doc_offsets) > 0):
        raise ValueError(f"{path}: doc_offsets must be strictly increasing")


def write_shard(path, tokens: np.ndarray, doc_offsets: np.ndarray, attrs: dict,
                compression=None) -> str:
    """Write one shard file atomically and return the SHA-256 of its tokens.

    The file is written to a temporary name in the same directory, flushed and fsync'ed, then
    renamed over ``path`` (``os.replace``), so a reader (or a killed run) sees either no file or
    the complete one.

    Args:
        path: destination ``.h5`` file.
        tokens: uint8 array, shape ``(n_tokens,)``.
        doc_offsets: int64 array, shape ``(documents + 1,)``, 0 first, ``n_tokens`` last,
            strictly increasing.
        attrs: at least ``tokenizer`` (str) and ``source_files`` (list of str); optional
            ``split``, ``shard_index``, ``config_sha256``. ``format_version``, ``documents``,
            ``bytes`` and ``sha256`` are computed here and may not be given.
        compression: ``None``/``"none"``, ``"gzip"`` (level 4) or ``"lzf"``.
    Returns:
        Hex SHA-256 of ``tokens.tobytes()``.
    Raises:
        ValueError: wrong dtypes/shapes/offsets, missing or reserved attributes, unknown
            compression (message names the file).
        OSError: the file cannot be written.
    """
    path = Path(path)
    tokens = np.ascontiguousarray(tokens)
    doc_offsets = np.ascontiguousarray(doc_offsets)
    _check_stream(path, tokens, doc_offsets)
    missing = [k for k in _REQUIRED_ATTRS if k not in attrs]
    if missing:
        raise ValueError(f"{path}: attrs lack {', '.join(missing)}")
    reserved = [k for k in _COMPUTED_ATTRS if k in attrs]
    if reserved:
        raise ValueError(f"{path}: attrs {', '.join(reserved)} are computed by write_shard")
    comp = None if compression in (None, "none") else compression
    if comp not in (None, "gzip", "lzf"):
        raise ValueError(f"{path}: unknown compression {compression!r} (one of {COMPRESSIONS})")
    digest = hashlib.sha256(tokens.data).hexdigest()

    def _ds(f, name, data, chunk):
        kw = {"compression": comp, "compression_opts": 4 if comp == "gzip" else None,
              "chunks": (min(chunk, len(data)),)} if len(data) else {}  # (none for no data)
        f.create_dataset(name, data=data, **kw)

    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            _ds(f, _TOKENS, tokens, TOKEN_CHUNK)
            _ds(f, _OFFSETS, doc_offsets, OFFSET_CHUNK)
            f.attrs.update({  # in this order: the file's bytes depend on it
                "format_version": FORMAT_VERSION, "tokenizer": str(attrs["tokenizer"]),
                "source_files": [str(s) for s in attrs["source_files"]],
                "documents": len(doc_offsets) - 1, "bytes": len(tokens), "sha256": digest,
                **{k: v for k, v in attrs.items() if k not in _REQUIRED_ATTRS}})
    return digest


def _open_h5(path: Path) -> h5py.File:
    try:  # a regular file: a FIFO would block HDF5's open
        check_regular(path, "a shard is an HDF5 file")
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown(path)}: shard file not found") from None
    except FileRefused as e:
        raise ShardFormatError(str(e)) from None
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise ShardFormatError(f"{path}: not a readable HDF5 file ({e})") from e


def _check_storage(path: Path, ds: h5py.Dataset) -> None:
    """A dataset's data lies in this file, all of it written: not an external file (HDF5 can
    point a dataset at any file: verify would hash and training read it), not a virtual
    dataset, and no unwritten chunk or contiguous block (a shape declared far past what the
    file stores reads as zeros: hashing 2**50 of them never ends).

    Raises:
        ShardFormatError: naming the file and the dataset.
    """
    where = f"{path}: dataset '{ds.name.lstrip('/')}'"
    if ds.external:
        raise ShardFormatError(f"{where} is stored in other file(s) "
                               f"({', '.join(str(e[0]) for e in ds.external)}); a shard holds "
                               "its own data")
    if ds.is_virtual:
        raise ShardFormatError(f"{where} is a virtual dataset; a shard holds its own data")
    n = ds.shape[0]
    if ds.chunks:  # (an empty dataset stores nothing and needs nothing)
        want = -(-n // ds.chunks[0])
        have = ds.id.get_num_chunks()
        if have < want:
            raise ShardFormatError(f"{where} declares {n:,} values but stores {have:,} of its "
                                   f"{want:,} chunks (never written)")
    elif ds.id.get_storage_size() < n * ds.dtype.itemsize:
        raise ShardFormatError(f"{where} declares {n:,} values but stores "
                               f"{ds.id.get_storage_size():,} bytes")


def read_tokens(path, start: int, stop: int) -> np.ndarray:
    """A slice ``tokens[start:stop]`` of a shard's stream, read without verification.

    Args:
        path: shard file.
        start, stop: token (byte) positions, Python slice semantics.
    Returns:
        uint8 array of shape ``(stop - start,)`` (shorter at the end of the stream).
    Raises:
        FileNotFoundError, ShardFormatError: missing or unreadable file, or a damaged chunk
            (naming the shard and the range).
    """
    with _open_h5(Path(path)) as f:
        try:
            return f[_TOKENS][start:stop]
        except KeyError as e:
            raise ShardFormatError(f"{path}: missing dataset ({e})") from e
        except (OSError, ValueError) as e:  # a damaged (e.g. gzip) chunk, read unverified
            reason = " ".join(str(e).split())
            raise ShardFormatError(f"{shown(path)}: tokens {start:,}..{stop:,} unreadable "
                                   f"({shown(reason, 160)}): the shard is damaged; "
                                   "`hvd-lm verify` checks every shard") from None


def _datasets(path: Path, f: h5py.File) -> tuple[h5py.Dataset, h5py.Dataset]:
    """The ``tokens`` and ``doc_offsets`` datasets of an open shard, once its format version,
    their presence, dtypes, shapes and storage (:func:`_check_storage`) are checked (attributes
    and shapes only, no data).

    Raises:
        ShardFormatError: naming the file, the dataset and what it holds.
    """
    version = _plain(f.attrs.get("format_version"))
    if version != FORMAT_VERSION:
        raise ShardFormatError(f"{path}: format_version={version!r}, expected {FORMAT_VERSION}")
    found = []
    for name, dtype, what in ((_TOKENS, np.uint8, "uint8 (byte tokens)"),
                              (_OFFSETS, np.int64, "int64 of length documents+1")):
        ds = f.get(name)
        if not isinstance(ds, h5py.Dataset):
            raise ShardFormatError(f"{path}: no dataset '{name}' (it has: "
                                   f"{', '.join(sorted(f.keys())) or 'none'})")
        if ds.dtype != dtype or ds.ndim != 1 or (name == _OFFSETS and ds.shape[0] < 1):
            raise ShardFormatError(f"{path}: dataset '{name}' is {ds.dtype} shape {ds.shape},"
                                   f" expected 1-D {what}")
        _check_storage(path, ds)
        found.append(ds)
    return found[0], found[1]


def check_layout(info) -> None:
    """The cheap part of :func:`verify_shard`, for ``--verify-shards false``: the file opens, has
    the format version, the ``tokens`` (1-D uint8) and ``doc_offsets`` (1-D int64) datasets, and
    as many tokens as its manifest entry says. Reads attributes and shapes only (no data).

    Args:
        info: the manifest entry (:class:`hvd_lm.formats.manifest.ShardInfo`).

    Raises:
        FileNotFoundError: the shard file is missing.
        ShardFormatError: any of those differs, naming the file, the dataset and what it holds.
    """
    path = Path(info.path)
    with _open_h5(path) as f:
        n = _datasets(path, f)[0].shape[0]
    if n != info.tokens:
        raise ShardFormatError(f"{path}: tokens={n}, manifest says {info.tokens}")


def _scan(path: Path) -> tuple[dict, str, int, np.ndarray, str | None]:
    """Read a shard's attributes and offsets, stream its tokens through SHA-256 (16 MiB reads)
    and check the internal structure.

    Returns:
        (attrs, sha256 hex of the tokens, n_tokens, doc_offsets, first structural problem or
        None). Problems found while streaming are returned, not raised, so that callers can
        report a checksum mismatch first.
    Raises:
        ShardFormatError: wrong version, missing datasets or wrong dtypes/shapes (nothing to
            hash), or unreadable data (e.g. a corrupt chunk).
    """
    with _open_h5(path) as f:
        try:
            tok, offs = _datasets(path, f)
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            n = tok.shape[0]
            if offs.shape[0] > n + 1:  # more documents than bytes: not read (could be any size)
                raise ShardFormatError(f"{path}: {offs.shape[0] - 1:,} documents in {n:,} bytes")
            offsets = offs[...]
            problem = None
            if offsets[0] != 0 or offsets[-1] != n or not np.all(np.diff(offsets) > 0):
                problem = f"{path}: {_OFFSETS} must rise strictly from 0 to {n}"
                ends = np.zeros(0, dtype=np.int64)
            else:
                ends = offsets[1:] - 1  # position of each document's EOD
            h = hashlib.sha256()
            zeros = 0
            for a in range(0, n, _READ_CHUNK):
                chunk = tok[a:a + _READ_CHUNK]
                h.update(chunk.data)
                zeros += int(np.count_nonzero(chunk == 0))
                lo, hi = np.searchsorted(ends, [a, a + len(chunk)])
                if problem is None and hi > lo and np.any(chunk[ends[lo:hi] - a] != 0):
                    problem = (f"{path}: a document does not end with EOD (0) "
                               f"in tokens[{a}:{a + len(chunk)}]")
        except (OSError, RuntimeError) as e:  # HDF5 read errors (e.g. a corrupt chunk)
            raise ShardFormatError(f"{path}: unreadable data ({e})") from e
    if problem is None and zeros != len(offsets) - 1:
        problem = f"{path}: {zeros} EOD (0) bytes in tokens but {len(offsets) - 1} documents"
    for key, actual in (("documents", len(offsets) - 1), ("bytes", n)):
        if problem is None and attrs.get(key) != actual:
            problem = f"{path}: attribute {key}={attrs.get(key)!r} but the datasets hold {actual}"
    return attrs, h.hexdigest(), n, offsets, problem


def check_shard(path, info=None) -> dict:
    """Check one shard file: format version, dataset types, offsets, one EOD per document, counts
    in the attributes, and the SHA-256 of the tokens (streamed in 16 MiB reads) against its
    ``sha256`` attribute; with ``info`` (its manifest entry) also against the token and document
    counts and the SHA-256 recorded there (:func:`verify_shard`).

    Returns:
        The file's attributes (plain Python values).
    Raises:
        FileNotFoundError: no such file.
        ShardChecksumError: the tokens do not hash to ``info.sha256`` or to the ``sha256``
            attribute (message names the file, expected and actual).
        ShardFormatError: unreadable file, a structural mismatch, or counts that differ from
            ``info`` (names file and field, expected and actual).
    """
    path = Path(path)
    attrs, digest, n, offsets, problem = _scan(path)
    for expected in ([info.sha256] if info is not None else []) + [attrs.get("sha256")]:
        if expected != digest:  # the manifest's first, then the file's own
            raise ShardChecksumError(path, str(expected), digest)
    for key, actual in (("tokens", n), ("documents", len(offsets) - 1)) if info is not None else ():
        if actual != getattr(info, key):
            raise ShardFormatError(f"{path}: {key}={actual}, manifest says {getattr(info, key)}")
    if problem:
        raise ShardFormatError(problem)
    return attrs


def verify_shard(info) -> None:
    """Re-check a shard against its manifest entry: :func:`check_shard` with ``info``.

    Args:
        info: the entry (:class:`hvd_lm.formats.manifest.ShardInfo`: ``path``, ``tokens``,
            ``documents``, ``sha256``).

    Raises:
        FileNotFoundError: the shard file is missing.
        ShardChecksumError: recomputed SHA-256 differs from ``info.sha256`` or from the file's
            own ``sha256`` attribute (message names the file, expected and actual).
        ShardFormatError: unreadable, wrong ``format_version``, broken structure, or counts that
            differ from the manifest (message names the file, the field, expected and actual).
    """
    check_shard(info.path, info)


def open_shard(path, verify: bool = True) -> Shard:
    """Read a whole shard into memory.

    Args:
        path: shard file.
        verify: recompute the SHA-256 of the tokens and compare it with the ``sha256`` attribute.
    Returns:
        :class:`Shard` with ``tokens`` (uint8), ``doc_offsets`` (int64) and ``attrs`` (dict).
    Raises:
        FileNotFoundError, ShardFormatError: missing or unreadable file, another format version,
            missing or ill-typed datasets.
        ShardChecksumError: ``verify`` and the checksum differs.
    """
    path = Path(path)
    with _open_h5(path) as f:
        tok, offs = _datasets(path, f)
        tokens, offsets = tok[...], offs[...]
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
    if verify:
        actual = hashlib.sha256(tokens.data).hexdigest()
        if attrs.get("sha256") != actual:
            raise ShardChecksumError(path, str(attrs.get("sha256")), actual)
    return Shard(path=path, tokens=tokens, doc_offsets=offsets, attrs=attrs)
