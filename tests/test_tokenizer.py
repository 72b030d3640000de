"""The byte-level tokenizer: UTF-8 bytes as ids, EOD = 0 after each document, NULs removed."""
import numpy as np
import pytest

from hvd_lm.formats.tokenizer import (
    EOD,
    TOKENIZER_NAME,
    VOCAB_SIZE,
    decode,
    encode,
    encode_bytes,
    encode_document,
    normalize_text,
)

TEXTS = ["Great album!", "caf\u00e9 na\u00efve \u00fcber",
         "\u65e5\u672c\u8a9e\u306e\u30ec\u30d3\u30e5\u30fc",
         "emoji \U0001f3b8\U0001f44d", "tabs\tand\nnewlines\r\n", ""]


def test_constants():
    assert EOD == 0 and VOCAB_SIZE == 256 and TOKENIZER_NAME == "bytes-utf8-eod0"


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_the_utf8_bytes_and_round_trip(text):
    ids = encode(text)
    assert ids.dtype == np.uint8 and ids.ndim == 1
    assert ids.tobytes() == text.encode("utf-8")
    assert decode(ids) == text
    ids[:0] = 0  # writable (torch.from_numpy warns on read-only arrays)
    assert ids.flags.writeable


def test_encode_document_appends_one_eod_and_nul_is_removed():
    doc = encode_document("a\x00b\x00")
    assert doc.tolist() == [ord("a"), ord("b"), EOD]
    assert encode("\x00\x00").size == 0
    assert encode_bytes("x\x00y") == b"xy"
    # so a 0 in a stream always ends a document
    stream = np.concatenate([encode_document(t) for t in TEXTS])
    assert np.count_nonzero(stream == EOD) == len(TEXTS)


def test_lone_surrogate_becomes_replacement_character():
    import json

    text = json.loads('"bad \\ud83d end"')  # what a JSON escape of half a pair gives
    assert encode(text).tobytes() == "bad \ufffd end".encode()


def test_decode_replaces_invalid_utf8_and_accepts_many_types():
    cut = "\u00e9".encode()[:1]  # half of a two-byte character (a model may sample this)
    assert decode(np.frombuffer(b"ok" + cut, np.uint8)) == "ok\ufffd"
    assert decode([104, 105]) == "hi"
    assert decode(b"hi") == "hi"
    assert decode(np.array([[104], [105]], dtype=np.int64)) == "hi"
    assert decode([]) == ""
    with pytest.raises(ValueError, match="0..255"):
        decode([104, 256])
    with pytest.raises(ValueError, match="0..255"):
        decode(np.array([-1]))


def test_normalize_collapses_whitespace_and_strips():
    assert normalize_text("  Great\t\talbum!\n\nLoved  it.  ") == "Great album! Loved it."
    assert normalize_text("a\u3000b\u00a0c") == "a b c"  # Unicode whitespace too
    assert encode("  a  b ", normalize=True).tobytes() == b"a b"
    assert encode("  a  b ").tobytes() == b"  a  b "  # off by default
    with pytest.raises(TypeError):
        encode(b"bytes")
