"""What a chat request does with ``tools``, ``tool_choice`` and a template's
reasoning section: the grammar it runs under, the prompt it adds, and how
its generated text becomes an OpenAI message or stream deltas.

``Llama.prepare_chat_completion`` makes one :class:`ChatPlan` per request
(:func:`chat_plan`); the server reaches it through that method only.

The grammar, by ``tool_choice``:

- ``"none"``: the tools are rendered into the prompt (the model may know of
  them) but nothing is constrained and nothing is read as a call;
- ``"required"`` or a named function: every token is constrained, from the
  first, to calls in the template's format (:meth:`Format.grammar`), their
  arguments valid under each function's ``parameters``;
- ``"auto"``: free text until one of the format's triggers (``<tool_call>``,
  ``[TOOL_CALLS]``, ...) is generated, then the call is constrained from the
  trigger on (a lazy grammar).  Formats without a trigger (``generic``) are
  constrained from the first token to their JSON answer, which can hold a
  plain reply (``{"response": ...}``).  Triggers that count only at the
  very start of a reply (Llama 3's bare ``{``) do not switch the grammar on:
  such a call is still read from the text, unconstrained.
"""
from __future__ import annotations

import json

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax.tool_calls import (ContentDelta, Format, Generic, Parsed, ReasoningDelta, Stream, ToolCallDelta,
                               check_tools, detect)
from llamax.tool_calls.generic import system_prompt
from llamax.tool_calls.reasoning import Reasoning, detect_reasoning


class ChatPlan:
    """One chat request's tool calls and reasoning (see the module).

    ``grammar`` / ``triggers`` / ``start_triggers``: what the sampler runs
    (None / () when nothing is constrained; triggers arm a lazy grammar
    anywhere, start triggers only where the output begins); :meth:`messages` is the conversation the
    template renders; :meth:`message` and :meth:`stream` read the generated
    text."""

    def __init__(self, fmt: Format | None, tools, mode: str, parallel: bool, legacy: bool,
                 reasoning: Reasoning | None, grammar: str | None, triggers: tuple, prompt: str | None,
                 start_triggers: tuple = ()):
        self.format = fmt
        self.tools = tools
        self.mode = mode                  # "", none, auto, required, named
        self.parallel = parallel
        self.legacy = legacy              # functions/function_call: the answer uses function_call
        self.reasoning = reasoning
        self.grammar = grammar
        self.triggers = triggers
        self.start_triggers = start_triggers
        self._prompt = prompt             # the generic format's system prompt, or None

    def open_reasoning(self, opened: bool) -> None:
        """Whether the rendered prompt opened the reasoning section (the
        reply then starts inside it)."""
        if self.reasoning is not None:
            self.reasoning = Reasoning(started_open=opened)

    @property
    def reads_calls(self) -> bool:
        return self.format is not None and self.mode not in ("", "none")

    def messages(self, messages: list) -> list:
        """The conversation the template renders; the caller's list is not
        changed.  For the generic format (a template that knows nothing of
        tools): the tool description as (or added to) the system message, and
        earlier assistant calls written as the JSON answers they were."""
        if not isinstance(self.format, Generic):
            return messages
        out = [_as_generic(m) for m in messages]
        if self._prompt is None:
            return out
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0]["content"] = out[0]["content"] + "\n\n" + self._prompt
        else:
            out.insert(0, {"role": "system", "content": self._prompt})
        return out

    def parse(self, text: str) -> Parsed:
        if self.format is not None and self.reads_calls:
            return self.format.parse(text, self.reasoning)
        reasoning_content = None
        if self.reasoning is not None:
            reasoning_content, text = self.reasoning.split(text)
            text = text.lstrip()  # (the blank line templates put after the section)
        return Parsed(text, [], reasoning_content)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message made of the generated ``text`` and the
        finish reason to report (``tool_calls`` / ``function_call`` when the
        reply is calls and generation stopped by itself)."""
        p = self.parse(text)
        msg: dict = {"role": "assistant", "content": p.content}
        if p.reasoning_content is not None:
            msg["reasoning_content"] = p.reasoning_content
        if p.tool_calls:
            if self.legacy:
                c = p.tool_calls[0]
                msg["function_call"] = {"name": c.name, "arguments": c.arguments}
            else:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in p.tool_calls]
            if finish_reason == "stop":
                finish_reason = "function_call" if self.legacy else "tool_calls"
        elif msg["content"] is None:
            msg["content"] = ""
        return msg, finish_reason

    def stream(self) -> DeltaStream:
        return DeltaStream(self)


def _as_generic(m):
    """An assistant message with calls as the generic JSON answer text
    (other messages as they are)."""
    if not isinstance(m, dict) or m.get("role") != "assistant" or not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass  # (written as given: the model sees what was sent)
        calls.append({"name": fn.get("name"), "arguments": args})
    text = json.dumps({"tool_calls": calls} if len(calls) > 1 else {"tool_call": calls[0]}, ensure_ascii=False)
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}


class DeltaStream:
    """Generated text in, OpenAI chat-completion ``delta`` dicts out."""

    def __init__(self, plan: ChatPlan):
        self._plan = plan
        self._inner: Stream | _ReasoningOnly | None
        if plan.format is not None and plan.reads_calls:
            self._inner = plan.format.stream(plan.reasoning)
        elif plan.reasoning is not None:
            self._inner = _ReasoningOnly(plan.reasoning)
        else:
            self._inner = None
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        if self._inner is None:
            return [{"content": text}] if text else []
        return self._deltas(self._inner.feed(text))

    def finish(self) -> list[dict]:
        return [] if self._inner is None else self._deltas(self._inner.finish())

    def _deltas(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, ContentDelta):
                out.append({"content": e.text})
            elif isinstance(e, ReasoningDelta):
                out.append({"reasoning_content": e.text})
            elif isinstance(e, ToolCallDelta):
                if self._plan.legacy:
                    if e.index > 0:
                        continue  # function_call answers carry one call
                    if e.name is not None:
                        self.calls += 1
                    fc = {"arguments": e.arguments} if e.name is None else {"name": e.name, "arguments": ""}
                    out.append({"function_call": fc})
                    continue
                if e.name is not None:
                    self.calls += 1
                    out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                                "function": {"name": e.name, "arguments": ""}}]})
                else:
                    out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.arguments}}]})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """The stream's last finish reason, as :meth:`ChatPlan.message` gives it."""
        if self.calls and reason == "stop":
            return "function_call" if self._plan.legacy else "tool_calls"
        return reason


