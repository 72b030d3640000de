"""SHA-256 of files and of settings: the helpers behind verified downloads, feature-cache keys,
prepare's resume fingerprints and the checkpoint identity a saved classifier records (shards
keep their own, over tokens, in :mod:`hvd_lm.formats.shards`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def file_sha256(path: str | Path, block: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes, read ``block`` bytes at a time.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def json_sha256(obj) -> str:
    """Hex SHA-256 of ``obj`` as JSON with sorted keys: the fingerprint of a set of settings
    (prepare's config and inputs, the feature cache's key)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
