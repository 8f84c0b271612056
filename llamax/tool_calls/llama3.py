"""Llama 3.1, 3.2 and 3.3 JSON tool calls: the message is a JSON object
``{"name": "f", "parameters": {...}}`` (``"arguments"`` read too), maybe
after ``<|python_tag|>``; several calls are apart by ``;`` and/or
newlines::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A call is read where the output begins (after whitespace) or right after
``<|python_tag|>``, never from a JSON object in the middle of prose.  The
built-in tools' Python-call syntax (``brave_search.call(query=...)``) is
not read: it stays content.
"""
from __future__ import annotations

import re

from llamax.tool_calls import _json
from llamax.tool_calls._base import INCOMPLETE, INVALID, Format, call_from, gbnf_literal, json_at, json_call_rule

__all__ = ["Llama3"]

_SEPARATOR = re.compile(r"[ \t\r\n]*;?[ \t\r\n]*")


class Llama3(Format):
    name = "llama3"
    triggers = ("<|python_tag|>",)
    _start_triggers = ("{",)
    _separator = "; "

    def _start(self, text: str, final: bool):
        j = _json.ws_end(text, 0)
        if j == len(text):
            return INVALID if final else INCOMPLETE
        if text[j] != "{":
            return INVALID
        found = self._calls(text, j, final)
        if not isinstance(found, tuple):
            return found
        calls, end = found
        return ([text[:j]] if j else []) + calls, end

    def _call_at(self, text: str, i: int, final: bool):
        return self._calls(text, i, final)

    def _calls(self, text: str, i: int, final: bool):
        """Calls apart by separators from ``i``; the sequence ends before the
        first thing that is not a call (that is content again)."""
        calls: list = []
        end = i
        while True:
            found = json_at(text, i, final)
            call = call_from(found[0], ("parameters", "arguments")) if isinstance(found, tuple) else None
            if found == INCOMPLETE:
                return INCOMPLETE
            if call is None:
                return (calls, end) if calls else INVALID
            calls.append(call)
            end = found[1]
            m = _SEPARATOR.match(text, end)  # always matches (maybe nothing)
            i = m.end() if m else end
            if i == len(text):  # another call may follow the separator
                return (calls, end) if final else INCOMPLETE
            if text[i] != "{":
                return calls, end

    def _rules(self, functions, choice, parallel, lazy):
        rules = super()._rules(functions, choice, parallel, lazy)
        rules["root"] = f'{gbnf_literal("<|python_tag|>")}? {rules["root"]}'
        return rules

    def _call_rule(self, name: str, args: str) -> str:
        return json_call_rule(name, args, "parameters")
