"""Build small shard directories for training tests from real review text (or synthetic text when
../shared is absent), through hvd_lm.formats.shards' own writer."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import h5py
import numpy as np

from hvd_lm.formats.manifest import build_manifest, manifest_entry, write_manifest
from hvd_lm.formats.shards import write_shard
from hvd_lm.formats.tokenizer import TOKENIZER_NAME, encode_document
from tests._mp import SHARED

MUSIC = SHARED / "data/amazon/mcauley2014_5core/reviews_Digital_Music_5.json.gz"


def review_texts(n: int, skip: int = 0) -> list[str]:
    """``n`` review texts (real McAuley reviews when available)."""
    if MUSIC.exists():
        out = []
        with gzip.open(MUSIC, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= skip:
                    out.append(json.loads(line)["reviewText"])
                if len(out) == n:
                    break
        return out
    rng = np.random.default_rng(skip)
    words = "the a great album song sound bad good love music track voice band really".split()
    return [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(n)]


def make_shards(directory: Path, splits: dict[str, list[list[str]]]) -> Path:
    """Write ``splits``: name -> list of shards -> list of document texts; return ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = {}
    for split, shards in splits.items():
        entries[split] = []
        for i, docs in enumerate(shards):
            arrays = [encode_document(t) for t in docs]
            tokens = np.concatenate(arrays)
            offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
            name = f"{split}-{i:05d}.h5"
            sha = write_shard(directory / name, tokens, offsets,
                              {"tokenizer": TOKENIZER_NAME, "source_files": ["test"]})
            entries[split].append(manifest_entry(name, len(tokens), len(docs), sha))
    write_manifest(directory, build_manifest(entries, TOKENIZER_NAME))
    return directory


def default_shards(directory: Path) -> Path:
    """3 train shards (~20 KB each) and 1 val shard of real reviews."""
    texts = review_texts(80)
    return make_shards(directory, {"train": [texts[0:20], texts[20:40], texts[40:60]],
                                   "val": [texts[60:80]]})


def split_tokens(directory: Path, split: str) -> int:
    """Tokens (bytes) of ``split``'s shards in ``directory`` (``<split>-*.h5``), read from the
    files themselves with h5py, not through hvd_lm's manifest: what a test expects of a fixture
    it did not choose (real reviews from ../shared, or generated text without it)."""
    total = 0
    for path in sorted(Path(directory).glob(f"{split}-*.h5")):
        with h5py.File(path, "r") as f:
            total += len(f["tokens"])
    return total
