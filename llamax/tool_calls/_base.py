"""What every tool-call format shares: the results, the checks on ``tools``
and ``tool_choice``, the scan that both parsers run, and grammar assembly.

A format describes itself to one scanner, :meth:`Format._scan`: the text so
far → the segments it has decided (content text, calls) and how much text
that covers.  A decision is taken only when no continuation can change it;
``final`` says there is none (end of generation), so what is still open
(a call cut short by ``max_tokens``) is decided as content.  :meth:`parse`
scans once with ``final``; a stream scans what it has after each delta,
keeps the undecided rest, and scans that with ``final`` at the end.  The
scan restarts cleanly at every point it stops at (content boundaries and
call ends), so both ways read the same segments: the streamed content,
names and arguments join to exactly what :meth:`parse` returns.

Arguments are streamed once a call is complete (its JSON closed), as one
piece: the text of a call still open may never become a call, and the
``arguments`` string is the parsed object re-serialized, not the model's
spelling, so earlier pieces could not be promised to add up to it.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import secrets
import string
from typing import Union

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax.grammar import json_schema_to_gbnf
from llamax.tool_calls import _json

__all__ = ["ToolCall", "Parsed", "ContentDelta", "ReasoningDelta", "ToolCallDelta", "Event", "ToolChoice",
           "Format", "Stream", "check_tools", "new_call_id"]


@dataclasses.dataclass
class ToolCall:
    """One call: ``arguments`` is the JSON text of the arguments object
    (``json.dumps(obj, ensure_ascii=False)`` of what the model wrote)."""
    id: str
    name: str
    arguments: str


@dataclasses.dataclass
class Parsed:
    """A generation read as a chat message.  ``content`` is the text outside
    calls (and reasoning), stripped; None when it is empty and there are calls."""
    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None = None


@dataclasses.dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclasses.dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI's streamed call: for each ``index`` one event with ``id`` and
    ``name`` (``arguments == ""``), then events with argument text only."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Event = Union[ContentDelta, ReasoningDelta, ToolCallDelta]

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A call id shaped like OpenAI's: ``call_`` and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


# -- tools and tool_choice ---------------------------------------------------------------

# OpenAI's rule for function names; every format's parser reads names of these characters.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICE_SHAPE = ('tool_choice must be "none", "auto", "required" or {"type": "function", '
                 '"function": {"name": ...}}')


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """``mode`` is "none", "auto", "required" or "function" (then ``name``
    is the one function allowed)."""
    mode: str
    name: str | None = None


def check_tools(tools, tool_choice=None) -> tuple:
    """``(tools, choice)``: a checked deep copy of an OpenAI ``tools`` list
    (None: no tools) and ``tool_choice`` as a :class:`ToolChoice` (None:
    "auto" with tools, "none" without, as OpenAI defaults).
    InvalidArgumentError naming the field that is wrong."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidArgumentError(f"tools must be a list of tools, not {type(tools).__name__}")
    seen: dict = {}
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidArgumentError(f"{at} must be an object, not {type(tool).__name__}")
        if tool.get("type") != "function":
            raise InvalidArgumentError(f'{at}.type must be "function", not {tool.get("type")!r}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidArgumentError(f"{at}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgumentError(f"{at}.function.name must be 1 to 64 letters, digits, '_' or '-', "
                                       f"not {name!r}")
        if name in seen:
            raise InvalidArgumentError(f"{at}.function.name {name!r} is also tools[{seen[name]}]'s: "
                                       f"names must be unique")
        seen[name] = i
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise InvalidArgumentError(f"{at}.function.parameters must be a JSON object (a JSON Schema)")
        if "description" in fn and not isinstance(fn["description"], str):
            raise InvalidArgumentError(f"{at}.function.description must be a string")
    return copy.deepcopy(tools), _choice(tool_choice, seen)


