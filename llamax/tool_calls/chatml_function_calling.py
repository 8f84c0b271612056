"""llama-cpp-python's ``chatml-function-calling`` chat format (0.3.x).

Its system prompt lists the functions as ``functions.<name>:`` and asks the
model to answer either with a message or with calls; after the
``<|im_start|>assistant`` line the model writes one of::

    message:
    The weather is fine.

    functions.get_weather:
    {"city": "Paris"}
    functions.get_time:
    {"zone": "CET"}

A leading ``message:`` is dropped; each ``functions.<name>:`` followed by a
JSON object is a call.
"""
from __future__ import annotations

from llamax.tool_calls._base import INCOMPLETE, INVALID, Format, gbnf_literal, literal_at, named_call_at

__all__ = ["ChatmlFunctionCalling"]


class ChatmlFunctionCalling(Format):
    name = "chatml-function-calling"
    triggers = ("functions.",)

    def _start(self, text: str, final: bool):
        end = literal_at(text, 0, "message:", final)
        return end if end in (INCOMPLETE, INVALID) else ([], end)

    def _call_at(self, text: str, i: int, final: bool):
        found = named_call_at(text, i, final, ":")
        return ([found[0]], found[1]) if isinstance(found, tuple) else found

    def _call_rule(self, name: str, args: str) -> str:
        return f"{gbnf_literal(f'functions.{name}:' + chr(10))} {args}"
