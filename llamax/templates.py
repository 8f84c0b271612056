"""Chat templates: the model's Jinja2 template, rendered in a sandbox.

Templates come from the GGUF (``tokenizer.chat_template``), from a name
(``chat_format``: a few well-known formats), or as a string.  Rendering uses
jinja2's ``ImmutableSandboxedEnvironment``, bounded in time and in the size of
everything it builds (``llamax._sandbox``), so a hostile template (attribute
escapes, CVE-2024-34359's payload, runaway loops, ``'a'|center(10**9)``)
raises :class:`ChatTemplateError` instead of running code, allocating
gigabytes or hanging the server.
"""
from __future__ import annotations

import datetime
from typing import Any, Iterable

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax._sandbox import (  # noqa: F401 (the limits, for callers and tests)
    MAX_INT_BITS, MAX_ITEMS, MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS, MAX_RENDER_WORK, ChatTemplateError, render,
    template,
)

__all__ = ["ChatTemplate", "ChatTemplateError", "CHAT_FORMATS", "prepare_prefill"]


# Templates by name, for models without one (or to override theirs).
CHAT_FORMATS = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
        "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}"
    ),
    "llama-3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "mistral-instruct": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    "zephyr": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}


class ChatTemplate:
    """A compiled chat template: ``render(messages, add_generation_prompt=True, **extra)``."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str | None = None):
        if not isinstance(source, str) or not source:
            raise InvalidArgumentError("a chat template must be a non-empty string")
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = template(source)

    @classmethod
    def by_name(cls, name: str, **tokens) -> "ChatTemplate":
        try:
            return cls(CHAT_FORMATS[name], name=name, **tokens)
        except KeyError:
            raise InvalidArgumentError(
                f"unknown chat_format {name!r}; known: {', '.join(sorted(CHAT_FORMATS))}") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list | None = None, **extra: Any) -> str:
        _check_messages(messages)
        ctx = dict(extra)
        # today's date, as llama.cpp's templates get it (a Llama 3.x template
        # prints it; without it, the date the template was written)
        now = datetime.datetime.now()
        ctx.setdefault("date_string", now.strftime("%d %b %Y"))
        ctx.setdefault("datetime", now.strftime("%b %d %Y"))
        ctx.update(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                   bos_token=self.bos_token, eos_token=self.eos_token)
        ctx["tools"] = tools  # None when absent (defined, as transformers renders it)
        return render(self._template, ctx)


def _check_messages(messages):
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ArgumentTypeError(f"messages[{i}] must be a dict, not {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise InvalidArgumentError(f"messages[{i}] needs a string 'role'")
        c = m.get("content")
        if c is not None and not isinstance(c, str):
            if isinstance(c, list) and all(isinstance(p, dict) for p in c):
                continue  # content parts: passed through to the template
            raise InvalidArgumentError(f"messages[{i}]['content'] must be a string")


def prepare_prefill(messages: Iterable[dict]) -> tuple[list[dict], str]:
    """Split off the final, partial assistant message: (the rest, its text).

    The caller's list and dicts are not modified.
    """
    msgs = list(messages)
    if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
        raise InvalidArgumentError(
            "assistant_prefill=True needs the last message to be the partial assistant message "
            "(role 'assistant')")
    partial = msgs[-1].get("content") or ""
    if not isinstance(partial, str):
        raise InvalidArgumentError("the partial assistant message's content must be a string")
    if len(msgs) < 2:
        raise InvalidArgumentError("assistant_prefill=True needs at least one message before the partial one")
    return msgs[:-1], partial
