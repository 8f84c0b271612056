"""MeetKai's functionary models.

* :class:`FunctionaryV31` (functionary-small/medium v3.1, on Llama 3.1)::

      <function=get_weather>{"city": "Paris"}</function>

* :class:`FunctionaryV32` (v3.2): the reply is a series of messages, each
  after ``>>>`` and a recipient: ``all`` for text to the user, a function's
  name for a call whose body is the arguments object::

      >>>all
      Let me look.>>>get_weather
      {"city": "Paris"}

  The v3.2 template's generation prompt ends with ``>>>`` itself, so the
  output starts at a recipient (``opens_recipient``, the default): a first
  ``all`` header is dropped and a first ``name\\n{...}`` is a call.

Code for the ``python`` recipient, or after v3.1's ``<|python_tag|>``, is
not read as a call: it stays content.
"""
from __future__ import annotations

from llamax.tool_calls import _json
from llamax.tool_calls._base import (INVALID, Format, FoundCall, check_tools, gbnf_literal, json_at, literal_at,
                                     name_at, named_call_at)

__all__ = ["FunctionaryV31", "FunctionaryV32"]


class FunctionaryV31(Format):
    name = "functionary-v3.1"
    triggers = ("<function=",)
    _separator = ""

    def _call_at(self, text: str, i: int, final: bool):
        found = named_call_at(text, i, final, ">")
        if not isinstance(found, tuple):
            return found
        call, end = found
        end = literal_at(text, _json.ws_end(text, end), "</function>", final)
        return end if isinstance(end, str) else ([call], end)

    def _call_rule(self, name: str, args: str) -> str:
        return f'{gbnf_literal(f"<function={name}>")} {args} {gbnf_literal("</function>")}'


class FunctionaryV32(Format):
    name = "functionary-v3.2"
    triggers = (">>>",)
    _separator = ">>>"

    def __init__(self, opens_recipient: bool = True) -> None:
        self.opens_recipient = bool(opens_recipient)

    def start_triggers(self, tools, tool_choice=None) -> tuple:
        """With ``opens_recipient``, each callable function's ``name\\n``:
        the first call comes without ``>>>``."""
        if not self.opens_recipient:
            return ()
        tools, choice = check_tools(tools, tool_choice)
        return tuple(t["function"]["name"] + "\n" for t in tools
                     if choice.name in (None, t["function"]["name"]))

    def _start(self, text: str, final: bool):
        return self._call_at(text, 0, final) if self.opens_recipient else INVALID

    def _call_at(self, text: str, i: int, final: bool):
        found = name_at(text, i, final, "\n")
        if not isinstance(found, tuple):
            return found
        name, j = found
        if name == "all":  # a text message: the header goes, the text is content
            return [], j
        found = json_at(text, j, final)
        if not isinstance(found, tuple):
            return found
        args, end = found
        return ([FoundCall(name, _json.dumps(args))], end) if isinstance(args, dict) else INVALID

    def _rules(self, functions, choice, parallel, lazy):
        rules = super()._rules(functions, choice, parallel, lazy)
        # the prompt wrote the first ">>>" unless a lazy grammar starts at a ">>>" trigger
        first = '">>>"?' if lazy and self.opens_recipient else "" if self.opens_recipient else '">>>"'
        rules["root"] = f"{first} {rules['root']}".strip()
        return rules

    def _call_rule(self, name: str, args: str) -> str:
        return f"{gbnf_literal(name + chr(10))} {args}"
