"""The ``tar`` input format: an archive (plain, gzip, bzip2 or xz; read as a stream, never
extracted to disk) of text files, one document per regular member whose path matches
``--tar-members`` (comma-separated ``fnmatch`` globs, default ``*.txt`` less the known non-reviews
and held-out reviews of :data:`data_prep.inputs.TAR_DEFAULT_EXCLUDE`, counted as
``members_left_out``; ``*`` crosses ``/``). Whatever the globs, a member whose file name is one
of :data:`data_prep.inputs.TAR_NOT_DOCUMENTS` (aclImdb's ``urls_*.txt`` lists, ``imdbEr.txt``)
is never a document: left out and counted the same way.
IMDB's aclImdb reviews are ``*/train/pos/*.txt,*/train/neg/*.txt``: not its ``urls_*.txt``
lists, nor its ``test/`` reviews (a language model trained on them would have read the
transfer's test set). A document's "line" is the member's 1-based position in the archive;
errors name the member as ``ARCHIVE[MEMBER]``. A leading UTF-8 BOM is dropped; an empty or
whitespace-only member is a blank line. A damaged or truncated archive is :class:`CorruptInput`
at the member where reading failed (the whole file is dropped with ``skip_bad``, as for a
damaged gzip stream).

The archive is read as a stream: gzip, bzip2 and xz are recognised by their magic bytes and
decompressed by the standard library's ``gzip``/``bz2``/``lzma`` readers, which check the
stream's checksum and end at its end marker (read to the end after the last member); tarfile
reads the members (``mode="r|"``) with :class:`_StrictTarInfo`, which ends the archive only at
its end-of-archive block. The data of every member not read (not matching, or over the
per-document budget) is read past here in 1 MiB pieces, so a member whose header claims more
bytes than the file holds ends in :class:`CorruptInput`, and the list of members tarfile keeps
is emptied as the stream goes, so memory does not grow with their number.
"""

from __future__ import annotations

import bz2
import fnmatch
import gzip
import lzma
import tarfile
import zlib
from typing import Callable, Iterator, Optional

from data_prep import inputs
from data_prep.gzip_blocks import CountingReader
from data_prep.inputs import CorruptInput, InputError, InputSpec, ReadStats, count_bad, utf8_ok
from data_prep.lines import decode
from hvd_lm.util.files import FileRefused, open_regular, shown

#: What reading a damaged or truncated tar stream raises (tarfile, and the decompressors).
_TAR_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)
#: The largest PAX or GNU long-name header read (tarfile holds one whole in memory).
_TAR_MAX_HEADER = 1 << 20
_TAR_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                 tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
#: Compressed streams by their magic bytes, each opened on a binary file object.
_TAR_CODECS = ((b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f)), (b"BZh", bz2.BZ2File),
               (b"\xfd7zXZ\x00", lzma.LZMAFile))


class _StrictTarInfo(tarfile.TarInfo):
    """A member header that lets an archive end only at its end-of-archive block: tarfile ends
    a stream silently at a cut or damaged header after the first member (here it raises), and
    reads a PAX / GNU long-name header whole whatever its declared size (here at most
    :data:`_TAR_MAX_HEADER`). The body is ``TarInfo.fromtarfile``'s (CPython 3.11-3.13)."""

    @classmethod
    def fromtarfile(cls, tar):
        buf = tar.fileobj.read(tarfile.BLOCKSIZE)
        try:
            obj = cls.frombuf(buf, tar.encoding, tar.errors)
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError,
                tarfile.InvalidHeaderError) as e:
            if tar.offset == 0:
                raise
            raise tarfile.SubsequentHeaderError(
                f"{e or 'truncated'} at byte {tar.offset:,} (no end-of-archive block)") from None
        obj.offset = tar.fileobj.tell() - tarfile.BLOCKSIZE
        if obj.type in _TAR_EXTENDED and obj.size > _TAR_MAX_HEADER:
            raise tarfile.SubsequentHeaderError(
                f"an extended header of {obj.size:,} bytes at byte {obj.offset:,}")
        return obj._proc_member(tar)


def _drain(stream) -> None:
    """Read ``stream`` to its end in 1 MiB pieces (a member's data, or a decompressor's
    trailer: its checksum is checked there)."""
    while stream.read(1 << 20):
        pass


