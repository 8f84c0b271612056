"""The jinja2 sandbox chat templates render in, bounded in time and memory.

jinja2's ``ImmutableSandboxedEnvironment`` stops a template reaching Python's
internals (CVE-2024-34359's payload); it does not stop one from allocating:
``'a'|center(10**9)``, ``'%09999999d' % 1``, ``'{:>999999999}'.format(1)``,
``s ~ s`` doubled in a loop, ``range(100000)|join(big)``.  Here every place
where a template's value can grow (each operator jinja2 lets a sandbox
intercept, ``~``, every builtin filter, every method of str/list/dict/int a
template can reach, str.format and ``%``, each ``{{ }}``, the bodies of
``{% set %}`` blocks and macros) works out the size of its result before it
is built and refuses one past these limits, with a :class:`ChatTemplateError`
naming the limit:

- ``MAX_OUTPUT_CHARS``: the rendered prompt, and any one string;
- ``MAX_ITEMS``: any one list, tuple or dict a template builds;
- ``MAX_INT_BITS``: any one integer;
- ``MAX_RENDER_WORK``: everything one render builds, added up (so many large
  values kept alive in a namespace are bounded too);
- ``MAX_RENDER_SECONDS``: checked at each lookup, call, operator, filter and
  loop iteration.

Each render has its own budget (a context variable): renders running at once
in different threads never share or reset each other's deadline.
"""
from __future__ import annotations

import contextvars
import datetime
import functools
import inspect
import itertools
import json
import json.encoder as _json_encoder
import re
import sys
import time
import types

from llamax._errors import LlamaxError

MAX_OUTPUT_CHARS = 4 * 1024 * 1024   # a rendered prompt, or any one string a template builds
MAX_ITEMS = 1 << 17                  # any one list, tuple or dict a template builds (jinja2's range: 100,000)
MAX_INT_BITS = 1 << 16               # any one integer a template computes (str() stops at 4,300 digits anyway)
MAX_RENDER_WORK = 16 * MAX_OUTPUT_CHARS  # all the strings (characters) and lists (8 per item) one render builds
MAX_RENDER_SECONDS = 2.0
_MAX_DEPTH = 500                     # nesting of a value whose text is measured (repr stops near 1,000)
_CHUNK = 1 << 16                     # strings measured piecewise: at most this much scratch text at once


class ChatTemplateError(LlamaxError, ValueError):
    """A chat template failed to render (syntax, raise_exception, sandbox, limits)."""

    __module__ = "llamax.templates"  # where callers import it from


# -- the budget of one render ----------------------------------------------------------------------
#
# A template can't allocate more than it is allowed to before a check sees
# it: every place where a template's value grows (operators, `~`, filters,
# methods of str/list/dict/int, str.format and %, output, {% set %} blocks and
# macro bodies) is given the size of its result before it is built, and
# refuses one larger than the limits above; every place where a template
# spends time (attribute and item lookups, calls, operators, filters, each
# iteration of a for loop) checks the deadline.  What a render has built is
# counted against MAX_RENDER_WORK, so keeping many large values alive (in a
# namespace or a list) is bounded too.

class _Budget:
    """One render's deadline and the size of what it has built and may still
    hold: values are counted when built, and large ones given back when they
    are seen to die (a namespace attribute overwritten, an operator's
    temporary operand), so the usual ``{% set ns.out = ns.out ~ piece %}``
    costs its growth, not its whole length, each time."""

    __slots__ = ("deadline", "work", "held")

    def __init__(self):
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.work = 0
        self.held: dict[int, int] = {}  # id -> size of each large value counted (only these are given back)

    def check(self):
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template took longer than {MAX_RENDER_SECONDS} s to render "
                                    "(MAX_RENDER_SECONDS)")

    def charge(self, n: int, value=None):
        self.work += n
        if self.work > MAX_RENDER_WORK:
            raise ChatTemplateError(f"chat template builds more than MAX_RENDER_WORK = {MAX_RENDER_WORK} "
                                    "characters of values in one render")
        if value is not None and n >= _HELD_MIN:
            self.held[id(value)] = self.held.get(id(value), 0) + n

    def release(self, value):
        """``value`` is about to be freed: what it was counted for comes back
        (never more than was counted, so nothing can be given back twice)."""
        self.work -= self.held.pop(id(value), 0)


_HELD_MIN = 4096  # values counted this large can be given back (at most MAX_RENDER_WORK / 4096 of them)


class _Probe:
    def call_binop(self, context, operator, left, right):  # the shape of the sandbox's hook
        return sys.getrefcount(left)

    def setitem(self, attrs, name):  # the shape of _Namespace.__setitem__
        old = attrs.get(name)
        return sys.getrefcount(old)


# sys.getrefcount of a value that only an operator's argument refers to (a
# temporary, freed when the operator returns), and of one only a namespace's
# dict refers to: measured here, as they differ between Python versions.
_TEMP_REFS = _Probe().call_binop(None, "+", "".join(["x", "y"]), None)
_STORED_REFS = _Probe().setitem({"k": "".join(["x", "y"])}, "k")


# Each render has its own budget: a context variable, so renders running at
# once in different threads never see (or reset) each other's deadline.
_BUDGET: contextvars.ContextVar = contextvars.ContextVar("llamax_chat_template_budget", default=None)


class _NotWhileCompiling(Exception):
    """jinja2 folds constant expressions while it compiles a template, each
    into a constant of the compiled code: nothing would bound their sum.
    Every hook raises this outside a render, and jinja2 leaves the
    expression to run at render time, under that render's budget."""


def _budget() -> _Budget:
    b = _BUDGET.get()
    if b is None:
        raise _NotWhileCompiling
    return b


