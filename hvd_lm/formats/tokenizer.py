"""The byte-level tokenizer: UTF-8 bytes are the token ids (0..255).

This is the one tokenizer of the project: ``data_prep`` writes shards with it, and training,
transfer and generation read them with it. As in Radford et al. 2017 ("Learning to Generate
Reviews and Discovering Sentiment") and NVIDIA/sentiment-discovery, a text is modelled as the
sequence of its UTF-8 bytes, so the vocabulary is the 256 byte values and there is no
out-of-vocabulary token.

Document boundaries: documents are stored back to back in one token stream, each one
*followed* by a single end-of-document byte ``EOD = 0`` (the NUL byte). NUL never occurs inside
a stored document: :func:`encode` removes NUL characters (U+0000, the only code point whose
UTF-8 form contains a 0 byte) from the text, so a 0 in the stream always means "document ends
here".

Lone surrogates (which ``json.loads`` produces from escapes like ``"\\ud800"``) cannot be encoded
as UTF-8; :func:`encode` replaces each with U+FFFD. :func:`decode` uses ``errors="replace"``, so
any id sequence (for example one sampled from a model, which may cut a multi-byte character)
decodes to a string.

Optional normalisation (off by default; when used, ``data_prep`` records it in the manifest):
collapse every run of whitespace to one space and strip both ends, as in sentiment-discovery's
``process_str`` (``" ".join(text.split())``) and the OpenAI preprocessing that replaced newlines
by spaces.
"""

from __future__ import annotations

import re

import numpy as np

#: Token id that follows every document in a token stream (the NUL byte).
EOD: int = 0
#: Number of token ids: the 256 byte values.
VOCAB_SIZE: int = 256
#: Name recorded in shard attributes and manifests; change it if the mapping ever changes.
TOKENIZER_NAME: str = "bytes-utf8-eod0"

_SURROGATE = re.compile("[\ud800-\udfff]")
_EOD_BYTE = bytes([EOD])


def normalize_text(text: str) -> str:
    """Collapse each run of whitespace (``str.split`` semantics, Unicode-aware) to one space and
    strip both ends.

    Source: sentiment-discovery ``data_utils/preprocess.py`` (whitespace collapsing in
    ``process_str``); Radford et al. 2017 likewise flattened newlines to spaces.

    Args:
        text: any string.
    Returns:
        The normalised string (never longer than ``text``).
    """
    return " ".join(text.split())


def replace_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (``json.loads`` makes them from escapes like
    ``"\\ud83d"``; UTF-8 cannot encode them) replaced by U+FFFD, as :func:`encode_bytes` does."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def encode_bytes(text: str, normalize: bool = False) -> bytes:
    """UTF-8 bytes of one document, without the end-of-document byte.

    NUL characters are removed, lone surrogates become U+FFFD, and with ``normalize=True`` the
    text first goes through :func:`normalize_text`. This is the fast path used by ``data_prep``;
    :func:`encode` wraps it into an array.

    Args:
        text: the document text.
        normalize: apply :func:`normalize_text` first.
    Returns:
        ``bytes`` of length <= 4 * len(text), containing no 0 byte.
    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"encode expects str, got {type(text).__name__}")
    if normalize:
        text = normalize_text(text)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. from a JSON "\ud83d" escape
        data = _SURROGATE.sub("\ufffd", text).encode("utf-8")
    return data.replace(_EOD_BYTE, b"")


def encode(text: str, normalize: bool = False) -> np.ndarray:
    """Token ids of one document, without the end-of-document byte.

    Args:
        text: the document text.
        normalize: apply :func:`normalize_text` first (off by default).
    Returns:
        Writable ``np.ndarray`` of dtype uint8, shape ``(n_bytes,)``, values 1..255 (NULs removed).
    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    return np.frombuffer(bytearray(encode_bytes(text, normalize)), dtype=np.uint8)


def encode_document(text: str, normalize: bool = False) -> np.ndarray:
    """Token ids of one document followed by ``EOD``, as stored in shards.

    Returns:
        Writable ``np.ndarray`` of dtype uint8, shape ``(n_bytes + 1,)``; the last id is ``EOD``.
    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    return np.frombuffer(bytearray(encode_bytes(text, normalize) + _EOD_BYTE), dtype=np.uint8)


def decode(ids) -> str:
    """Text of a sequence of token ids (invalid UTF-8 becomes U+FFFD, ``errors="replace"``).

    ``EOD`` ids decode to ``"\\x00"``; split on ``EOD`` first to get separate documents.

    Args:
        ids: ``bytes``, a sequence of ints, or an array (numpy, or anything ``np.asarray``
            accepts, such as a CPU torch tensor) of integer ids in 0..255, any shape (flattened).
    Returns:
        The decoded string.
    Raises:
        ValueError: an id is outside 0..255.
    """
    if isinstance(ids, (bytes, bytearray, memoryview)):
        return bytes(ids).decode("utf-8", errors="replace")
    arr = np.asarray(ids)
    if arr.dtype != np.uint8:
        if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
            raise ValueError(f"token ids must be in 0..{VOCAB_SIZE - 1}, got range "
                             f"{arr.min()}..{arr.max()}")
        arr = arr.astype(np.uint8)
    return arr.tobytes().decode("utf-8", errors="replace")