def read_tar_members(spec: InputSpec, stats: ReadStats, skip_bad: bool, utf8_errors: str,
                     progress: Optional[Callable[[int], None]] = None,
                     max_doc_bytes: Optional[int] = None) -> Iterator[tuple[int, str]]:
    """The documents of a ``tar`` input (module docstring), as
    :func:`data_prep.readers.read_documents` yields them.

    Args:
        spec: the input (``text_field`` holds the member globs, comma-separated).
        stats: counters to update. skip_bad, utf8_errors: as ``read_documents``'s.
        progress: called with the bytes read from disk since the last call.
        max_doc_bytes: the largest member read (a larger one is a bad record).
    Yields:
        ``(position, text)``: the member's 1-based position in the archive, its text.
    Raises:
        BadRecord: a member over ``max_doc_bytes`` or (strict) with invalid UTF-8, unless
            ``skip_bad``. CorruptInput: a damaged or truncated archive or compressed stream.
        InputError: the file cannot be opened, or holds no tar archive.
    """
    globs = [g.strip() for g in spec.text_field.split(",") if g.strip()]
    # no --tar-members: TAR_DEFAULT_EXCLUDE applies
    excluded = inputs.TAR_DEFAULT_EXCLUDE if spec.field_source == "default" else ()
    if not spec.size:
        return
    try:  # a FIFO or a device swapped in since the input was resolved is refused, not read
        raw = open_regular(spec.path, "prepare reads review files")
    except FileRefused as e:
        raise InputError(str(e)) from None
    except OSError as e:
        raise InputError(f"{shown(spec.path)}: cannot read ({e})") from e
    with raw:
        magic = raw.read(6)
        raw.seek(0)
        stream = CountingReader(raw, progress)
        codec = next((c for m, c in _TAR_CODECS if magic.startswith(m)), None)
        if codec is not None:
            stream = codec(stream)
        try:
            tar = tarfile.open(fileobj=stream, mode="r|", tarinfo=_StrictTarInfo)
        except _TAR_ERRORS as e:
            if isinstance(e, tarfile.TarError) and codec:
                try:  # the decompressed stream is intact: it just holds no tar archive
                    _drain(stream)
                except _TAR_ERRORS as damage:
                    e = damage
            if isinstance(e, tarfile.TarError):
                raise InputError(f"{spec.path}: not a readable tar archive ({e})") from None
            raise CorruptInput(spec.path, 1, "damaged or truncated compressed stream "
                               f"before the first member ({e})") from None
        index = 0

        def damaged(e, where):
            return CorruptInput(spec.path, index + (where == "after"),
                                f"damaged or truncated tar archive {where} member "
                                f"{index:,} ({e})")

        while True:
            try:
                member = tar.next()
            except _TAR_ERRORS as e:
                raise damaged(e, "after") from None
            if member is None:
                break
            tar.members = []  # a stream's TarFile keeps every member it has read: not ours
            index += 1
            wanted = member.isreg() and any(fnmatch.fnmatchcase(member.name, g) for g in globs)
            base = member.name.rsplit("/", 1)[-1]
            if wanted and (any(fnmatch.fnmatchcase(base, g) for g in inputs.TAR_NOT_DOCUMENTS)
                           or any(fnmatch.fnmatchcase(member.name, g) for g in excluded)):
                stats.members_left_out += 1  # a URL list, IMDB's held-out test reviews...
                wanted = False
            name = member.name if member.name.isprintable() else repr(member.name)
            where = f"{spec.path}[{name}]"  # one line, whatever the archive names it
            if wanted and max_doc_bytes is not None and member.size > max_doc_bytes:
                count_bad(stats, skip_bad, where, 1, inputs.over_budget(
                    f"a member of {member.size:,} bytes", max_doc_bytes))
                wanted = False
            try:
                if not wanted:  # read past its data here: tarfile's own skip never stops
                    if member.isreg() or member.type not in tarfile.SUPPORTED_TYPES:
                        _drain(tar.extractfile(member))  # at a false size past the end
                    continue
                data = tar.extractfile(member).read()
            except _TAR_ERRORS as e:
                raise damaged(e, "in") from None
            stats.bytes_in += len(data)
            text, ok = decode(data, True)
            if not text or text.isspace():
                stats.blank_lines += 1
                continue
            if not ok and not utf8_ok(stats, skip_bad, utf8_errors, where, 1):
                continue
            stats.records += 1
            yield index, text
        try:
            _drain(stream)  # the end of the compressed stream: its checksum
        except _TAR_ERRORS as e:
            raise damaged(e, "after") from None