def _too_long(n: int, what: str = "a string"):
    if n > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(f"chat template builds {what} larger than its output limit "
                                f"(MAX_OUTPUT_CHARS = {MAX_OUTPUT_CHARS} characters)")


def _too_many(n: int):
    if n > MAX_ITEMS:
        raise ChatTemplateError(f"chat template builds a list larger than MAX_ITEMS = {MAX_ITEMS} items")


def _int_bits(n: int):
    if n > MAX_INT_BITS:
        raise ChatTemplateError(f"chat template computes an integer larger than MAX_INT_BITS = {MAX_INT_BITS} bits")


def _charge(b: _Budget, out, *inputs, deep: bool = False):
    """Count a value the template just built (not one it passed through):
    a string's characters, 8 per item of a list, tuple or dict, and with
    ``deep`` the characters of the strings a list or tuple holds (those a
    str method such as split or partition made)."""
    for x in inputs:
        if out is x:
            return
    if isinstance(out, str):
        b.charge(len(out), out)
    elif isinstance(out, (list, tuple, dict)):
        n = 8 * len(out)
        if deep and not isinstance(out, dict):
            n += sum(len(x) for x in out if isinstance(x, str))
        b.charge(n, out)


# -- sizes of text, measured without building it ---------------------------------------------------

def _chunks(s: str):
    for i in range(0, len(s), _CHUNK):
        yield s[i:i + _CHUNK]


def _repr_str_len(s: str, ascii_only: bool) -> int:
    """An upper bound of len(repr(s)) (or ascii(s))."""
    if (s.isascii() or not ascii_only) and s.isprintable():
        return len(s) + 2 + s.count("\\") + s.count("'")
    conv = ascii if ascii_only else repr
    # escapes are per character: measured a chunk at a time (+ the quote escapes a chunk may have skipped)
    return sum(len(conv(c)) - 2 for c in _chunks(s)) + 2 + s.count("'") + s.count('"')


def _json_str_len(s: str, ensure_ascii: bool) -> int:
    """len(json.dumps(s)), exactly."""
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        return len(s) + 2
    enc = _json_encoder.encode_basestring_ascii if ensure_ascii else _json_encoder.encode_basestring
    return sum(len(enc(c)) - 2 for c in _chunks(s)) + 2


def _escaped_len(s: str) -> int:
    """len(markupsafe.escape(s)) for a str, exactly."""
    return len(s) + 4 * (s.count("&") + s.count('"') + s.count("'")) + 3 * (s.count("<") + s.count(">"))


_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_JINJA_TYPES: tuple = (type(None), type(None))  # jinja2's Undefined and Namespace, once it is imported


