"""Hermes 2 Pro, Qwen 2.5 and Qwen 3: each call is a JSON object between
tags, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``"parameters"`` is read where ``"arguments"`` is missing; whitespace
around the JSON is free; the closing tag is required (a block cut before it
stays content).
"""
from __future__ import annotations

from llamax.tool_calls import _json
from llamax.tool_calls._base import INVALID, Format, call_from, gbnf_literal, json_at, literal_at

__all__ = ["Hermes"]


class Hermes(Format):
    name = "hermes"
    triggers = ("<tool_call>",)

    def _call_at(self, text: str, i: int, final: bool):
        found = json_at(text, i, final)
        if not isinstance(found, tuple):
            return found
        obj, end = found
        call = call_from(obj, ("arguments", "parameters"))
        if call is None:
            return INVALID
        end = literal_at(text, _json.ws_end(text, end), "</tool_call>", final)
        return end if isinstance(end, str) else ([call], end)

    def _call_rule(self, name: str, args: str) -> str:
        head = gbnf_literal('<tool_call>\n{"name": ' + _json.dumps(name) + ', "arguments": ')
        tail = gbnf_literal("}\n</tool_call>")
        return f"{head} {args} {tail}"
