"""The fallback for chat templates that know nothing of tools: the tools are
described in the system prompt (:func:`system_prompt`) and the model answers
with one JSON object, in one of three shapes::

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]}
    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    {"response": "The answer, as text."}

The object is the whole answer (whitespace around it aside), with that one
key; anything else is read as plain content.  There is no trigger: the
grammar (:meth:`Generic.grammar`) constrains the whole output, so the object
is always written; with tool_choice "auto" it allows ``response`` too.  A
stream holds the object until it is complete: the ``response`` text arrives
in one piece.
"""
from __future__ import annotations

import json

from llamax._errors import InvalidArgumentError
from llamax.grammar import json_schema_to_gbnf
from llamax.tool_calls import _json
from llamax.tool_calls._base import INCOMPLETE, INVALID, Format, call_from, check_tools, gbnf_literal, json_at, json_call_rule

__all__ = ["Generic", "system_prompt"]

_TOOL_CALLS = gbnf_literal('{"tool_calls": [')
_TOOL_CALL = gbnf_literal('{"tool_call": ')
_RESPONSE = gbnf_literal('{"response": ')


class Generic(Format):
    name = "generic"
    triggers = ()

    def _start(self, text: str, final: bool):
        j = _json.ws_end(text, 0)
        if j == len(text):
            return INVALID if final else INCOMPLETE
        if text[j] != "{":
            return INVALID
        found = json_at(text, j, final, skip_ws=False)
        if not isinstance(found, tuple):
            return found
        obj, end = found
        segments = _envelope(obj)
        return INVALID if segments is None else (segments, end)

    def _rules(self, functions, choice, parallel, lazy):
        calls = {f"call-{k}": self._call_rule(name, args) for k, (name, args) in enumerate(functions)}
        if parallel:
            shape = f'{_TOOL_CALLS} call ( ", " call )* "]}}"'
        else:
            shape = f'{_TOOL_CALL} call "}}"'
        rules = {"root": shape, "call": " | ".join(calls), **calls}
        if choice.mode == "auto":  # answering in words is allowed too
            rules["root"] = f'{shape} | {_RESPONSE} response-root "}}"'
            for line in json_schema_to_gbnf({"type": "string"}, prefix="response-").splitlines():
                name, body = line.split(" ::= ", 1)
                rules[name] = body
        return rules

    def _call_rule(self, name: str, args: str) -> str:
        return json_call_rule(name, args)


def _envelope(obj) -> list | None:
    """The segments of a complete answer object, or None if it is not one."""
    if not isinstance(obj, dict) or len(obj) != 1:
        return None
    if isinstance(obj.get("response"), str):
        return [obj["response"]]
    if "tool_call" in obj:
        call = call_from(obj["tool_call"])
        return None if call is None else [call]
    calls = obj.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return None
    calls = [call_from(c) for c in calls]
    return None if None in calls else calls


def system_prompt(tools, tool_choice=None, parallel_tool_calls: bool = True) -> str:
    """System prompt text that describes ``tools`` (the ones ``tool_choice``
    allows) and the JSON answer :class:`Generic` reads, for a chat template
    without tool support.  InvalidArgumentError for bad tools, and for
    tool_choice "none" (offer no tools then)."""
    tools, choice = check_tools(tools, tool_choice)
    if choice.mode == "none":
        raise InvalidArgumentError('tool_choice is "none" (or there are no tools): there is nothing to describe')
    listed = [t["function"] for t in tools if choice.name in (None, t["function"]["name"])]
    lines = ["You can call the following tools. Each one is given as JSON: its name, what it does, and a "
             "JSON Schema of its arguments.", ""]
    for fn in listed:
        entry = {"name": fn["name"]}
        if fn.get("description"):
            entry["description"] = fn["description"]
        entry["parameters"] = fn.get("parameters", {"type": "object"})
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines += ["", "Reply with exactly one JSON object and nothing else, in one of these shapes:"]
    if parallel_tool_calls:
        lines.append('- to call one or more tools: {"tool_calls": [{"name": "<tool name>", "arguments": '
                     '{<arguments>}}, ...]}')
    else:
        lines.append('- to call a tool: {"tool_call": {"name": "<tool name>", "arguments": {<arguments>}}}')
    if choice.mode == "auto":
        lines.append('- to answer without a tool: {"response": "<your answer>"}')
    elif choice.mode == "required":
        lines += ["", "You must call a tool."]
    else:
        lines += ["", f"You must call the tool {choice.name!r}."]
    return "\n".join(lines)