def _choice(tool_choice, names: dict) -> ToolChoice:
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidArgumentError(f"{_CHOICE_SHAPE}, not {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise InvalidArgumentError('tool_choice "required" needs tools to call')
        return ToolChoice(tool_choice)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise InvalidArgumentError(_CHOICE_SHAPE)
    if fn["name"] not in names:
        raise InvalidArgumentError(f"tool_choice.function.name {fn['name']!r} is not the name of one of the "
                                   f"tools")
    return ToolChoice("function", fn["name"])


# -- reading calls -----------------------------------------------------------------------

# a segment: content text (str) or a call
@dataclasses.dataclass(frozen=True)
class FoundCall:
    name: str
    arguments: str


INCOMPLETE = "incomplete"  # a continuation may still decide it
INVALID = "invalid"  # never a call, whatever follows


def call_from(obj, keys: tuple = ("arguments",)) -> FoundCall | None:
    """The call in ``{"name": ..., <key>: {...}}`` (the first of ``keys``
    present; none: no arguments, ``{}``), or None.  Arguments written as a
    JSON string holding an object are taken too (some models quote them)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: object = {}
    for key in keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        end = _json.value_end(args, 0)
        args = _json.load(args) if end == len(args) else None
    if not isinstance(args, dict):
        return None
    return FoundCall(obj["name"], _json.dumps(args))


def json_at(text: str, i: int, final: bool, *, skip_ws: bool = True):
    """``(value, end)`` for the JSON value at ``text[i]`` (after whitespace),
    INCOMPLETE or INVALID (INVALID for what is still open when ``final``)."""
    if skip_ws:
        i = _json.ws_end(text, i)
    if i >= len(text):
        return INVALID if final else INCOMPLETE
    end = _json.value_end(text, i)
    if end == _json.INCOMPLETE:
        return INVALID if final else INCOMPLETE
    if end == _json.INVALID:
        return INVALID
    value = _json.load(text[i:end])
    return INVALID if value is None else (value, end)


def literal_at(text: str, i: int, lit: str, final: bool):
    """The end of ``lit`` at ``text[i]``, INCOMPLETE (the text ends inside
    it) or INVALID."""
    if text.startswith(lit, i):
        return i + len(lit)
    if not final and lit.startswith(text[i:]):
        return INCOMPLETE
    return INVALID


_NAME_CHARS = re.compile(r"[a-zA-Z0-9_-]*")


def name_at(text: str, i: int, final: bool, end: str):
    """``(name, index past end)`` for a function name at ``text[i]`` followed
    by the text ``end``; INCOMPLETE or INVALID."""
    m = _NAME_CHARS.match(text, i)  # always matches (maybe nothing)
    j = m.end() if m else i
    if j == len(text):
        return INVALID if final else INCOMPLETE
    if j == i:
        return INVALID
    after = literal_at(text, j, end, final)
    return after if isinstance(after, str) else (text[i:j], after)


def named_call_at(text: str, i: int, final: bool, end: str):
    """``(call, index past it)`` for a call written as its function's name,
    the text ``end``, then a JSON object of arguments (Mistral v11,
    functionary, chatml-function-calling); INCOMPLETE or INVALID."""
    found = name_at(text, i, final, end)
    if not isinstance(found, tuple):
        return found
    name, j = found
    found = json_at(text, j, final)
    if not isinstance(found, tuple):
        return found
    args, k = found
    return (FoundCall(name, _json.dumps(args)), k) if isinstance(args, dict) else INVALID


def json_call_rule(name: str, args: str, key: str = "arguments", before: str = "") -> str:
    """GBNF of ``{"name": <name>, "<key>": <args rule>}`` after the text ``before``."""
    head = gbnf_literal(before + '{"name": ' + _json.dumps(name) + f', "{key}": ')
    return f'{head} {args} "}}"'


def hold_from(text: str, pos: int, triggers: tuple) -> int:
    """The first index >= pos from which the text is a proper beginning of a
    trigger: content from there on must wait for the next delta."""
    for k in range(max(pos, len(text) - max(map(len, triggers), default=0) + 1), len(text)):
        tail = text[k:]
        if any(t.startswith(tail) for t in triggers):
            return k
    return len(text)


# -- grammars ------------------------------------------------------------------------------

def gbnf_literal(text: str) -> str:
    """A GBNF literal for ``text``."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c])
        elif c.isprintable():
            out.append(c)
        else:
            out.append(f"\\x{ord(c):02X}" if ord(c) < 0x100 else f"\\u{ord(c):04X}" if ord(c) < 0x10000
                       else f"\\U{ord(c):08X}")
    return '"' + "".join(out) + '"'


# Keywords that decide what a value is; a parameters schema with none of them gets "type": "object".
_SHAPES = ("type", "$ref", "allOf", "anyOf", "oneOf", "enum", "const")


class Format:
    """A tool-call format: how calls are written in generated text.

    ``triggers``: the texts that begin a call wherever they appear (a lazy
    grammar waits for one of them).  :meth:`start_triggers`: texts that
    begin a call only at the very start of the output."""

    name: str = ""
    triggers: tuple = ()
    _start_triggers: tuple = ()

    def __repr__(self) -> str:
        return f"<tool-call format {self.name!r}>"

    def start_triggers(self, tools, tool_choice=None) -> tuple:
        """Texts that begin a call only where the output begins."""
        return self._start_triggers

    # parsing

    def parse(self, text: str, reasoning=None) -> Parsed:
        """The whole generated ``text`` as a message: content (outside calls,
        stripped) and the calls in order.  Text that starts a call but never
        becomes a valid one (cut short, not JSON) stays in the content as
        written.  ``reasoning`` (a :class:`llamax.tool_calls.reasoning.Reasoning`)
        splits off the reasoning section first."""
        if not isinstance(text, str):
            raise ArgumentTypeError(f"the generated text must be a str, not {type(text).__name__}")
        reasoning_content = None
        if reasoning is not None:
            reasoning_content, text = reasoning.split(text)
        segments, _ = self._scan(text, final=True, at_start=True)
        calls = [ToolCall(new_call_id(), s.name, s.arguments) for s in segments if isinstance(s, FoundCall)]
        content = "".join(s for s in segments if isinstance(s, str)).strip()
        return Parsed(None if not content and calls else content, calls, reasoning_content)

    def stream(self, reasoning=None) -> Stream:
        """A streaming parser: ``feed(delta)`` and ``finish()`` return events."""
        return Stream(self, reasoning)

    def _scan(self, text: str, final: bool, at_start: bool) -> tuple:
        """``(segments, used)``: what ``text`` decides, and how much of it
        (the rest waits for more text; with ``final`` nothing waits).  The
        default: content until a trigger, where :meth:`_call_at` reads."""
        out: list = []
        pos = 0
        if at_start:
            first = self._start(text, final)
            if first == INCOMPLETE:
                return [], 0
            if first != INVALID:
                out, pos = first
        more, used = self._scan_triggers(text, pos, final)
        return out + more, used

    def _start(self, text: str, final: bool):
        """What the beginning of the output decides: ``(segments, end)``,
        INCOMPLETE, or INVALID when no rule for the start applies."""
        return INVALID

    def _call_at(self, text: str, i: int, final: bool):
        """At ``i`` just past a trigger: ``(calls, end)`` (maybe no calls, a
        header that is not one), INCOMPLETE or INVALID."""
        return INVALID

    def _scan_triggers(self, text: str, pos: int, final: bool) -> tuple:
        out: list = []
        start = pos  # where undelivered content begins
        while True:
            hit = self._find(text, pos)
            if hit is None:
                end = len(text) if final or not self.triggers else hold_from(text, pos, self.triggers)
                if end > start:
                    out.append(text[start:end])
                return out, max(end, start)
            i, trigger = hit
            found = self._call_at(text, i + len(trigger), final)
            if found == INCOMPLETE:
                if i > start:
                    out.append(text[start:i])
                return out, i
            if found == INVALID:  # the trigger is content; a trigger may begin inside it
                pos = i + 1
                continue
            calls, end = found
            if i > start:
                out.append(text[start:i])
            out += calls
            start = pos = end

    def _find(self, text: str, pos: int):
        best = None
        for t in self.triggers:
            k = text.find(t, pos)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, t)
        return best

    # grammars

    def grammar(self, tools, tool_choice=None, parallel_tool_calls: bool = True, *, lazy: bool = False) -> str:
        """GBNF whose every complete output is one call (one or more with
        ``parallel_tool_calls``) in this format, of the functions in ``tools``
        (only the named one when ``tool_choice`` names one), arguments valid
        under each function's ``parameters``.

        With ``lazy``, the root matches text that begins at a trigger, the
        trigger included: generation runs free until :attr:`triggers` (or
        :meth:`start_triggers` at the start) appear, then this grammar
        constrains from the trigger's first character on (llama.cpp's lazy
        grammars).  Most formats' calls begin with their trigger, so the root
        is the same either way.  InvalidArgumentError for bad tools, and for
        tool_choice "none" (there is nothing to constrain)."""
        tools, choice = check_tools(tools, tool_choice)
        if choice.mode == "none":
            raise InvalidArgumentError('tool_choice is "none" (or there are no tools): no call to constrain')
        functions: list = []
        text: list = []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            if choice.name is not None and fn["name"] != choice.name:
                continue
            params = fn.get("parameters", {"type": "object"})
            if not any(k in params for k in _SHAPES):  # arguments are an object whatever the schema omits
                params = dict(params, type="object")
            prefix = f"fn{len(functions)}-"
            try:
                text.append(json_schema_to_gbnf(params, prefix=prefix))
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"tools[{i}].function.parameters: {e}") from None
            functions.append((fn["name"], f"{prefix}root"))
        rules = self._rules(functions, choice, parallel_tool_calls, lazy)
        return "".join(f"{name} ::= {body}\n" for name, body in rules.items()) + "".join(text)

    def _rules(self, functions: list, choice: ToolChoice, parallel: bool, lazy: bool) -> dict:
        """The format's own rules (name → body, ``root`` first) over the
        argument rules: ``functions`` holds ``(name, args rule)``.  The
        default: root is one call, or calls apart by :attr:`_separator`."""
        calls = {f"call-{k}": self._call_rule(name, args) for k, (name, args) in enumerate(functions)}
        call = " | ".join(calls)
        root = f"call ( {gbnf_literal(self._separator)} call )*" if parallel else "call"
        if not self._separator and parallel:
            root = "call+"
        return {"root": root, "call": call, **calls}

    _separator = "\n"

    def _call_rule(self, name: str, args: str) -> str:
        raise NotImplementedError


