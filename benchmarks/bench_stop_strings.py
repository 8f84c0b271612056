"""Stop strings: the per-token cost of text assembly (request.py's
_TextAssembler) with 16 stop strings of 1,024 characters over a 300-token
generation, against the implementation it replaced (issue #30, item 4; kept
as the reference in tests/api/test_stop_strings.py).

  python3 benchmarks/bench_stop_strings.py [--tokens 300] [--stops 16] [--stop-len 1024] [--repeat 5]

Cases (each streamed, where text is released as it becomes final, and not
streamed, where the old code rescanned the whole text every token):
- "prose": ~4-character tokens of English-like text; the stop strings are
  random lowercase text, so their first letters keep half-matching;
- "near miss": the text is "aaaa..." and every stop string is 1,023 "a"s and
  one other letter, so each token extends a 1,023-character partial match;
- "none": no stop strings (the floor).
Prints microseconds per token (the best of --repeat runs) for old and new.
This is the time the token loop's callback (or, for batched requests, the
event loop) spends per token on stop strings, without the model.
"""
from __future__ import annotations

import argparse
import random
import time

from llamax_dev import tests_module

from llamax.request import _TextAssembler

_reference = tests_module("api/test_stop_strings.py")   # the replaced implementation, kept there
_Model, _ReferenceAssembler = _reference._Model, _reference._ReferenceAssembler

WORDS = ("the of and to in is that for it as with was on be by this are at from or have an they which "
         "one you were her all she there would their we him been has when who will more no if out so said").split()


def prose(n_tokens, rng):
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens * 2))
    return [text[i:i + 4].encode() for i in range(0, 4 * n_tokens, 4)]


def per_token_us(cls, pieces, stops, streaming, repeat):
    model = _Model(pieces)
    best = float("inf")
    for _ in range(repeat):
        out = []
        t0 = time.perf_counter()
        asm = cls(model, stops, out.append if streaming else None)
        for tok in range(len(pieces)):
            if asm.add(tok):
                break
        asm.finish()
        best = min(best, time.perf_counter() - t0)
    return best / len(pieces) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--stops", type=int, default=16)
    ap.add_argument("--stop-len", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    cases = {
        "prose": (prose(a.tokens, rng),
                  ["".join(rng.choice(letters) for _ in range(a.stop_len)) for _ in range(a.stops)]),
        "near miss": ([b"aaaa"] * a.tokens,
                      ["a" * (a.stop_len - 1) + letters[1 + i % 25] for i in range(a.stops)]),
        "none": (prose(a.tokens, rng), []),
    }
    print(f"{a.stops} stop strings of {a.stop_len} characters, {a.tokens} tokens; microseconds per token "
          f"(best of {a.repeat})")
    print(f"{'case':<10} {'mode':<9} {'old':>10} {'new':>10} {'old/new':>8}")
    for name, (pieces, stops) in cases.items():
        for streaming in (True, False):
            old = per_token_us(_ReferenceAssembler, pieces, stops, streaming, a.repeat)
            new = per_token_us(_TextAssembler, pieces, stops, streaming, a.repeat)
            mode = "stream" if streaming else "whole"
            print(f"{name:<10} {mode:<9} {old:>10.1f} {new:>10.1f} {old / new:>8.1f}")


if __name__ == "__main__":
    main()
