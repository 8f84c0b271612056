"""Stop strings in text assembly (request.py's _TextAssembler): the linear
matcher gives exactly what the quadratic one it replaced gave (kept below as
the reference), piece for piece, on random text, token splits (UTF-8
sequences cut mid-character, invalid bytes) and stop lists (unicode,
overlapping, prefixes of each other, longer than the text)."""
import codecs

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamax.request import _StopMatcher, _TextAssembler


class _Model:
    """token id i → the i-th byte string of a fixed table."""

    def __init__(self, pieces):
        self.pieces = pieces

    def token_to_piece(self, tok):
        return self.pieces[tok]


class _ReferenceAssembler:
    """The implementation before issue #30 (O(len(stop)^2) per token), as it was."""

    def __init__(self, model, stops, emit):
        self.model = model
        self.stops = stops
        self.emit = emit
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""
        self.n_emitted = 0
        self.stopped = False
        self.n_tokens_used = 0
        self.hold = max((len(s) for s in stops), default=0)

    def add(self, tok) -> bool:
        self.n_tokens_used += 1
        self.text += self.decoder.decode(self.model.token_to_piece(int(tok)))
        if not self.stops:
            self._flush(len(self.text))
            return False
        start = max(0, self.n_emitted - self.hold)
        cut = -1
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.text = self.text[:cut]
            self.decoder.reset()
            self.stopped = True
            self._flush(len(self.text))
            return True
        self._flush(len(self.text) - self._partial_stop_len())
        return False

    def _partial_stop_len(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _flush(self, upto):
        if self.emit is not None and upto > self.n_emitted:
            self.emit(self.text[self.n_emitted:upto])
            self.n_emitted = upto

    def add_all(self, tokens):
        piece = self.model.token_to_piece
        self.text += self.decoder.decode(b"".join(piece(int(t)) for t in tokens))
        self.n_tokens_used = len(tokens)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.decoder.decode(b"", final=True)
        self._flush(len(self.text))
        return self.text


def _run(cls, pieces, stops, streaming):
    model = _Model(pieces)
    out = []
    asm = cls(model, stops, out.append if streaming else None)
    returns = []
    for tok in range(len(pieces)):
        returns.append(asm.add(tok))
        if returns[-1]:
            break
    text = asm.finish()
    return text, out, returns, asm.stopped, asm.n_tokens_used


# A small alphabet makes stop strings occur, overlap and half-occur often;
# the non-ASCII letters (2, 3 and 4 bytes in UTF-8) get cut between tokens.
ALPHABET = "ab\n é€😀"
texts = st.text(alphabet=ALPHABET, max_size=60)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=8), max_size=6)


@st.composite
def token_pieces(draw):
    """The UTF-8 bytes of a random text cut at random byte offsets (so
    characters are split between tokens), plus sometimes an invalid byte."""
    data = bytearray(draw(texts).encode())
    if draw(st.booleans()):
        data.insert(draw(st.integers(0, len(data))), draw(st.sampled_from([0xff, 0x80, 0xe2])))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=len(data) + 2)))
    pieces, last = [], 0
    for c in cuts + [len(data)]:
        pieces.append(bytes(data[last:c]))  # empty pieces too: a token with no text of its own
        last = c
    return pieces


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=token_pieces(), stops=stop_lists, streaming=st.booleans())
def test_same_as_reference(pieces, stops, streaming):
    assert _run(_TextAssembler, pieces, stops, streaming) == _run(_ReferenceAssembler, pieces, stops, streaming)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=40), stops=st.lists(st.text(min_size=1, max_size=6), max_size=4))
def test_same_as_reference_any_unicode(text, stops):
    """Any code point, one character per token (stops rarely occur here, but
    partial matches and their release are exercised)."""
    pieces = [c.encode("utf-8", "surrogatepass") for c in text]
    for streaming in (False, True):
        assert _run(_TextAssembler, pieces, stops, streaming) == _run(_ReferenceAssembler, pieces, stops, streaming)


@pytest.mark.parametrize("pieces, stops, text, out", [
    ([b"ab", b"ca", b"bcd"], ["abcd", "cab"], "ab", ["ab"]),           # the earliest start wins
    ([b"aaa", b"aab"], ["aaab"], "aa", ["aa"]),                       # a fallback inside a partial match
    ([b"x<", b"/s", b"!"], ["</s>"], "x</s!", ["x", "</s!"]),          # held, then released
    ([b""], ["a"], "", []),                                           # empty text
    ([b"\xe2\x82", b"\xac!"], ["\u20ac"], "", []),                    # a stop made of a split character
])
def test_examples(pieces, stops, text, out):
    got = _run(_TextAssembler, pieces, stops, True)
    assert got[:2] == (text, out)
    assert got == _run(_ReferenceAssembler, pieces, stops, True)


def test_matcher_long_partial_match():
    """16 stop strings of 1,024 characters that the text keeps half-matching
    (each new "a" makes every automaton fall back once): the held tail stays
    1,023 characters, and the match is found where it starts."""
    stops = ["a" * 1023 + chr(ord("b") + i) for i in range(16)]
    m = _StopMatcher(stops)
    for _ in range(300):
        assert m.feed("a" * 4) is None
    assert m.held() == 1023
    assert m.feed("b") == -1023  # the first stop string, starting 1,023 characters back