# -- streaming -------------------------------------------------------------------------------

class Stripped:
    """Pieces of a text whose whole is wanted stripped: leading whitespace
    dropped, trailing whitespace held until more text follows it."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, piece: str) -> str:
        if not self._started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._started = True
        body = piece.rstrip()
        if not body:
            self._pending += piece
            return ""
        out = self._pending + body
        self._pending = piece[len(body):]
        return out


class Stream:
    """A streaming parser (from :meth:`Format.stream`).  Content that might
    begin a call is held until the text decides; a call is delivered when it
    is complete: an event with its ``index``, ``id`` and ``name`` (empty
    ``arguments``), then one with its whole ``arguments``.  The events join
    to :meth:`Format.parse` of the whole text (ids apart)."""

    def __init__(self, fmt: Format, reasoning=None) -> None:
        self._fmt = fmt
        self._buf = ""
        self._at_start = True
        self._content = Stripped()
        self._reasoning = None if reasoning is None else reasoning.stream()
        self._calls = 0
        self._done = False

    def feed(self, delta: str) -> list:
        """The events that ``delta`` (the next generated text) decides."""
        if self._done:
            raise InvalidArgumentError("feed() after finish(): the stream is over")
        if not isinstance(delta, str):
            raise ArgumentTypeError(f"a delta must be a str, not {type(delta).__name__}")
        return self._take(delta, final=False)

    def finish(self) -> list:
        """The events of what was held back: generation has ended."""
        if self._done:
            return []
        self._done = True
        return self._take("", final=True)

    def _take(self, delta: str, final: bool) -> list:
        events: list = []
        if self._reasoning is not None:
            thought, delta = self._reasoning.finish() if final else self._reasoning.feed(delta)
            if thought:
                events.append(ReasoningDelta(thought))
        self._buf += delta
        segments, used = self._fmt._scan(self._buf, final, self._at_start)
        if used:
            self._buf = self._buf[used:]
            self._at_start = False
        for seg in segments:
            if isinstance(seg, str):
                text = self._content.push(seg)
                if text:
                    events.append(ContentDelta(text))
            else:
                events.append(ToolCallDelta(self._calls, "", new_call_id(), seg.name))
                events.append(ToolCallDelta(self._calls, seg.arguments))
                self._calls += 1
        return events
