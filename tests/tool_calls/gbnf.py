"""A small GBNF reader and recognizer in pure Python, for the tests only.

llama.cpp's grammar engine judges grammars in tests/api (it needs a model's
vocabulary); these tests load no model, so this recognizer stands in.  It
reads the subset the grammar writers here use: one ``name ::= body`` rule a
line; literals, character classes (ranges, ``^``), rule references, groups,
``|``, and ``* + ? {m} {m,} {m,n}``; the escapes llama.cpp reads
(``\\x \\u \\U \\t \\r \\n \\\\ \\" \\[ \\]``).  Anything else raises
GrammarSyntaxError, as llama.cpp's parser would refuse it.

A text matches when the whole of it is one complete derivation of the start
rule: ``matches(rules, text)``.
"""
from __future__ import annotations

import re

_RULE = re.compile(r"([a-zA-Z0-9-]+) ::= (.*)")
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_COUNT = re.compile(r"\{([0-9]+)(?:(,)([0-9]*))?\}")
_SIMPLE_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]"}


class GrammarSyntaxError(ValueError):
    pass


def parse(text: str, start: str = "root") -> dict:
    """Rule name → node.  Every rule defined once, every reference defined,
    ``start`` among them."""
    rules: dict = {}
    refs: set = set()
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _RULE.fullmatch(line)
        if not m:
            raise GrammarSyntaxError(f"not a rule line: {line!r}")
        name, body = m.groups()
        if name in rules:
            raise GrammarSyntaxError(f"rule {name!r} defined twice")
        reader = _Reader(body, refs)
        rules[name] = reader.alternatives()
        if reader.i != len(body):
            raise GrammarSyntaxError(f"rule {name!r}: unexpected {body[reader.i:]!r}")
    if start not in rules:
        raise GrammarSyntaxError(f"no {start} rule")
    missing = refs - rules.keys()
    if missing:
        raise GrammarSyntaxError(f"undefined rules: {sorted(missing)}")
    return rules


class _Reader:
    def __init__(self, body: str, refs: set) -> None:
        self.s, self.i, self.refs = body, 0, refs

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def alternatives(self):
        alts = [self.sequence()]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            alts.append(self.sequence())
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self):
        items = []
        while True:
            self.ws()
            if self.i >= len(self.s) or self.s[self.i] in "|)":
                return ("seq", items)
            items.append(self.quantified(self.atom()))

    def atom(self):
        c = self.s[self.i]
        if c == '"':
            self.i += 1
            out = []
            while True:
                if self.i >= len(self.s):
                    raise GrammarSyntaxError("unterminated literal")
                if self.s[self.i] == '"':
                    self.i += 1
                    return ("lit", "".join(out))
                out.append(self.char())
        if c == "[":
            self.i += 1
            negated = self.s[self.i:self.i + 1] == "^"
            self.i += negated
            ranges = []
            while True:
                if self.i >= len(self.s):
                    raise GrammarSyntaxError("unterminated class")
                if self.s[self.i] == "]":
                    self.i += 1
                    return ("cls", negated, ranges)
                lo = self.char()
                hi = lo
                if self.s[self.i:self.i + 1] == "-" and self.s[self.i + 1:self.i + 2] not in ("]", ""):
                    self.i += 1
                    hi = self.char()
                ranges.append((ord(lo), ord(hi)))
        if c == "(":
            self.i += 1
            node = self.alternatives()
            if self.s[self.i:self.i + 1] != ")":
                raise GrammarSyntaxError("unclosed group")
            self.i += 1
            return node
        m = _NAME.match(self.s, self.i)
        if not m:
            raise GrammarSyntaxError(f"unexpected {self.s[self.i:]!r}")
        self.i = m.end()
        self.refs.add(m[0])
        return ("ref", m[0])

    def char(self) -> str:
        c = self.s[self.i]
        self.i += 1
        if c != "\\":
            return c
        e = self.s[self.i]
        self.i += 1
        if e in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[e]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width is None:
            raise GrammarSyntaxError(f"unknown escape \\{e}")
        digits = self.s[self.i:self.i + width]
        if not re.fullmatch(f"[0-9a-fA-F]{{{width}}}", digits):
            raise GrammarSyntaxError(f"bad escape \\{e}{digits}")
        self.i += width
        return chr(int(digits, 16))

    def quantified(self, node):
        c = self.s[self.i:self.i + 1]
        if c in ("*", "+", "?") and c:
            self.i += 1
            return ("rep", node, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
        m = _COUNT.match(self.s, self.i)
        if m:
            self.i = m.end()
            lo = int(m[1])
            hi = lo if not m[2] else (int(m[3]) if m[3] else None)
            return ("rep", node, lo, hi)
        return node


class _Match:
    def __init__(self, rules: dict, text: str) -> None:
        self.rules, self.text, self.memo = rules, text, {}

    def rule(self, name: str, pos: int) -> frozenset:
        key = (name, pos)
        if key not in self.memo:
            self.memo[key] = frozenset()  # a rule re-entered at the same place (left recursion) matches nothing
            self.memo[key] = self.ends(self.rules[name], pos)
        return self.memo[key]

    def ends(self, node, pos: int) -> frozenset:
        kind = node[0]
        text = self.text
        if kind == "lit":
            return frozenset([pos + len(node[1])]) if text.startswith(node[1], pos) else frozenset()
        if kind == "cls":
            if pos >= len(text):
                return frozenset()
            cp = ord(text[pos])
            inside = any(a <= cp <= b for a, b in node[2])
            return frozenset([pos + 1]) if inside != node[1] else frozenset()
        if kind == "ref":
            return self.rule(node[1], pos)
        if kind == "alt":
            return frozenset().union(*(self.ends(n, pos) for n in node[1]))
        if kind == "seq":
            cur = frozenset([pos])
            for item in node[1]:
                cur = frozenset().union(*(self.ends(item, p) for p in cur))
                if not cur:
                    break
            return cur
        _, item, lo, hi = node
        out = set([pos]) if lo == 0 else set()
        cur, seen, count = frozenset([pos]), set(), 0
        while cur and (hi is None or count < hi):
            cur = frozenset().union(*(self.ends(item, p) for p in cur))
            count += 1
            if hi is None and count >= lo:
                cur = frozenset(cur - seen)  # unbounded: stop once no new place is reached
                seen |= cur
            if count >= lo:
                out |= cur
        return frozenset(out)


def matches(rules: dict, text: str, start: str = "root") -> bool:
    """Whether ``text`` is a complete output of ``rules`` (from :func:`parse`)."""
    return len(text) in _Match(rules, text).rule(start, 0)