class _ReasoningOnly:
    """A reasoning split without tool calls, as events."""

    def __init__(self, reasoning: Reasoning):
        self._s = reasoning.stream()
        self._started = False  # content so far was only whitespace (dropped, as parse drops it)

    def feed(self, text: str) -> list:
        return self._events(*self._s.feed(text))

    def finish(self) -> list:
        return self._events(*self._s.finish())

    def _events(self, thought, content) -> list:
        out: list = []
        if thought:
            out.append(ReasoningDelta(thought))
        if content and not self._started:
            content = content.lstrip()
            self._started = bool(content)
        if content:
            out.append(ContentDelta(content))
        return out


def chat_plan(tools, tool_choice, parallel_tool_calls, template_source: str | None, chat_format: str | None,
              *, legacy: bool = False) -> ChatPlan | None:
    """The plan of a chat request (None: no tools and no reasoning section,
    the text is the content as generated).  Whether the rendered prompt
    opens the reasoning section is told later (:meth:`ChatPlan.open_reasoning`)."""
    if parallel_tool_calls is None:
        # one call unless asked (llama-server's default; OpenAI's is True):
        # small models asked for "one or more" tend to repeat a call until
        # max_tokens cuts the reply, and a cut reply has no calls at all
        parallel = False
    elif isinstance(parallel_tool_calls, bool):
        parallel = parallel_tool_calls and not legacy
    else:
        raise ArgumentTypeError(f"parallel_tool_calls must be a bool, not {type(parallel_tool_calls).__name__}")
    reasoning = Reasoning() if detect_reasoning(template_source) else None
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidArgumentError(f"tool_choice {tool_choice!r} without tools: pass the tools it chooses from")
        if reasoning is None:
            return None
        return ChatPlan(None, None, "", parallel, legacy, reasoning, None, (), None)
    tools, choice = check_tools(tools, tool_choice)
    fmt = detect(template_source, chat_format)
    mode = "named" if choice.mode == "function" or choice.name is not None else choice.mode
    if not tools or mode == "none":
        return ChatPlan(fmt, tools, "none", parallel, legacy, reasoning, None, (), None)
    prompt = system_prompt(tools, tool_choice, parallel) if isinstance(fmt, Generic) else None
    starts = tuple(fmt.start_triggers(tools, tool_choice)) if mode == "auto" else ()
    if mode == "auto" and (fmt.triggers or starts):
        grammar = fmt.grammar(tools, tool_choice, parallel, lazy=True)
        triggers = tuple(fmt.triggers)
    else:
        grammar = fmt.grammar(tools, tool_choice, parallel)
        triggers = ()
    return ChatPlan(fmt, tools, mode, parallel, legacy, reasoning, grammar, triggers, prompt, starts)