def _text_len(value, limit: int = MAX_OUTPUT_CHARS, mode: str = "str", *, item_sep: int = 2, key_sep: int = 2,
              indent: int | None = None) -> int:
    """An upper bound of the length of ``str(value)`` (mode "str"),
    ``repr``/``ascii`` ("repr", "ascii") or ``json.dumps`` ("json",
    "json_ascii", with its separators' lengths and indent), found by walking
    the value; raises ChatTemplateError as soon as it passes ``limit``."""
    if mode == "str" and (value is None or isinstance(value, (str, int, float))):  # the common case, quickly
        n = len(value) if isinstance(value, str) else 24 if value is None or isinstance(value, (bool, float)) \
            else value.bit_length() // 3 + 2
        if n > limit:
            _too_long(MAX_OUTPUT_CHARS + 1)
        return n
    Undefined, Namespace = _JINJA_TYPES
    json_mode = mode.startswith("json")
    total = 0
    stack = [(value, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise ChatTemplateError(f"chat template value is nested more than {_MAX_DEPTH} deep")
        if isinstance(obj, str):
            if json_mode:
                n = _json_str_len(obj, mode == "json_ascii")
            elif depth == 0 and mode == "str":
                n = len(obj)
            else:
                n = _repr_str_len(obj, mode == "ascii") + (0 if type(obj) is str else 64)  # Markup('...')
        elif obj is None or isinstance(obj, (bool, float)):
            n = 24
        elif isinstance(obj, int):
            n = obj.bit_length() // 3 + 2  # decimal digits (< bits / 3.32) and a sign
        elif isinstance(obj, (list, tuple, dict, set, frozenset) + _VIEWS):
            if isinstance(obj, dict):
                children = [x for kv in obj.items() for x in kv]
            elif isinstance(obj, type({}.items())):
                children = [x for kv in obj for x in kv]
            else:
                children = obj
            per_item = max(item_sep, 1) + (key_sep + 2 if isinstance(obj, (dict, type({}.items()))) else 0)
            if indent is not None:
                per_item += 1 + indent * (depth + 1)
            # brackets, a subclass's or a view's name, a 1-tuple's comma; then each item's separators
            n = 2 + (0 if type(obj) in (list, tuple, dict) else 64) + per_item * len(obj)
            if total + n > limit:
                total += n
                break
            stack.extend((x, depth + 1) for x in children)
        elif isinstance(obj, Namespace):
            n = 13
            stack.append((object.__getattribute__(obj, "_Namespace__attrs"), depth + 1))
        elif isinstance(obj, Undefined):
            n = 9  # "Undefined"; str() of one is ""
        elif json_mode:
            n = 0  # json.dumps refuses it (TypeError)
        else:
            n = len(str(obj) if depth == 0 and mode == "str" else repr(obj))  # loop, macro, range, ...: short
        total += n
        if total > limit:
            break
    if total > limit:
        raise ChatTemplateError(f"chat template builds a string larger than its output limit "
                                f"(MAX_OUTPUT_CHARS = {MAX_OUTPUT_CHARS} characters)")
    return total


def _cased_len(s: str, method: str) -> int:
    """An upper bound of len(getattr(s, method)()) (case mappings can
    lengthen text: "ß".upper() == "SS", "ﬃ".upper() == "FFI")."""
    if s.isascii():
        return len(s)
    if 3 * len(s) <= MAX_OUTPUT_CHARS:
        return 3 * len(s)
    if method in ("upper", "lower", "casefold"):  # per character, whatever the neighbours
        return sum(len(getattr(c, method)()) for c in _chunks(s))
    # title, capitalize, swapcase: each character becomes its upper or its lower case
    return sum(len(c.upper()) + len(c.lower()) for c in _chunks(s))


def _items(value, strings: bool = True):
    """``value`` ready to be iterated more than once: a sized collection as it
    is (at most MAX_ITEMS long), anything else (a generator) read into a list
    of at most MAX_ITEMS."""
    if isinstance(value, str):
        if strings:
            _too_many(len(value))
        return value
    try:
        n = len(value)
    except TypeError:
        out = list(itertools.islice(value, MAX_ITEMS + 1))
        _too_many(len(out))
        return out
    _too_many(n)
    return value


# -- printf-style % and str.format -----------------------------------------------------------------

def _printf_num(fmt, k, seq, argi):
    """A width or precision at fmt[k]: digits or '*' (taken from the arguments)."""
    if k < len(fmt) and fmt[k] == "*":
        v = seq[argi] if argi < len(seq) else 0
        return (abs(v) if isinstance(v, int) else 0), k + 1, argi + 1
    j = k
    while j < len(fmt) and fmt[j].isdigit():
        j += 1
    if j - k > 10:
        return MAX_OUTPUT_CHARS + 1, j, argi
    return (int(fmt[k:j]) if j > k else 0), j, argi


def _printf_len(fmt: str, args, esc: int = 1) -> int:
    """An upper bound of len(fmt % args), following the grammar of str %
    (mapping keys, flags, '*' widths, precision, length modifiers), raising
    past MAX_OUTPUT_CHARS; ``esc``: the growth of escaped arguments (Markup)."""
    if isinstance(args, tuple):
        seq, mapping = args, None
    else:
        seq, mapping = (args,), args
    total, i, argi, n = 0, 0, 0, len(fmt)
    while True:
        j = fmt.find("%", i)
        if j < 0:
            total += n - i
            break
        total += j - i
        k = j + 1
        key = None
        if k < n and fmt[k] == "(":
            depth, k = 1, k + 1
            start = k
            while k < n and depth:
                depth += {"(": 1, ")": -1}.get(fmt[k], 0)
                k += 1
            key = fmt[start:k - 1]
        while k < n and fmt[k] in "-+ #0":
            k += 1
        width, k, argi = _printf_num(fmt, k, seq, argi)
        prec = 0
        if k < n and fmt[k] == ".":
            prec, k, argi = _printf_num(fmt, k + 1, seq, argi)
        while k < n and fmt[k] in "hlL":
            k += 1
        if k >= n:
            break  # "incomplete format": Python raises
        conv = fmt[k]
        i = k + 1
        if conv == "%":
            piece = 1
        else:
            if key is not None:
                try:
                    value = mapping[key]
                except Exception:  # Python raises the same
                    value = None
            else:
                value = seq[argi] if argi < len(seq) else None
                argi += 1
            if conv in "sra":
                piece = esc * _text_len(value, mode={"s": "str", "r": "repr", "a": "ascii"}[conv])
                if prec:
                    piece = min(piece, esc * prec)
            elif conv == "c":
                piece = esc
            elif isinstance(value, int) and conv in "diouxX":
                piece = max(value.bit_length(), prec) + 4
            else:
                piece = 330 + prec  # a float: "%f" of 1e308 has 309 digits
        total += max(width, piece)
        _too_long(total)
    _too_long(total)
    return total


def _field_len(value, spec: str) -> int:
    """An upper bound of len(format(value, spec)): every number in the spec
    (width, precision) added to the value's own length: a string's, an int's
    bits (binary) with room for grouping, a float's 309 digits and grouping."""
    nums = 0
    for run in re.findall(r"\d+", spec):
        if len(run) > 10:
            return MAX_OUTPUT_CHARS + 1
        nums += int(run)
    if isinstance(value, str):
        return len(value) + nums
    if isinstance(value, int):
        return 2 * (value.bit_length() + 2) + 330 + nums  # an int formatted as "f" becomes a float
    if isinstance(value, float):
        return 660 + nums
    return _text_len(value) + nums  # anything else formats as str(value)


def _formatter_classes():
    from jinja2.sandbox import SandboxedFormatter
    from markupsafe import EscapeFormatter

    class _Formatter(SandboxedFormatter):
        """str.format in the sandbox, with every field measured before it is
        formatted (`'{:>999999999}'.format(1)` raises instead of allocating)."""

        esc = 1

        def vformat(self, format_string, args, kwargs):
            self._size = len(format_string)
            _too_long(self._size)
            return super().vformat(format_string, args, kwargs)

        def convert_field(self, value, conversion):
            if conversion in ("s", "r", "a"):  # str(), repr() or ascii() of the value, before building it
                _text_len(value, MAX_OUTPUT_CHARS - self._size, {"s": "str", "r": "repr", "a": "ascii"}[conversion])
            return super().convert_field(value, conversion)

        def format_field(self, value, format_spec):
            self._size += self.esc * _field_len(value, format_spec)
            _too_long(self._size)
            return super().format_field(value, format_spec)

    class _EscapeFormatter(_Formatter, EscapeFormatter):
        esc = 6  # each field escaped for Markup

    return _Formatter, _EscapeFormatter


# -- methods of str, list, dict, int, ... called from a template ------------------------------------
#
# Every public method of the builtin types a template can reach is listed:
# called as it is (its result is no larger than its inputs, or a number), with
# its result measured first, or refused.  A method not listed (a new Python's)
# is refused until it is reviewed (tests/api/test_chat_sandbox.py checks the
# tables against dir()).

def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _esc(owner) -> int:
    return 6 if hasattr(owner, "__html__") else 1  # Markup's methods escape their str arguments


def _m_plain(env, ctx, meth, owner, args, kwargs):
    """A method that returns a number, a bool, or what its object holds."""
    return env._call(ctx, meth, args, kwargs)


def _m_built(env, ctx, meth, owner, args, kwargs):
    """A method whose result is new but no larger than its inputs (strip,
    partition, copy): counted against the render's work."""
    return env._call(ctx, meth, args, kwargs)


def _m_refuse(env, ctx, meth, owner, args, kwargs):
    cls = owner if isinstance(owner, type) else type(owner)
    raise ChatTemplateError(f"chat templates may not call {cls.__name__}.{meth.__name__}() "
                            "(its result can't be bounded before it is built)")


def _m_cased(env, ctx, meth, owner, args, kwargs):
    _too_long(_cased_len(owner, meth.__name__))
    return env._call(ctx, meth, args, kwargs)


def _m_width(env, ctx, meth, owner, args, kwargs):  # center, ljust, rjust, zfill
    w = _arg(args, kwargs, 0, "width", 0)
    if isinstance(w, int):
        _too_long(max(len(owner), w) * (_esc(owner) if meth.__name__ != "zfill" else 1))
    return env._call(ctx, meth, args, kwargs)


def _m_expandtabs(env, ctx, meth, owner, args, kwargs):
    t = _arg(args, kwargs, 0, "tabsize", 8)
    if isinstance(t, int):
        _too_long(len(owner) + (owner.count("\t") + owner.count("\n") + 1) * max(t, 0))
    return env._call(ctx, meth, args, kwargs)


def _m_join(env, ctx, meth, owner, args, kwargs):
    if len(args) != 1 or kwargs:
        return env._call(ctx, meth, args, kwargs)  # Python says what is wrong
    items = _items(args[0], strings=False)
    if not isinstance(items, (list, tuple, str)):
        items = list(items)
    esc = _esc(owner)
    total = len(owner) * max(len(items) - 1, 0)
    for x in items:
        total += esc * (len(x) if isinstance(x, str) else _text_len(x))
        _too_long(total)
    return env._call(ctx, meth, (items,), {})


def _m_replace(env, ctx, meth, owner, args, kwargs):
    old, new = _arg(args, kwargs, 0, "old", None), _arg(args, kwargs, 1, "new", None)
    count = _arg(args, kwargs, 2, "count", -1)
    if isinstance(old, str) and isinstance(new, str) and isinstance(count, int):
        k = owner.count(old) if count < 0 else min(count, owner.count(old))
        _too_long(len(owner) + k * max(_esc(owner) * len(new) - len(old), 0))
    return env._call(ctx, meth, args, kwargs)


def _m_split(env, ctx, meth, owner, args, kwargs):
    """split/rsplit: at most MAX_ITEMS parts, without building more."""
    sep = _arg(args, kwargs, 0, "sep", None)
    maxsplit = _arg(args, kwargs, 1, "maxsplit", -1)
    if len(args) > 2 or set(kwargs) - {"sep", "maxsplit"} or not isinstance(maxsplit, int):
        return env._call(ctx, meth, args, kwargs)
    cap = MAX_ITEMS if maxsplit < 0 else min(maxsplit, MAX_ITEMS)
    out = env._call(ctx, meth, (sep, cap), {})
    if len(out) > MAX_ITEMS:
        _too_many(len(out))
    return out


def _m_splitlines(env, ctx, meth, owner, args, kwargs):
    _too_many(sum(owner.count(c) for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029") + 1)
    return env._call(ctx, meth, args, kwargs)


def _m_translate(env, ctx, meth, owner, args, kwargs):
    table = _arg(args, kwargs, 0, "table", None)
    if isinstance(table, dict):
        values = table.values()
    elif isinstance(table, (list, tuple)):
        values = table
    else:
        raise ChatTemplateError("chat templates may call str.translate() with a dict or a list only")
    longest = max((len(v) for v in values if isinstance(v, str)), default=1)
    _too_long(len(owner) * max(longest, 1))
    return env._call(ctx, meth, args, kwargs)


def _m_format(env, ctx, meth, owner, args, kwargs):  # str.format reached without getattr (|attr)
    return env.wrap_str_format(meth)(*args, **kwargs)


def _m_escape(env, ctx, meth, owner, args, kwargs):  # Markup.escape(s)
    if len(args) == 1:
        s = args[0]
        _too_long(_escaped_len(s) if isinstance(s, str) else 5 * _text_len(s))
    return env._call(ctx, meth, args, kwargs)


def _m_fromkeys(env, ctx, meth, owner, args, kwargs):
    if args:
        args = (_items(args[0]),) + tuple(args[1:])
    return env._call(ctx, meth, args, kwargs)


_P, _B, _R = _m_plain, _m_built, _m_refuse
_STR_METHODS = dict.fromkeys(
    "count endswith find index isalnum isalpha isascii isdecimal isdigit isidentifier islower isnumeric "
    "isprintable isspace istitle isupper rfind rindex startswith".split(), _P)
_STR_METHODS.update(dict.fromkeys(
    "lstrip rstrip strip removeprefix removesuffix partition rpartition maketrans striptags unescape".split(), _B))
_STR_METHODS.update(dict.fromkeys("capitalize casefold lower swapcase title upper".split(), _m_cased))
_STR_METHODS.update(dict.fromkeys("center ljust rjust zfill".split(), _m_width))
_STR_METHODS.update(expandtabs=_m_expandtabs, join=_m_join, replace=_m_replace, split=_m_split, rsplit=_m_split,
                    splitlines=_m_splitlines, translate=_m_translate, format=_m_format, format_map=_m_format,
                    escape=_m_escape, encode=_R)
_METHODS = {
    str: _STR_METHODS,
    list: dict(copy=_B, count=_P, index=_P, append=_R, clear=_R, extend=_R, insert=_R, pop=_R, remove=_R,
               reverse=_R, sort=_R),
    tuple: dict(count=_P, index=_P),
    dict: dict(copy=_B, get=_P, items=_P, keys=_P, values=_P, fromkeys=_m_fromkeys, clear=_R, pop=_R, popitem=_R,
               setdefault=_R, update=_R),
    int: dict(as_integer_ratio=_P, bit_count=_P, bit_length=_P, conjugate=_P, is_integer=_P, to_bytes=_R,
              from_bytes=_R),
    float: dict(as_integer_ratio=_P, conjugate=_P, hex=_P, fromhex=_P, is_integer=_P),
    range: dict(count=_P, index=_P),
    # reachable only in odd ways (dict views, `-` of two key views, .encode is refused): nothing allowed
    bytes: {}, bytearray: {}, set: dict(copy=_B, isdisjoint=_P, issubset=_P, issuperset=_P),
    frozenset: dict(copy=_B, isdisjoint=_P, issubset=_P, issuperset=_P), complex: dict(conjugate=_P),
    **{v: dict(isdisjoint=_P) for v in _VIEWS},
}


def _method_rules(cls):
    for base in cls.__mro__:
        rules = _METHODS.get(base)
        if rules is not None:
            return rules
    return None


# -- filters ---------------------------------------------------------------------------------------
#
# Each of jinja2's builtin filters, with what must be measured before it runs
# (None: its result is a number, an element of its input, a lazy iterator, or
# text no longer than its input's).  A filter not listed (a new jinja2's) is
# not available until it is reviewed.

def _f_str(a, name):
    v = a[name]
    if not isinstance(v, str):
        _text_len(v)  # str() of a list of big strings is bigger than any of them


def _f_value_str(a):
    _f_str(a, "value")


def _f_s_str(a):
    _f_str(a, "s")


def _f_cased(method):
    def check(a):
        s = a["s"]
        _too_long(_cased_len(s, method) if isinstance(s, str) else 3 * _text_len(s))
    return check


def _f_center(a):
    _f_value_str(a)
    if isinstance(a["width"], int):
        _too_long(max(_text_len(a["value"]), a["width"]))


def _f_escape(a):
    s = a["s"] if "s" in a else a["value"]
    _too_long(_escaped_len(s) if isinstance(s, str) else 5 * _text_len(s))


def _f_format(a):
    _f_value_str(a)
    args, kwargs = a["args"], a["kwargs"]
    _printf_len(str(a["value"]), kwargs or args)


def _f_indent(a):
    s, width = a["s"], a["width"]
    n = _text_len(s)
    w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    lines = (sum(s.count(c) for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029") if isinstance(s, str) else n) + 2
    _too_long(n + lines * (max(w, 0) + 1))


def _f_join(a):
    eval_ctx, d, attribute = a["eval_ctx"], a["d"], a["attribute"]
    esc = 5 if eval_ctx.autoescape else 1
    if isinstance(a["value"], str) and attribute is None:  # its characters, joined
        n = len(a["value"])
        _too_long(esc * (n + _text_len(d) * max(n - 1, 0)))
        return
    items = a["value"] = list(_items(a["value"], strings=False))
    if attribute is not None:
        from jinja2.filters import make_attrgetter
        get = make_attrgetter(eval_ctx.environment, attribute)
        measured = [get(x) for x in items]
    else:
        measured = items
    total = esc * _text_len(d) * max(len(items) - 1, 0)
    for x in measured:
        total += esc * _text_len(x)
        _too_long(total)


def _f_materialize(name):
    def check(a):
        a[name] = _items(a[name])
    return check


def _f_replace(a):
    s, old, new, count = a["s"], a["old"], a["new"], a["count"]
    esc = 5 if a["eval_ctx"].autoescape else 1
    n = esc * _text_len(s)
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        k = s.count(old) if count is None else min(max(count, 0), s.count(old))
        _too_long(n + k * max(esc * len(new) - len(old), 0))
    else:
        _too_long(n + (n + 1) * esc * _text_len(new))


def _f_reverse(a):
    if not isinstance(a["value"], str):
        a["value"] = _items(a["value"])


def _f_batch(a):
    a["value"] = _items(a["value"])
    if a["fill_with"] is not None and isinstance(a["linecount"], int):
        _too_many(len(a["value"]) + a["linecount"])


def _f_slice(a):
    a["value"] = _items(a["value"])
    if isinstance(a["slices"], int):
        _too_many(len(a["value"]) + a["slices"])


def _f_sum(a):
    items = a["iterable"] = _items(a["iterable"])
    start = a["start"]
    if a["attribute"] is not None:
        from jinja2.filters import make_attrgetter
        get = make_attrgetter(a["environment"], a["attribute"])
        parts = [get(x) for x in items]
    else:
        parts = list(items)
    if isinstance(start, (list, tuple)) or any(isinstance(x, (list, tuple)) for x in parts):
        total = len(start) if isinstance(start, (list, tuple)) else 0
        copied = 0
        for x in parts:
            total += len(x) if isinstance(x, (list, tuple)) else 0
            copied += total  # sum() of lists copies the running total at each step
        _too_many(total)
        if 8 * copied > MAX_RENDER_WORK:
            raise ChatTemplateError("chat template sums lists whose copies exceed MAX_RENDER_WORK = "
                                    f"{MAX_RENDER_WORK}")


def _f_truncate(a):
    end = a["end"]
    _too_long(_text_len(a["s"]) + (len(end) if isinstance(end, str) else _text_len(end)))


def _f_urlencode(a):
    _too_long(12 * _text_len(a["value"]))  # a character: up to 4 UTF-8 bytes, each %XX


def _f_urlize(a):
    n = _text_len(a["value"])
    extra = sum(_text_len(a[k]) for k in ("target", "rel") if a[k] is not None)
    _too_long(6 * n + (n // 2 + 1) * (80 + extra))  # escaped text; each word a link at most


def _f_wordwrap(a):
    s, width, wrap = a["s"], a["width"], a["wrapstring"]
    n = _text_len(s)
    w = len(wrap) if isinstance(wrap, str) else len(a["environment"].newline_sequence)
    lines = n // 2 + 1 + (n // width if isinstance(width, int) and width > 0 else n)
    _too_long(n + lines * w)


def _f_xmlattr(a):
    d = a["d"]
    _too_long(5 * _text_len(d) + 8 * (len(d) if hasattr(d, "__len__") else 0))


def _f_pprint(a):
    raise ChatTemplateError("the pprint filter is not available in chat templates (its output can't be "
                            "bounded before it is built)")


_FILTER_CHECKS = {
    "abs": None, "attr": None, "count": None, "d": None, "default": None, "dictsort": None, "filesizeformat": None,
    "first": None, "float": None, "int": None, "items": None, "length": None, "map": None, "max": None,
    "min": None, "random": None, "reject": None, "rejectattr": None, "round": None, "select": None,
    "selectattr": None, "unique": None,
    "batch": _f_batch, "capitalize": _f_cased("capitalize"), "center": _f_center, "e": _f_escape,
    "escape": _f_escape, "forceescape": _f_escape, "format": _f_format, "groupby": _f_materialize("value"),
    "indent": _f_indent, "join": _f_join, "last": _f_materialize("seq"), "list": _f_materialize("value"),
    "lower": _f_cased("lower"), "pprint": _f_pprint, "replace": _f_replace, "reverse": _f_reverse,
    "safe": _f_value_str, "slice": _f_slice, "sort": _f_materialize("value"), "string": _f_s_str,
    "striptags": _f_value_str, "sum": _f_sum, "title": _f_cased("title"), "trim": _f_value_str,
    "truncate": _f_truncate, "upper": _f_cased("upper"), "urlencode": _f_urlencode, "urlize": _f_urlize,
    "wordcount": _f_s_str, "wordwrap": _f_wordwrap, "xmlattr": _f_xmlattr,
    "tojson": None,  # ours: measures its own output
}
# filters whose result is one of their arguments or an element of one (not built)
_PASSING_FILTERS = frozenset("attr d default first last max min random".split())
# jinja2's tests return booleans in time linear in their arguments: all kept.
_TESTS = frozenset("""!= < <= == > >= boolean callable defined divisibleby eq equalto escaped even false filter
    float ge greaterthan gt in integer iterable le lessthan lower lt mapping ne none number odd sameas sequence
    string test true undefined upper""".split())


_PASS_ARG_NAMES = ("context", "eval_ctx", "environment", "env")


def _bounded_filter(name, func, check):
    """``func`` with its deadline check, its size check, and what it built
    counted; jinja2's pass_context/pass_environment marks are kept."""
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    # jinja2 passes a context, eval context or environment first when the
    # filter is marked so; some of its filters are wrappers marked so whose
    # signature (the wrapped function's) doesn't name it
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None \
        and (not params or params[0].name not in _PASS_ARG_NAMES) else 0
    simple = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    names = [p.name for p in params]
    defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def arguments(args, kwargs):
        """The filter's arguments by name (None: let the filter say what is
        wrong with them), and how to pass them back."""
        rest = args[skip:]
        if simple and not kwargs and len(rest) <= len(names):  # the usual call, without inspect's cost
            a = dict(defaults)
            a.update(zip(names, rest))
            if len(a) < len(names):
                return None, None
            return a, lambda: (args[:skip] + tuple(a[n] for n in names), {})
        try:
            bound = sig.bind(*rest, **kwargs)
        except TypeError:
            return None, None
        bound.apply_defaults()
        return bound.arguments, lambda: (args[:skip] + bound.args, bound.kwargs)

    @functools.wraps(func)
    def bounded(*args, **kwargs):
        b = _budget()
        b.check()
        if check is not None:
            a, repack = arguments(args, kwargs)
            if a is not None:
                check(a)
                args, kwargs = repack()
        out = func(*args, **kwargs)
        if name not in _PASSING_FILTERS:
            _charge(b, out, *args)
        return out

    return bounded


# -- the environment -------------------------------------------------------------------------------

class _Buffer(list):
    """The output of a {% set %} block, a macro, a {% filter %} or a {% call %}
    body, collected before it is joined: bounded like the render's output."""

    __slots__ = ("size", "budget")

    def __init__(self):
        super().__init__()
        self.size = 0
        self.budget = _budget()

    def append(self, piece):
        n = len(piece) if isinstance(piece, str) else _text_len(piece)
        self.size += n
        if self.size > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters "
                                    "(MAX_OUTPUT_CHARS, in a {% set %} block or a macro)")
        self.budget.check()
        self.budget.charge(n)
        list.append(self, piece)

    def extend(self, pieces):
        for p in pieces:
            self.append(p)


def _slice(value, start, stop, step):
    """`x[a:b:c]`: jinja2 compiles a slice to plain Python subscription, past
    the sandbox's getitem; its copy is counted here."""
    b = _budget()
    b.check()
    out = value[start:stop:step]
    _charge(b, out, value)
    return out


def _loop_iter(context, value):
    """A for loop's iterable, checking the deadline at each step (a loop with
    an empty body runs no other check)."""
    b = _budget()
    for x in value:
        b.check()
        yield x


def _concat(eval_ctx, items):
    """`a ~ b ~ ...`: measured before it is joined (jinja2 compiles `~` to a
    join no sandbox hook sees)."""
    from jinja2.runtime import markup_join, str_join

    b = _budget()
    b.check()
    markup = eval_ctx.autoescape or eval_ctx.volatile
    escaping = markup and any(hasattr(x, "__html__") for x in items)
    total = 0
    for x in items:
        if escaping and not hasattr(x, "__html__"):
            total += _escaped_len(x) if isinstance(x, str) else 5 * _text_len(x)
        else:
            total += len(x) if isinstance(x, str) else _text_len(x, MAX_OUTPUT_CHARS - total)
        _too_long(total)
    out = (markup_join if markup else str_join)(items)
    b.charge(len(out), out)
    return out


def _finalize(eval_ctx, value):
    """Every {{ ... }}: a value's text is measured before str() builds it."""
    if isinstance(value, str):
        if eval_ctx.autoescape and not hasattr(value, "__html__"):
            _too_long(_escaped_len(value))
        return value
    if value is None or isinstance(value, (int, float)):
        return value  # short (an int past 4,300 digits makes str() raise)
    n = _text_len(value)
    if eval_ctx.autoescape and not hasattr(value, "__html__"):
        _too_long(5 * n)
    return value


def _bounded_range(*args):
    from jinja2.sandbox import safe_range
    _budget().check()
    return safe_range(*args)  # at most jinja2's MAX_RANGE (100,000) items; loops over it check the deadline


def _lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 (jinja2's names)
    from jinja2.utils import generate_lorem_ipsum
    if isinstance(n, int) and isinstance(max, int):
        _too_long(n * (abs(max) + 1) * 16)  # n paragraphs of at most `max` words (of at most 13 letters)
    return generate_lorem_ipsum(n, html, min, max)


def _raise_exception(message):
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt):
    if isinstance(fmt, str):
        _too_long(256 * len(fmt))  # Python's strftime grows its buffer up to 256 x the format's length
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    if separators is None:
        seps = (", ", ": ") if indent is None else (",", ": ")
    else:
        seps = separators
    ind = None if indent is None else len(indent) if isinstance(indent, str) else max(int(indent), 0)
    try:
        item_sep, key_sep = (len(seps[0]), len(seps[1]))
    except (TypeError, IndexError):
        item_sep = key_sep = 0  # json.dumps says what is wrong
    _text_len(value, mode="json_ascii" if ensure_ascii else "json", item_sep=item_sep, key_sep=key_sep,
              indent=ind)
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


_ENV_CLASS = None


def _env_class():
    """The sandbox class, made once (a class made per template would be a
    reference cycle per Llama, freed only by the garbage collector)."""
    global _ENV_CLASS, _JINJA_TYPES
    if _ENV_CLASS is not None:
        return _ENV_CLASS
    from jinja2 import nodes
    from jinja2.runtime import Undefined
    from jinja2.utils import Namespace
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    formatter, escape_formatter = _formatter_classes()

    class _Rewrite(NodeTransformer):
        """`~`, slices and for loops, rewritten into calls of our bounded filters."""

        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Filter(nodes.Tuple(node.nodes, "load", lineno=node.lineno), "llamax_concat", [], [],
                                None, None, lineno=node.lineno)

        def visit_Getitem(self, node):
            self.generic_visit(node)
            if node.ctx != "load" or not isinstance(node.arg, nodes.Slice):
                return node
            none = nodes.Const(None, lineno=node.lineno)
            parts = [none if x is None else x for x in (node.arg.start, node.arg.stop, node.arg.step)]
            return nodes.Filter(node.node, "llamax_slice", parts, [], None, None, lineno=node.lineno)

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, "llamax_loop", [], [], None, None, lineno=node.iter.lineno)
            return node

    class _CodeGen(CodeGenerator):
        def buffer(self, frame):
            # the output of a block, a macro or a call body: a bounded list (see _Buffer)
            frame.buffer = self.temporary_identifier()
            self.writeline(f"{frame.buffer} = environment.llamax_buffer()")

    class _Env(ImmutableSandboxedEnvironment):
        code_generator_class = _CodeGen
        llamax_buffer = _Buffer
        # Every operator jinja2 lets a sandbox intercept: each checks the
        # deadline and the size of what it would build.
        intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
        intercepted_unops = frozenset(["+", "-"])

        def _parse(self, source, name, filename):
            tree = _Rewrite().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        def call_binop(self, context, operator, left, right):
            b = _budget()
            b.check()
            if operator == "+":
                if isinstance(left, str) and isinstance(right, str):
                    esc = hasattr(left, "__html__") or hasattr(right, "__html__")
                    _too_long(_escaped_len(left) + _escaped_len(right) if esc else len(left) + len(right))
                elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                    _too_many(len(left) + len(right))
            elif operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(n, int) and isinstance(seq, str):
                        _too_long(len(seq) * n)
                    elif isinstance(n, int) and isinstance(seq, (list, tuple)):
                        _too_many(len(seq) * n)
                        # n references to each string: what comparing or printing the list walks
                        if n * sum(len(x) for x in seq if isinstance(x, str)) > MAX_RENDER_WORK:
                            raise ChatTemplateError("chat template repeats strings past MAX_RENDER_WORK = "
                                                    f"{MAX_RENDER_WORK} characters")
                if isinstance(left, int) and isinstance(right, int):
                    _int_bits(left.bit_length() + right.bit_length())
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                        and left.bit_length() * right > MAX_INT_BITS:
                    raise ChatTemplateError(f"chat template computes a huge power (more than MAX_INT_BITS = "
                                            f"{MAX_INT_BITS} bits)")
            elif operator == "%" and isinstance(left, str):
                _printf_len(left, right, 6 if hasattr(left, "__html__") else 1)
            out = super().call_binop(context, operator, left, right)
            _charge(b, out, left, right)
            # a temporary operand (`a + b` in `a + b + c`) is freed on return
            if sys.getrefcount(left) <= _TEMP_REFS:
                b.release(left)
            if sys.getrefcount(right) <= _TEMP_REFS:
                b.release(right)
            return out

        def call_unop(self, context, operator, arg):
            _budget().check()
            return super().call_unop(context, operator, arg)

        def getattr(self, obj, attribute):
            _budget().check()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            b = _budget()
            b.check()
            out = super().getitem(obj, argument)
            if isinstance(argument, slice):
                _charge(b, out, obj)  # a slice copies
            return out

        def wrap_str_format(self, value):
            """jinja2's sandboxed str.format / format_map, with each field measured."""
            if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) \
                    or value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
                return None
            f_self = value.__self__
            fmt = escape_formatter(self, escape=f_self.escape) if hasattr(f_self, "__html__") else formatter(self)
            is_map = value.__name__ == "format_map"
            str_type = type(f_self)

            def wrapper(*args, **kwargs):
                if is_map:
                    if kwargs:
                        raise TypeError("format_map() takes no keyword arguments")
                    if len(args) != 1:
                        raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                    args, kwargs = (), args[0]
                b = _budget()
                out = str_type(fmt.vformat(f_self, args, kwargs))
                b.charge(len(out), out)
                return out

            return functools.update_wrapper(wrapper, value)

        def _call(self, context, obj, args, kwargs):
            return ImmutableSandboxedEnvironment.call(self, context, obj, *args, **kwargs)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            b = _budget()
            b.check()
            obj = __obj
            if isinstance(obj, (types.MethodDescriptorType, types.WrapperDescriptorType)) and args \
                    and isinstance(args[0], obj.__objclass__):
                obj, args = obj.__get__(args[0]), args[1:]  # dict.update(d, ...): as d.update(...)
            if isinstance(obj, (types.BuiltinMethodType, types.MethodType)):
                owner = obj.__self__
                rules = _method_rules(owner if isinstance(owner, type) else type(owner))
                if rules is not None:
                    # jinja2 passes a loop's or block's variables along; no method of these types takes them
                    kwargs = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
                    rule = rules.get(obj.__name__, _m_refuse)
                    out = rule(__self, __context, obj, owner, args, kwargs)
                    if rule is not _m_plain:
                        _charge(b, out, owner, *args, deep=True)
                    return out
            return __self._call(__context, obj, args, kwargs)

    class _Namespace(Namespace):
        def __setitem__(self, name, value):
            attrs = object.__getattribute__(self, "_Namespace__attrs")
            old = attrs.get(name)
            if old is not None and sys.getrefcount(old) <= _STORED_REFS:
                _budget().release(old)  # only this attribute held it: it is freed now
            attrs[name] = value

    _Env.llamax_namespace = _Namespace
    _JINJA_TYPES = (Undefined, Namespace)
    _ENV_CLASS = _Env
    return _Env


def _generation_ext():
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the
    assistant's tokens for training masks): rendered as its body."""
    global _GENERATION_EXT
    if _GENERATION_EXT is None:
        from jinja2.ext import Extension

        class _Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        _GENERATION_EXT = _Generation
    return _GENERATION_EXT


_GENERATION_EXT = None


def _make_env():
    from jinja2 import pass_context, pass_eval_context

    # {% break %} / {% continue %} and {% generation %}, as transformers' environment has them
    env = _env_class()(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                       extensions=["jinja2.ext.loopcontrols", _generation_ext()],
                       finalize=pass_eval_context(_finalize))
    filters = dict(env.filters, tojson=_tojson, wordcount=_wordcount)
    # a filter not reviewed (a newer jinja2's) is left out: templates using it fail to compile
    env.filters = {name: _bounded_filter(name, f, _FILTER_CHECKS[name])
                   for name, f in filters.items() if name in _FILTER_CHECKS}
    env.filters["llamax_concat"] = pass_eval_context(_concat)
    env.filters["llamax_loop"] = pass_context(_loop_iter)
    env.filters["llamax_slice"] = _slice
    env.tests = {name: t for name, t in env.tests.items() if name in _TESTS}
    env.globals.update(range=_bounded_range, lipsum=_lipsum, raise_exception=_raise_exception,
                       strftime_now=_strftime_now, namespace=env.llamax_namespace)
    return env


_WORD_RE = re.compile(r"\w+")


def _wordcount(s):
    """jinja2's wordcount, without its list of every word."""
    from markupsafe import soft_str
    return sum(1 for _ in _WORD_RE.finditer(soft_str(s)))


def template(source: str):
    """``source`` compiled in a bounded sandbox (one environment per template:
    jinja2 environments are shared by the threads rendering it, and hold no
    render's state)."""
    env = _make_env()
    try:
        return env.from_string(source)
    except Exception as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def render(tmpl, variables: dict) -> str:
    """Render ``tmpl`` (from ``template``) under a budget of its own."""
    b = _Budget()
    token = _BUDGET.set(b)
    out: list[str] = []
    size = 0
    try:
        for piece in tmpl.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise ChatTemplateError(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters "
                                        "(MAX_OUTPUT_CHARS)")
            b.check()
            out.append(piece)
    except ChatTemplateError:
        raise
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError("chat template ran out of memory") from None
    except Exception as e:  # SecurityError, UndefinedError, TypeError, ...
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)
    return "".join(out)
