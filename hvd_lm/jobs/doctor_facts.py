"""What one host's ``hvd-lm doctor`` agent reports about itself (:mod:`hvd_lm.jobs.doctor`): its
GPUs, the shard folder as it reads it, the package versions every rank imports and a digest of
hvd_lm's sources (two checkouts of one commit agree)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from importlib import metadata
from pathlib import Path

import hvd_lm
from hvd_lm.options.command import error_text
from hvd_lm.util.files import open_regular, read_bounded


def gpu_count() -> tuple[int, list[str]]:
    """(GPUs, their names) from ``nvidia-smi`` (10 s at most), else the driver's
    ``/proc/driver/nvidia/gpus`` entries, else (0, [])."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        if proc.returncode == 0:
            names = [x.strip() for x in proc.stdout.splitlines() if x.strip()]
            return len(names), names
    d = Path("/proc/driver/nvidia/gpus")
    return len(list(d.iterdir())) if d.is_dir() else 0, []


def shard_facts(folder: str) -> dict:
    """What this host sees of a shard folder: ``{"manifest_sha256", "shards", "bytes"}``, or
    ``{"error": one line}`` when the manifest or a shard cannot be read."""
    from hvd_lm.formats.manifest import MAX_MANIFEST_BYTES, load_manifest

    try:
        man = load_manifest(folder)  # a regular file within MAX_MANIFEST_BYTES, or refused
        total = 0
        for s in man.shards:  # a FIFO or a device named like a shard is refused, never opened
            with open_regular(s.path, "a shard is an HDF5 file") as f:
                f.read(8)
                total += os.fstat(f.fileno()).st_size
        raw = read_bounded(Path(folder) / "manifest.json", MAX_MANIFEST_BYTES,
                           "a manifest lists its shards (hvd_lm.formats.manifest)")
        return {"manifest_sha256": hashlib.sha256(raw).hexdigest(),
                "shards": len(man.shards), "bytes": total}
    except (OSError, ValueError) as e:
        return {"error": error_text(e)}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages every rank imports (None when missing)."""
    out = {}
    for name in ("torch", "horovod", "mpi4py", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def source_digest() -> str:
    """sha256 over hvd_lm's Python sources (names and bytes): two checkouts of the same commit
    agree, a host with another version of the code does not (version strings alone would)."""
    h = hashlib.sha256()
    pkg = Path(hvd_lm.__file__).parent
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(pkg)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]
