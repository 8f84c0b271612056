"""GBNF grammars for constrained generation, and a JSON Schema → GBNF converter.

:class:`LlamaGrammar` is llama-cpp-python's grammar object: pass one as
``grammar=`` to :meth:`llamax.Llama.create_completion` and friends.  Its text
is parsed by llama.cpp when a request builds its sampler; a grammar llama.cpp
can't parse raises :class:`llamax.GrammarError` there.

:func:`json_schema_to_gbnf` turns a JSON Schema (a dict or JSON text, e.g.
pydantic's ``model_json_schema()``) into a grammar whose every complete output
is JSON valid under the schema.  It never loosens a schema: a validation
keyword it can't express raises :class:`llamax.InvalidArgumentError` naming
it, and where a schema allows more than the grammar can say, the grammar
allows a subset of the valid documents, never an invalid one:

* whitespace between tokens is bounded (a newline and up to 20 spaces or
  tabs), none follows the document (generation ends with it); integers
  have at most 16 digits, fractions 16, exponents 3;
* optional object properties come in the schema's order (required ones
  first), and only declared properties unless ``additionalProperties`` says
  otherwise; an array with ``prefixItems`` has all of them;
* ``pattern`` is a regular expression (the subset shared by ECMA-262, which
  JSON Schema specifies, and Python's ``re``, which ``jsonschema`` uses):
  characters, escapes, ``.``, classes, groups, ``|``, quantifiers and the
  anchors ``^`` / ``$`` at its ends; an unanchored side may hold any text;
* numbers take inclusive integer ``minimum`` / ``maximum`` (integers any
  bound); ``format`` is one of date, time, date-time, uuid; a pattern takes
  ``minLength`` / ``maxLength`` only when it is one repeated character class;
* counts (``maxLength``, ``maxItems``, quantifiers) above 100000 are lowered
  to it; keys allowed by ``additionalProperties`` are written without
  unicode escapes;
* ``oneOf`` is read as ``anyOf``: its alternatives are expected to be
  disjoint (as pydantic's discriminated unions are).

Unknown keywords are ignored, as the JSON Schema specification says.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from typing import Callable
from urllib.parse import unquote

from llamax._errors import ArgumentTypeError, InvalidArgumentError, LoadError
from llamax._validate import is_number

__all__ = ["JSON_GBNF", "JSON_OBJECT_GBNF", "LlamaGrammar", "json_schema_to_gbnf"]


class LlamaGrammar:
    """A GBNF grammar (llama-cpp-python's ``LlamaGrammar``).  Make one with
    :meth:`from_string`, :meth:`from_file` or :meth:`from_json_schema`."""

    def __init__(self, *, _grammar: str) -> None:
        self._grammar = _check_gbnf(_grammar)
        self._root = "root"

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> LlamaGrammar:
        """The grammar ``grammar`` (GBNF text with a ``root`` rule).  ``verbose``
        is accepted for compatibility and has no effect."""
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file: str | os.PathLike, verbose: bool = True) -> LlamaGrammar:
        """The grammar in the UTF-8 text file ``file``."""
        if not isinstance(file, (str, os.PathLike)):
            raise ArgumentTypeError(f"file must be a path (str or os.PathLike), not {type(file).__name__}")
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise LoadError(f"can't read the grammar file {os.fspath(file)!r}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise InvalidArgumentError(f"the grammar file {os.fspath(file)!r} is not UTF-8 text ({e.reason} "
                                       f"at byte {e.start})") from None
        if not text.strip():
            raise InvalidArgumentError(f"the grammar file {os.fspath(file)!r} is empty")
        return cls.from_string(text, verbose=verbose)

    @classmethod
    def from_json_schema(cls, json_schema: str | dict, verbose: bool = True) -> LlamaGrammar:
        """The grammar of the JSON documents valid under ``json_schema`` (JSON
        text or a dict); see :func:`json_schema_to_gbnf`."""
        return cls(_grammar=json_schema_to_gbnf(json_schema))

    @property
    def grammar(self) -> str:
        """The GBNF text."""
        return self._grammar

    @property
    def root(self) -> str:
        """The rule generation starts from: always ``"root"``."""
        return self._root

    def __repr__(self) -> str:
        return f"<LlamaGrammar: {self._grammar.count('::=')} rules, {len(self._grammar)} characters>"


def _check_gbnf(text: object) -> str:
    # The obvious mistakes only: llama.cpp parses the rest when a sampler is built.
    if not isinstance(text, str):
        raise ArgumentTypeError(f"a grammar must be GBNF text (str), not {type(text).__name__}")
    if not text.strip():
        raise InvalidArgumentError("the grammar is empty")
    if not re.search(r"^[ \t]*root[ \t]*::=", text, re.MULTILINE):
        raise InvalidArgumentError("the grammar has no 'root' rule (generation starts from it): "
                                   "add a line 'root ::= ...'")
    return text


def json_schema_to_gbnf(schema: str | dict | bool, prop_order: list | None = None, *,
                        prefix: str = "") -> str:
    """GBNF text for the JSON documents valid under ``schema`` (JSON text, a
    dict, or a boolean schema).  ``prop_order`` lists property names to put
    first, in that order, within required and within optional properties.
    ``prefix`` (letters, digits and ``-``) is put before every rule name,
    definitions and references alike, so that several converted schemas can
    share one grammar: the document's rule is then ``<prefix>root``.
    InvalidArgumentError for a schema that isn't one or uses what this
    converter does not support (the message says which keyword, and where)."""
    if isinstance(schema, (str, bytes, bytearray)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidArgumentError(f"the JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidArgumentError("the JSON schema nests too deeply to read") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgumentError(f"a JSON schema must be a JSON object (or true / false), "
                                       f"not {type(schema).__name__}")
    elif not isinstance(schema, (dict, bool)):
        raise ArgumentTypeError(f"a JSON schema must be JSON text or a dict, not {type(schema).__name__}")
    if prop_order is not None and not (isinstance(prop_order, (list, tuple))
                                       and all(isinstance(p, str) for p in prop_order)):
        raise ArgumentTypeError("prop_order must be a list of property names")
    if not isinstance(prefix, str):
        raise ArgumentTypeError(f"prefix must be a str, not {type(prefix).__name__}")
    if prefix and not _RULE_NAME.fullmatch(prefix):
        raise InvalidArgumentError(f"prefix {prefix!r} must be letters, digits and '-' (what a GBNF rule "
                                   f"name is made of)")
    try:
        return _Converter(schema, prop_order or (), prefix).convert()
    except RecursionError:
        raise InvalidArgumentError("the JSON schema nests too deeply (hundreds of levels): flatten it with "
                                   "$defs") from None


# -- keywords ------------------------------------------------------------------

# Describe, never restrict: skipped.
_ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$schema", "$id", "$comment", "$anchor",
    "$dynamicAnchor", "$vocabulary", "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
    "contentEncoding", "contentMediaType", "contentSchema", "discriminator",
})
# The keywords of each instance type, which also tell a schema's type when it has no "type".
_TYPE_KEYWORDS = {
    "object": frozenset({"properties", "required", "additionalProperties", "unevaluatedProperties"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
}
# Validation keywords not implemented: refused unless the value has no effect.
_UNSUPPORTED = frozenset({
    "not", "if", "then", "else", "multipleOf", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "dependentRequired", "dependentSchemas", "dependencies", "contains", "minContains",
    "maxContains", "unevaluatedItems", "uniqueItems", "$dynamicRef", "$recursiveRef",
})
_HARMLESS = {"uniqueItems": False, "minProperties": 0, "unevaluatedItems": True}
# Every keyword that constrains (what merging and sibling checks look at).
_VALIDATION = frozenset({"type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf"}).union(
    _UNSUPPORTED, *_TYPE_KEYWORDS.values())
_TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")
_FORMATS = ("date", "time", "date-time", "uuid")


# -- GBNF text -----------------------------------------------------------------

_RULE_NAME = re.compile(r"[a-zA-Z0-9-]+")
_NOT_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
# One token of a rule body as this converter writes it: a literal, a class, a
# repetition count, a name, or anything else one character at a time.  Counts
# and names are told apart here because a property named "0" makes a rule "0".
_BODY_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\{[0-9,]*\}|[a-zA-Z0-9-]+|.', re.S)
# llama.cpp turns x{m,n} into n rules and takes any n above 2000 as unbounded.
_MAX_REPEAT = 2000
# The largest repetition count honoured: a larger minimum is refused, a larger maximum lowered to it.
_MAX_COUNT = 100_000

# The shared rules, as templates: {name} is the rule name of another one.
_PRIMITIVES = {
    "space": r'| " " | "\n" [ \t]{{0,20}}',
    "value": "{object} | {array} | {string} | {number} | {boolean} | {null}",
    "object": r'"{{" {space} ( {string} {space} ":" {space} {value} {space} '
              r'( "," {space} {string} {space} ":" {space} {value} {space} )* )? "}}"',
    "array": r'"[" {space} ( {value} {space} ( "," {space} {value} {space} )* )? "]"',
    "string": r'"\"" {char}* "\""',
    # one character of a JSON string: \u escapes of lone surrogates excluded (they would not count as one)
    "char": r'[^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" ( [0-9a-cA-Ce-fE-F] [0-9a-fA-F]{{3}} | '
            r'[dD] [0-7] [0-9a-fA-F]{{2}} ) )',
    "integer": r'"-"? ( "0" | [1-9] [0-9]{{0,15}} )',
    "number": r'"-"? ( "0" | [1-9] [0-9]{{0,15}} ) ( "." [0-9]{{1,16}} )? ( [eE] [-+]? [0-9]{{1,3}} )?',
    "boolean": r'"true" | "false"',
    "null": r'"null"',
    # RFC 3339, as JSON Schema's formats are
    "date": r'[0-9]{{4}} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] )',
    "time": r'( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{{1,9}} )? '
            r'( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    "date-time": r'{date} "T" {time}',
    "uuid": r'[0-9a-f]{{8}} "-" [0-9a-f]{{4}} "-" [0-9a-f]{{4}} "-" [0-9a-f]{{4}} "-" [0-9a-f]{{12}}',
    # a key character with one encoding per character (what excluding declared keys relies on)
    "key-char": r'[^"\\\x7F\x00-\x1F] | "\\" ["\\bfnrt]',
}


def _hex(cp: int) -> str:
    return f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}" if cp < 0x10000 else f"\\U{cp:08X}"


def _lit(text: str) -> str:
    """A GBNF literal matching ``text``."""
    esc = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return '"' + "".join(esc.get(c) or (c if c.isprintable() else _hex(ord(c))) for c in text) + '"'


def _json_lit(text: str) -> str:
    """A GBNF literal matching ``text``'s JSON encoding, without the quotes."""
    return _lit(json.dumps(text, ensure_ascii=False)[1:-1])


def _cls_char(cp: int) -> str:
    c = chr(cp)
    return c if c.isascii() and c.isalnum() else _hex(cp)


def _cls(ranges) -> str:
    return "[" + "".join(_cls_char(a) if a == b else f"{_cls_char(a)}-{_cls_char(b)}" for a, b in ranges) + "]"


def _alt(alts) -> str:
    """Alternatives as one GBNF item."""
    alts = list(dict.fromkeys(alts))
    return alts[0] if len(alts) == 1 else "( " + " | ".join(alts) + " )"


def _repeat(item: str, lo: int, hi: int | None) -> str:
    """``item`` (one GBNF item) lo to hi times (hi None: no limit), as
    unambiguous pieces of at most _MAX_REPEAT repetitions."""
    if hi is not None and hi > _MAX_REPEAT:
        if lo >= _MAX_REPEAT:
            return f"{item}{{{_MAX_REPEAT}}} {_repeat(item, lo - _MAX_REPEAT, hi - _MAX_REPEAT)}"
        return (f"( {_repeat(item, lo, _MAX_REPEAT - 1)} | "
                f"{item}{{{_MAX_REPEAT}}} {_repeat(item, 0, hi - _MAX_REPEAT)} )")
    if lo > _MAX_REPEAT:
        return f"{item}{{{_MAX_REPEAT}}} {_repeat(item, lo - _MAX_REPEAT, None if hi is None else hi - _MAX_REPEAT)}"
    if hi == 0:
        return '""'
    if lo == hi:
        return item if lo == 1 else f"{item}{{{lo}}}"
    suffix = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((lo, hi))
    return item + (suffix or (f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"))


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p and p != '""') or '""'


# -- integers --------------------------------------------------------------------

_MAX_DIGITS = 16  # an unbounded integer's digits at most (the "integer" rule's too)


def _digits(a: str, b: str) -> str:
    """Decimal numerals from a to b, strings of the same length."""
    if a == b:
        return _lit(a)
    i = 0
    while a[i] == b[i]:
        i += 1
    head, a, b = a[:i], a[i:], b[i:]
    n = len(a) - 1
    tail = f" [0-9]{{{n}}}" if n > 1 else " [0-9]" if n == 1 else ""
    def span(lo: int, hi: int) -> str:  # the digits lo..hi, then any n digits
        return (_lit(str(lo)) if lo == hi else f"[{lo}-{hi}]") + tail

    if a[1:] == "0" * n and b[1:] == "9" * n:
        alts = [span(int(a[0]), int(b[0]))]
    else:
        alts = [f"{_lit(a[0])} {_digits(a[1:], '9' * n)}"]
        if int(b[0]) - int(a[0]) > 1:
            alts.append(span(int(a[0]) + 1, int(b[0]) - 1))
        alts.append(f"{_lit(b[0])} {_digits('0' * n, b[1:])}")
    return _seq(_lit(head) if head else "", _alt(alts))


def _uint_range(lo: int, hi: int | None) -> str:
    """Numerals of the integers lo..hi (0 <= lo <= hi; hi None: unbounded)."""
    alts = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for n in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = 10 ** n - 1 if hi is None else min(hi, 10 ** n - 1)
        alts.append(_digits(str(a), str(b)))
    if hi is None and top < _MAX_DIGITS:
        alts.append(f"[1-9] [0-9]{{{top},{_MAX_DIGITS - 1}}}")
    return _alt(alts)


def _int_range(lo: int | None, hi: int | None) -> str:
    alts = []
    if lo is None or lo < 0:
        alts.append(f'"-" {_uint_range(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo)}')
    if hi is None or hi >= 0:
        alts.append(_uint_range(max(lo or 0, 0), hi))
    return _alt(alts)


def _magnitude(lo: int, hi: int | None) -> str:
    """Decimal numerals (fractions allowed, no exponent) of the numbers lo..hi (integers, 0 <= lo <= hi)."""
    frac = '( "." [0-9]{1,16} )?'
    if hi is None:
        return f"{_uint_range(lo, None)} {frac}"
    alts = [f"{_uint_range(lo, hi - 1)} {frac}"] if hi > lo else []
    return _alt(alts + [f'{_uint_range(hi, hi)} ( "." "0"{{1,16}} )?'])


# -- character sets (lists of inclusive code point ranges) ---------------------------

_MAX_CP = 0x10FFFF


def _normalize(ranges):
    out: list = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(ranges):
    out, nxt = [], 0
    for a, b in _normalize(ranges):
        if a > nxt:
            out.append((nxt, a - 1))
        nxt = b + 1
    return out + ([(nxt, _MAX_CP)] if nxt <= _MAX_CP else [])


def _subtract(ranges, cut):
    keep, out = _complement(cut), []
    for a, b in _normalize(ranges):
        out += [(max(a, c), min(b, d)) for c, d in keep if max(a, c) <= min(b, d)]
    return out


@functools.cache
def _python_class(cls: str):
    """The code points Python's ``re`` matches with ``cls`` (e.g. ``\\d``)."""
    text = "".join(map(chr, range(_MAX_CP + 1)))
    return tuple((m.start(), m.end() - 1) for m in re.finditer(cls + "+", text))


_ASCII_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_ECMA_SPACE = _ASCII_SPACE + [(0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                              (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]


def _shorthand(letter: str):
    """(fewest, most) code points that ``\\<letter>`` may match: ECMA-262 (what
    JSON Schema specifies) and Python's ``re`` (what ``jsonschema`` runs)
    disagree outside ASCII, so a class takes the set both accept."""
    lower = letter.lower()
    if lower == "s":
        few = _subtract(_ECMA_SPACE, _complement(_python_class(r"\s")))
        most = _normalize(_ECMA_SPACE + list(_python_class(r"\s")))
    else:
        few = [(0x30, 0x39)] + ([(0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)] if lower == "w" else [])
        most = list(_python_class("\\" + lower))
    return (few, most) if letter == lower else (_complement(most), _complement(few))


_JSON_ESCAPES = ((0x22, '\\"'), (0x5C, "\\\\"), (0x08, "\\b"), (0x0C, "\\f"), (0x0A, "\\n"), (0x0D, "\\r"),
                 (0x09, "\\t"))
# Never raw in a JSON string: controls, '"', '\'; never in UTF-8 text: surrogates.
_NOT_RAW = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)]


def _json_charset(ranges) -> str | None:
    """One GBNF item for the JSON encoding of one character in ``ranges``
    (None if there is none).  Controls without a short escape are left out."""
    raw = _subtract(ranges, _NOT_RAW)
    alts = [_cls(raw)] if raw else []
    alts += [_lit(esc) for cp, esc in _JSON_ESCAPES if any(a <= cp <= b for a, b in ranges)]
    return _alt(alts) if alts else None


# -- JSON values -----------------------------------------------------------------

class _Unsatisfiable(InvalidArgumentError):
    """No value satisfies both sides of a merge (an anyOf alternative is dropped)."""


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "unknown")


def _same(a, b) -> bool:
    """JSON equality (true is not 1; 1 is 1.0)."""
    ta, tb = _json_type(a), _json_type(b)
    if ta != tb:
        return False
    if ta == "array":
        return len(a) == len(b) and all(map(_same, a, b))
    if ta == "object":
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _types(t, at: str) -> list:
    """A type keyword as a list of names (it may be read, by allOf and enum,
    before the converter reaches it)."""
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and t and all(isinstance(x, str) for x in t):
        return list(t)
    raise InvalidArgumentError(f"type at {at} must be a type name or a non-empty list of them")


def _merge(a: dict, b: dict, at: str) -> dict:
    """The schema of the values valid under both a and b (allOf), for the
    keywords whose combination is a keyword again."""
    out = dict(a)
    for k, v in b.items():
        if k not in out or k not in _VALIDATION:  # annotations and unknown keywords: the first kept
            out.setdefault(k, v)
            continue
        w = out[k]
        if _same(w, v):
            continue
        if k == "properties" and isinstance(w, dict) and isinstance(v, dict):
            out[k] = {**w, **{p: {"allOf": [w[p], s]} if p in w else s for p, s in v.items()}}
        elif k == "required" and isinstance(w, list) and isinstance(v, list):
            out[k] = list(dict.fromkeys(w + v))
        elif k == "type":
            tv, tw = _types(v, at), _types(w, at)
            common = [t for t in tw if t in tv or (t == "integer" and "number" in tv)]
            common += ["integer"] if "integer" in tv and "number" in tw else []
            if not common:
                raise _Unsatisfiable(f"no value has both type {w!r} and {v!r} (allOf at {at})")
            out[k] = common[0] if len(common) == 1 else common
        elif k in ("minLength", "minItems", "minimum", "exclusiveMinimum") and is_number(w) and is_number(v):
            out[k] = max(w, v)
        elif k in ("maxLength", "maxItems", "maximum", "exclusiveMaximum") and is_number(w) and is_number(v):
            out[k] = min(w, v)
        elif k == "enum" and isinstance(w, list) and isinstance(v, list):
            out[k] = [x for x in w if any(_same(x, y) for y in v)]
            if not out[k]:
                raise _Unsatisfiable(f"no value is in both enums (allOf at {at})")
        elif k == "const":
            raise _Unsatisfiable(f"two different const values (allOf at {at})")
        elif k in ("anyOf", "oneOf") and isinstance(w, list) and isinstance(v, list):
            out[k] = [{"allOf": [x, y]} for x in w for y in v]
        elif k == "allOf" and isinstance(w, list) and isinstance(v, list):
            out[k] = w + v
        else:
            raise InvalidArgumentError(f"json schema keyword {k!r} with two different values in allOf "
                                       f"is not supported (at {at})")
    for x in (a, b):  # read below before the converter checks it
        if not isinstance(x.get("properties", {}), dict):
            raise InvalidArgumentError(f"properties at {at} must be an object")
    for x, y in ((a, b), (b, a)):  # a closed object's extra-property rule applies to the other's properties
        extra = set(y.get("properties", ())) - set(x.get("properties", ()))
        if x.get("additionalProperties", True) is not True and extra:
            raise InvalidArgumentError(f"allOf at {at} combines an object whose additionalProperties restrict "
                                       f"other properties with one that declares {sorted(extra)}: not supported")
    return out


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


class _Names(dict):
    """format_map's view of the shared rules: a missing name adds the rule."""

    def __init__(self, lookup: Callable[[str], str]) -> None:
        super().__init__()
        self._lookup = lookup

    def __missing__(self, key: str) -> str:
        return self._lookup(key)


class _Converter:
    """Walks a schema and emits one named rule per part, deduplicated: one
    rule per body, named after the first part that needs it (suffixed -1,
    -2... when another body has that name)."""

    def __init__(self, schema, prop_order, prefix: str = "") -> None:
        self._schema = schema
        self._prefix = prefix
        self._order = {p: i for i, p in enumerate(prop_order)}
        self._rules: dict = {"root": None}  # None: named, body not yet made (a $ref being visited)
        self._bodies: dict = {}  # body -> name, for the rules made by _add
        self._prims: dict = {}
        self._refs: dict = {"#": "root", "": "root"}

    def convert(self) -> str:
        self._rules["root"] = self._expr(self._schema, "root", "#")
        if not self._prefix:
            return "".join(f"{name} ::= {body}\n" for name, body in self._rules.items())
        # Renamed once the rules are made: bodies are built by formatting names in,
        # so only a token equal to a defined name is a reference.
        def rename(body: str) -> str:
            return "".join(self._prefix + t if t in self._rules else t for t in _BODY_TOKEN.findall(body))
        return "".join(f"{self._prefix}{name} ::= {rename(body)}\n" for name, body in self._rules.items())

    # rules

    def _add(self, base: str, body: str | None) -> str:
        """The rule name for ``body`` (None: reserve one), derived from ``base``."""
        if body in self._bodies:
            return self._bodies[body]
        base = _NOT_RULE_CHARS.sub("-", base).strip("-") or "rule"
        name, n = base, 0
        while name in self._rules:
            n += 1
            name = f"{base}-{n}"
        self._rules[name] = body
        if body is not None:
            self._bodies[body] = name
        return name

    def _prim(self, key: str) -> str:
        name = self._prims.get(key)
        if name is None:
            name = self._prims[key] = self._add(key, None)  # reserved first: "value" refers to itself
            self._rules[name] = _PRIMITIVES[key].format_map(_Names(self._prim))
        return name

    def _rule(self, schema, name: str, at: str) -> str:
        expr = self._expr(schema, name, at)
        return expr if _RULE_NAME.fullmatch(expr) else self._add(name, expr)

    @staticmethod
    def _child(name: str, key: str) -> str:
        return key if name == "root" else f"{name}-{key}"

    # references

    def _resolve(self, ref, at: str):
        if not isinstance(ref, str):
            raise InvalidArgumentError(f"$ref at {at} must be a string, not {type(ref).__name__}")
        if not ref.startswith("#"):
            raise InvalidArgumentError(f"$ref {ref!r} at {at} refers to another document; put that schema "
                                       f"under \"$defs\" and refer to it as \"#/$defs/Name\"")
        pointer = unquote(ref[1:])
        if pointer and not pointer.startswith("/"):
            raise InvalidArgumentError(f"$ref {ref!r} at {at} names an anchor; refer to the schema by its "
                                       f"JSON pointer instead, like \"#/$defs/Name\"")
        node = self._schema
        for part in pointer.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise InvalidArgumentError(f"$ref {ref!r} at {at} refers to nothing: there is no {part!r} "
                                           f"there; define the schema under \"$defs\"")
        return node

    def _ref(self, ref, at: str) -> str:
        name = self._refs.get(ref)
        if name is None:
            target = self._resolve(ref, at)
            name = self._refs[ref] = self._add(ref.rsplit("/", 1)[-1], None)  # named first: it may recur
            body = self._expr(target, name, ref)
            if body == name:
                raise InvalidArgumentError(f"$ref {ref!r} refers to itself and nothing else")
            self._rules[name] = body
        return name

    def _deref(self, schema, at: str, depth: int = 0) -> dict:
        """``schema`` with its own $ref (chain) merged in."""
        if schema is True:
            return {}
        if schema is False:
            raise _Unsatisfiable(f"the schema at {at} is false: no value is valid there")
        if not isinstance(schema, dict):
            raise InvalidArgumentError(f"the schema at {at} must be an object or a boolean, "
                                       f"not {type(schema).__name__}")
        if "$ref" not in schema:
            return schema
        if depth > 64:
            raise InvalidArgumentError(f"the $ref at {at} leads to a cycle of $refs")
        ref = schema["$ref"]
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return _merge(self._deref(self._resolve(ref, at), str(ref), depth + 1), rest, at)

    # schemas

    def _expr(self, schema, name: str, at: str, depth: int = 0) -> str:
        """A GBNF expression (maybe with top-level |) for the values valid under ``schema``."""
        if depth > 64:
            raise InvalidArgumentError(f"the schema at {at} combines itself without end (allOf / $ref cycle)")
        if schema is True:
            return self._prim("value")
        if schema is False:
            raise _Unsatisfiable(f"the schema at {at} is false: no value is valid there")
        if not isinstance(schema, dict):
            raise InvalidArgumentError(f"the schema at {at} must be an object or a boolean, "
                                       f"not {type(schema).__name__}")
        for k, v in schema.items():
            if k in _UNSUPPORTED and not (k in _HARMLESS and _same(v, _HARMLESS[k])):
                raise InvalidArgumentError(f"json schema keyword {k!r} is not supported (at {at})")

        def rest(key: str) -> dict:
            return {k: v for k, v in schema.items() if k != key}

        def constrains(d: dict) -> bool:
            return any(k in _VALIDATION for k in d)

        if "$ref" in schema:
            if not constrains(rest("$ref")):
                return self._ref(schema["$ref"], at)
            return self._expr(self._deref(schema, at), name, at, depth + 1)
        if "allOf" in schema:
            parts = self._list(schema, "allOf", at)
            merged = rest("allOf")
            for i, part in enumerate(parts):
                merged = _merge(merged, self._deref(part, f"{at}/allOf/{i}"), at)
            return self._expr(merged, name, at, depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                names = []
                for i, alt in enumerate(self._list(schema, key, at)):
                    where = f"{at}/{key}/{i}"
                    saved = dict(self._rules), dict(self._refs), dict(self._prims), dict(self._bodies)
                    try:
                        if constrains(rest(key)):
                            alt = _merge(rest(key), self._deref(alt, where), where)
                        names.append(self._rule(alt, f"{name}-{i}", where))
                    except _Unsatisfiable:  # this alternative allows nothing: dropped, with its rules
                        self._rules, self._refs, self._prims, self._bodies = saved
                if not names:
                    raise InvalidArgumentError(f"no alternative of {key} at {at} can be satisfied")
                return " | ".join(dict.fromkeys(names))
        if "enum" in schema or "const" in schema:
            return self._enum(schema, at)

        types = schema.get("type")
        if types is None:
            types = [t for t, kws in _TYPE_KEYWORDS.items() if kws.intersection(schema)]
            if not types:
                return self._prim("value")
        elif isinstance(types, str) or (isinstance(types, list) and types
                                        and all(isinstance(t, str) for t in types)):
            types = list(dict.fromkeys(_types(types, at)))
        else:
            raise InvalidArgumentError(f"type at {at} must be a type name or a non-empty list of them")
        for t in types:
            if t not in _TYPES:
                raise InvalidArgumentError(f"unknown type {t!r} at {at}; the JSON types are {', '.join(_TYPES)}")
        if "integer" in types and "number" in types:
            types.remove("integer")  # numbers include the integers
        if len(types) == 1:
            return self._typed(schema, types[0], name, at)
        exprs = [self._typed(schema, t, f"{name}-{t}", at) for t in types]
        return " | ".join(e if _RULE_NAME.fullmatch(e) else self._add(f"{name}-{t}", e) for e, t in zip(exprs, types))

    @staticmethod
    def _list(schema: dict, key: str, at: str) -> list:
        v = schema[key]
        if not isinstance(v, list) or not v:
            raise InvalidArgumentError(f"{key} at {at} must be a non-empty list of schemas")
        return v

    def _typed(self, schema: dict, t: str, name: str, at: str) -> str:
        if t in ("null", "boolean"):
            return self._prim(t)
        if t in ("integer", "number"):
            return self._numeric(schema, t, at)
        return {"string": self._string, "array": self._array, "object": self._object}[t](schema, name, at)

    def _enum(self, schema: dict, at: str) -> str:
        values = schema.get("enum")
        if values is not None and not isinstance(values, list):
            raise InvalidArgumentError(f"enum at {at} must be a list of values")
        if "const" in schema:
            values = [schema["const"]] if values is None else [v for v in values if _same(v, schema["const"])]
        if "type" in schema:
            types = _types(schema["type"], at)
            values = [v for v in values if _json_type(v) in types
                      or (_json_type(v) == "integer" and "number" in types)]
        other = sorted(k for k in schema if k in _VALIDATION and k not in ("enum", "const", "type"))
        if other:
            raise InvalidArgumentError(f"json schema keyword {other[0]!r} together with enum / const is not "
                                       f"supported (at {at})")
        if not values:
            raise InvalidArgumentError(f"no value satisfies enum / const (and type) at {at}")
        try:
            return " | ".join(dict.fromkeys(self._const(v) for v in values))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"enum / const at {at} holds a value that is not JSON: {e}") from None

    def _const(self, v) -> str:
        """The JSON value v, with the whitespace the other rules allow within it."""
        space = self._prim("space")
        sep = f' "," {space} '
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise TypeError("object keys must be strings")
            items = [f'{_lit(json.dumps(k, ensure_ascii=False))} {space} ":" {space} {self._const(x)} {space}'
                     for k, x in v.items()]
            return _seq('"{"', space, sep.join(items), '"}"')
        if isinstance(v, (list, tuple)):
            return _seq('"["', space, sep.join(f"{self._const(x)} {space}" for x in v), '"]"')
        return _lit(json.dumps(v, ensure_ascii=False, allow_nan=False))

    def _numeric(self, schema: dict, t: str, at: str) -> str:
        lo, lo_excl = self._bound(schema, "minimum", at)
        hi, hi_excl = self._bound(schema, "maximum", at)
        if lo is None and hi is None:
            return self._prim(t)
        if t == "integer":
            lo_i = None if lo is None else math.floor(lo) + 1 if lo_excl else math.ceil(lo)
            hi_i = None if hi is None else math.ceil(hi) - 1 if hi_excl else math.floor(hi)
            if lo_i is not None and hi_i is not None and lo_i > hi_i:
                raise InvalidArgumentError(f"no integer lies within minimum {lo} and maximum {hi} at {at}")
            return _int_range(lo_i, hi_i)
        if lo_excl or hi_excl or any(b is not None and b != int(b) for b in (lo, hi)):
            raise InvalidArgumentError(f"the bounds of a number at {at} are not supported: only inclusive "
                                       f"integer minimum / maximum (use type integer, or round the bounds)")
        lo, hi = (None if b is None else int(b) for b in (lo, hi))
        if lo is not None and hi is not None and lo > hi:
            raise InvalidArgumentError(f"minimum {lo} is above maximum {hi} at {at}")
        alts = []
        if lo is None or lo < 0:  # -x, x from max(-hi, 0) to -lo
            alts.append(f'"-" {_magnitude(0 if hi is None or hi >= 0 else -hi, None if lo is None else -lo)}')
        if hi is None or hi >= 0:
            alts.append(_magnitude(max(lo or 0, 0), hi))
        return " | ".join(alts)

    @staticmethod
    def _bound(schema: dict, key: str, at: str):
        """(bound, exclusive) from minimum/exclusiveMinimum (or maximum...): the tighter one."""
        excl_key = "exclusive" + key[0].upper() + key[1:]
        value, excl = schema.get(key), schema.get(excl_key)
        for k, v in ((key, value), (excl_key, excl)):
            if v is not None and not is_number(v) and not (k == excl_key and isinstance(v, bool)):
                raise InvalidArgumentError(f"{k} at {at} must be a number, not {v!r}")
        if isinstance(excl, bool):  # draft 4: a flag on minimum / maximum
            return value, excl and value is not None
        if excl is None:
            return value, False
        if value is None:
            return excl, True
        tighter = excl >= value if key == "minimum" else excl <= value
        return (excl, True) if tighter else (value, False)

    @staticmethod
    def _count(schema: dict, key: str, at: str) -> int | None:
        v = schema.get(key)
        if v is None:
            return None
        if not is_number(v) or v < 0 or v != int(v):
            raise InvalidArgumentError(f"{key} at {at} must be a non-negative integer, not {v!r}")
        if v > _MAX_COUNT and key.startswith("min"):
            raise InvalidArgumentError(f"{key} {v} at {at} is above the {_MAX_COUNT} supported")
        return min(int(v), _MAX_COUNT)

    def _string(self, schema: dict, name: str, at: str) -> str:
        lo, hi = self._count(schema, "minLength", at) or 0, self._count(schema, "maxLength", at)
        fmt, pattern = schema.get("format"), schema.get("pattern")
        quote = _lit('"')
        if fmt is not None and (pattern is not None or lo > 0 or hi is not None):
            raise InvalidArgumentError(f"json schema keyword format together with pattern or minLength / "
                                       f"maxLength is not supported (at {at}): use one of them")
        if hi is not None and lo > hi:
            raise InvalidArgumentError(f"minLength {lo} is above maxLength {hi} at {at}")
        if fmt is not None:
            if fmt not in _FORMATS:
                raise InvalidArgumentError(f"string format {fmt!r} at {at} is not supported (only "
                                           f"{', '.join(_FORMATS)}); describe it with a pattern instead")
            return f"{quote} {self._prim(fmt)} {quote}"
        if pattern is not None:
            if not isinstance(pattern, str):
                raise InvalidArgumentError(f"pattern at {at} must be a string")
            lengths = (lo, hi) if lo > 0 or hi is not None else None
            return f"{quote} {_Pattern(self, pattern, name, at).convert(lengths)} {quote}"
        if (lo, hi) == (0, None):
            return self._prim("string")
        return f"{quote} {_repeat(self._prim('char'), lo, hi)} {quote}"

    def _array(self, schema: dict, name: str, at: str) -> str:
        items, prefix = schema.get("items"), schema.get("prefixItems", [])
        if isinstance(items, list):  # draft 2019 and before: items as the prefix
            prefix, items = items, schema.get("additionalItems")
        if not isinstance(prefix, list):
            raise InvalidArgumentError(f"prefixItems at {at} must be a list of schemas")
        lo, hi = self._count(schema, "minItems", at) or 0, self._count(schema, "maxItems", at)
        if hi is not None and lo > hi:
            raise InvalidArgumentError(f"minItems {lo} is above maxItems {hi} at {at}")
        n = len(prefix) if hi is None else min(len(prefix), hi)  # the prefix, always whole
        elems = [self._rule(p, f"{name}-{i}", f"{at}/prefixItems/{i}") for i, p in enumerate(prefix[:n])]
        need, more = max(lo - n, 0), None if hi is None else hi - n  # items after the prefix
        if items is False and need:
            raise InvalidArgumentError(f"minItems {lo} at {at} asks for more items than prefixItems allows")
        if items is False or (items is None and prefix):
            more = need  # no more than minItems asks for
        sep, space = f'"," {self._prim("space")}', self._prim("space")
        if more != 0:
            item = self._rule(True if items is None else items, self._child(name, "item"), f"{at}/items")
        # each item followed by the space allowed before ',' or ']'
        if elems:
            inner = _seq(f" {sep} ".join(f"{e} {space}" for e in elems),
                         _repeat(f"( {sep} {item} {space} )", need, more) if more != 0 else "")
        elif more == 0:
            inner = ""
        else:
            inner = _seq(item, space, _repeat(f"( {sep} {item} {space} )", max(need - 1, 0),
                                              None if more is None else more - 1))
            inner = inner if need else f"( {inner} )?"
        return _seq('"["', space, inner, '"]"')

    def _object(self, schema: dict, name: str, at: str) -> str:
        props, required = schema.get("properties", {}), schema.get("required", [])
        if not isinstance(props, dict):
            raise InvalidArgumentError(f"properties at {at} must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise InvalidArgumentError(f"required at {at} must be a list of property names")
        extra = schema.get("additionalProperties", schema.get("unevaluatedProperties"))
        if isinstance(schema.get("unevaluatedProperties"), dict):
            raise InvalidArgumentError(f"json schema keyword 'unevaluatedProperties' with a schema is not "
                                       f"supported (at {at})")
        keys = [k for k in props if props[k] is not False or k in required]  # false: the key can't appear
        keys += [k for k in dict.fromkeys(required) if k not in props]
        undeclared = True if extra is None else extra  # the schema of a required, undeclared property
        if undeclared is False and any(k not in props for k in keys):
            raise _Unsatisfiable(f"the object at {at} requires a property it does not declare, and allows no "
                                 f"other: declare it under properties")
        if extra is None:
            extra = not keys  # only the declared properties, or any when none are
        if extra is True and not keys:
            return self._prim("object")
        keys.sort(key=lambda k: (k not in required, self._order.get(k, len(self._order))))  # stable
        space = self._prim("space")
        kv = {}
        for k in keys:
            child = self._child(name, k)
            value = self._rule(props.get(k, undeclared), child, f"{at}/properties/{_pointer(k)}")
            kv[k] = self._add(f"{child}-kv",  # with the space allowed before ',' or '}'
                              f'{_lit(json.dumps(k, ensure_ascii=False))} {space} ":" {space} {value} {space}')
        req, opt = [kv[k] for k in keys if k in required], [kv[k] for k in keys if k not in required]
        extra_kv = None
        if extra is not False:
            child = self._child(name, "additional")
            value = self._rule(extra, child, f"{at}/additionalProperties")
            key = self._key_except(list(dict.fromkeys([*props, *keys])), child)  # false properties too
            extra_kv = self._add(f"{child}-kv", f'{key} {space} ":" {space} {value} {space}')
        sep = f'"," {space}'

        def tail(i: int) -> list:  # the optional properties from the i-th on, then the extra ones
            return [f"( {sep} {o} )?" for o in opt[i:]] + ([f"( {sep} {extra_kv} )*"] if extra_kv else [])

        if req:
            inner = _seq(f" {sep} ".join(req), *tail(0))
        else:  # the first property present has no comma before it
            alts = [_seq(o, *tail(i + 1)) for i, o in enumerate(opt)]
            alts += [f"{extra_kv} ( {sep} {extra_kv} )*"] if extra_kv else []
            inner = f"( {' | '.join(alts)} )?" if alts else ""
        return _seq(_lit("{"), space, inner, _lit("}"))

    def _key_except(self, keys: list, name: str) -> str:
        """A JSON string that decodes to none of ``keys``."""
        if not keys:
            return self._prim("string")
        # A trie of the keys' encodings, one unit per character; key-char's
        # encodings are unique, so a key that differs from every trie path is
        # no declared key.  (Keys with other controls can't be written at all.)
        trie: dict = {}
        for k in keys:
            units = [json.dumps(c, ensure_ascii=False)[1:-1] for c in k]
            if not any(u.startswith("\\u") for u in units):
                node = trie
                for u in units:
                    node = node.setdefault(u, {})
                node[""] = {}  # a key ends here
        key_char, quote = self._prim("key-char"), _lit('"')

        def rest(node: dict) -> str:
            alts = [] if "" in node else [quote]
            alts += [f"{_lit(u)} {rest(child)}" for u, child in node.items() if u]
            raw = [(ord(u), ord(u)) for u in node if len(u) == 1]
            other = [_cls(_subtract([(0, _MAX_CP)], _NOT_RAW + [(0x7F, 0x7F)] + raw))]
            escapes = [ord(c) for c in '"\\bfnrt' if "\\" + c not in node]
            other += [f'"\\\\" {_cls((c, c) for c in escapes)}'] if escapes else []
            alts.append(f"{_alt(other)} {key_char}* {quote}")
            return _alt(alts)

        return self._add(f"{name}-key", f"{quote} {rest(trie)}")


# -- pattern ---------------------------------------------------------------------

_START, _END = object(), object()  # the anchors ^ and $
# what '.' leaves out in ECMA-262 (Python's re leaves out only \n)
_LINE_TERMINATORS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")


class _Pattern:
    """A regular expression → GBNF for the JSON encoding of the strings it matches."""

    def __init__(self, conv: _Converter, text: str, name: str, at: str) -> None:
        self.conv, self.text, self.name, self.at, self.i = conv, text, name, at, 0
        self.runs: dict = {}  # item -> (one-character item, lo, hi): the runs, for minLength / maxLength

    def fail(self, what: str):
        raise InvalidArgumentError(f"pattern {self.text!r} at {self.at}: {what}")

    def unsupported(self, what: str):
        self.fail(f"{what} is not supported")

    def peek(self, n: int = 1) -> str:
        return self.text[self.i:self.i + n]

    def convert(self, lengths=None) -> str:
        """The GBNF; with ``lengths`` (minLength, maxLength), for a pattern
        ^X$ where X is one character (class) repeated."""
        branches = self.alternation(top=True)
        if self.i < len(self.text):
            self.fail(f"unbalanced ')' at position {self.i}")
        if lengths is not None:
            items = branches[0]
            if len(branches) > 1 or len(items) != 3 or items[0] is not _START or items[2] is not _END \
                    or items[1] not in self.runs:
                self.unsupported("minLength / maxLength with a pattern other than ^X$, ^X*$, ^X+$ or "
                                 "^X{m,n}$ for one character or class X")
            item, lo, hi = self.runs[items[1]]
            lo, hi = max(lo, lengths[0]), min(x for x in (hi, lengths[1], math.inf) if x is not None)
            if lo > hi:
                self.fail(f"no string matches it with minLength {lengths[0]} and maxLength {lengths[1]}")
            return _repeat(item, lo, None if hi == math.inf else hi)
        anything = f"{self.conv._prim('char')}*"  # JSON Schema patterns are not anchored
        out = []
        for items in branches:
            start, end = items[:1] == [_START], items[-1:] == [_END]
            items = items[1 if start else 0:len(items) - 1 if end else len(items)]
            if _START in items or _END in items:
                self.unsupported("an anchor ^ or $ inside the pattern (only at its start and end)")
            out.append(_seq("" if start else anything, *items, "" if end else anything) if items else anything)
        return _alt(out)

    def alternation(self, top: bool) -> list:
        branches = [self.sequence(top)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence(top))
        return branches

    def sequence(self, top: bool) -> list:
        items: list = []
        chars: list = []  # literal characters, joined into one literal

        def flush() -> None:
            if chars:
                items.append(_json_lit("".join(chars)))
                if len(chars) == 1:
                    self.runs[items[-1]] = (items[-1], 1, 1)
                chars.clear()

        while self.i < len(self.text) and self.peek() not in "|)":
            value, kind = self.atom(top)
            quant = self.quantifier()
            if kind == "anchor":
                if quant:
                    self.fail("a quantifier after an anchor")
                flush()
                items.append(value)
            elif kind == "char" and quant is None:
                chars.append(value)
            else:
                flush()
                one = _json_lit(value) if kind == "char" else value
                if kind == "group" and quant is not None:  # a rule: llama.cpp limits what a repeated group holds
                    one = self.conv._add(f"{self.name}-group", one[2:-2])
                item = one if quant is None else _repeat(one, *quant)
                if kind != "group":
                    self.runs[item] = (one, *(quant or (1, 1)))
                items.append(item)
        flush()
        return items

    def atom(self, top: bool):
        c = self.text[self.i]
        self.i += 1
        if c == "(":
            if self.peek(2) == "?:":
                self.i += 2
            elif self.peek(2) == "?<" and self.peek(3)[2:] not in ("=", "!"):
                end = self.text.find(">", self.i)
                if end < 0:
                    self.fail("a group name without '>'")
                self.i = end + 1
            elif self.peek() == "?":
                self.unsupported(f"the group '({self.peek(3)}' (lookaround or flags)")
            branches = self.alternation(top=False)
            if self.peek() != ")":
                self.fail("a '(' without ')'")
            self.i += 1
            return "( " + " | ".join(_seq(*b) for b in branches) + " )", "group"
        if c == "[":
            return self.charset(self.char_class()), "set"
        if c == ".":
            return self.charset(_complement(_LINE_TERMINATORS)), "set"
        if c == "\\":
            kind, value = self.escape(in_class=False)
            return (self.charset(value[0]), "set") if kind == "set" else (value, "char")
        if c in "^$":
            if not top:
                self.unsupported("an anchor ^ or $ inside a group")
            return (_START if c == "^" else _END), "anchor"
        if c in "*+?":
            self.fail(f"'{c}' with nothing to repeat")
        if c == "{":
            self.unsupported("a '{' that is not a quantifier (escape it as \\{)")
        return c, "char"

    def charset(self, ranges) -> str:
        item = _json_charset(ranges)
        if item is None:
            self.fail("a character class that matches no character a JSON string can hold")
        return item

    def quantifier(self):
        c = self.peek()
        if c in ("*", "+", "?") and c:
            self.i += 1
            quant = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            m = _QUANTIFIER.match(self.text, self.i)
            if not m:
                self.unsupported("a '{' that is not a quantifier {m}, {m,} or {m,n} (escape it as \\{)")
            self.i = m.end()
            lo = int(m[1])
            hi = lo if m[2] is None else int(m[3]) if m[3] else None
            if hi is not None and hi < lo:
                self.fail(f"the quantifier {m[0]} has its bounds out of order")
            if lo > _MAX_COUNT:
                self.unsupported(f"the quantifier {m[0]} (above {_MAX_COUNT} repetitions)")
            quant = (lo, hi if hi is None else min(hi, _MAX_COUNT))
        else:
            return None
        if self.peek() == "?":
            self.i += 1  # lazy: matches the same strings
        if self.peek() and self.peek() in "*+?{":
            self.unsupported("a quantifier after a quantifier")
        return quant

    def escape(self, in_class: bool):
        """("char", c) or ("set", (fewest, most) code point ranges)."""
        if self.i >= len(self.text):
            self.fail("a '\\' at the end")
        c = self.text[self.i]
        self.i += 1
        if c in "dDwWsS":
            return "set", _shorthand(c)
        if c == "b" and in_class:
            return "char", "\b"
        simple = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}
        if c in simple:
            return "char", simple[c]
        if c == "0" and not self.peek().isdigit():
            return "char", "\0"
        if c in "xu":
            m = re.compile(r"[0-9a-fA-F]{2}" if c == "x" else r"[0-9a-fA-F]{4}|\{[0-9a-fA-F]{1,6}\}").match(
                self.text, self.i)
            if not m:
                self.fail(f"a malformed \\{c} escape")
            self.i = m.end()
            cp = int(m[0].strip("{}"), 16)
            if 0xD800 <= cp <= 0xDFFF or cp > _MAX_CP:
                self.unsupported(f"the escape \\{c}{m[0]} (a surrogate or no code point)")
            return "char", chr(cp)
        what = {"b": "the word boundary \\b", "B": "the non-boundary \\B", "k": "a backreference \\k",
                "p": "a Unicode property escape \\p", "P": "a Unicode property escape \\P",
                "c": "a control escape \\c"}.get(c)
        if what or c.isdigit():
            self.unsupported(what or f"a backreference or octal escape \\{c}")
        if c.isalnum() or c == "_":
            self.unsupported(f"the escape \\{c}")
        return "char", c

    def char_class(self):
        negate = self.peek() == "^"
        self.i += negate
        if self.peek() == "]":
            self.unsupported("an empty class or a ']' first in a class (escape it as \\])")
        few: list = []
        most: list = []
        while True:
            if self.i >= len(self.text):
                self.fail("a '[' without ']'")
            if self.peek() == "]":
                self.i += 1
                break
            kind, value = self.class_atom()
            if kind == "char" and self.peek() == "-" and self.peek(2)[1:] not in ("]", ""):
                self.i += 1
                kind2, end = self.class_atom()
                if kind2 != "char":
                    self.unsupported("a range ending in a class escape")
                if ord(end) < ord(value):
                    self.fail(f"the range {value}-{end} is out of order")
                value, kind = (ord(value), ord(end)), "range"
            if kind == "set":
                few += value[0]
                most += value[1]
            else:
                r = value if kind == "range" else (ord(value), ord(value))
                few.append(r)
                most.append(r)
        # a negated class leaves out the most its members may match
        return _complement(most) if negate else _normalize(few)

    def class_atom(self):
        c = self.text[self.i]
        self.i += 1
        return self.escape(in_class=True) if c == "\\" else ("char", c)


JSON_GBNF = json_schema_to_gbnf({})
"""GBNF for any JSON value."""
JSON_OBJECT_GBNF = json_schema_to_gbnf({"type": "object"})
"""GBNF for any JSON object (``response_format={"type": "json_object"}``)."""
