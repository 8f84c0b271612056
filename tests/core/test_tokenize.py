"""Tokenization equals llama.cpp's own test vectors for every vocab that has them."""
import numpy as np
import pytest

import llamax
from llamax_dev import data

SEP = "\n__ggml_vocab_test__\n"
CASES = data.vocab_cases()


def test_vectors_exist():
    assert len(CASES) >= 10


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_vocab_vectors(path):
    m = llamax.Model(path, vocab_only=True)
    try:
        texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split(SEP)
        # llama.cpp's test strips the trailing separator line, leaving one text per .out line
        if texts and texts[-1].endswith("\n__ggml_vocab_test__\n"[1:]):
            texts[-1] = texts[-1][: -len("__ggml_vocab_test__\n")]
        outs = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
        outs = [o for o in outs]
        n = min(len(texts), len(outs))
        assert n >= 10
        checked = 0
        for text, out in zip(texts[:n], outs[:n]):
            want = [int(x) for x in out.split()]
            got = m.tokenize(text, add_special=False, parse_special=False)
            assert got.dtype == np.int32
            assert got.tolist() == want, f"{path.name}: {text!r}"
            checked += 1
        assert checked == n
    finally:
        m.close()


def test_add_and_parse_special(model):
    plain = model.tokenize("<|im_start|>hi", add_special=False, parse_special=False)
    parsed = model.tokenize("<|im_start|>hi", add_special=False, parse_special=True)
    im_start = model.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1
    assert parsed[0] == im_start[0]
    assert im_start[0] not in plain.tolist()


def test_roundtrip_and_pieces(model):
    text = "Héllo wörld — 日本語 🙂"
    toks = model.tokenize(text, add_special=False)
    assert model.detokenize(toks).decode("utf-8") == text
    assert model.detokenize_text(toks) == text
    assert b"".join(model.token_to_piece(int(t)) for t in toks) == text.encode("utf-8")


def test_buffer_protocol_inputs(model):
    from array import array
    toks = model.tokenize("buffer protocol", add_special=False)
    want = model.detokenize(toks)
    assert model.detokenize(array("i", toks.tolist())) == want
    assert model.detokenize(toks.tolist()) == want
    assert model.detokenize(toks.astype(np.int64)) == want


def test_long_text_tokenizes_without_gil_same_result(model):
    text = "lorem ipsum dolor sit amet " * 2000  # over the no-GIL threshold
    toks = model.tokenize(text, add_special=False)
    assert model.detokenize_text(toks) == text
    short = model.tokenize("lorem ipsum dolor sit amet ", add_special=False)
    assert toks[: len(short) - 1].tolist() == short[:-1].tolist()


def test_invalid_utf8(model):
    with pytest.raises(llamax.InvalidUtf8Error):
        model.tokenize(b"\xff\xfe bad")
    with pytest.raises(llamax.InvalidUtf8Error):
        model.tokenize("lone \ud800 surrogate")
    # a token that is a partial UTF-8 sequence: bytes are fine, strict text is not
    emoji = model.tokenize("🙂", add_special=False)
    if len(emoji) > 1:
        part = emoji[:1]
        assert isinstance(model.detokenize(part), bytes)
        with pytest.raises(llamax.InvalidUtf8Error):
            model.detokenize_text(part)
        assert "\ufffd" in model.detokenize_text(part, errors="replace")


@pytest.mark.parametrize("bad", [-1, 49152, 2**31 - 1])
def test_bad_token_ids(model, bad):
    with pytest.raises(llamax.TokenError):
        model.detokenize([1, bad])
    with pytest.raises(llamax.TokenError):
        model.token_to_piece(bad)


def test_token_id_too_big_for_int32(model):
    with pytest.raises(llamax.TokenError):
        model.detokenize([2**31])
    with pytest.raises(llamax.TokenError):
        model.detokenize([2**70])


def test_wrong_types(model):
    with pytest.raises(TypeError):
        model.tokenize(123)
    with pytest.raises(TypeError):
        model.detokenize("abc")
    with pytest.raises(TypeError):
        model.detokenize([1.5, 2.0])
