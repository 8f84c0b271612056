"""OpenAI-style tool calls read from generated text, in the formats chat
templates teach models (issue #35), and grammars that make a model write them.

A :class:`Format` parses a whole reply (:meth:`Format.parse` → :class:`Parsed`)
or a stream of deltas (:meth:`Format.stream`: content held while it may be
the start of a call; calls delivered in OpenAI's streamed shape once
complete; the events join to what ``parse`` returns), and builds the GBNF
that constrains a call (:meth:`Format.grammar`).  Reasoning sections are
:mod:`llamax.tool_calls.reasoning`'s.

:func:`detect` picks the format from a chat template's source, by the first
of these rules that holds:

1. ``chat_format == "chatml-function-calling"``: llama-cpp-python's format;
2. the template contains ``<tool_call>``: ``hermes`` (Hermes, Qwen 2.5 / 3);
3. it contains ``[TOOL_CALLS]``: ``mistral-v11`` if it also contains
   ``[ARGS]`` (name, then arguments), else ``mistral`` (a JSON array);
4. ``<function=``: ``functionary-v3.1``;
5. ``>>>``: ``functionary-v3.2``;
6. ``<|python_tag|>``, or both ``"parameters"`` and ``ipython``: ``llama3``;
7. otherwise (no template either): ``generic``, the JSON answer a system
   prompt asks for (:func:`llamax.tool_calls.generic.system_prompt`).

Functionary's templates come before Llama 3's because they are Llama 3.1
templates too.
"""
from __future__ import annotations

from llamax.tool_calls._base import (ContentDelta, Event, Format, Parsed, ReasoningDelta, Stream, ToolCall,
                                     ToolCallDelta, ToolChoice, check_tools, new_call_id)
from llamax.tool_calls.chatml_function_calling import ChatmlFunctionCalling
from llamax.tool_calls.functionary import FunctionaryV31, FunctionaryV32
from llamax.tool_calls.generic import Generic
from llamax.tool_calls.hermes import Hermes
from llamax.tool_calls.llama3 import Llama3
from llamax.tool_calls.mistral import Mistral, MistralV11
from llamax.tool_calls.reasoning import Reasoning, detect_reasoning

__all__ = ["ToolCall", "Parsed", "ContentDelta", "ReasoningDelta", "ToolCallDelta", "Event", "ToolChoice",
           "Format", "Stream", "Reasoning", "FORMATS", "detect", "detect_reasoning", "check_tools",
           "new_call_id", "Hermes", "Llama3", "Mistral", "MistralV11", "FunctionaryV31", "FunctionaryV32",
           "ChatmlFunctionCalling", "Generic"]

FORMATS: dict = {cls.name: cls for cls in (Hermes, Llama3, Mistral, MistralV11, FunctionaryV31, FunctionaryV32,
                                           ChatmlFunctionCalling, Generic)}
"""Format name → format class (each makes its format with no arguments)."""


def detect(template_source: str | None, chat_format: str | None = None) -> Format:
    """The format of the chat template ``template_source`` (its Jinja text;
    None: none) or of llama-cpp-python's ``chat_format``: see the rules above."""
    src = template_source or ""
    if chat_format == "chatml-function-calling":
        return ChatmlFunctionCalling()
    if "<tool_call>" in src:
        return Hermes()
    if "[TOOL_CALLS]" in src:
        return MistralV11() if "[ARGS]" in src else Mistral()
    if "<function=" in src:
        return FunctionaryV31()
    if ">>>" in src:
        return FunctionaryV32()
    if "<|python_tag|>" in src or ('"parameters"' in src and "ipython" in src):
        return Llama3()
    return Generic()
