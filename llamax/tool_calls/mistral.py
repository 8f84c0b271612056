"""Mistral's calls, in the two spellings of its tokenizer versions.

* :class:`Mistral` (Mistral 7B v0.3, Mixtral, Nemo; tokenizers before v11):
  one JSON array after ``[TOOL_CALLS]``::

      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

* :class:`MistralV11` (Mistral Small 3.2, Magistral, Devstral; tokenizer v11
  and later): the name, then ``[ARGS]`` and the arguments, once per call::

      [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...

``detect`` tells them apart by ``[ARGS]`` in the chat template.  A call
``"id"`` the model writes in the array is not kept: ids are ours.
"""
from __future__ import annotations

from llamax.tool_calls._base import INVALID, Format, call_from, gbnf_literal, json_at, json_call_rule, named_call_at

__all__ = ["Mistral", "MistralV11"]


class Mistral(Format):
    name = "mistral"
    triggers = ("[TOOL_CALLS]",)
    _separator = ", "

    def _call_at(self, text: str, i: int, final: bool):
        found = json_at(text, i, final)
        if not isinstance(found, tuple):
            return found
        value, end = found
        calls = [call_from(v) for v in value] if isinstance(value, list) else []
        if not calls or None in calls:
            return INVALID
        return calls, end

    def _rules(self, functions, choice, parallel, lazy):
        rules = super()._rules(functions, choice, parallel, lazy)
        rules["root"] = f'{gbnf_literal("[TOOL_CALLS][")} {rules["root"]} "]"'
        return rules

    def _call_rule(self, name: str, args: str) -> str:
        return json_call_rule(name, args)


class MistralV11(Format):
    name = "mistral-v11"
    triggers = ("[TOOL_CALLS]",)
    _separator = ""

    def _call_at(self, text: str, i: int, final: bool):
        found = named_call_at(text, i, final, "[ARGS]")
        return ([found[0]], found[1]) if isinstance(found, tuple) else found

    def _call_rule(self, name: str, args: str) -> str:
        return f"{gbnf_literal('[TOOL_CALLS]' + name + '[ARGS]')} {args}"
