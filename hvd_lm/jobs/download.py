"""Fetch the demo's public review files, verifying each one's sha256 before it is kept.

Each file is streamed to a temporary file beside its destination while its SHA-256 is computed;
only a file whose size and digest match ``configs/sources.yaml`` is renamed into place
(``os.replace``), so a failed or corrupted download never leaves a file that looks complete. A file
already present with the right digest is not fetched again.

The source list is not trusted further than that: every ``save_as`` must be a relative path that
stays inside ``--out`` once resolved (no absolute path, no ``..``, no link out of it), checked for
all files before the first is fetched; and a stream is cut off as soon as it delivers more than
the listed ``bytes`` (a server announcing more is refused before reading), so an endless or
oversized answer never fills the disk.
"""
from __future__ import annotations

import hashlib
import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import hvd_lm
from hvd_lm.options import Command, option
from hvd_lm.options.tree import read_yaml, shorten, shown
from hvd_lm.util.atomic import atomic_path
from hvd_lm.util.digest import file_sha256
from hvd_lm.util.files import FileRefused, check_regular
from hvd_lm.util.files import shown as shown_path


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
    """(base URL, sources) from a YAML source list (read within
    :func:`hvd_lm.options.tree.read_yaml`'s size budget).

    Raises:
        ValueError: naming the file and the field: missing fields, a ``save_as`` that is not a
            plain relative path (absolute, ``..``, empty), a size that is not a positive integer.
    """
    try:
        data = read_yaml(path)
        base, sources = data["base_url"], [Source(**f) for f in data["files"]]
    except (KeyError, TypeError) as e:  # (a ConfigError of read_yaml is a ValueError: raised)
        raise ValueError(f"{path}: bad source list ({shorten(str(e))}); need base_url and "
                         "files[path, save_as, sha256, bytes]") from None
    for i, s in enumerate(sources):
        where = f"{path}: files[{i}]"
        parts = PurePosixPath(str(s.save_as)).parts if isinstance(s.save_as, str) else ()
        if not parts or PurePosixPath(s.save_as).is_absolute() or ".." in parts \
                or "\\" in s.save_as or "\0" in s.save_as:
            raise ValueError(f"{where}.save_as {shown(s.save_as)}: must be a relative path inside "
                             "--out (no leading /, no '..')")
        if isinstance(s.bytes, bool) or not isinstance(s.bytes, int) or s.bytes < 0:
            raise ValueError(f"{where}.bytes {shown(s.bytes)}: must be the file's size in bytes")
    return base, sources


def destination(out_dir: str | Path, save_as: str) -> Path:
    """Where a source is saved: ``out_dir / save_as``, which must stay inside ``out_dir`` once
    links are resolved.

    Raises:
        ValueError: the path leads out of ``out_dir`` (e.g. through a link inside it).
    """
    out = Path(out_dir).resolve()
    dest = (out / save_as).resolve()
    if dest == out or out not in dest.parents:
        raise ValueError(f"save_as {shown(save_as)} leads to {dest}, outside --out {out}")
    return out / save_as


def fetch(url: str, dest: Path, sha256: str, size: int) -> Path:
    """Download ``url`` to ``dest`` atomically (60 s without data is a timeout), keeping it only
    when its ``size`` (bytes) and sha256 match.

    Raises:
        ChecksumMismatch: wrong size or digest, or more bytes than ``size`` (the stream is cut
            off at ``size`` + 1 bytes; nothing is left at ``dest``).
        DownloadError: the server could not be reached, timed out or answered an HTTP error
            (the message names ``url`` and ``--mirror``; nothing is left at ``dest``).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, n = hashlib.sha256(), 0  # the digest and size of what arrived
    with atomic_path(dest) as tmp:  # a mismatch raises inside: the temporary file is removed
        try:
            with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as out:
                announced = resp.headers.get("Content-Length")
                if announced and announced.isdigit() and int(announced) > size:
                    raise ChecksumMismatch(f"{url}: the server announces {int(announced):,} "
                                           f"bytes, the source list {size:,}; not fetched")
                while chunk := resp.read(max(1, min(1 << 20, size - n + 1))):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
                    if n > size:  # an endless or oversized stream
                        raise ChecksumMismatch(f"{url}: more than the {size:,} bytes the source "
                                               "list gives; download stopped, nothing kept")
        except urllib.error.HTTPError as e:
            raise DownloadError(f"{url}: HTTP {e.code} {e.reason}; {MIRROR_HINT}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError,
                http.client.HTTPException) as e:  # e.g. BadStatusLine: no HTTP reply
            reason = " ".join(str(getattr(e, "reason", None) or e).split()) or type(e).__name__
            raise DownloadError(f"{url}: cannot fetch ({shorten(reason)}); {MIRROR_HINT}") \
                from None
        if n != size:
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
        ValueError: a bad source list, a ``save_as`` leading out of ``out_dir``, two sources
            saved as one file, or a destination that exists as a FIFO, device or folder
            (checked before the first fetch).
    """
    base, sources = load_sources(sources_file)
    base = (mirror or base).rstrip("/")
    try:  # every destination checked before anything is fetched
        dests = [destination(out_dir, s.save_as) for s in sources]
    except ValueError as e:
        raise ValueError(f"{shown_path(sources_file)}: {e}") from None
    first: dict[Path, int] = {}
    for i, dest in enumerate(dests):
        # two sources, one file: the second would replace the first, both "verified"
        if (j := first.setdefault(dest.resolve(), i)) != i:
            raise ValueError(f"{shown_path(sources_file)}: files[{j}].save_as "
                             f"{shown(sources[j].save_as)} and files[{i}].save_as "
                             f"{shown(sources[i].save_as)} are the same file {shown_path(dest)}")
        if dest.exists():  # a FIFO would block the digest's open
            try:
                check_regular(dest, "a download is saved as a file")
            except FileRefused as e:
                raise ValueError(f"{shown_path(sources_file)}: files[{i}]: {e}") from None
    for s, dest in zip(sources, dests):
        if dest.exists() and file_sha256(dest) == s.sha256:
            log(f"ok (cached)  {dest}")
        else:
            fetch(f"{base}/{s.path}", dest, s.sha256, s.bytes)
            log(f"downloaded   {dest}  ({s.bytes:,} bytes, sha256 verified)")
    return dests


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


DOWNLOAD = Command(DownloadConfig, download_command, description="Fetch the demo's public review "
                   "files into --out, each kept only if its size and sha256 match the source list.")
