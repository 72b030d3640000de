"""Fetch the demo's public review files, verifying each one's sha256 before it is kept.

Each file is streamed to a temporary file beside its destination while its SHA-256 is computed;
only a file whose size and digest match ``configs/sources.yaml`` is renamed into place
(``os.replace``), so a failed or corrupted download never leaves a file that looks complete. A file
already present with the right digest is not fetched again.
"""
from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

import hvd_lm
from hvd_lm.options import Command, option
from hvd_lm.util.atomic import atomic_path
from hvd_lm.util.digest import file_sha256


class ChecksumMismatch(ValueError):
    """A downloaded (or present) file does not have the sha256 its source list names."""


class DownloadError(OSError):
    """A source could not be fetched (no network, DNS, HTTP error); the message names the URL
    and the way around it (``--mirror``)."""


MIRROR_HINT = ("no network to it? Copy the files (paths as in configs/sources.yaml) to a server "
               "you can reach and pass `hvd-lm download --mirror URL`, or put the corpus in "
               "../shared/data/amazon")


@dataclass
class Source:
    """One file to fetch: URL path under the base URL, local name, expected sha256 and size."""

    path: str
    save_as: str
    sha256: str
    bytes: int


def load_sources(path: str | Path) -> tuple[str, list[Source]]:
    """(base URL, sources) from a YAML source list. Raises ValueError naming file and field."""
    data = yaml.safe_load(Path(path).read_text())
    try:
        return data["base_url"], [Source(**f) for f in data["files"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad source list ({e}); need base_url and files[path, save_as, "
                         "sha256, bytes]") from None


def fetch(url: str, dest: Path, sha256: str, size: int | None = None, timeout: float = 60) -> Path:
    """Download ``url`` to ``dest`` atomically, keeping it only when its sha256 matches.

    Raises:
        ChecksumMismatch: wrong size or digest (nothing is left at ``dest``).
        DownloadError: the server could not be reached, timed out or answered an HTTP error
            (the message names ``url`` and ``--mirror``; nothing is left at ``dest``).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    n = 0
    with atomic_path(dest) as tmp:  # a mismatch raises inside: the temporary file is removed
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp, open(tmp, "wb") as out:
                while chunk := resp.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
        except urllib.error.HTTPError as e:
            raise DownloadError(f"{url}: HTTP {e.code} {e.reason}; {MIRROR_HINT}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", None) or e
            raise DownloadError(f"{url}: cannot fetch ({reason}); {MIRROR_HINT}") from None
        if size is not None and n != size:
            raise ChecksumMismatch(f"{url}: got {n} bytes, expected {size}")
        if h.hexdigest() != sha256:
            raise ChecksumMismatch(f"{url}: sha256 {h.hexdigest()} != expected {sha256}")
    return dest


def download_all(sources_file: str | Path, out_dir: str | Path, mirror: str | None = None,
                 log=print) -> list[Path]:
    """Fetch every file of ``sources_file`` into ``out_dir`` (skipping verified ones present).

    Args:
        mirror: base URL used instead of the list's ``base_url`` (e.g. a local copy).

    Returns:
        The local paths, in list order.

    Raises:
        ChecksumMismatch, DownloadError: as :func:`fetch`.
    """
    base, sources = load_sources(sources_file)
    base = (mirror or base).rstrip("/")
    out = []
    for s in sources:
        dest = Path(out_dir) / s.save_as
        if dest.exists() and file_sha256(dest) == s.sha256:
            log(f"ok (cached)  {dest}")
        else:
            fetch(f"{base}/{s.path}", dest, s.sha256, s.bytes)
            log(f"downloaded   {dest}  ({s.bytes:,} bytes, sha256 verified)")
        out.append(dest)
    return out


@dataclass
class DownloadConfig:
    """``hvd-lm download``."""

    sources: str = option(str(hvd_lm.REPO_ROOT / "configs" / "sources.yaml"),
                          "YAML list of files (base_url, files[path, save_as, sha256, bytes])")
    out: str = option(str(hvd_lm.REPO_ROOT / "data" / "amazon"), "destination folder")
    mirror: str | None = option(None, "base URL to use instead of the list's")


def download_command(cfg: DownloadConfig) -> int:
    """``hvd-lm download``: every file present and verified (else one ERROR line, exit 1)."""
    download_all(cfg.sources, cfg.out, mirror=cfg.mirror)
    return 0


DOWNLOAD = Command(DownloadConfig, download_command,
                   description="Fetch the demo's public review files into --out, each kept only "
                   "if its size and sha256 match the source list.")
