"""Where a JSON value ends in generated text, and whether more text could
still complete it.

A streaming parser must tell a call still being written (hold it back) from
text that can never become a call (let it out as content), and decide the
same way the whole-text parser will.  :func:`value_end` answers with three
outcomes whose decisions never change as text is appended: an end index
(complete: the same end for every continuation), ``INCOMPLETE`` (some
continuation completes it) or ``INVALID`` (none does).  It accepts what
:func:`json.loads` accepts, minus ``NaN`` / ``Infinity``.
"""
from __future__ import annotations

import json
import re

INCOMPLETE = -1
INVALID = -2

_WS = re.compile(r"[ \t\n\r]*")
_STR_BODY = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_STRING = re.compile('"' + _STR_BODY + '"')
# a string cut short: its body so far, maybe ending inside an escape
_STRING_CUT = re.compile('"' + _STR_BODY + r'(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# a number cut short (ending where the text ends): "-", "1.", "1e+", ...
_NUMBER_CUT = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?)?\Z")
_LITERALS = ("true", "false", "null")


def value_end(text: str, i: int) -> int:
    """The index just past the JSON value that starts at ``text[i]`` (no
    whitespace skipped), INCOMPLETE or INVALID.  A value ending exactly at the
    end of the text is complete only if appending can't extend it (objects,
    arrays, strings, literals; a number there is INCOMPLETE)."""
    n = len(text)
    stack: list = []  # "{" / "[" of the open containers
    expect = "value"  # value, first-value ([ just opened), first-key ({ just opened), key, colon, next
    while True:
        if stack:  # whitespace only inside containers: the caller decides about the outside
            i = ws_end(text, i)
        if i >= n:
            return INCOMPLETE
        c = text[i]
        if expect == "next":
            if c == ",":
                expect = "key" if stack[-1] == "{" else "value"
                i += 1
                continue
            if c != ("}" if stack[-1] == "{" else "]"):
                return INVALID
            stack.pop()
            i += 1
            if not stack:
                return i
            continue
        if expect == "colon":
            if c != ":":
                return INVALID
            expect = "value"
            i += 1
            continue
        if expect in ("first-key", "key"):
            if c == "}" and expect == "first-key":
                stack.pop()
                i += 1
                if not stack:
                    return i
                expect = "next"
                continue
            if c != '"':
                return INVALID
            m = _STRING.match(text, i)
            if not m:
                return INCOMPLETE if _STRING_CUT.match(text, i) else INVALID
            i, expect = m.end(), "colon"
            continue
        # a value
        if c == "]" and expect == "first-value":
            stack.pop()
            i += 1
        elif c in "{[":
            stack.append(c)
            expect = "first-key" if c == "{" else "first-value"
            i += 1
            continue
        elif c == '"':
            m = _STRING.match(text, i)
            if not m:
                return INCOMPLETE if _STRING_CUT.match(text, i) else INVALID
            i = m.end()
        elif c == "-" or c.isdigit():
            if _NUMBER_CUT.match(text, i):  # the rest of the text is a number so far
                return INCOMPLETE
            m = _NUMBER.match(text, i)
            if not m:
                return INVALID
            i = m.end()
        else:
            for lit in _LITERALS:
                if text.startswith(lit, i):
                    i += len(lit)
                    break
                if lit.startswith(text[i:]):
                    return INCOMPLETE
            else:
                return INVALID
        if not stack:
            return i
        expect = "next"


def ws_end(text: str, i: int) -> int:
    """The index past JSON whitespace at ``text[i]``."""
    m = _WS.match(text, i)  # always matches (maybe nothing)
    return m.end() if m else i


def load(text: str):
    """``json.loads`` of a value :func:`value_end` found complete; None if
    Python's reader still refuses it (nesting too deep to read)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def dumps(obj) -> str:
    """The arguments text of a call: one spelling for every format, so a
    call parses to the same string whatever the model's spacing."""
    return json.dumps(obj, ensure_ascii=False)
