"""The manifest of a prepared corpus: the only module that knows its field names.

Manifest (``manifest.json``, one per shard directory, written last and atomically)
-------------------------------------------------------------------------------------
A JSON object::

    {"format_version": 1,
     "tokenizer": "bytes-utf8-eod0", "eod": 0, "vocab_size": 256,
     "splits": {"train": {"shards": [{"file": "train-00000.h5", "tokens": 123, "documents": 4,
                                      "sha256": "<64 hex>"}, ...],
                          "tokens": 123, "documents": 4},
                "val": {...}, "test": {...}},
     "totals": {"shards": 3, "tokens": ..., "documents": ...},
     ... anything else (the writer's provenance: command, seed, normalisation, versions,
         counters) ...}

Shard ``file`` names are relative to the manifest's directory. :func:`load_manifest` checks the
fields above and returns a :class:`Manifest`; everything except ``splits`` is in ``meta``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_lm.formats.shards import _HEX64, FORMAT_VERSION
from hvd_lm.formats.tokenizer import EOD, TOKENIZER_NAME, VOCAB_SIZE
from hvd_lm.util.atomic import write_text
from hvd_lm.util.files import read_json, shown

#: File name of the manifest inside a shard directory.
MANIFEST_NAME: str = "manifest.json"
#: The largest manifest read: 64 MiB, about 400,000 shards' entries (a 40 GB corpus in 64 MiB
#: shards lists 640); a link to /dev/zero or a huge file is refused, not read whole.
MAX_MANIFEST_BYTES = 64 << 20


@dataclass
class ShardInfo:
    """One shard as listed in a manifest.

    Attributes:
        path: absolute path of the shard file.
        split: ``"train"``, ``"val"`` or ``"test"``.
        tokens: number of tokens (bytes) in the shard's stream.
        documents: number of documents.
        sha256: hex SHA-256 of the tokens.
    """

    path: Path
    split: str
    tokens: int
    documents: int
    sha256: str


@dataclass
class Manifest:
    """A loaded ``manifest.json``.

    Attributes:
        directory: absolute path of the shard directory.
        shards: every shard, in manifest order (splits in file order, shards in listed order).
        meta: the manifest's other fields (totals, provenance, counters, ...).
    """

    directory: Path
    shards: list[ShardInfo]
    meta: dict = field(default_factory=dict)

    @property
    def split_names(self) -> list[str]:
        """The splits that have shards, sorted."""
        return sorted({s.split for s in self.shards})

    def split(self, name: str) -> list[ShardInfo]:
        """The shards of one split, in manifest order.

        Raises:
            KeyError: the split has no shards (message names the split and the manifest file).
        """
        found = [s for s in self.shards if s.split == name]
        if not found:
            raise KeyError(f"split {name!r} has no shards in {self.directory / MANIFEST_NAME} "
                           f"(splits present: {', '.join(self.split_names) or 'none'})")
        return found


def write_manifest(directory, manifest_dict: dict) -> Path:
    """Write ``manifest.json`` into ``directory`` atomically (temp file, fsync, ``os.replace``).

    Args:
        directory: the shard directory (must exist).
        manifest_dict: the JSON object (schema in the module docstring).
    Returns:
        Path of the written manifest.
    Raises:
        TypeError: the dict is not JSON-serialisable. OSError: write failure.
    """
    return write_text(Path(directory) / MANIFEST_NAME, json.dumps(manifest_dict, indent=1) + "\n")


def manifest_entry(file_name: str, tokens: int, documents: int, sha256: str) -> dict:
    """One shard's entry in a manifest's ``splits.<name>.shards`` list."""
    return {"file": file_name, "tokens": int(tokens), "documents": int(documents), "sha256": sha256}


def build_manifest(entries: dict[str, list[dict]], tokenizer: str, **meta) -> dict:
    """Assemble a manifest dict (schema in the module docstring).

    Args:
        entries: split name -> list of :func:`manifest_entry` dicts, in stream order.
        tokenizer: tokenizer name.
        **meta: extra top-level fields (provenance, counters, ...).
    """
    counts = ("tokens", "documents")
    splits = {name: {"shards": shards, **{k: sum(s[k] for s in shards) for k in counts}}
              for name, shards in entries.items()}
    totals = {"shards": sum(len(s["shards"]) for s in splits.values()),
              **{k: sum(s[k] for s in splits.values()) for k in counts}}
    return {"format_version": FORMAT_VERSION, "tokenizer": tokenizer, "eod": EOD,
            "vocab_size": VOCAB_SIZE, "splits": splits, "totals": totals, **meta}


def _field(path: Path, where: str, value: Any, kind: type, check=None, what: str = "") -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) or (check and not check(value)):
        raise ValueError(f"{shown(path)}: field {where} is {shown(repr(value), 80)}, expected "
                         f"{what or kind.__name__}")
    return value


def load_manifest(directory) -> Manifest:
    """Load and check ``directory/manifest.json``.

    Returns:
        :class:`Manifest` with absolute shard paths.
    Raises:
        FileNotFoundError: no manifest in ``directory``.
        hvd_lm.util.files.FileRefused: the manifest is a FIFO, device or socket, larger than
            :data:`MAX_MANIFEST_BYTES`, or not JSON (nested too deeply included).
        ValueError: invalid JSON, wrong ``format_version``, a ``tokenizer`` or ``vocab_size``
            other than the byte tokenizer's, or a missing/ill-typed field (the message names
            the file and the field, e.g. ``splits.train.shards[3].sha256``), or a shard file
            listed twice.
    """
    directory = Path(directory).resolve()
    path = directory / MANIFEST_NAME
    try:
        data = read_json(path, MAX_MANIFEST_BYTES, "a manifest lists its shards in a few kB per "
                         "thousand (hvd_lm.formats.manifest.MAX_MANIFEST_BYTES)")
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown(path)}: no manifest (run `python -m data_prep prepare` "
                                "first)") from None
    _field(path, "(top level)", data, dict, what="a JSON object")
    _field(path, "format_version", data.get("format_version"), int,
           lambda v: v == FORMAT_VERSION, str(FORMAT_VERSION))
    _field(path, "tokenizer", data.get("tokenizer"), str, lambda t: t == TOKENIZER_NAME,
           f"{TOKENIZER_NAME!r} (hvd_lm.formats.tokenizer: UTF-8 bytes, end of document 0)")
    _field(path, "vocab_size", data.get("vocab_size"), int, lambda v: v == VOCAB_SIZE,
           f"{VOCAB_SIZE} (the byte tokenizer's ids 0..{VOCAB_SIZE - 1})")
    splits = _field(path, "splits", data.get("splits"), dict, what="an object")
    shards: list[ShardInfo] = []
    seen: dict[str, str] = {}  # file -> where it was listed first
    for name, block in splits.items():
        _field(path, f"splits.{name}", block, dict, what="an object")
        lst = _field(path, f"splits.{name}.shards", block.get("shards"), list, what="a list")
        for i, entry in enumerate(lst):
            where = f"splits.{name}.shards[{i}]"
            _field(path, where, entry, dict, what="an object")
            fname = _field(path, f"{where}.file", entry.get("file"), str,
                           lambda s: s and "/" not in s and "\\" not in s and s not in (".", ".."),
                           "a file name without directories")
            if fname in seen:  # a split would read another split's data, or its own twice
                raise ValueError(f"{path}: field {where}.file names {fname!r}, already listed "
                                 f"at {seen[fname]}; each shard belongs to one place")
            seen[fname] = where
            tokens, docs = (_field(path, f"{where}.{k}", entry.get(k), int, lambda v: v >= 0,
                                   "an int >= 0") for k in ("tokens", "documents"))
            sha = _field(path, f"{where}.sha256", entry.get("sha256"), str,
                         lambda s: bool(_HEX64.match(s)), "64 lower-case hex digits")
            shards.append(ShardInfo(path=directory / fname, split=name, tokens=tokens,
                                    documents=docs, sha256=sha))
    meta = {k: v for k, v in data.items() if k != "splits"}
    return Manifest(directory=directory, shards=shards, meta=meta)
