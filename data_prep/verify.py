"""``verify DIR``: re-check a shard directory against its manifest.

For every shard listed in ``manifest.json``: the file exists, ``format_version`` matches, the
token and document counts match the manifest, the structure is sound (offsets, one EOD per
document) and the SHA-256 of the tokens matches (:func:`hvd_lm.formats.shards.verify_shard`). Shards
are checked in parallel over ``--workers`` processes. A manifest that cannot be read (missing, a
FIFO or a device, over its budget, not a manifest) is an error, one ``ERROR:`` line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from data_prep.parallel import Context
from hvd_lm.formats import manifest as manifests
from hvd_lm.formats import shards
from hvd_lm.options import option


@dataclass
class VerifyConfig:
    """``verify DIR``."""

    directory: str = option("", "directory holding manifest.json", positional=True,
                            required=True)
    workers: int = option(1, "parallel processes", ge=1)
    progress: bool = option(True, "progress bar (--no-progress: none)", switch=False,
                            flag="--no-progress")


def _check(info: manifests.ShardInfo, progress=None) -> Optional[str]:
    try:
        shards.verify_shard(info)
    except (ValueError, OSError) as e:  # checksum, format, missing or unreadable file
        return str(e)
    finally:
        if progress is not None:
            progress(info.tokens)
    return None


def verify_directory(directory, ctx: Optional[Context] = None) -> tuple[list, list]:
    """Check every shard of ``directory`` against its manifest.

    Args:
        directory: a directory written by ``prepare``.
        ctx: workers/ranks to spread the shards over (default: one process).
    Returns:
        ``(shards checked, problems)``: the manifest's :class:`~hvd_lm.formats.manifest.ShardInfo`
        list and one message per mismatch (empty when everything verifies).
    Raises:
        FileNotFoundError / ValueError: the manifest cannot be read or is not one (missing, a
            FIFO or a device: never opened, over its size budget, not JSON, a bad field): the
            command's one ``ERROR:`` line naming it, not a ``MISMATCH`` of a shard.
    """
    ctx = ctx or Context(1, progress=False)
    manifest = manifests.load_manifest(Path(directory))
    problems = [p for p in ctx.run(_check, manifest.shards, desc="verify",
                                   weight=lambda s: s.tokens) if p is not None]
    totals = manifest.meta.get("totals", {})
    listed = {"shards": len(manifest.shards), "tokens": sum(s.tokens for s in manifest.shards),
              "documents": sum(s.documents for s in manifest.shards)}
    for key, value in listed.items():
        if key in totals and totals[key] != value:
            problems.append(f"{manifest.directory / manifests.MANIFEST_NAME}: totals.{key} is "
                            f"{totals[key]} but the shard entries add up to {value}")
    return manifest.shards, problems
